"""What a search finds and how it ranks and bounds it, shared by nmt's beam search (beam.py) and
CTranslate2's (backend_ct2.py); plain Python, so that decoding a CTranslate2 export never imports torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class Source:
    """A sentence to translate, as ids without EOS, with what binds its translation."""

    ids: list[int]
    key: int = 0  # its line number: what seeds its draws under --sample
    prefix: list[int] = field(default_factory=list)  # the ids its translation begins with
    constraints: list[list[int]] = field(default_factory=list)  # phrases (ids) it must contain


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS and EOS
    score: float  # log-probability divided by the length penalty
    alignment: str | None = None  # with --alignments: Pharaoh "i-j" word pairs


def length_penalty(length: int | Tensor, alpha: float):
    """GNMT's ((5 + |Y|) / 6) ** alpha, |Y| counting the EOS."""
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(source_lengths: list[int], a: float, b: int, ceiling: int) -> list[int]:
    """Each sentence's output limit, a * |X| + b tokens counting the EOS (|X| without its EOS),
    within the model's positions."""
    return [max(1, min(int(a * n + b), ceiling)) for n in source_lengths]
