"""`nmt bpe`: a joint sentencepiece BPE model, and every split encoded into binarized shards.

The model is learned from a bounded random sample of both training sides, so memory does not
grow with the corpus. Normalisation is the identity (prep already normalised the text), which
makes decoding an exact inverse of encoding; byte fallback means no input is ever unknown.
"""

from __future__ import annotations

import itertools
import random
import tempfile
from pathlib import Path

import numpy as np

from nmt_cli import ui
from nmt_cli.config import BpeConfig
from nmt_cli.errors import NmtError
from nmt_cli.rundir import RunDir, atomic_open
from nmt_cli.shards import BOS, EOS, PAD, UNK, ShardWriter, dtype_for
from nmt_cli.textio import chunks, read_lines

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


def learn(config: BpeConfig, run: RunDir, src: str, tgt: str, vocab_size: int) -> None:
    import sentencepiece as spm

    sample = sample_lines([run.text("train", src), run.text("train", tgt)], config.sample_lines, config.seed)
    ui.say(f"learning a joint BPE model of {vocab_size} pieces from {len(sample):,} sentences")
    run.spm_model.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=run.spm_model.parent) as tmp:
        text = Path(tmp) / "sample.txt"
        text.write_text("".join(line + "\n" for line in sample), encoding="utf-8")
        del sample
        try:
            spm.SentencePieceTrainer.train(
                input=str(text),
                model_prefix=str(Path(tmp) / "spm"),
                model_type="bpe",
                vocab_size=vocab_size,
                character_coverage=1.0,
                byte_fallback=True,
                normalization_rule_name="identity",
                pad_id=PAD,
                unk_id=UNK,
                bos_id=BOS,
                eos_id=EOS,
                pad_piece="<pad>",
                input_sentence_size=0,
                shuffle_input_sentence=False,
                num_threads=config.threads,
                minloglevel=2,
            )
        except RuntimeError as e:
            message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            fix = " (choose a smaller --vocab-size)" if "vocab" in message.lower() else ""
            raise NmtError(f"sentencepiece could not learn the BPE model: {message}{fix}") from None
        # Both files appear together, each atomically.
        for name, dest in (("spm.vocab", run.spm_vocab), ("spm.model", run.spm_model)):
            (Path(tmp) / name).replace(dest)


def spm_of(where: Path) -> Path:
    """The sentencepiece model of a run directory, a package or export, or a .model file."""
    for candidate in (where, where / "spm.model", where / "bpe" / "spm.model"):
        if candidate.is_file():
            return candidate
    raise NmtError(
        f"no sentencepiece model at {where} (give a run directory, a directory from "
        "`nmt export`, or an .model file)"
    )


def adopt(where: Path, run: RunDir) -> None:
    """Take another model's sentencepiece model as this run's (for fine-tuning that model)."""
    import sentencepiece as spm

    path = spm_of(where)
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as e:
        raise NmtError(f"{path} is not a sentencepiece model ({e})") from None
    if (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) != (PAD, UNK, BOS, EOS):
        raise NmtError(f"{path} was not made by `nmt bpe`: its special pieces have other ids")
    ui.say(f"encoding with the BPE model of {where} ({sp.get_piece_size()} pieces)")
    run.spm_model.parent.mkdir(parents=True, exist_ok=True)
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    with atomic_open(run.spm_vocab) as f:
        f.write(vocab)
    with atomic_open(run.spm_model, "wb") as f:
        f.write(path.read_bytes())


def load(run: RunDir):
    """The run's sentencepiece processor."""
    import sentencepiece as spm

    run.require(run.spm_model, "bpe")
    return spm.SentencePieceProcessor(model_file=str(run.spm_model))


def encode_file(sp, text: Path, prefix: Path, threads: int, bar, task) -> dict:
    """Encode a text file into a shard; returns its token statistics."""
    vocab = sp.get_piece_size()
    is_byte = np.array([sp.is_byte(i) for i in range(vocab)], dtype=bool)
    unk = bytes_ = longest = 0
    with ShardWriter(prefix, vocab) as writer:
        for chunk in chunks(read_lines(text), ENCODE_CHUNK):
            ids = sp.encode(chunk, out_type=int, num_threads=threads)
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


def run_bpe(config: BpeConfig, run: RunDir) -> dict:
    """Learn the BPE model and binarize every split; returns per-file token statistics."""
    splits = run.splits()
    manifest = run.load_manifest()["prep"]
    src, tgt = manifest["src"], manifest["tgt"]
    for split in splits:
        for lang in (src, tgt):
            run.require(run.text(split, lang), "prep")
    if config.from_model:
        adopt(Path(config.from_model), run)
        sp = load(run)
        vocab_size = sp.get_piece_size()
    else:
        vocab_size = config.vocab_size or auto_vocab_size(manifest["splits"]["train"]["kept"])
        learn(config, run, src, tgt, vocab_size)
        sp = load(run)
    stats: dict = {}
    produced: list[Path] = [run.spm_model, run.spm_vocab]
    total = sum(manifest["splits"][s]["kept"] for s in splits) * 2
    with ui.progress() as bar:
        task = bar.add_task("encode", total=total)
        for split in splits:
            for lang in (src, tgt):
                stats[f"{split}.{lang}"] = encode_file(
                    sp, run.text(split, lang), run.tokens(split, lang), config.threads, bar, task
                )
                produced += [Path(f"{run.tokens(split, lang)}.bin"), Path(f"{run.tokens(split, lang)}.idx")]
    run.record("bpe", produced, vocab_size=vocab_size, dtype=dtype_for(vocab_size).name, stats=stats)
    return {"vocab_size": vocab_size, "stats": stats}


def show(result: dict) -> None:
    """The table of what `run_bpe` encoded."""
    ui.table(
        f"nmt bpe: {result['vocab_size']} pieces",
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
