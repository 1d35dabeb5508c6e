"""`nmt import --trim`: a base-shaped NLLB with its 256k-piece vocabulary (6+6 layers, d_model 512,
8 heads, FFN 2048, random weights; its sentencepiece model learned on Multi30k's four languages
and filled up to 256,000 pieces with pieces of characters Multi30k never has, whose embeddings
are zeros, as a trained model's pieces of other scripts never score highest on it; NLLB's numbering in
tokenizer.json and its 202 language codes), imported whole and trimmed to Multi30k's training
text in en, de, fr and cs: each import's time and peak memory, each package's parameters, then
both translating the same Multi30k validation lines (en -> de), each a process of its own end
to end, in alternated rounds, and how many lines they translate alike.

    python benchmarks/trim.py [--lines 300] [--beam 4] [--max-len 32] [--rounds 2]

Random weights run every translation to the length limit: the figures are of that much decoding.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from benchmarks.common import cpu_name  # noqa: E402
from benchmarks.huggingface import NMT, measured  # noqa: E402

LANGUAGES = {"en": "eng_Latn", "de": "deu_Latn", "fr": "fra_Latn", "cs": "ces_Latn"}


def build(folder: Path, multi30k: Path, pieces: int = 256_000) -> Path:
    """The NLLB-shaped folder, as its published one is laid out (the files nmt reads)."""
    import torch
    from m2m100 import _sentencepiece, shaped
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers import M2M100ForConditionalGeneration
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    folder.mkdir(parents=True)
    model_file = _sentencepiece(folder, multi30k, 8000)
    proto = pb.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    learned = len(proto.pieces)
    for n in range(pieces - learned):  # characters of the private use area: never in Multi30k
        proto.pieces.add(piece=chr(0xE000 + n % 6000) + str(n // 6000), score=-1e4 - n, type=1)
    proto.trainer_spec.vocab_size = len(proto.pieces)
    model_file.write_bytes(proto.SerializeToString())
    specials = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab = dict(specials)
    for i, p in enumerate(proto.pieces):
        if p.piece not in specials:
            vocab[p.piece] = i + 1  # NLLB's: the sentencepiece id plus one
    added = [{"id": i, "content": c, "special": True} for c, i in specials.items()]
    top = max(vocab.values()) + 1
    added += [
        {"id": top + i, "content": code, "special": True} for i, code in enumerate(FAIRSEQ_LANGUAGE_CODES)
    ]
    added.append({"id": top + len(FAIRSEQ_LANGUAGE_CODES), "content": "<mask>", "special": True})
    (folder / "tokenizer.json").write_text(
        json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": added})
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn", "tgt_lang": "deu_Latn"})
    )
    config = shaped(top + len(FAIRSEQ_LANGUAGE_CODES) + 3, 512, 6, 8, 2048, 1024, 0.02)
    torch.manual_seed(0)
    model = M2M100ForConditionalGeneration(config)
    with torch.no_grad():  # the filler: pieces of scripts a trained model never scores highest here
        model.get_input_embeddings().weight[learned + 1 : top] = 0.0
    model.save_pretrained(folder)
    return folder


def parameters(package: Path) -> int:
    from nmt_cli.inference import models

    return sum(t.numel() for t in models.locate(package).weights().values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=300)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from conftest import multi30k_folder

    multi30k = multi30k_folder()
    rows = []

    def report(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        folder = build(work / "nllb", multi30k)
        report({"part": "build the folder", "seconds": round(time.perf_counter() - start, 1)})
        corpus = work / "corpus.txt"
        with open(corpus, "w", encoding="utf-8") as f:
            for lang in LANGUAGES:
                f.write(gzip.open(multi30k / f"train.{lang}.gz", "rt", encoding="utf-8").read())
        sources = work / "sources.en"
        sources.write_text(
            "\n".join(
                gzip.open(multi30k / "val.en.gz", "rt", encoding="utf-8").read().splitlines()[: args.lines]
            )
            + "\n"
        )
        packages = {"whole": work / "whole", "trimmed": work / "trimmed"}
        languages = ["--src", "eng_Latn", "--tgt", "deu_Latn"]
        trim = ["--trim", str(corpus), "--languages", ",".join(LANGUAGES.values())]
        for name, extra in (("whole", []), ("trimmed", trim)):
            seconds, mb = measured([*NMT, "import", str(folder), str(packages[name]), *languages, *extra])
            report(
                {
                    "part": f"import, {name}",
                    "seconds": round(seconds, 1),
                    "peak_mb": round(mb),
                    "parameters": parameters(packages[name]),
                    "pieces": json.loads((packages[name] / "nmt.json").read_text())["model"]["vocab_size"],
                }
            )
        decode = ["--beam", str(args.beam), "--max-len", str(args.max_len), "--threads", "2"]
        times: dict[str, list[float]] = {name: [] for name in packages}
        peaks: dict[str, float] = {}
        for r in range(args.rounds):
            for name in packages if r % 2 == 0 else list(packages)[::-1]:
                out = work / f"out.{name}"
                seconds, mb = measured(
                    [*NMT, "translate", "--model", str(packages[name]), *decode], sources, out
                )
                times[name].append(seconds)
                peaks[name] = max(peaks.get(name, 0.0), mb)
        outs = {name: (work / f"out.{name}").read_text().splitlines() for name in packages}
        for name in packages:
            seconds = statistics.median(times[name])
            report(
                {
                    "part": f"translate, {name}",
                    "lines": args.lines,
                    "sentences_per_s": round(args.lines / seconds, 2),
                    "seconds": [round(t, 1) for t in times[name]],
                    "peak_mb": round(peaks[name]),
                }
            )
        same = sum(a == b for a, b in zip(outs["whole"], outs["trimmed"]))
        report({"part": "the same translations", "lines": same, "of": args.lines})
    print(f"\n{cpu_name()}; beam {args.beam}, --max-len {args.max_len}, {args.rounds} rounds")


if __name__ == "__main__":
    main()
