"""Benchmark one model for six directions against six bilingual models, in the same CPU time.

    python benchmarks/many_pairs.py [--minutes 60] [--out benchmarks/out/many] [--threads 1]

Multi30k en<->de, en<->fr, en<->cs from the shared copy, the quickstart's `small` CPU recipe
(config/training.py's MULTI30K_CPU: its vocabulary size, batch, warm-up, checkpoints and
averaging) for every model:

- multilingual: `nmt prep multi30k` (the six English-centric directions, `<2xx>` on each
  source), one joint BPE, `nmt train --max-time M`;
- bilingual: for each direction, `nmt prep multi30k --pair X-Y`, its own BPE,
  `nmt train --max-time M/6`, one after another.

The two arms run side by side, each on `--threads` threads (default: half the cores), so each
has M minutes of the same cores' time and both see the same machine. Validation costs the same
share of each: the multilingual run validates its six directions every 6 x 500 updates, a
bilingual run its one every 500. Every model is averaged over its last checkpoints as the
quickstart does, then test2016 is translated (beam 4, the default engine) and scored per
direction: cased sacreBLEU and chrF with signatures.

Results go to OUT/many.json and print as the markdown rows of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_name, nmt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("NMT_SHARED_DATA", ROOT.parent / "shared" / "data")) / "multi30k"
PAIRS = ("en-de", "de-en", "en-fr", "fr-en", "en-cs", "cs-en")


def one_run(run: Path, pairs: list[str], minutes: float, threads: int, log: Path) -> dict:
    """Prep, BPE, train, average and score one run; its test2016 scores per direction."""
    from nmt_cli.config import MULTI30K_CPU

    if not (run / "manifest.json").exists() or "bpe" not in json.loads((run / "manifest.json").read_text()):
        given = [a for p in pairs for a in ("--pair", p)]
        nmt("prep", "multi30k", "--run-dir", str(run), "--mirror", str(MULTI30K), *given, log=log)
        nmt("bpe", "--run-dir", str(run), "--vocab-size", str(MULTI30K_CPU.vocab_size), log=log)
    recipe = {**MULTI30K_CPU.train, "eval_every": MULTI30K_CPU.train["eval_every"] * len(pairs)}
    options = [
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in recipe.items()
    ]
    started = time.monotonic()
    if not (run / "averaged.pt").exists():
        nmt(
            "train",
            "--run-dir",
            str(run),
            *options,
            "--max-steps=0",
            f"--max-time={minutes:g}",
            f"--threads={threads}",
            log=log,
        )
        nmt("average", "--run-dir", str(run), "--last", str(MULTI30K_CPU.average), log=log)
    trained = time.monotonic() - started
    report = json.loads(
        nmt(
            "score",
            "--run-dir",
            str(run),
            "--split",
            "test",
            "--json",
            "--metrics",
            "bleu,chrf",
            f"--threads={threads}",
            log=log,
        )
    )
    by_pair = report.get("pairs") or {pairs[0]: report}
    out: dict = {"pairs": {}, "train": json.loads((run / "train.json").read_text()), "seconds": trained}
    for pair, r in by_pair.items():
        by = {s["metric"]: s for s in r["scores"]}
        out["pairs"][pair] = {
            "bleu": by["bleu"]["score"],
            "chrf": by["chrf"]["score"],
            "bleu_signature": by["bleu"]["signature"],
            "chrf_signature": by["chrf"]["signature"],
            "lines": r.get("lines"),
        }
    valid = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    valid = [row for row in valid if row.get("kind") == "valid"]
    out["updates"] = valid[-1]["step"] if valid else None
    out["valid"] = valid[-1] if valid else None  # the last validation: greedy BLEU/chrF per direction
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=60.0, help="the multilingual run's training minutes")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "many")
    ap.add_argument("--threads", type=int, default=0, help="threads of each arm (default: half the cores)")
    args = ap.parse_args()
    threads = args.threads or max(1, (os.cpu_count() or 2) // 2)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"minutes": args.minutes, "threads": threads, "cpu": cpu_name(), "bilingual": {}}

    def multilingual() -> None:
        results["multilingual"] = one_run(
            args.out / "multi", list(PAIRS), args.minutes, threads, args.out / "multi.log"
        )

    def bilingual() -> None:
        for pair in PAIRS:
            results["bilingual"][pair] = one_run(
                args.out / pair, [pair], args.minutes / len(PAIRS), threads, args.out / f"{pair}.log"
            )

    started = time.perf_counter()
    arms = [threading.Thread(target=multilingual), threading.Thread(target=bilingual)]
    for arm in arms:
        arm.start()
    for arm in arms:
        arm.join()
    if "multilingual" not in results or len(results["bilingual"]) < len(PAIRS):
        sys.exit(f"an arm failed; see the logs in {args.out}")
    results["wall_minutes"] = (time.perf_counter() - started) / 60
    (args.out / "many.json").write_text(json.dumps(results, indent=2))

    multi = results["multilingual"]
    print(
        f"| test2016 | one model, {args.minutes:g} min: BLEU | chrF "
        f"| six models, {args.minutes / 6:g} min each: BLEU | chrF |"
    )
    print("|---|---|---|---|---|")
    sums = [0.0] * 4
    for pair in PAIRS:
        m, b = multi["pairs"][pair], results["bilingual"][pair]["pairs"][pair]
        row = [m["bleu"], m["chrf"], b["bleu"], b["chrf"]]
        sums = [s + x for s, x in zip(sums, row)]
        print(f"| {pair} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    print("| mean | " + " | ".join(f"**{s / len(PAIRS):.2f}**" for s in sums) + " |")
    updates = ", ".join(f"{p} {results['bilingual'][p]['updates']}" for p in PAIRS)
    print(f"\nupdates: one model {multi['updates']}; six models {updates}")
    print(f"- BLEU: `{multi['pairs']['en-de']['bleu_signature']}`")
    print(f"- chrF: `{multi['pairs']['en-de']['chrf_signature']}`")
    print(
        f"\n{results['cpu']}, {threads} thread(s) per arm; "
        f"whole benchmark {results['wall_minutes']:.1f} minutes"
    )


if __name__ == "__main__":
    main()
