"""What a search finds and how it ranks and bounds it, shared by nmt's beam search (beam.py) and
CTranslate2's (backend_ct2.py); plain Python, so that decoding a CTranslate2 export never imports torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nmt_cli.config import DecodeOptions

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class Source:
    """A sentence to translate, as ids without EOS, with what binds its translation."""

    ids: list[int]
    stream: int = 0  # its random stream under --sample (stream_of: --seed and its line number)
    prefix: list[int] = field(default_factory=list)  # the ids its translation begins with
    constraints: list[list[int]] = field(default_factory=list)  # phrases (ids) it must contain
    # its length penalty's: sentences of one batch may rank differently
    alpha: float = DecodeOptions.alpha


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS and EOS
    score: float  # log-probability divided by the length penalty
    alignment: str | None = None  # with --alignments: Pharaoh "i-j" word pairs


def length_penalty(length: int | Tensor, alpha: float):
    """GNMT's ((5 + |Y|) / 6) ** alpha, |Y| counting the EOS."""
    return ((5.0 + length) / 6.0) ** alpha


def coverage_penalty(coverage: Sequence[float], beta: float) -> float:
    """GNMT's coverage penalty (Wu et al. 2016, eq. 14), added to a finished translation's
    score: beta x the sum over source tokens of log(min(attention received, 1)), `coverage` the
    attention each source token received summed over the translation's steps (its EOS's
    included). A position never attended to (padding, a left-out EOS) counts nothing, as in
    CTranslate2."""
    return beta * sum(math.log(min(c, 1.0)) for c in coverage if c > 0)


def stream_of(seed: int, key: int) -> int:
    """A sentence's random stream under --sample, from --seed and its key (its line number): a
    sentence draws alike whatever else is in its batch, and whatever seeds the others have."""
    return seed * 1_000_003 + key


def limits(
    source_lengths: list[int],
    a: float,
    b: int,
    ceiling: int,
    prefixes: Sequence[Sequence[int]] | None = None,
    constraints: Sequence[Sequence[Sequence[int]]] | None = None,
) -> list[int]:
    """Each sentence's output limit (counting the EOS): a * |X| + b, raised to hold its prefix,
    then its constraint phrases, then the EOS; within `ceiling`."""
    out = max_lengths(source_lengths, a, b, ceiling)
    for i, n in enumerate(out):
        forced = len(prefixes[i]) if prefixes else 0
        phrases = sum(len(p) for p in constraints[i]) if constraints else 0
        out[i] = max(n, min(forced + phrases + 1, ceiling))
    return out


def max_lengths(source_lengths: list[int], a: float, b: int, ceiling: int) -> list[int]:
    """Each sentence's output limit, a * |X| + b tokens counting the EOS (|X| without its EOS),
    within the model's positions."""
    return [max(1, min(int(a * n + b), ceiling)) for n in source_lengths]
