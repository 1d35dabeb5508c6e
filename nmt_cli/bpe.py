"""`nmt bpe`: a joint sentencepiece BPE model (or one per side, `--separate`), and every split
encoded into binarized shards.

The model is learned from a bounded random sample of both training sides, so memory does not
grow with the corpus. Normalisation is the identity (prep already normalised the text), which
makes decoding an exact inverse of encoding; byte fallback means no input is ever unknown. With
`--lowercase` it is lowercasing instead, held in the model file itself, so that whatever encodes
with the model (training, `nmt translate`, an export, `nmt serve`) folds case the same way.
"""

from __future__ import annotations

import heapq
import itertools
import random
import tempfile
from pathlib import Path

import numpy as np

from nmt_cli import ui
from nmt_cli.config import BpeConfig
from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_open
from nmt_cli.inference import shortlist
from nmt_cli.rundir import RunDir
from nmt_cli.shards import Shard, ShardWriter
from nmt_cli.textio import chunks, read_lines
from nmt_cli.vocab import BOS, EOS, PAD, UNK, Vocabularies, processor

ENCODE_CHUNK = 20_000


def auto_vocab_size(train_pairs: int) -> int:
    """A joint vocabulary that suits the corpus: small data wants few, frequent pieces."""
    if train_pairs < 100_000:
        return 8000
    if train_pairs < 1_000_000:
        return 16000
    return 32000


def sample_lines(paths: list[Path], k: int, seed: int) -> list[str]:
    """A uniform random sample of k non-empty lines of all files together (reservoir sampling)."""
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    for line in itertools.chain.from_iterable(read_lines(p) for p in paths):
        if not line:
            continue
        seen += 1
        if len(reservoir) < k:
            reservoir.append(line)
        else:
            j = rng.randrange(seen)
            if j < k:
                reservoir[j] = line
    return reservoir


def learn(
    config: BpeConfig, texts: list[Path], vocab_size: int, tags: list[str], dest: Path, what: str
) -> None:
    """A BPE model of `vocab_size` pieces learned from `texts`, written to `dest` (and its pieces
    beside it, .vocab); each corpus tag (`nmt prep custom --tag`) is one piece of its own."""
    import sentencepiece as spm

    sample = sample_lines(texts, config.sample_lines, config.seed)
    ui.say(f"learning {what} BPE model of {vocab_size} pieces from {len(sample):,} sentences")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        text = Path(tmp) / "sample.txt"
        text.write_text("".join(line + "\n" for line in sample), encoding="utf-8")
        del sample
        normalization = {"normalization_rule_name": "identity"}
        if config.lowercase:
            rules = Path(tmp) / "lowercase.tsv"
            rules.write_text(_lowercase_rules(), encoding="utf-8")
            normalization = {"normalization_rule_tsv": str(rules)}
        try:
            spm.SentencePieceTrainer.train(
                input=str(text),
                model_prefix=str(Path(tmp) / "spm"),
                model_type="bpe",
                vocab_size=vocab_size,
                character_coverage=1.0,
                byte_fallback=True,
                **normalization,
                pad_id=PAD,
                unk_id=UNK,
                bos_id=BOS,
                eos_id=EOS,
                pad_piece="<pad>",
                user_defined_symbols=tags,
                input_sentence_size=0,
                shuffle_input_sentence=False,
                num_threads=config.threads,
                minloglevel=2,
            )
        except RuntimeError as e:
            message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            fix = " (choose a smaller --vocab-size)" if "vocab" in message.lower() else ""
            raise NmtError(f"sentencepiece could not learn {what} BPE model: {message}{fix}") from None
        # Both files appear together, each atomically.
        for name, target in (("spm.vocab", dest.with_suffix(".vocab")), ("spm.model", dest)):
            (Path(tmp) / name).replace(target)


def _lowercase_rules() -> str:
    """sentencepiece's rule file (hex code points, tab, hex code points) mapping every character
    to Python's lowercase of it. Not sentencepiece's own nmt_nfkc_cf: Unicode case folding makes
    "ß" "ss", which German references keep, and NFKC changes more than case."""
    rules = []
    for code in range(0x110000):
        if 0xD800 <= code < 0xE000:  # surrogates are not characters
            continue
        lower = chr(code).lower()
        if lower != chr(code):
            rules.append(f"{code:X}\t{' '.join(f'{ord(c):X}' for c in lower)}\n")
    return "".join(rules)


