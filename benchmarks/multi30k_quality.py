"""Benchmark the quality `nmt quickstart` reaches on Multi30k en-de in a fixed training time.

    python benchmarks/multi30k_quality.py [--minutes 60] [--out benchmarks/out/quality] [OPTIONS]

1. `nmt quickstart --minutes M+1 --mirror ../shared/data/multi30k`: prep, bpe, the quickstart's
   CPU recipe trained for M minutes (validation BLEU logged along the way), average, translate
   test2016 with beam 4, score, plot. Further OPTIONS (`nmt train`'s, e.g. `--dropout 0.1`) go
   to the quickstart and override its recipe.
2. `nmt score --split test2017` (translates test2017 with the same model).
3. For both test sets: cased detokenized sacreBLEU and chrF with signatures, and BLEU on text
   processed like the Multi30k repository's tokenized files (`nmt score --moses-lc`), the
   measure the small-data literature reports (Wu et al. 2021, Transformer-Tiny: 41.02).
4. The learning curve: greedy BLEU and NLL on the validation set against minutes of training.

Results go to OUT/quality.json and print as the markdown rows of docs/benchmarks.md. An OUT
that already holds a run resumes it (the budget counts the time it trained before): remove OUT
for a new measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("NMT_SHARED_DATA", ROOT.parent / "shared" / "data")) / "multi30k"


def nmt(*args: str, log: Path) -> str:
    with open(log, "a", encoding="utf-8") as err:
        done = subprocess.run(
            [sys.executable, "-m", "nmt_cli", *args], stdout=subprocess.PIPE, stderr=err, text=True
        )
    if done.returncode:
        sys.exit(f"nmt {' '.join(args)} failed (exit {done.returncode}); see {log}")
    return done.stdout


def scores(run: Path, split: str, log: Path) -> dict:
    cased = json.loads(
        nmt("score", "--run-dir", str(run), "--split", split, "--json", "--metrics", "bleu,chrf", log=log)
    )
    lc = json.loads(
        nmt(
            "score",
            "--hyp",
            cased["hyp"],
            "--ref",
            cased["ref"],
            "--moses-lc",
            "--lang",
            "de",
            "--metrics",
            "bleu",
            "--json",
            log=log,
        )
    )
    by = {s["metric"]: s for s in cased["scores"]}
    return {
        "bleu": by["bleu"]["score"],
        "bleu_signature": by["bleu"]["signature"],
        "chrf": by["chrf"]["score"],
        "chrf_signature": by["chrf"]["signature"],
        "moses_lc_bleu": lc["scores"][0]["score"],
        "moses_lc_signature": lc["scores"][0]["signature"],
        "lines": cased["lines"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=60.0, help="minutes of training")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "quality")
    ap.add_argument("--threads", type=int, default=0)
    args, train_options = ap.parse_known_args()
    run = args.out / "run"
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "quality.log"
    extra = ["--threads", str(args.threads)] if args.threads else []
    if (run / "checkpoints").is_dir():
        print(f"{run} holds a run: resuming it (remove {args.out} for a new measurement)", file=sys.stderr)
    started = time.perf_counter()
    # The quickstart keeps a minute of its budget for prep, BPE, decoding and scoring.
    nmt(
        "quickstart",
        "--run-dir",
        str(run),
        "--minutes",
        f"{args.minutes + 1:g}",
        "--mirror",
        str(MULTI30K),
        *extra,
        *train_options,
        log=log,
    )
    pipeline = time.perf_counter() - started
    results = {
        "minutes": args.minutes,
        "pipeline_minutes": pipeline / 60,
        "train": json.loads((run / "train.json").read_text()),
        "bpe": json.loads((run / "bpe.json").read_text()),
        "test2016": scores(run, "test", log),
        "test2017": scores(run, "test2017", log),
    }
    curve = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == "valid":
            curve.append({k: row.get(k) for k in ("step", "epoch", "minutes", "valid_nll", "valid_bleu")})
    results["curve"] = curve
    results["steps"] = curve[-1]["step"] if curve else None
    (args.out / "quality.json").write_text(json.dumps(results, indent=2))

    print("| test set | BLEU (moses-lc, tokenize none) | sacreBLEU cased | chrF |")
    print("|---|---|---|---|")
    for name in ("test2016", "test2017"):
        r = results[name]
        print(f"| {name} | {r['moses_lc_bleu']:.2f} | {r['bleu']:.2f} | {r['chrf']:.2f} |")
    for name in ("moses_lc_signature", "bleu_signature", "chrf_signature"):
        print(f"- {name}: `{results['test2016'][name]}`")
    print("\n| minutes | step | epoch | valid NLL | valid BLEU (greedy) |")
    print("|---|---|---|---|---|")
    for row in curve:
        bleu = f"{row['valid_bleu']:.2f}" if row["valid_bleu"] is not None else "-"
        print(f"| {row['minutes']:.1f} | {row['step']} | {row['epoch']} | {row['valid_nll']:.3f} | {bleu} |")
    print(f"\nwhole pipeline: {pipeline / 60:.1f} minutes; curves: {run / 'curves.png'}")


if __name__ == "__main__":
    main()
