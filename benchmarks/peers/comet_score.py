"""unbabel-comet's own scores of the tiny random COMET models that tests/comet_model.py builds:
the figures nmt's COMET must equal (tests/integration/test_comet.py). Run in unbabel-comet's venv
(../shared/PEERS.md says how it installs), from the repository's root:

    comet-venv/bin/python benchmarks/peers/comet_score.py > tests/data/comet_expected.json

With --model DIR --src F --mt F [--ref F] it scores files with a model folder instead (a
published one, e.g. Unbabel/wmt22-comet-da with its encoder inside): one JSON object out, with
the seconds it took to load and to score and its peak resident memory (benchmarks/comet_speed.py).
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def peak_rss_gib() -> float:
    """The peak resident memory since this process's exec (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def predict(folder: Path, rows: list[dict], batch_size: int = 4) -> dict:
    import time

    import comet

    here = os.getcwd()
    os.chdir(folder)  # hparams' pretrained_model is the encoder's folder, relative to the model's
    try:
        start = time.perf_counter()
        model = comet.load_from_checkpoint(str(folder / "checkpoints" / "model.ckpt"), local_files_only=True)
        loaded = time.perf_counter()
        out = model.predict(rows, batch_size=batch_size, gpus=0, progress_bar=False, num_workers=1)
        done = time.perf_counter()
    finally:
        os.chdir(here)
    return {
        "segments": [float(x) for x in out.scores],
        "system": float(out.system_score),
        "load_s": loaded - start,
        "score_s": done - loaded,
        "peak_rss_gib": peak_rss_gib(),
    }


def main() -> None:
    from importlib.metadata import version

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--src", type=Path)
    ap.add_argument("--mt", type=Path)
    ap.add_argument("--ref", type=Path)
    ap.add_argument("--batch-size", type=int, default=16, help="with --model: unbabel-comet's batch")
    args = ap.parse_args()
    if args.model is not None:
        read = {
            k: getattr(args, k).read_text(encoding="utf-8").splitlines()
            for k in ("src", "mt", "ref")
            if getattr(args, k)
        }
        rows = [dict(zip(read, values)) for values in zip(*read.values())]
        print(json.dumps(predict(args.model.resolve(), rows, args.batch_size)))
        return
    import comet_model

    out = {"unbabel_comet": version("unbabel-comet"), "transformers": version("transformers"), "models": {}}
    for estimator in ("regression_metric", "referenceless_regression_metric", "unified_metric"):
        with tempfile.TemporaryDirectory() as tmp:
            folder = comet_model.build(Path(tmp), estimator)
            keys = ("src", "mt", "ref") if estimator == "regression_metric" else ("src", "mt")
            rows = [dict(zip(("src", "mt", "ref"), triple)) for triple in comet_model.SEGMENTS]
            rows = [{k: r[k] for k in keys} for r in rows]
            out["models"][estimator] = predict(folder, rows)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
