"""Models across the Hugging Face format: `nmt import` and `nmt export --format huggingface` of a
base-shaped MarianMTModel (OPUS-MT's shape: 6+6 layers, d_model 512, 8 heads, FFN 2048, swish, a
58101-piece shared vocabulary; random weights, its sentencepiece models learned on Multi30k), their
time and peak memory; then the imported model translating the same lines through nmt's engine,
its CTranslate2 export and transformers' `generate`, each a process of its own end to end (start,
load, translate), in alternated rounds.

    python benchmarks/huggingface.py [--lines 200] [--beam 4] [--max-len 32] [--rounds 3]
    python benchmarks/huggingface.py --fine-tune 20     # the import fine-tuned three ways instead

Random weights run every translation to the length limit (--max-len tokens, EOS included, for
every engine): the figures are of that much decoding. transformers gets the lines sorted by
length in batches of 32, as its users batch them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import cpu_name  # noqa: E402

NMT = [sys.executable, "-m", "nmt_cli"]

MAKE = """
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import multi30k_folder
from marian import make_marian
make_marian(Path(sys.argv[1]), multi30k_folder(), d_model=512, layers=6, heads=8, ffn=2048,
            vocab_size=int(sys.argv[2]), init_std=0.02)
print(multi30k_folder())
"""

GENERATE = """
import sys, torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
folder, beam, limit, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
tok = AutoTokenizer.from_pretrained(folder)
lines = sys.stdin.read().splitlines()
order = sorted(range(len(lines)), key=lambda i: len(lines[i]))
out = [""] * len(lines)
with torch.inference_mode():
    for k in range(0, len(order), 32):
        batch = [lines[i] for i in order[k : k + 32]]
        inputs = tok(batch, return_tensors="pt", padding=True)
        ids = model.generate(**inputs, num_beams=beam, max_new_tokens=limit)
        for i, text in zip(order[k : k + 32], tok.batch_decode(ids, skip_special_tokens=True)):
            out[i] = text
sys.stdout.write("".join(t + "\\n" for t in out))
"""


def measured(
    command: list[str], stdin: Path | None = None, stdout: Path | None = None
) -> tuple[float, float]:
    """Run `command`: its wall seconds and its peak resident memory (MB)."""
    start = time.perf_counter()
    with open(stdin or os.devnull, "rb") as i, open(stdout or os.devnull, "wb") as o:
        proc = subprocess.Popen(command, stdin=i, stdout=o, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        err = proc.stderr.read().decode() if proc.stderr else ""
    if status:
        sys.exit(f"{' '.join(command)} failed: {err[-2000:]}")
    return time.perf_counter() - start, usage.ru_maxrss / 1024


def fine_tune(args, work: Path, multi30k: Path, report) -> None:
    """The base-shaped import fine-tuned three ways on Multi30k, each a run of its own."""
    base = work / "run"
    measured([*NMT, "prep", "multi30k-en-de", "--run-dir", str(base), "--mirror", str(multi30k)])
    measured([*NMT, "bpe", "--from", str(work / "package"), "--run-dir", str(base)])
    ways = {
        "all weights": [],
        "--freeze embeddings": ["--freeze", "embeddings"],
        "--adapters 8": ["--adapters", "8"],
    }
    for name, extra in ways.items():
        run = work / name.replace(" ", "_").replace("-", "")
        shutil.copytree(base, run)
        steps = str(args.fine_tune)
        seconds, mb = measured(
            [
                *NMT,
                "train",
                "--run-dir",
                str(run),
                "--init-from",
                str(work / "package"),
                "--max-steps",
                steps,
                "--save-every",
                steps,
                "--eval-every",
                steps,
                "--max-tokens",
                "2048",
                "--threads",
                str(args.threads),
                *extra,
            ]
        )
        saved = sorted((run / "checkpoints").glob("checkpoint_*.pt"))[-1]
        nll = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        report(
            {
                "part": f"fine-tune, {name}",
                "updates": args.fine_tune,
                "seconds": round(seconds, 1),
                "checkpoint_mb": round(saved.stat().st_size / 2**20, 1),
                "peak_mb": round(mb),
                "valid_nll": next(r["valid_nll"] for r in reversed(nll) if "valid_nll" in r),
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=58101)
    parser.add_argument(
        "--fine-tune",
        type=int,
        default=0,
        metavar="STEPS",
        help="Also fine-tune the import on Multi30k for STEPS updates: all weights, --freeze "
        "embeddings, --adapters 8 (seconds per update, checkpoint size, peak memory); no translating.",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nmt-hf-bench-"))
    folder = work / "opus-mt-en-de"
    # Made in a process of its own: a child's peak memory counts its parent's at the fork (Linux
    # keeps ru_maxrss across exec), and this one would hold torch and transformers.
    made = subprocess.run(
        [sys.executable, "-c", MAKE, str(folder), str(args.vocab)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    multi30k = Path(made.stdout.split()[-1])
    rows = []

    def report(row: dict) -> None:
        row["cpu"] = cpu_name()
        rows.append(row)
        print(json.dumps(row), flush=True)

    seconds, mb = measured([*NMT, "import", str(folder), str(work / "package")])
    report({"part": "nmt import", "seconds": round(seconds, 2), "peak_mb": round(mb)})
    seconds, mb = measured(
        [*NMT, "export", str(work / "hf"), "--model", str(work / "package"), "--format", "huggingface"]
    )
    report({"part": "nmt export --format huggingface", "seconds": round(seconds, 2), "peak_mb": round(mb)})
    seconds, mb = measured(
        [*NMT, "export", str(work / "ct2"), "--model", str(work / "package"), "--format", "ctranslate2"]
    )
    report({"part": "nmt export --format ctranslate2", "seconds": round(seconds, 2), "peak_mb": round(mb)})
    if args.fine_tune:
        fine_tune(args, work, multi30k, report)
        return
    source = work / "source.en"
    with gzip.open(multi30k / "val.en.gz", "rt", encoding="utf-8") as f:
        source.write_text("".join(f.readlines()[: args.lines]))
    common = ["--beam", str(args.beam), "--max-len", str(args.max_len), "--threads", str(args.threads)]
    systems = {
        "nmt engine": [*NMT, "translate", "--model", str(work / "package"), *common],
        "nmt, CTranslate2 float32": [*NMT, "translate", "--model", str(work / "ct2"), *common],
        "transformers generate": [
            sys.executable,
            "-c",
            GENERATE,
            str(folder),
            str(args.beam),
            str(args.max_len),
            str(args.threads),
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, command in systems.items():
            seconds, _ = measured(command, source, work / f"{name}.out")
            times[name].append(seconds)
    outs = {name: (work / f"{name}.out").read_text().splitlines() for name in systems}
    for name, spent in times.items():
        best = min(spent)
        report(
            {
                "part": name,
                "lines": args.lines,
                "beam": args.beam,
                "max_len": args.max_len,
                "seconds": [round(s, 2) for s in spent],
                "sentences_per_s": round(args.lines / best, 1),
                "same_as_transformers": sum(
                    a == b for a, b in zip(outs[name], outs["transformers generate"])
                ),
            }
        )
    print(json.dumps({"work": str(work)}))


if __name__ == "__main__":
    main()