def vocabularies_of(where: Path) -> Vocabularies:
    """The sentencepiece models of a run directory, a package or export, or one .model file."""
    if where.is_file():
        return Vocabularies.joint_model(where)
    for folder in (where, where / "bpe"):
        found = Vocabularies.in_folder(folder)
        if all(p.is_file() for p in found.files()):
            return found
    raise NmtError(
        f"no sentencepiece model at {where} (give a run directory, a directory from "
        "`nmt export`, or an .model file)"
    )


def adopt(where: Path, run: RunDir, tags: list[str]) -> Vocabularies:
    """Take another model's sentencepiece models as this run's (for fine-tuning that model); its
    source side must hold the run's corpus `tags` as pieces."""
    found = vocabularies_of(where)
    mine = Vocabularies.in_folder(run.spm_folder, found.joint)
    run.spm_folder.mkdir(parents=True, exist_ok=True)
    for path, dest in zip(found.files(), mine.files()):
        sp = processor(path, follow=True)  # a file the user named
        if (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) != (PAD, UNK, BOS, EOS):
            raise NmtError(f"{path} was not made by `nmt bpe`: its special pieces have other ids")
        for tag in tags if path == found.source else ():
            if sp.piece_to_id(tag) == UNK:
                raise NmtError(
                    f"the BPE model of {where} has no piece {tag!r} (a --tag of this run's corpora), "
                    "so the tag would be cut into pieces: prep without it, or learn a BPE model here"
                )
        ui.say(f"encoding with the BPE model {path} ({sp.get_piece_size()} pieces)")
        vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
        with atomic_open(dest.with_suffix(".vocab")) as f:
            f.write(vocab)
        with atomic_open(dest, "wb") as f:
            f.write(sp.serialized_model_proto())
    return mine


def _drop_other_layout(run: RunDir, kept: Vocabularies) -> None:
    """Remove the sentencepiece models of the layout not made now (a joint model after
    separate ones, or the reverse), so that the run holds one layout."""
    other = Vocabularies.in_folder(run.spm_folder, not kept.joint)
    for path in other.files():
        path.unlink(missing_ok=True)
        path.with_suffix(".vocab").unlink(missing_ok=True)


def load(run: RunDir, side: str = "target"):
    """The sentencepiece processor of the run's `side` ("source" or "target")."""
    return processor(getattr(run.vocabularies(), side))


def dropout_encoding(run: RunDir, lang: str, p: float, seed: int, epoch: int) -> Shard:
    """The training side `lang` encoded with BPE-dropout for `epoch`, in memory: BPE's merges
    applied best first, each attempt skipped with probability `p` (Provilkov et al. 2020).

    The same for the same (seed, epoch, lang) in any process, as an exact resume and ranks that
    each encode their own copy need. sentencepiece's own sampling (enable_sampling) is not:
    seeded alike, two processes get different encodings (sentencepiece 0.2.x), so the merge
    loop is done here, on sentencepiece's pieces and scores, word by word (its BPE never merges
    across a word's leading U+2581); at p = 0 it gives sentencepiece's encoding exactly. Encoded
    on the fly, not from pre-sampled copies: a small share of an epoch's time, and no number of
    epochs is fixed ahead."""
    prep = run.load_manifest()["prep"]
    sp = load(run, "source" if lang == prep["src"] else "target")
    tags = {sp.piece_to_id(tag) for tag in corpus_tags(prep)} if lang == prep["src"] else set()
    dropout = _Dropout(sp, p, random.Random(f"{seed}/{epoch}/{lang}"), tags)
    ids: list[list[int]] = []
    for chunk in chunks(read_lines(run.text("train", lang)), ENCODE_CHUNK):
        ids += [dropout.sentence(sentence) for sentence in sp.encode(chunk, out_type=int)]
    return Shard.in_memory(ids, sp.get_piece_size())


