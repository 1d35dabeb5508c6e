"""Benchmark the quality `nmt quickstart` reaches on Multi30k en-de in a fixed training time.

    python benchmarks/multi30k_quality.py [--minutes 60] [--out benchmarks/out/quality] [OPTIONS]

1. `nmt quickstart --minutes M+1 --mirror ../shared/data/multi30k`: prep, bpe, the quickstart's
   CPU recipe trained for M minutes (validation BLEU logged along the way), average, translate
   test2016 with beam 4, score, plot. Further OPTIONS (`nmt train`'s, e.g. `--dropout 0.1`) go
   to the quickstart and override its recipe.
2. `nmt score --split test2017` (translates test2017 with the same model).
3. For the validation set and both test sets: cased detokenized sacreBLEU and chrF with
   signatures (case-insensitive with `--lowercase`, which makes the model read and write
   lowercase), and BLEU on text processed like the Multi30k repository's tokenized files (`nmt
   score --moses-lc`), the measure the small-data literature reports (Wu et al. 2021,
   Transformer-Tiny: 41.02). Recipes are chosen by the validation figure alone.
4. The learning curve: greedy BLEU and NLL on the validation set against minutes of training.

With `--seeds N`, N models of the recipe (seeds 1..N; `--first-seed F`: F..F+N-1) train side by
side for the same M minutes, the cores shared out (`--threads`, default cores / N), each averaged
as the quickstart does; the test sets are translated by their ensemble (`nmt score --model A
--model B`), and the validation set by the ensemble and by each model alone, the evidence for
choosing the ensemble.

Results go to OUT/quality.json and print as the markdown rows of docs/benchmarks.md. An OUT
that already holds a run resumes it (the budget counts the time it trained before): remove OUT
for a new measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_name, nmt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("NMT_SHARED_DATA", ROOT.parent / "shared" / "data")) / "multi30k"


def scores(run: Path, split: str, log: Path, models: list[Path] = ()) -> dict:
    """The run's model's scores on `split`, or those of the ensemble of `models`."""
    given = [a for m in models for a in ("--model", str(m))]
    cased = json.loads(
        nmt(
            "score",
            "--run-dir",
            str(run),
            "--split",
            split,
            "--json",
            "--metrics",
            "bleu,chrf",
            *given,
            log=log,
        )
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


def ensemble(args, train_options: list[str], log: Path) -> dict:
    """--seeds N: N models of the recipe trained side by side on the cores (seeds F..F+N-1 for
    --first-seed F, the threads shared out), each averaged as the quickstart does, then decoded
    as one ensemble."""
    from nmt_cli.config import MULTI30K_CPU

    base = args.out / "data"
    if not (base / "manifest.json").exists():
        nmt("prep", "multi30k-en-de", "--run-dir", str(base), "--mirror", str(MULTI30K), log=log)
        lowercase = ["--lowercase"] if args.lowercase else []
        nmt("bpe", "--run-dir", str(base), "--vocab-size", str(MULTI30K_CPU.vocab_size), *lowercase, log=log)
    runs = [args.out / f"run{k}" for k in range(1, args.seeds + 1)]
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.seeds)
    recipe = [
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
        for k, v in MULTI30K_CPU.train.items()
    ]
    procs = []
    for k, run in enumerate(runs, 1):
        if not run.exists():
            shutil.copytree(base, run)
        command = ["train", "--run-dir", str(run), *recipe, "--max-steps=0", f"--max-time={args.minutes:g}"]
        command += [f"--seed={args.first_seed + k - 1}", f"--threads={threads}", *train_options]
        with open(log, "a", encoding="utf-8") as err:
            procs.append(
                subprocess.Popen([sys.executable, "-m", "nmt_cli", *command], stdout=err, stderr=err)
            )
    if any(p.wait() for p in procs):
        sys.exit(f"a training run failed; see {log}")
    for run in runs:
        nmt("average", "--run-dir", str(run), "--last", str(MULTI30K_CPU.average), log=log)
    models = [run / "averaged.pt" for run in runs]
    return {
        "members_valid": [scores(run, "valid", log) for run in runs],
        "valid": scores(runs[0], "valid", log, models),
        "test2016": scores(runs[0], "test", log, models),
        "test2017": scores(runs[0], "test2017", log, models),
        "train": json.loads((runs[0] / "train.json").read_text()),
        "run": runs[0],
    }


def main() -> None:
    from nmt_cli.config import resolve_precision
    from nmt_cli.engine.device import cpu_has_bf16

    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=60.0, help="minutes of training")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "quality")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--seeds", type=int, default=1, help="train this many models side by side and decode their ensemble"
    )
    ap.add_argument("--first-seed", type=int, default=1, help="with --seeds N: seeds F..F+N-1 (another pair)")
    ap.add_argument("--precision", default="auto", help="training's --precision (recorded as resolved)")
    ap.add_argument(
        "--lowercase", action="store_true", help="`nmt bpe --lowercase`: the model reads and writes lowercase"
    )
    args, train_options = ap.parse_known_args()
    train_options += ["--precision", args.precision]
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "quality.log"
    started = time.perf_counter()
    if args.seeds > 1:
        results = ensemble(args, train_options, log)
        run = results.pop("run")
    else:
        run = args.out / "run"
        extra = ["--threads", str(args.threads)] if args.threads else []
        extra += ["--lowercase"] if args.lowercase else []
        if (run / "checkpoints").is_dir():
            print(
                f"{run} holds a run: resuming it (remove {args.out} for a new measurement)", file=sys.stderr
            )
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
        results = {
            "train": json.loads((run / "train.json").read_text()),
            "valid": scores(run, "valid", log),  # beam, the figure recipes are chosen by
            "test2016": scores(run, "test", log),
            "test2017": scores(run, "test2017", log),
        }
    pipeline = time.perf_counter() - started
    results.update(
        minutes=args.minutes,
        seeds=args.seeds,
        first_seed=args.first_seed,
        cpu=cpu_name(),
        precision=resolve_precision(args.precision, "cpu", cpu_has_bf16()),
        lowercase=args.lowercase,
        pipeline_minutes=pipeline / 60,
        bpe=json.loads((run / "bpe.json").read_text()),
    )
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
    if args.seeds > 1:
        members = ", ".join(f"{r['moses_lc_bleu']:.2f}" for r in results["members_valid"])
        print(
            f"\nvalidation moses-lc BLEU: ensemble {results['valid']['moses_lc_bleu']:.2f}, members {members}"
        )
    else:
        print(f"\nvalidation moses-lc BLEU: {results['valid']['moses_lc_bleu']:.2f}")
    print("\nLearning curve" + (" of the first member" if args.seeds > 1 else "") + ":")
    print("| minutes | step | epoch | valid NLL | valid BLEU (greedy) |")
    print("|---|---|---|---|---|")
    for row in curve:
        bleu = f"{row['valid_bleu']:.2f}" if row["valid_bleu"] is not None else "-"
        print(f"| {row['minutes']:.1f} | {row['step']} | {row['epoch']} | {row['valid_nll']:.3f} | {bleu} |")
    print(f"\nwhole pipeline: {pipeline / 60:.1f} minutes; curves: {run / 'curves.png'}")


if __name__ == "__main__":
    main()
