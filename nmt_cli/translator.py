"""The translator under `nmt translate`, `nmt score`, `nmt serve` and the Python API (`Translator`):
read, clean, encode, length-sort, search, restore order, detokenize, write.

A Unix filter that streams: it translates what has arrived as soon as input pauses (a line
typed into a pipe is answered at once) and at most `chunk` lines at a time (a file goes in
large length-sorted batches), writing the translations in input order before reading on, so
memory stays bounded however long the input. Every input line gives exactly one output line;
with scores (--scores, or --nbest above 1), `nbest` lines of line number, score and text.

Two backends search the same way (backend.Backend): nmt's own engine (backend_nmt.py) and
CTranslate2 (backend_ct2.py), on a run's model, a package or a CTranslate2 export (models.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TextIO, cast

from nmt_cli import backend as engines
from nmt_cli import languages
from nmt_cli.backend import Backend, Choice
from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.engine.hypothesis import Hypothesis, Source, length_penalty, limits, stream_of
from nmt_cli.errors import NmtError
from nmt_cli.languages import Languages
from nmt_cli.models import Model
from nmt_cli.normalize import normalize
from nmt_cli.textio import Counts, requests

if TYPE_CHECKING:
    from nmt_cli.comet import Comet

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


class Translator:
    """A loaded model with its sentencepiece models, translating lists of raw lines."""

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
        self._routed: Translator | None = None  # nmt's engine beside CTranslate2, once a call needs it
        if self.engine == "ctranslate2" and not config.cuda_graphs:  # it launches its own kernels
            raise NmtError("--no-cuda-graphs is for nmt's engine, and CTranslate2 decodes here: drop it")
        self.backend: Backend
        if self.engine == "ctranslate2":  # imported here: neither backend needs the other's
            from nmt_cli import backend_ct2

            self.backend = backend_ct2.Backend(model, config, gpus, serving)
        else:
            from nmt_cli import backend_nmt

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
            languages.refuse(options.src_lang, options.tgt_lang, self.where)
            return [], []
        if options.alignments:
            raise NmtError("--alignments of a multilingual model's translations: not yet")
        return self.languages.tokens(options.src_lang, options.tgt_lang)

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

    def costs(
        self,
        lines: list[str],
        options: DecodeOptions,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """What decoding each line may cost: its work in tokens, its hypotheses at once
        (DecodeOptions.rows) times its output limit (hypothesis.limits: what its length, prefix,
        constraints and max_len allow); and the bytes its search holds at most (the decoder's
        caches for those rows and limit, the encoder's keys and values, a step's scores over
        the vocabulary, the alignments' attention); an empty line nothing. `nmt serve`'s queue
        and its memory are bounded by them, so they are read on the server's event loop: the
        pieces of the raw text, not cleaned (cleaning would cost most of the time and changes a
        count by a piece or two)."""
        first, start = self.language_tokens(options)
        tagged = (1 if options.tag else 0) + len(first)
        lengths = [min(len(x) + tagged, self.max_src) if x else 0 for x in self.source_sp.encode(lines)]
        forced = self.target_sp.encode(prefixes) if prefixes is not None else None
        if start:
            forced = [start + f for f in forced] if forced is not None else [start] * len(lines)
        phrases = [self.target_sp.encode(c) for c in constraints] if constraints else None
        work = self.work_of(lengths, options, forced, phrases)
        sizes = []
        for length, tokens in zip(lengths, work):
            if not length:
                sizes.append(0)
                continue
            limit = tokens // options.rows + 1
            size = sum(
                per_token * (4 * options.rows * limit + 2 * (length + 1)) + 12 * options.rows * vocab
                for per_token, vocab in self.parts
            )
            if options.alignments:
                size += 4 * options.nbest * limit * (length + 1) * len(self.parts)
            sizes.append(size)
        return work, sizes

    def steps_in_turn(self) -> bool:
        """Whether a server may decode several batches at once, taking their steps in turn:
        nmt's engine on a CPU. On a GPU one batch at a time until a GPU has measured it (a graph
        captured in one thread while another launches kernels would fail its capture)."""
        return self._nmt_on_cpu()

    def _nmt_on_cpu(self) -> bool:
        device = getattr(self.backend, "device", None)
        return self.engine == "nmt" and getattr(device, "type", None) == "cpu"

    def joins(self, options: DecodeOptions) -> bool:
        """Whether sentences with `options` may join a running batch (`running`): nmt's engine on a
        CPU, one model without a shortlist, a search that takes sentences midway
        (decoding.Running.takes), no alignments. Not on a GPU until one has measured it."""
        joins = getattr(self.backend, "joins", None)
        return (
            self.engine == "nmt"
            and not options.alignments
            and self.languages is None  # its language tokens go in and out in hypotheses()
            and joins is not None
            and joins(options)
        )

    def running(self, options: DecodeOptions):
        """A running batch for sentences with `options` (but for the seed, alpha and length
        limits: DecodeOptions.joint): ids join it between its steps and leave as they end
        (decoding.Running; `nmt serve`)."""
        if not self.joins(options):
            raise ValueError("these options or this engine take no running batch")
        self.check_tag(options.tag)
        return cast(Any, self.backend).running(options)

    def cuda_graphs(self) -> str | None:
        """Whether nmt's engine on a GPU replays its decoding steps as CUDA graphs: "on", or "off:"
        and why (--no-cuda-graphs, a shortlist, or a recording that failed in this process, after
        which no step is recorded again); None elsewhere."""
        if not self._nmt_on_gpu():
            return None
        from nmt_cli.engine import graphed

        if graphed._failed is not None:
            return f"off: recording failed ({graphed._failed})"
        return "on" if getattr(self.backend, "graphs", None) is not False else "off: not asked for"

    def _nmt_on_gpu(self) -> bool:
        device = getattr(self.backend, "device", None)
        return self.engine == "nmt" and getattr(device, "type", None) == "cuda"

    def slots(self) -> int:
        """How many searches step at once at most: a server's batches take turns at so many
        (backend_nmt spreads a call's batches over its CPU threads; a GPU one at a time)."""
        return getattr(self.backend, "slots", 1)

    def work_of(
        self,
        lengths: list[int],
        options: DecodeOptions,
        forced: list[list[int]] | None = None,
        phrases: list[list[list[int]]] | None = None,
    ) -> list[int]:
        """The work (costs) of sentences of `lengths` pieces, with those prefixes and constraints (ids)."""
        ceiling = min(self.max_src, options.max_len or self.max_src)
        found = limits(lengths, options.max_len_a, options.max_len_b, ceiling, forced, phrases)
        return [options.rows * n if length else 0 for n, length in zip(found, lengths)]

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
        if any(o.shared() != options.shared() for o in each):
            raise ValueError("the lines of one call may differ in seed and alpha only")
        self.check_tag(options.tag)
        first, forced = self.language_tokens(options)
        check_options(self.choice, options, constraints is not None and any(constraints))
        if options.chooses:
            from nmt_cli import mbr  # sacrebleu's, imported where it is used

            return mbr.chosen(self, lines, each, keys, prefixes, constraints, gone)
        keys = keys if keys is not None else [self.counts.lines + i for i in range(len(lines))]
        ids = self.encode(lines, options.tag, first)
        starts = self.encode_targets(prefixes) if prefixes is not None else [[] for _ in lines]
        starts = [forced + s for s in starts]
        # a phrase that cleaning leaves empty asks for nothing
        phrases = [[x for x in self.encode_targets(c) if x] for c in constraints or [[] for _ in lines]]
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
            from nmt_cli import comet

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

    def output(
        self, lines: list[str], prefixes: list[str] | None = None, constraints: list[list[str]] | None = None
    ) -> list[str]:
        """`nmt translate`'s output lines for `lines`: one per line; with scores (--scores, or
        nbest > 1) `nbest` per line, as 'line<TAB>score<TAB>text' (the line numbered from 0)."""
        routed = self.routed(self.config.decode, constraints is not None and any(constraints))
        if routed is not None:
            routed.counts = self.counts  # one count of lines, as one translator's
            return routed.output(lines, prefixes, constraints)
        hyps = self.hypotheses(lines, prefixes=prefixes, constraints=constraints)
        texts = self.texts(hyps)
        o = self.config.decode
        if o.alignments:  # the alignment after the text, tab-separated
            texts = [[f"{t}\t{h.alignment or ''}" for t, h in zip(ts, hs)] for ts, hs in zip(texts, hyps)]
        if o.nbest == 1 and not o.scores:
            return [t[0] for t in texts]
        first = self.counts.lines
        return [
            f"{first + i}\t{h.score:.4f}\t{text}"
            for i, (hs, ts) in enumerate(zip(hyps, texts))
            for h, text in zip(hs, ts)
        ]

    # -- the Python API: Translator.load(...), then translate, translations, score
    @classmethod
    def load(cls, model: str | Path | list[str | Path], **settings) -> Translator:
        """A model ready to translate: a run directory, a package or export from `nmt export`, or
        a checkpoint file (a list: their ensemble). `settings` are `nmt translate`'s options
        (engine="ctranslate2", device="cuda", beam=5, ...): the translation defaults."""
        from nmt_cli import models

        paths = [Path(p) for p in ([model] if isinstance(model, (str, Path)) else model)]
        decoding = {f.name for f in dataclasses.fields(DecodeOptions)}
        unknown = sorted(set(settings) - decoding - {f.name for f in dataclasses.fields(TranslateConfig)})
        if unknown or "decode" in settings:
            raise NmtError(
                f"unknown settings {unknown or ['decode']}: take `nmt translate`'s options, as beam=5"
            )
        decode = DecodeOptions(**{k: v for k, v in settings.items() if k in decoding})
        config = TranslateConfig(decode=decode, **{k: v for k, v in settings.items() if k not in decoding})
        found, choice = engines.loaded(Path("."), paths, None, config)
        original = (lambda: models.load(Path("."), paths, None)) if found.converted else None
        return cls(found, config, choice=choice, original=original)

    def translate(
        self,
        lines: list[str],
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        **options,
    ) -> list[str]:
        """The best translation of each line (beginning with its prefix, holding its
        constraints, if given). `options` (beam=5, sample=True, ...) replace the defaults for
        this call."""
        return [t[0].text for t in self.translations(lines, prefixes, constraints, **options)]

    def translations(
        self,
        lines: list[str],
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        **options,
    ) -> list[list[Translation]]:
        """The `nbest` best translations of each line (or draws, with sample=True), best first,
        each with its score; each beginning with its line of `prefixes` and containing every
        phrase of its list in `constraints`, if given."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(DecodeOptions)})
        if unknown:
            raise NmtError(f"unknown decoding options {unknown}: take `nmt translate`'s, as beam=5")
        decode = dataclasses.replace(self.config.decode, **options)
        for given, what in ((prefixes, "prefix"), (constraints, "list of constraints")):
            if given is not None and len(given) != len(lines):
                raise NmtError(f"{len(lines)} lines but {len(given)} of {what}: give one {what} per line")
        routed = self.routed(decode, constraints is not None and any(constraints))
        if routed is not None:
            return routed.translations(lines, prefixes, constraints, **options)
        hyps = self.hypotheses(lines, decode, list(range(len(lines))), prefixes, constraints)
        texts = self.texts(hyps)
        return [[Translation(t, h.score, h.alignment) for t, h in zip(ts, hs)] for ts, hs in zip(texts, hyps)]

    def routed(self, options: DecodeOptions, constraints: bool) -> Translator | None:
        """Where --engine auto chose CTranslate2 and a call of the Python API asks what is nmt's
        engine's (backend.nmt_only): nmt's engine on the same model, loaded at the first such
        call. The command line chooses knowing its options; the server refuses such a request."""
        if self.engine != "ctranslate2" or not self.choice.why.startswith("auto"):
            return None
        why = engines.nmt_only(options, constraints)
        if why is None:
            return None
        if self._routed is None:
            config = dataclasses.replace(self.config, engine="nmt")
            self._routed = Translator(self._original(), config, choice=Choice("nmt", f"auto: {why}"))
        return self._routed

    def score(self, sources: list[str], targets: list[str]) -> list[PairScore]:
        """How likely the model finds each target as the translation of its source (what
        `nmt score-pairs` prints)."""
        if len(sources) != len(targets):
            raise NmtError(f"{len(sources)} sources but {len(targets)} targets: give one target per source")
        return self.score_pairs(sources, targets)

    def stream(
        self,
        source: BinaryIO,
        sink: TextIO,
        advance: Callable[[int], None],
        prefixes: BinaryIO | None = None,
        constraints: BinaryIO | None = None,
    ) -> Counts:
        """Translate `source` line by line into `sink`, in input order, as input arrives; each
        translation beginning with the line of `prefixes` of the same number and containing
        the tab-separated phrases of the line of `constraints`, where given."""
        for request in requests(source, self.config.chunk, self.counts, prefixes, constraints):
            for text in self.output(request.lines, request.prefixes, request.constraints):
                sink.write(text + "\n")
            sink.flush()
            advance(len(request.lines))
        return self.counts
