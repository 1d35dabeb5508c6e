"""nmt against fairseq over several draws of the same side-by-side: vs_fairseq_quality.py run
with different --seed values (one training of each toolkit per seed, the same hour).

One draw compares one training of each toolkit, and its paired bootstrap resamples sentences,
not trainings: a seed alone moves nmt's validation BLEU by 0.7-1.4 (docs/benchmarks.md). With two or
more draws this prints, from the translations each draw kept (OUT/hyps) and nothing else:

1. each draw's gap (nmt - fairseq) and its p, as vs_fairseq_quality.py recorded them;
2. the pooled comparison: every draw's translations of a set, one after another, against the
   references repeated as often, with the paired bootstrap (1000 samples) of nmt against
   fairseq, so each toolkit is scored on all its trainings at once;
3. how far each toolkit's own draws land from each other on the validation set (the first draw
   against each later one, with the bootstrap's p): the noise a gap between toolkits must beat.

    python benchmarks/vs_fairseq_seeds.py OUT OUT [OUT ...]

Both settings of the side-by-side are read: each toolkit's default length penalty, and the one
each draw chose on its validation set. Nothing is decoded or trained again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
# The draws' own settings: each toolkit's default length penalty, the sets and nmt's splits.
from vs_fairseq_quality import DEFAULTS, SPLITS  # noqa: E402

SETTINGS = ("defaults", "chosen on valid")  # vs_fairseq.json's rows
METRICS = ("moses_lc", "bleu", "chrf")


def penalties(draw: dict, setting: str) -> dict:
    return DEFAULTS if setting == "defaults" else draw["chosen"]


def hyps(out: Path, name: str, who: str, penalty: float) -> list[str]:
    return (out / "hyps" / f"{name}.{who}.{penalty:g}.de").read_text(encoding="utf-8").splitlines()


def refs(out: Path, name: str) -> list[str]:
    path = out / "nmt" / "text" / f"{SPLITS[name]}.raw.de"
    return path.read_text(encoding="utf-8").splitlines()


def compare(ours: list[str], theirs: list[str], ref: list[str], names: tuple[str, str]) -> dict:
    """Scores of both and p of `ours` against `theirs` in the three measures."""
    from nmt_cli import score

    cased = score.report(ours, ref, (names[0], "ref"), ["bleu", "chrf"], baseline=(names[1], theirs))
    lc = score.report(ours, ref, (names[0], "ref"), ["bleu"], moses_lc_lang="de", baseline=(names[1], theirs))
    rows = {
        "moses_lc": lc["compare"]["bleu"],
        "bleu": cased["compare"]["bleu"],
        "chrf": cased["compare"]["chrf"],
    }
    return {m: {"a": r["system"], "b": r["baseline"], "p": r["p_value"]} for m, r in rows.items()}


def gaps(r: dict) -> str:
    return " / ".join(f"{r[m]['a'] - r[m]['b']:+.2f}" for m in METRICS)


def ps(r: dict) -> str:
    return " / ".join(f"{r[m]['p']:.3f}" for m in METRICS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outs", type=Path, nargs="+", help="vs_fairseq_quality.py --out folders, one per seed")
    args = ap.parse_args()
    if len(args.outs) < 2:
        sys.exit("give two or more draws (vs_fairseq_quality.py --out folders)")
    draws = {out: json.loads((out / "vs_fairseq.json").read_text()) for out in args.outs}
    for out, draw in draws.items():
        u = draw["updates"]
        print(
            f"- {out}: seed {draw.get('seed', 1)}, nmt {u['nmt']} updates ({draw['precision']['nmt']}), "
            f"fairseq {u['fairseq']}; chosen alpha {draw['chosen']['nmt']:g}, "
            f"lenpen {draw['chosen']['fairseq']:g}"
        )
    target_met = {}
    for setting in SETTINGS:
        print(f"\n{setting}: nmt - fairseq, moses-lc / cased BLEU / chrF (p)\n")
        print(
            "| set | "
            + " | ".join(f"seed {d.get('seed', 1)}" for d in draws.values())
            + " | pooled | pooled p |"
        )
        print("| --- |" + " --- |" * (len(draws) + 2))
        for name in SPLITS:
            per_draw = []
            for draw in draws.values():
                r = draw[setting][name]
                per_draw.append(
                    " / ".join(f"{r['nmt'][m] - r['fairseq'][m]:+.2f}" for m in METRICS)
                    + " (" + " / ".join(f"{r['p'][m]:.3f}" for m in METRICS) + ")"
                )  # fmt: skip
            ours, theirs, ref = [], [], []
            for out, draw in draws.items():
                pen = penalties(draw, setting)
                ours += hyps(out, name, "nmt", pen["nmt"])
                theirs += hyps(out, name, "fairseq", pen["fairseq"])
                ref += refs(out, name)
            pooled = compare(ours, theirs, ref, ("nmt", "fairseq"))
            print(f"| {name} | " + " | ".join(per_draw) + f" | {gaps(pooled)} | {ps(pooled)} |")
            if name != "valid":
                # The bar: ahead by 1 BLEU (both measures) and 1 chrF, each with p < 0.05.
                target_met[(setting, name)] = all(
                    pooled[m]["a"] - pooled[m]["b"] >= 1 and pooled[m]["p"] < 0.05 for m in METRICS
                )
    print("\nEach toolkit's draws against each other on the validation set (defaults), A / B (p):\n")
    print("| toolkit | draws | moses-lc | cased BLEU | chrF |\n| --- | --- | --- | --- | --- |")
    outs = list(draws)
    ref = refs(outs[0], "valid")
    for who in ("nmt", "fairseq"):
        first = hyps(outs[0], "valid", who, DEFAULTS[who])
        for later in outs[1:]:
            r = compare(first, hyps(later, "valid", who, DEFAULTS[who]), ref, (str(outs[0]), str(later)))
            cells = " | ".join(f"{r[m]['a']:.2f} / {r[m]['b']:.2f} ({r[m]['p']:.3f})" for m in METRICS)
            print(f"| {who} | {outs[0].name} / {later.name} | {cells} |")
    print("\nTarget (pooled: nmt ahead by >= 1 in moses-lc, cased BLEU and chrF, each p < 0.05):")
    for (setting, name), met in target_met.items():
        print(f"- {setting}, {name}: {'met' if met else 'not met'}")


if __name__ == "__main__":
    main()
