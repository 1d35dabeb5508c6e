"""The decoding levers of trained Multi30k runs, chosen on the validation set, then read on test.

    python benchmarks/decode_levers.py RUN [RUN ...] [--alphas 0.6 1.0 1.5] [--test CHOICE]

Each RUN is a run directory from `benchmarks/multi30k_quality.py` (OUT/run, or OUT/run1 and
OUT/run2 with --seeds 2) with its last 10 checkpoints (the quickstart keeps 10, 250 updates
apart), all with one BPE model. Each choice is decoded with beam 4 on the 1014 validation
sentences and scored as the benchmark reports (`nmt score --moses-lc`, with cased sacreBLEU and
chrF beside it, case-insensitive for a model from `nmt bpe --lowercase`):

- `avg5`: the first run's mean of its last 5 checkpoints (what `nmt average` does);
- `avg10`: the first run's mean of its last 10;
- `ens-avg5`: the ensemble (nmt translate --model A --model B) of every run's `avg5`;
- `ens-avg5x2`: the ensemble of every run's `avg5` and its mean of the 5 checkpoints before;
each at every length penalty alpha of --alphas. Nothing here reads the test sets, unless
`--test CHOICE` (e.g. `--test ens-avg5@1.0`) names the one choice to score on test2016 and
test2017 afterwards. Results go to FIRST_RUN/levers.json and print as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nmt_cli import package, scoring  # noqa: E402
from nmt_cli.bpe import folds_case  # noqa: E402
from nmt_cli.config import ModelConfig, TranslateConfig  # noqa: E402
from nmt_cli.engine import checkpoint  # noqa: E402
from nmt_cli.rundir import RunDir  # noqa: E402
from nmt_cli.textio import read_lines  # noqa: E402
from nmt_cli.translate import Translator  # noqa: E402


def averaged(run: RunDir, paths: list[Path], name: str) -> package.Model:
    """The mean of `paths` as a model to translate with."""
    weights, meta = checkpoint.average(paths)
    return package.Model(
        where=Path(name),
        config=ModelConfig(**meta["model"]),
        spm=run.spm_model,
        src=meta.get("src", "en"),
        tgt=meta.get("tgt", "de"),
        sha256=name,
        load_weights=lambda: weights,
    )


def choices(runs: list[RunDir]) -> dict[str, package.Model]:
    found = [checkpoint.listed(run.checkpoints) for run in runs]
    if min(len(f) for f in found) < 10:
        sys.exit("each run must keep its last 10 checkpoints")
    last5 = [averaged(run, f[-5:], f"{run.root.name}-avg5") for run, f in zip(runs, found)]
    before = [averaged(run, f[-10:-5], f"{run.root.name}-avg5b") for run, f in zip(runs, found)]
    return {
        "avg5": last5[0],
        "avg10": averaged(runs[0], found[0][-10:], "avg10"),
        "ens-avg5": package.ensemble(last5),
        "ens-avg5x2": package.ensemble(last5 + before),
    }


def score(model: package.Model, alpha: float, run: RunDir, split: str) -> dict:
    src = list(read_lines(run.text(split, "en", raw=True)))
    refs = list(read_lines(run.text(split, "de", raw=True)))
    hyps = Translator(model, TranslateConfig(alpha=alpha)).translate(src)
    names = (f"{model.where}@{alpha}", split)
    # A lowercasing model (`nmt bpe --lowercase`) gets case-insensitive scores, as `nmt score` gives.
    cased = scoring.report(hyps, refs, names, ["bleu", "chrf"], lowercase=folds_case(model.spm))["scores"]
    lc = scoring.report(hyps, refs, names, ["bleu"], moses_lc_lang="de")["scores"][0]
    return {"moses_lc": lc["score"], "bleu": cased[0]["score"], "chrf": cased[1]["score"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.6, 1.0, 1.5])
    ap.add_argument("--test", help="CHOICE@ALPHA to score on the test sets (chosen on validation)")
    args = ap.parse_args()
    runs = [RunDir(r) for r in args.runs]
    run, models = runs[0], choices(runs)
    out = run.root / "levers.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    if args.test:
        name, alpha = args.test.split("@")
        results["test"] = {
            "choice": args.test,
            **{split: score(models[name], float(alpha), run, split) for split in ("test", "test2017")},
        }
    else:
        results["valid"] = {
            f"{name}@{alpha:g}": score(model, alpha, run, "valid")
            for name, model in models.items()
            for alpha in args.alphas
        }
    out.write_text(json.dumps(results, indent=2))
    case = "lowercased" if folds_case(models["avg5"].spm) else "cased"
    print(f"| choice | split | BLEU moses-lc | sacreBLEU {case} | chrF |\n|---|---|---:|---:|---:|")
    rows = [(c, "valid", r) for c, r in results.get("valid", {}).items()]
    rows += [
        (results["test"]["choice"], s, results["test"][s]) for s in ("test", "test2017") if "test" in results
    ]
    for choice, split, r in rows:
        print(f"| {choice} | {split} | {r['moses_lc']:.2f} | {r['bleu']:.2f} | {r['chrf']:.2f} |")


if __name__ == "__main__":
    main()
