"""How far apart two trainings of one recipe land: the paired bootstrap between two seeds.

The side-by-side against fairseq (vs_fairseq_quality.py) compares one training of each toolkit
with sacreBLEU's paired bootstrap, which resamples the test sentences but not the training. This
script puts the same test to two runs of nmt that differ only in their seed (for example the two
of `multi30k_quality.py --seeds 2`): whatever it calls significant there is training noise.
It reads the validation set only. Any two runs of one data set can be compared the same way
(precision_lever.sh compares an fp32 run with a bf16 one).

    python benchmarks/seed_noise.py RUN_A RUN_B [--split valid]

Each run's model (its averaged one) translates the split with `nmt score`'s defaults; both are
scored against the references as released (cased BLEU, chrF, moses-lc BLEU), with p for A
against B (1000 bootstrap samples).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def translations(run: Path, split: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "nmt_cli", "score", "--run-dir", str(run), "--split", split, "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return Path(json.loads(out)["hyp"]).read_text(encoding="utf-8").splitlines()


def main() -> None:
    from nmt_cli import scoring

    ap = argparse.ArgumentParser()
    ap.add_argument("runs", type=Path, nargs=2)
    ap.add_argument("--split", default="valid", help="valid (the default); a test set only at the end")
    args = ap.parse_args()
    a, b = (translations(run, args.split) for run in args.runs)
    tgt = json.loads((args.runs[0] / "manifest.json").read_text())["prep"]["tgt"]
    refs = (args.runs[0] / "text" / f"{args.split}.raw.{tgt}").read_text(encoding="utf-8").splitlines()
    names = (str(args.runs[0]), "ref")
    cased = scoring.report(a, refs, names, ["bleu", "chrf"], baseline=(str(args.runs[1]), b))["compare"]
    lc = scoring.report(a, refs, names, ["bleu"], moses_lc_lang=tgt, baseline=(str(args.runs[1]), b))
    rows = {"moses_lc": lc["compare"]["bleu"], "bleu": cased["bleu"], "chrf": cased["chrf"]}
    print(f"{args.split}: A = {args.runs[0]}, B = {args.runs[1]}")
    print("| metric | A | B | A - B | p |\n| --- | ---: | ---: | ---: | ---: |")
    for metric, r in rows.items():
        diff = r["system"] - r["baseline"]
        print(f"| {metric} | {r['system']:.2f} | {r['baseline']:.2f} | {diff:+.2f} | {r['p_value']:.3f} |")


if __name__ == "__main__":
    main()