class _Dropout:
    """BPE-dropout over a sentencepiece BPE model: sentencepiece's merge loop (bpe_model.cc,
    SampleEncode), each merge skipped with probability `p`, drawn from `rng`. The pieces in
    `atomic` (corpus tags: user-defined symbols, which no merge builds) stand alone."""

    def __init__(self, sp, p: float, rng: random.Random, atomic: set[int] = frozenset()):
        n = sp.get_piece_size()
        self.piece = [sp.id_to_piece(i) for i in range(n)]
        self.is_byte = [sp.is_byte(i) for i in range(n)]
        normal = (i for i in range(n) if not (sp.is_control(i) or sp.is_unknown(i) or self.is_byte[i]))
        self.table = {self.piece[i]: (i, sp.get_score(i)) for i in normal}
        self.p, self.draw, self.atomic = p, rng.random, atomic

    def sentence(self, ids: list[int]) -> list[int]:
        """A sentence's deterministic encoding re-segmented word by word; a word with byte
        pieces (characters outside the vocabulary) is kept as it is, and so is a tag."""
        out: list[int] = []
        word: list[int] = []
        for i in [*ids, -1]:
            if word and (i == -1 or i in self.atomic or self.piece[i].startswith("\u2581")):
                if any(self.is_byte[j] for j in word):
                    out += word
                else:
                    out += [self.table[s][0] for s in self.merge("".join(self.piece[j] for j in word))]
                word = []
            if i in self.atomic:
                out.append(i)
            else:
                word.append(i)
        return out

    def merge(self, word: str) -> list[str]:
        symbols = list(word)
        if len(symbols) == 1:
            return symbols
        nxt, prev = [*range(1, len(symbols)), -1], list(range(-1, len(symbols) - 1))
        agenda: list[tuple[float, int, int, int]] = []

        def add(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                found = self.table.get(symbols[left] + symbols[right])
                if found is not None:  # best score first, then leftmost
                    size = len(symbols[left]) + len(symbols[right])
                    heapq.heappush(agenda, (-found[1], left, right, size))

        for i in range(1, len(symbols)):
            add(i - 1, i)
        while agenda:
            _, left, right, size = heapq.heappop(agenda)
            if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != size:
                continue  # a pair that an earlier merge has used up
            if self.draw() < self.p:
                continue
            symbols[left] += symbols[right]
            symbols[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])
        return [s for s in symbols if s]


def encode_file(
    sp, text: Path, prefix: Path, threads: int, bar, task, first: list[int] | None = None
) -> dict:
    """Encode a text file into a shard, `first` (a language token) before each line; returns its
    token statistics."""
    vocab = sp.get_piece_size()
    is_byte = np.array([sp.is_byte(i) for i in range(vocab)], dtype=bool)
    unk = bytes_ = longest = 0
    with ShardWriter(prefix, vocab) as writer:
        for chunk in chunks(read_lines(text), ENCODE_CHUNK):
            ids = sp.encode(chunk, out_type=int, num_threads=threads)
            if first:
                ids = [first + x for x in ids]
            writer.add(ids)
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64)
            unk += int((flat == UNK).sum())
            bytes_ += int(is_byte[flat].sum())
            longest = max(longest, max((len(s) for s in ids), default=0))
            bar.advance(task, len(chunk))
    n, t = writer.sentences, writer.tokens
    return {
        "sentences": n,
        "tokens": t,
        "mean_length": round(t / n, 2) if n else 0.0,
        "max_length": longest,
        "unk_rate": unk / t if t else 0.0,
        "byte_fallback_rate": bytes_ / t if t else 0.0,
    }


def corpus_tags(prep: dict) -> list[str]:
    """The training corpora's tags (`--tag`, `<2xx>`), each once: sentencepiece refuses twins."""
    return list(dict.fromkeys(c["tag"] for c in prep["splits"]["train"].get("corpora", []) if c["tag"]))


