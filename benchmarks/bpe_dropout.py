"""What `nmt train --bpe-dropout` costs: encoding an epoch on the fly, beside the epoch itself.

    python benchmarks/bpe_dropout.py RUN [--p 0.1] [--repeats 3]

RUN is a prepared and binarized run directory (a `benchmarks/multi30k_quality.py` run, say).
Prints the seconds to encode both training sides with BPE-dropout (the median of --repeats, one
core, as the trainer does at each epoch's start), sentencepiece's deterministic encoding of the
same text for scale, how many more tokens the dropout encoding has, and, if RUN trained with
--bpe-dropout, its mean epoch in seconds from metrics.jsonl and the encoding's share of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nmt_cli import bpe  # noqa: E402
from nmt_cli.rundir import RunDir  # noqa: E402
from nmt_cli.shards import Shard  # noqa: E402
from nmt_cli.textio import read_lines  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    run = RunDir(args.run)
    prep = run.load_manifest()["prep"]
    langs = (prep["src"], prep["tgt"])
    sp = bpe.load(run)
    dropout, plain, ratio = [], [], {}
    for epoch in range(args.repeats):
        started = time.perf_counter()
        shards = [bpe.dropout_encoding(run, lang, args.p, 1, epoch) for lang in langs]
        dropout.append(time.perf_counter() - started)
        started = time.perf_counter()
        for lang in langs:
            sp.encode(list(read_lines(run.text("train", lang))), out_type=int, num_threads=1)
        plain.append(time.perf_counter() - started)
        for lang, shard in zip(langs, shards):
            ratio[lang] = int(shard.lengths.sum()) / int(Shard(run.tokens("train", lang)).lengths.sum())
    result = {
        "p": args.p,
        "dropout_encoding_s": statistics.median(dropout),
        "sentencepiece_encoding_s": statistics.median(plain),
        "tokens_vs_fixed": ratio,
    }
    records = run.metric_records() if run.metrics.exists() else []
    starts = [r["minutes"] for r in records if r["kind"] == "epoch"]
    if len(starts) > 2:
        epoch_s = 60 * statistics.median(b - a for a, b in zip(starts, starts[1:]))
        result["epoch_s"] = epoch_s
        result["share_of_epoch"] = result["dropout_encoding_s"] / epoch_s
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
