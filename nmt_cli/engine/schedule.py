"""The learning-rate schedule of section 5.3."""

from __future__ import annotations


def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """Section 5.3: d^-0.5 * min(step^-0.5, step * warmup^-1.5), times `scale`."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
