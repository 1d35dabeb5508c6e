"""How many batch shapes a training run meets, and the padding it pays for them.

    python benchmarks/batch_shapes.py RUN [--epochs 10] [--max-tokens 4096 3125] [--parts 1 2 8]

RUN is a run directory after `nmt bpe` (its train split). Two corpora: the split itself, and
"joined", each of its pairs joined with a random other pair, repeated to 8 times the pairs (the
length of a news sentence, the size of a bigger corpus). For each --max-tokens and number of
parts of an update (ranks x --update-freq), over --epochs epochs: the distinct (rows, source,
target) shapes, the padding share, and the share of updates whose batches have one shape, for
the batches as `nmt train` makes them ("grid") and as long as their longest sentence
("exact", each batch a part of an update).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nmt_cli.engine.batches import Planned, Split, make_batches, padding_share  # noqa: E402
from nmt_cli.shards import Shard  # noqa: E402


def exact(split: Split, max_tokens: int, seed: int, epoch: int, parts: int) -> list[Planned]:
    s, t = split.src_lengths[split.keep], split.tgt_lengths[split.keep]
    batches = [split.keep[g] for g in make_batches(s, t, max_tokens, seed, epoch)]
    shapes = [(len(b), int(split.src_lengths[b].max()), int(split.tgt_lengths[b].max())) for b in batches]
    planned = [Planned(b, shape) for b, shape in zip(batches, shapes)]
    return planned[: len(planned) // parts * parts]


def figures(split: Split, max_tokens: int, parts: int, epochs: int, how) -> dict:
    shapes: set = set()
    shares, same = [], []
    for epoch in range(epochs):
        batches = how(split, max_tokens, 1, epoch, parts)
        shapes |= {b.shape for b in batches}
        shares.append(padding_share(batches, split.src_lengths, split.tgt_lengths))
        steps = [batches[i : i + parts] for i in range(0, len(batches), parts)]
        same.append(np.mean([len({b.shape for b in step}) == 1 for step in steps]))
    return {
        "batches_per_epoch": len(batches),
        "shapes": len(shapes),
        "padding": round(float(np.mean(shares)), 4),
        "updates_of_one_shape": round(float(np.mean(same)), 4),
    }


def joined(split: Split, times: int, seed: int = 0) -> Split:
    """A Split whose lengths are those of pairs joined two by two (sentences are not read)."""
    rng = np.random.default_rng(seed)
    n = len(split.src_lengths)
    a, b = rng.integers(0, n, n * times), rng.integers(0, n, n * times)
    sl, tl = split.src_lengths[a] + split.src_lengths[b] - 1, split.tgt_lengths[a] + split.tgt_lengths[b] - 1
    keep = np.flatnonzero((sl <= split.limit) & (tl <= split.limit))
    return Split(split.src, split.tgt, sl, tl, keep, split.limit)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, nargs="*", default=[4096, 3125])
    ap.add_argument("--parts", type=int, nargs="*", default=[1, 2, 8])
    ap.add_argument("--limit", type=int, default=256)
    args = ap.parse_args()
    data = args.run / "data"
    langs = sorted({p.name.split(".")[1] for p in data.glob("train.*.idx")})
    split = Split.of(Shard(data / f"train.{langs[1]}"), Shard(data / f"train.{langs[0]}"), args.limit)
    for name, corpus in (("split", split), ("joined", joined(split, 8))):
        for max_tokens in args.max_tokens:
            for parts in args.parts:
                for how_name, how in (("exact", exact), ("grid", Split.batches)):
                    row = figures(corpus, max_tokens, parts, args.epochs, how)
                    head = {"corpus": name, "pairs": len(corpus.keep), "max_tokens": max_tokens}
                    print(json.dumps({**head, "parts": parts, "batching": how_name, **row}), flush=True)


if __name__ == "__main__":
    main()