def run_bpe(config: BpeConfig, run: RunDir) -> dict:
    """Learn the BPE model(s) and binarize every split; returns the vocabulary sizes and
    per-file token statistics."""
    splits = run.splits()
    manifest = run.load_manifest()["prep"]
    src, tgt = manifest["src"], manifest["tgt"]
    for split in splits:
        for lang in (src, tgt):
            run.require(run.text(split, lang), "prep")
    tags = corpus_tags(manifest)
    languages = None
    if config.from_model:
        vocabs = adopt(Path(config.from_model), run, tags)
        languages = _languages(Path(config.from_model), config, src, tgt)
    elif config.src_lang or config.tgt_lang:
        raise NmtError("--src-lang and --tgt-lang name a multilingual model's languages: give --from MODEL")
    if not config.from_model:
        vocabs = Vocabularies.in_folder(run.spm_folder, joint=not config.separate)
        auto = auto_vocab_size(manifest["splits"]["train"]["kept"])
        if vocabs.joint:
            texts = [run.text("train", src), run.text("train", tgt)]
            learn(config, texts, config.vocab_size or auto, tags, vocabs.source, "a joint")
        else:
            sizes = config.side_sizes(auto)
            learn(config, [run.text("train", src)], sizes[0], tags, vocabs.source, f"the source ({src})")
            learn(config, [run.text("train", tgt)], sizes[1], [], vocabs.target, f"the target ({tgt})")
    _drop_other_layout(run, vocabs)
    source, target = vocabs.processors()
    first = (
        {}
        if languages is None
        else {
            lang: [target.piece_to_id(languages["tokens"][languages[side]])]
            for lang, side in ((src, "src"), (tgt, "tgt"))
        }
    )
    stats: dict = {}
    produced: list[Path] = [q for p in vocabs.files() for q in (p, p.with_suffix(".vocab"))]
    total = sum(manifest["splits"][s]["kept"] for s in splits) * 2
    with ui.progress() as bar:
        task = bar.add_task("encode", total=total)
        for split in splits:
            for lang, sp in ((src, source), (tgt, target)):
                stats[f"{split}.{lang}"] = encode_file(
                    sp,
                    run.text(split, lang),
                    run.tokens(split, lang),
                    config.threads,
                    bar,
                    task,
                    first.get(lang),
                )
                produced += [Path(f"{run.tokens(split, lang)}.bin"), Path(f"{run.tokens(split, lang)}.idx")]
    (run.spm_folder / shortlist.NAME).unlink(missing_ok=True)  # of other pieces, if any
    ui.say("counting the training pairs' pieces for the lexical shortlist (translate --shortlist)")
    produced.append(shortlist.for_run(run))
    sizes = {"src_vocab_size": source.get_piece_size(), "vocab_size": target.get_piece_size()}
    said = {"languages": languages} if languages else {}
    run.record("bpe", produced, joint=vocabs.joint, **sizes, stats=stats, **said)
    return {"joint": vocabs.joint, **sizes, "stats": stats}


def _languages(where: Path, config: BpeConfig, src: str, tgt: str) -> dict | None:
    """The language tokens of a multilingual model `where` (an M2M100 or NLLB import) and the
    codes of this run's two languages, as M2M100 trains: each source line begins with its
    language's token, each target line with its own; None for a model of one pair."""
    from nmt_cli.inference import models

    tokens = models.locate(where).languages if not where.suffix == ".model" else {}
    if not tokens:
        if config.src_lang or config.tgt_lang:
            raise NmtError(
                f"--src-lang and --tgt-lang name a multilingual model's languages: {where} has one pair"
            )
        return None
    codes = {"src": config.src_lang or src, "tgt": config.tgt_lang or tgt}
    for side, code in codes.items():
        if code not in tokens:
            some = ", ".join(list(tokens)[:6])
            raise NmtError(
                f"{where} is multilingual and has no language {code!r:.40}: give --{side}-lang, one of its "
                f"{len(tokens)} ({some}, …)"
            )
    return {"tokens": tokens, **codes}


def show(result: dict) -> None:
    """The table of what `run_bpe` encoded."""
    ui.table(
        f"nmt bpe: {result['vocab_size']} pieces"
        if result["joint"]
        else f"nmt bpe: {result['src_vocab_size']} source and {result['vocab_size']} target pieces",
        ["file", "sentences", "tokens", "mean length", "max", "unknown", "byte fallback"],
        [
            [
                name,
                f"{s['sentences']:,}",
                f"{s['tokens']:,}",
                f"{s['mean_length']:.1f}",
                str(s["max_length"]),
                f"{s['unk_rate']:.3%}",
                f"{s['byte_fallback_rate']:.3%}",
            ]
            for name, s in result["stats"].items()
        ],
    )
