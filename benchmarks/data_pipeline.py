"""Benchmark `nmt prep` + `nmt bpe`: wall time on Multi30k, and peak memory against corpus size.

    python benchmarks/data_pipeline.py [--sizes 200000 2000000] [--out benchmarks/out]

1. `nmt prep multi30k-en-de --mirror ../shared/data/multi30k` then `nmt bpe --vocab-size 8000`.
2. A custom corpus of N distinct pairs generated from Multi30k sentences (each pair joins two
   random training pairs), through `nmt prep custom` and `nmt bpe` (default settings), for each
   N: wall time, pairs/s and the peak RSS of the largest process of each step; and the lexical
   shortlist `nmt bpe` builds, built again alone.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("NMT_SHARED_DATA", ROOT.parent / "shared" / "data")) / "multi30k"


def timed(args: list[str], python: list[str] | None = None) -> dict:
    """Run one nmt command (or `python` arguments) in a fresh process; wall seconds and the peak
    RSS of its processes."""
    code = (
        "import resource, subprocess, sys, json, time\n"
        "t = time.perf_counter()\n"
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
        "stderr=subprocess.DEVNULL)\n"
        "print(json.dumps({'seconds': time.perf_counter() - t, 'peak_rss_mb': "
        "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, sys.executable, *(python or ["-m", "nmt_cli", *args])],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def generate(n: int, folder: Path) -> tuple[Path, Path]:
    en = gzip.open(MULTI30K / "train.en.gz", "rt", encoding="utf-8").read().splitlines()
    de = gzip.open(MULTI30K / "train.de.gz", "rt", encoding="utf-8").read().splitlines()
    rng = random.Random(n)
    src, tgt = folder / f"gen{n}.en", folder / f"gen{n}.de"
    with open(src, "w", encoding="utf-8") as fs, open(tgt, "w", encoding="utf-8") as ft:
        for _ in range(n):
            i, j = rng.randrange(len(en)), rng.randrange(len(en))
            fs.write(f"{en[i]} {en[j]}\n")
            ft.write(f"{de[i]} {de[j]}\n")
    return src, tgt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[200_000, 2_000_000])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"cpus": os.cpu_count()}

    run = args.out / "multi30k"
    prep = timed(["prep", "multi30k-en-de", "--run-dir", str(run), "--mirror", str(MULTI30K)])
    bpe = timed(["bpe", "--run-dir", str(run), "--vocab-size", "8000"])
    results["multi30k"] = {"prep": prep, "bpe": bpe, "total_seconds": prep["seconds"] + bpe["seconds"]}
    print(json.dumps(results["multi30k"]), flush=True)

    for n in args.sizes:
        src, tgt = generate(n, args.out)
        run = args.out / f"custom{n}"
        prep = timed(
            ["prep", "custom", "--run-dir", str(run), "--train-src", str(src), "--train-tgt", str(tgt)]
        )
        bpe = timed(["bpe", "--run-dir", str(run)])
        # the lexical shortlist `nmt bpe` counts (part of its time above), again alone
        (run / "bpe" / "shortlist.txt").unlink()
        alone = f"from nmt_cli import shortlist, rundir; shortlist.for_run(rundir.RunDir({str(run)!r}))"
        listed = timed([], ["-c", alone])
        results[f"custom{n}"] = {
            "pairs": n,
            "prep": prep,
            "bpe": bpe,
            "shortlist": listed,
            "prep_pairs_per_s": n / prep["seconds"],
            "bpe_pairs_per_s": n / bpe["seconds"],
            "peak_rss_mb": max(prep["peak_rss_mb"], bpe["peak_rss_mb"]),
        }
        print(json.dumps(results[f"custom{n}"]), flush=True)
        src.unlink()
        tgt.unlink()
    if len(args.sizes) == 2:
        a, b = (results[f"custom{n}"]["peak_rss_mb"] for n in args.sizes)
        results["rss_ratio"] = b / a
    (args.out / "data_pipeline.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
