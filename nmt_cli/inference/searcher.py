"""The search under `Translator` (translator.py): a loaded model's lines encoded (tags, language
tokens, the model's length), length-sorted into batches, searched by one of two backends,
aligned or scored, and decoded back to text.

A Unix filter that streams: it translates what has arrived as soon as input pauses (a line
typed into a pipe is answered at once) and at most `chunk` lines at a time (a file goes in
large length-sorted batches), writing the translations in input order before reading on, so
memory stays bounded however long the input. Every input line gives exactly one output line;
with scores (--scores, or --nbest above 1), `nbest` lines of line number, score and text.

Two backends search the same way (backend.Backend): nmt's own engine (backend_nmt.py) and
CTranslate2 (backend_ct2.py), on a run's model, a package or a CTranslate2 export (models.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.config.corpus import target_token
from nmt_cli.engine.hypothesis import Hypothesis, Source, length_penalty, stream_of
from nmt_cli.errors import NmtError
from nmt_cli.inference import backend as engines
from nmt_cli.inference import languages
from nmt_cli.inference.backend import Backend, Choice
from nmt_cli.inference.languages import Languages
from nmt_cli.inference.models import Model
from nmt_cli.normalize import normalize
from nmt_cli.textio import Counts

if TYPE_CHECKING:
    from nmt_cli.inference.comet import Comet

# Characters of a source line kept per position the model reads: sentencepiece's pieces hold 16
# characters at most (its max_sentencepiece_length), so the cut never changes what the model
# reads.
PIECE_CHARS = 32
# Characters that some readers take for a line break: an output line must stay one line.
ONE_LINE = str.maketrans({c: " " for c in "\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})
# --batch-size 0: sentences per batch, and for nmt's engine on a CPU with a model of d_model
# NARROW or less, whose steps are small matrices whose operators cost about as much for twice
# the rows (docs/benchmarks.md, "Decoding"); a wider model's gain nothing from more, and hold
# twice the cache
BATCH, NARROW_BATCH, NARROW = 32, 64, 256


@dataclass(frozen=True)
class Translation:
    text: str
    score: float  # the log-probability divided by the length penalty, as the search ranks
    alignment: str | None = None  # with alignments=True: Pharaoh "i-j" word pairs


@dataclass(frozen=True)
class PairScore:
    """A target's log-probability given its source: the sum, the tokens it counts (its EOS
    too), and the score a search gives it (the sum divided by the length penalty)."""

    total: float
    tokens: int
    score: float

    @property
    def per_token(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0


def check_options(choice: Choice, options: DecodeOptions, constraints: bool = False) -> None:
    """One line where `options` (and lexical constraints, if given) cannot be met by the engine
    `choice` names."""
    if constraints and options.sample:
        raise NmtError("--constraints are met by beam search: drop --sample")
    lacking = engines.refusal(choice.engine, options, constraints)
    if lacking:
        raise NmtError(f"{lacking}, and {choice}: choose nmt's engine (--engine nmt; engine='nmt')")


class Searcher:
    """A loaded model with its sentencepiece models and its backend, searching lists of lines:
    the part of a `Translator` that does not face its callers."""

    def __init__(
        self,
        model: Model,
        config: TranslateConfig,
        gpus: int = 0,
        choice: Choice | None = None,
        original: Callable[[], Model] | None = None,
        serving: bool = False,
    ):
        """`gpus`: CTranslate2's replicas of the model, one on each of the first `gpus` GPUs,
        sharing the batches (nmt's engine spreads over worker processes instead: workers.py);
        `choice`: the engine, where the caller chose it (backend.choose, default: by `config`);
        `original`: where `model` is a kept CTranslate2 conversion, the model it was made from,
        for the calls of the Python API that --engine auto routes to nmt's engine; `serving`:
        for `nmt serve` (CTranslate2 keeps a spare worker for its long batches)."""
        self.config = config
        self.choice = choice or engines.choose(model, config)
        self.engine = self.choice.engine
        self._original = original or (lambda: model)
        if self.engine == "ctranslate2" and not config.cuda_graphs:  # it launches its own kernels
            raise NmtError("--no-cuda-graphs is for nmt's engine, and CTranslate2 decodes here: drop it")
        self.backend: Backend
        if self.engine == "ctranslate2":  # imported here: neither backend needs the other's
            from nmt_cli.inference import backend_ct2

            self.backend = backend_ct2.Backend(model, config, gpus, serving)
        else:
            from nmt_cli.inference import backend_nmt

            self.backend = backend_nmt.Backend(model, config)
        # one object when the vocabulary is joint
        self.source_sp, self.target_sp = model.vocabs.processors()
        c = model.config
        if not model.vocabs.joint and not c.src_vocab_size:
            raise NmtError(f"{model.where} has one embedding for both sides but two sentencepiece models")
        sides = (
            (model.vocabs.source, c.src_vocab_size or c.vocab_size, self.source_sp),
            (model.vocabs.target, c.vocab_size, self.target_sp),
        )
        for path, size, sp in sides:
            if sp.get_piece_size() != size:
                raise NmtError(
                    f"{model.where} has a vocabulary of {size} but {path} has "
                    f"{sp.get_piece_size()}: they are from different runs"
                )
        self.src_lang, self.tgt_lang = model.src, model.tgt
        self.languages = Languages.of(
            model.languages, self.target_sp.piece_to_id, *model.language_pair, model.where
        )
        self.where, self.tags = model.where, model.tags
        self.check_tag(config.decode.tag)
        # room for the EOS in every model; a target also has its BOS before it
        self.max_src = model.max_src
        self.max_tgt = self.max_src - 1
        # what a search holds per sentence, by costs(): float32 caches, whatever the precision
        self.parts = [
            (m.config.num_decoder_layers * m.config.d_model * 4, m.config.vocab_size) for m in model.parts
        ]
        self.counts = Counts()
        self._metrics: dict[str, Comet] = {}  # --comet's and --kiwi's models, once asked for
        narrow = all(m.config.d_model <= NARROW for m in model.parts)
        self.batch_size = config.batch_size or (NARROW_BATCH if narrow and self._nmt_on_cpu() else BATCH)

    def check_tag(self, tag: str) -> None:
        if tag and tag not in self.tags:
            raise NmtError(
                f"--tag {tag!r} is not a tag of {self.where}: "
                + (
                    f"choose {', '.join(map(repr, self.tags))}"
                    if self.tags
                    else "it was trained without tags"
                )
            )

    def language_tokens(self, options: DecodeOptions) -> tuple[list[int], list[int]]:
        """A multilingual model's first source token and first target token for `options`
        (none for a model of one pair); one error line for what it cannot take."""
        if self.languages is None:
            targets = self.many_targets()
            if not targets:
                languages.refuse(options.src_lang, options.tgt_lang, self.where)
                return [], []
            # a many-to-many run's model (`nmt prep multi30k --pair ...`): the target's token
            # before the source, as its training put it there
            if options.src_lang:
                raise NmtError(
                    f"--src-lang: {self.where}, trained on several directions, is told the target alone"
                )
            if options.tgt_lang and options.tgt_lang not in targets:
                raise NmtError(
                    f"--tgt-lang {options.tgt_lang!r:.40}: {self.where} translates into {', '.join(targets)}"
                )
            return (
                self.source_sp.encode(target_token(options.tgt_lang), out_type=int)
                if options.tgt_lang
                else []
            ), []
        if options.alignments:
            raise NmtError("--alignments of a multilingual model's translations: not yet")
        return self.languages.tokens(options.src_lang, options.tgt_lang)

    def many_targets(self) -> tuple[str, ...]:
        """The target languages of a model trained on several directions, each source tagged
        with its target's token (its every corpus tag is one: `<2de>`); none for another."""
        many = bool(self.tags) and all(
            t.startswith("<2") and t.endswith(">") and len(t) > 3 for t in self.tags
        )
        return tuple(t[2:-1] for t in self.tags) if many else ()

    def encode(self, lines: list[str], tag: str = "", first: list[int] | None = None) -> list[list[int]]:
        """Source lines as ids, cleaned as training's were, `tag` before each (not an empty one),
        and `first` (a language token) before all."""
        # a piece holds a few characters at most: a line is cut far past what the model reads
        # (and counted as cut below) before sentencepiece makes a list of ids of all of it
        cleaned = [normalize(line, self.src_lang)[: PIECE_CHARS * self.max_src] for line in lines]
        if tag:
            cleaned = [f"{tag} {line}" if line else line for line in cleaned]
        ids = self.source_sp.encode(cleaned, out_type=int)
        if first:
            ids = [first + x if x else x for x in ids]
        for i, x in enumerate(ids):
            if len(x) > self.max_src:
                ids[i] = x[: self.max_src]
                self.counts.truncated += 1
        return ids

    def _nmt_on_cpu(self) -> bool:
        device = getattr(self.backend, "device", None)
        return self.engine == "nmt" and getattr(device, "type", None) == "cpu"

    def _nmt_on_gpu(self) -> bool:
        device = getattr(self.backend, "device", None)
        return self.engine == "nmt" and getattr(device, "type", None) == "cuda"

    def slots(self) -> int:
        """How many searches step at once at most: a server's batches take turns at so many
        (backend_nmt spreads a call's batches over its CPU threads; a GPU one at a time)."""
        return getattr(self.backend, "slots", 1)

    def batches(self, ids: list[list[int]], among: Iterable[int] | None = None) -> Iterable[list[int]]:
        """Indices of the sentences `among` (default: the non-empty ones), longest first, in
        batches of bounded size."""
        among = (i for i, x in enumerate(ids) if x) if among is None else among
        order = sorted(among, key=lambda i: -len(ids[i]))
        size = self.batch_size
        if not self.config.batch_size:  # lines too few for a batch a thread: shared out, BATCH at least
            size = min(size, max(BATCH, -(-len(order) // self.slots())))
        batch: list[int] = []
        for i in order:
            longest = len(ids[batch[0]]) + 1 if batch else len(ids[i]) + 1
            if batch and (len(batch) >= size or longest * (len(batch) + 1) > self.config.max_tokens):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def hypotheses(
        self,
        lines: list[str],
        options: DecodeOptions | list[DecodeOptions] | None = None,
        keys: list[int] | None = None,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        gone: Callable[[], list[bool]] | None = None,
    ) -> list[list[Hypothesis]]:
        """The nbest hypotheses of each line; an empty line gets empty ones. `options` replace
        the config's for this call: one for all lines, or one per line alike but for the seed
        and alpha (DecodeOptions.shared: `nmt serve` batches requests so); `keys`, with each
        line's seed, make its random stream under --sample (default: the lines' numbers in the
        input); `prefixes`: the text each translation begins with; `constraints`: the phrases
        each must contain; `gone`: for each line, whether nobody waits for it any more: nmt's
        engine ends such a line's rows at its next decoding step (CTranslate2 finishes a batch
        it has begun); once no line is waited for, errors.Stopped."""
        each = options if isinstance(options, list) else [options or self.config.decode] * len(lines)
        options = each[0] if each else self.config.decode
        shared = options.shared()
        if any(o is not options and o.shared() != shared for o in each):
            raise ValueError("the lines of one call may differ in seed and alpha only")
        self.check_tag(options.tag)
        first, forced = self.language_tokens(options)
        check_options(self.choice, options, constraints is not None and any(constraints))
        if options.chooses:
            from nmt_cli.inference import mbr

            return mbr.chosen(self, lines, each, keys, prefixes, constraints, gone)
        keys = keys if keys is not None else [self.counts.lines + i for i in range(len(lines))]
        ids = self.encode(lines, options.tag, first)
        starts = self.encode_targets(prefixes) if prefixes is not None else [[] for _ in lines]
        starts = [forced + s for s in starts]
        # a phrase that cleaning leaves empty asks for nothing
        phrases = [[x for x in self.encode_targets(c) if x] for c in constraints or [[]] * len(lines)]
        sources = [
            Source(x, stream_of(o.seed, key), start, c, o.alpha)
            for x, key, start, c, o in zip(ids, keys, starts, phrases, each)
        ]
        out: list[list[Hypothesis]] = [[Hypothesis([], 0.0)] * options.nbest for _ in lines]
        # constrained lines batch apart, so that the others are searched exactly as without them
        bound = [i for i, x in enumerate(ids) if x and phrases[i]]
        free = [i for i, x in enumerate(ids) if x and not phrases[i]]
        batches = [*self.batches(ids, free), *self.batches(ids, bound)]
        views = None
        if gone is not None:  # each batch's view of the lines'

            def view(batch: list[int]) -> Callable[[], list[bool]]:
                def of_batch() -> list[bool]:
                    now = gone()
                    return [now[i] for i in batch]

                return of_batch

            views = [view(b) for b in batches]
        found = self.backend.search([[sources[i] for i in b] for b in batches], options, views)
        for batch, hyps in zip(batches, found, strict=True):  # strict: runs `found` to its end
            for i, h in zip(batch, hyps):
                out[i] = h
        if options.alignments:
            self.align(ids, out, options.tag)
        return languages.stripped(out) if forced else out

    def metric(self, kind: str) -> Comet:
        """The COMET model of --comet ("comet", reference-based) or --kiwi ("kiwi"), loaded once."""
        if kind not in self._metrics:
            from nmt_cli.inference import comet

            path = self.config.comet if kind == "comet" else self.config.kiwi
            self._metrics[kind] = comet.for_choosing(
                kind, path, self.config.comet_precision, self.config.device
            )
        return self._metrics[kind]

    def align(self, ids: list[list[int]], hyps: list[list[Hypothesis]], tag: str) -> None:
        """Set each hypothesis's word alignment (of the source `ids`)."""
        rows = [(i, h) for i, hs in enumerate(hyps) if ids[i] for h in hs]
        size = self.batch_size
        groups = [rows[k : k + size] for k in range(0, len(rows), size)]
        found = self.backend.align(
            [[ids[i] for i, _ in g] for g in groups], [[h.tokens for _, h in g] for g in groups]
        )
        for group, pairs_of in zip(groups, found, strict=True):
            for (i, h), pairs in zip(group, pairs_of):
                source = self._words(ids[i], self.source_sp, skip=1 if tag else 0)
                target = self._words(h.tokens, self.target_sp)
                words = sorted({(source[a], target[b]) for a, b in pairs if source[a] >= 0})
                h.alignment = " ".join(f"{a}-{b}" for a, b in words)

    def _words(self, ids: list[int], sp, skip: int = 0) -> list[int]:
        """The word of each piece of `sp` (a piece that begins with '▁' begins one), the first
        `skip` words (a tag) numbered below 0."""
        out, word = [], -1 - skip
        for i, piece in enumerate(sp.id_to_piece(ids)):
            word += piece.startswith("▁") or i == 0
            out.append(word)
        return out

    def encode_targets(self, lines: list[str]) -> list[list[int]]:
        """Target-side text as ids, cleaned as the target side was for training, within the
        model's positions (room for BOS and EOS)."""
        if not lines:  # sentencepiece takes a millisecond over a list of none
            return []
        cleaned = [normalize(line, self.tgt_lang) for line in lines]
        return [y[: self.max_tgt] for y in self.target_sp.encode(cleaned, out_type=int)]

    def score_pairs(self, sources: list[str], targets: list[str]) -> list[PairScore]:
        """How likely the model finds each target line as the translation of its source line
        (forced decoding), scored as the search scores its hypotheses."""
        if self.languages is not None:
            raise NmtError("score-pairs of a multilingual model: not yet")
        src_ids, tgt_ids = self.encode(sources, self.config.decode.tag), self.encode_targets(targets)
        out: list[PairScore] = [PairScore(0.0, 0, 0.0)] * len(sources)
        batches = list(self.batches(src_ids, range(len(src_ids))))
        found = self.backend.score(
            [[src_ids[i] for i in b] for b in batches], [[tgt_ids[i] for i in b] for b in batches]
        )
        alpha = self.config.decode.alpha
        for batch, sums in zip(batches, found, strict=True):
            for i, total in zip(batch, sums):
                n = len(tgt_ids[i]) + 1  # with its EOS
                out[i] = PairScore(total, n, total / length_penalty(n, alpha))
        return out

    def texts(self, hyps: list[list[Hypothesis]]) -> list[list[str]]:
        """The text of each hypothesis, kept to one line."""
        flat = iter(self.target_sp.decode([h.tokens for hs in hyps for h in hs]))
        return [[next(flat).translate(ONE_LINE) for _ in hs] for hs in hyps]
