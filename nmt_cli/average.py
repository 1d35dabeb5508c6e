"""`nmt average`: the last checkpoints of a run (or its best kept ones) averaged into its
averaged model."""

from __future__ import annotations

from collections.abc import Callable

from nmt_cli.engine.checkpoint import average, best_listed, listed, save_tensors
from nmt_cli.errors import NmtError
from nmt_cli.files import now, read_json
from nmt_cli.rundir import RunDir


def average_run(run: RunDir, last: int, say: Callable[[str], None], best: int = 0) -> dict:
    """Average the last `last` checkpoints (or the `best` best kept ones) into the run's
    averaged model."""
    if best:
        paths = [p for _, p in best_listed(run.best)][:best]
        if not paths:
            raise NmtError(f"no best models in {run.best}: train with --keep-best N")
        if len(paths) < best:
            say(f"only {len(paths)} best models are kept; averaging all of them")
        chosen = sorted(paths)  # by step
    else:
        paths = listed(run.checkpoints)
        if not paths:
            raise NmtError(f"no checkpoints in {run.checkpoints}: run `nmt train` first")
        if len(paths) < last:
            say(f"only {len(paths)} checkpoints exist; averaging all of them")
        chosen = paths[-last:]
    from nmt_cli.inference.models import with_adapters

    weights, meta = average(chosen, with_adapters)  # an adapted run's averaged model is plain
    newest = read_json(chosen[-1].with_suffix(".json"), 1 << 20)
    record = {
        **{k: meta[k] for k in ("format", "model", "train", "src", "tgt")},
        "step": newest["step"],
        "averaged": [p.name for p in chosen],
        "saved": now(),
    }
    save_tensors(run.averaged, {"model": weights}, record)
    return record
