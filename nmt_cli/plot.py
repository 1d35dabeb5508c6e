"""`nmt plot`: a run's curves from its metrics file, drawn into one PNG in the run directory.

Four panels against the update step, each with minutes of training on its top axis: training
and validation loss (NLL, nats per token), validation BLEU (if `--eval-bleu` logged it), the
learning rate, and tokens per second. matplotlib is an optional extra (`pip install
'nmt-cli[plot]'`): nothing else needs it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nmt_cli.errors import NmtError
from nmt_cli.rundir import RunDir


def by_kind(records: list[dict]) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for record in records:
        rows.setdefault(record["kind"], []).append(record)
    return rows


def _column(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    picked = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if not picked:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*picked)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def _minutes_axis(ax, steps: np.ndarray, minutes: np.ndarray) -> None:
    """A top axis labelled in minutes of training at the steps they were reached."""
    from matplotlib.ticker import MaxNLocator

    marks = [m for m in MaxNLocator(nbins=6).tick_values(0, minutes[-1]) if 0 <= m <= minutes[-1]]
    top = ax.twiny()
    top.set_xlim(ax.get_xlim())
    top.set_xticks(np.interp(marks, minutes, steps), [f"{m:g}" for m in marks])
    top.set_xlabel("minutes")


def _smooth(y: np.ndarray, width: int = 10) -> np.ndarray:
    """Running mean: a logged training loss is one batch's, and noisy."""
    if len(y) < width:
        return y
    kernel = np.ones(width) / width
    head = np.cumsum(y[: width - 1]) / np.arange(1, width)
    return np.concatenate([head, np.convolve(y, kernel, mode="valid")])


def plot(run: RunDir, out: Path | None = None) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise NmtError(
            "`nmt plot` needs matplotlib: pip install 'nmt-cli[plot]' (or pip install matplotlib)"
        ) from None
    if not run.metrics.exists():
        raise NmtError(f"{run.metrics} not found: run `nmt train` first")
    rows = by_kind(run.metric_records())
    train, valid = rows.get("train", []), rows.get("valid", [])
    if not train:
        raise NmtError(f"{run.metrics} has no training figures yet")
    # Steps -> minutes, for the top axes (both increase together, also across resumes).
    timeline = sorted({(r["step"], r["minutes"]) for r in train + valid})
    t_steps = np.asarray([s for s, _ in timeline], dtype=float)
    t_minutes = np.maximum.accumulate(np.asarray([m for _, m in timeline], dtype=float))

    # a run of several directions: each direction's BLEU beside their mean
    directions = sorted({k for r in valid for k in r if k.startswith("valid_bleu_")})
    bleu = [(valid, "valid_bleu", "BLEU" if not directions else "mean", "o-")]
    bleu += [(valid, key, key.removeprefix("valid_bleu_"), ".--") for key in directions]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    panels = [
        (
            axes[0, 0],
            "loss (nats per token)",
            [
                (train, "nll", "training NLL (running mean)", "-"),
                (valid, "valid_nll", "validation NLL", "o-"),
            ],
        ),
        (axes[0, 1], "validation BLEU (greedy)", bleu),
        (axes[1, 0], "learning rate", [(train, "lr", "lr", "-")]),
        (axes[1, 1], "tokens per second", [(train, "tokens_per_s", "target tokens/s", "-")]),
    ]
    for ax, title, series in panels:
        drawn = False
        for records, key, label, style in series:
            x, y = _column(records, key)
            if key in ("nll", "tokens_per_s"):
                y = _smooth(y)
            if len(x):
                ax.plot(x, y, style, label=label, markersize=3)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("update step")
        ax.grid(alpha=0.3)
        if not drawn:
            hint = "run `nmt train --eval-bleu`" if "BLEU" in title else "nothing logged"
            ax.text(0.5, 0.5, hint, ha="center", va="center", transform=ax.transAxes, color="grey")
        elif len(series) > 1:
            ax.legend()
        if drawn and len(t_steps) > 1:
            _minutes_axis(ax, t_steps, t_minutes)
    fig.suptitle(f"{run.root.name}: step {int(t_steps[-1])}, {t_minutes[-1]:.1f} minutes")
    out = out or run.plot
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
