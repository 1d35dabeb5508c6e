"""How nmt hands sentences to CTranslate2, whose call takes one length limit: the sentences of
every batch pooled in calls of those whose output limits share a band SPREAD wide, each call's
limit its band's top (backend_ct2.parts). Times `Translator.hypotheses` in one process at
several spreads (0: calls of 32 length-sorted sentences each at its longest sentence's limit, as
CTranslate2's own batching would), alternated rounds, beam 4, 2 threads.

    python benchmarks/ct2_calls.py RUN [--rounds 3] [--spreads 0 1 1.25 1.5] [--cases ...]

`small`: RUN's trained model (limits |x| + 50); `base`: a model of that shape with random
weights and RUN's vocabulary, its outputs cut at the source length (a random model never ends a
sentence, so each runs to its call's limit).
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import cpu_name  # noqa: E402
from benchmarks.deploy import random_model  # noqa: E402
from nmt_cli.config import DecodeOptions, TranslateConfig  # noqa: E402
from nmt_cli.inference import backend_ct2  # noqa: E402
from nmt_cli.inference.models import from_dir  # noqa: E402
from nmt_cli.inference.translator import Translator  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
bands = backend_ct2.parts
TEXTS = {"test2016": "multi30k/test_2016_flickr.en.gz", "newstest2014": "wmt14/newstest2014.en.gz"}
CASES = ["base:newstest2014:100", "base:test2016:1000", "small:test2016:1000", "small:newstest2014:1000"]


def per_batch(limits: list[int], ceiling: int) -> list[tuple[int, list[int]]]:
    """Calls of 32 length-sorted sentences, each at its longest sentence's limit."""
    order = sorted(range(len(limits)), key=lambda i: -limits[i])
    return [(limits[order[k]], order[k : k + 32]) for k in range(0, len(order), 32)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spreads", nargs="+", type=float, default=[0.0, 1.0, 1.1, 1.25, 1.5])
    ap.add_argument("--cases", nargs="+", default=CASES, help="MODEL:TEXT:LINES")
    args = ap.parse_args()
    texts = {k: gzip.open(DATA / v, "rt", encoding="utf-8").read().splitlines() for k, v in TEXTS.items()}
    cases = [(m, t, int(n)) for m, t, n in (c.split(":") for c in args.cases)]
    with tempfile.TemporaryDirectory() as work:
        models = {"base": Path(work) / "base", "small": Path(work) / "small"}
        random_model(args.run, "base", models["base"])
        export = ["export", str(models["small"]), "--run-dir", str(args.run)]
        subprocess.run([sys.executable, "-m", "nmt_cli", *export], check=True)
        for shape, text, lines in cases:
            cut = {"max_len_a": 1.0, "max_len_b": 0} if shape == "base" else {}
            config = TranslateConfig(engine="ctranslate2", threads=2, decode=DecodeOptions(beam=4, **cut))
            translator = Translator(from_dir(models[shape]), config)
            given = texts[text][:lines]
            translator.hypotheses(given[:64])  # warm
            times: dict[float, list[float]] = {s: [] for s in args.spreads}
            for _ in range(args.rounds):
                for spread in args.spreads:
                    backend_ct2.parts = per_batch if spread < 1 else bands
                    backend_ct2.SPREAD = max(spread, 1.0)
                    start = time.perf_counter()
                    translator.hypotheses(given)
                    times[spread].append(time.perf_counter() - start)
            row = ", ".join(
                f"{'sorted 32s' if s < 1 else s}: {statistics.median(t):.2f} s" for s, t in times.items()
            )
            print(f"{shape} {text} {lines} lines: {row}", flush=True)
    print(f"{cpu_name()}, 2 threads, medians of {args.rounds} alternated rounds")


if __name__ == "__main__":
    main()
