"""The learning-rate schedules: the paper's (section 5.3, inverse square root after a linear
warm-up) and the ones fine-tuning and longer runs reach for: linear or cosine decay to a floor
at --max-steps, or constant, each after the same warm-up."""

from __future__ import annotations

import math


def learning_rate(
    step: int,
    d_model: int,
    warmup: int,
    scale: float = 1.0,
    kind: str = "inverse-sqrt",
    peak: float = 0.0,
    max_steps: int = 0,
    floor: float = 0.0,
) -> float:
    """The rate of update `step` (from 1). Section 5.3: d^-0.5 * min(step^-0.5, step *
    warmup^-1.5), times `scale`, whose peak (at `warmup`) is d^-0.5 * warmup^-0.5 * scale; `peak`
    sets that peak instead. After the warm-up: the inverse square root, a linear or cosine
    decay from the peak to `floor` at `max_steps`, or the peak throughout; never below `floor`."""
    step = max(step, 1)
    if kind == "inverse-sqrt" and not peak:  # the paper's formula as written
        rate = scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        return max(rate, floor) if step > warmup else rate
    top = peak or scale * d_model**-0.5 * warmup**-0.5
    if step <= warmup:
        return top * step / warmup
    if kind == "inverse-sqrt":
        rate = top * math.sqrt(warmup / step)
    elif kind == "constant":
        rate = top
    else:
        done = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        shape = 1 - done if kind == "linear" else 0.5 * (1 + math.cos(math.pi * done))
        rate = floor + (top - floor) * shape
    return max(rate, floor)
