"""A Trainer's checkpoints: what it saves (weights, optimizer, scaler, every rank's RNG state,
the loop's state and its time so far), how it comes back from them, and its best models."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from nmt_cli.engine import checkpoint
from nmt_cli.engine.state import State, gather_rng, restore_rng
from nmt_cli.errors import NmtError
from nmt_cli.files import now

if TYPE_CHECKING:
    from nmt_cli.engine.trainer import Trainer


def record(t: Trainer, **extra) -> dict:
    """The JSON record of a model saved now: what it is, and `extra`."""
    return {
        "format": 1,
        "saved": now(),
        "step": t.state.step,
        "model": dataclasses.asdict(t.model_config),
        "train": dataclasses.asdict(t.config),
        "src": t.src_lang,
        "tgt": t.tgt_lang,
        **extra,
    }


def save(t: Trainer) -> None:
    """Every rank calls this at the same step (its RNG state is gathered); rank 0 writes."""
    rng = gather_rng(t.dist, t.device)
    t.saved_at = t.state.step
    if not t.dist.is_main:
        return
    tensors = {
        "model": t.model.state_dict(),
        "optimizer": t.optimizer.state_dict(),
        "scaler": t.scaler.state_dict() if t.scaler.is_enabled() else {},
        **({"ema": t.ema.weights} if t.ema is not None else {}),
        **rng,
    }
    # The time trained so far goes with the checkpoint: --max-time budgets the whole run,
    # however many times it was interrupted and resumed.
    state = dataclasses.replace(t.state, seconds=t.elapsed())
    meta = record(t, state=dataclasses.asdict(state), world=t.dist.world)
    path = checkpoint.path_for(t.out.checkpoints, t.state.step)
    try:
        checkpoint.save_tensors(path, tensors, meta)
    except OSError as e:
        raise NmtError(
            f"could not write checkpoint {path} ({e.strerror or e}); the previous "
            "checkpoints are intact: free space or fix the disk, then rerun to "
            "resume"
        ) from None
    checkpoint.prune(t.out.checkpoints, t.config.keep_last)


def resume(t: Trainer) -> bool:
    """Come back from the newest checkpoint every rank can read (else start from --init-from,
    if given); whether there was one."""
    found = checkpoint.load_agreed(t.out.checkpoints, t.reporter.say, t.dist.gather_objects)
    if found is None:
        if t.init is not None:  # a fresh optimizer and schedule, unless asked to keep them
            t.reporter.say(t.init.start(t.model, t.model_config, t.optimizer, t.state))
            set_optimizer_options(t)
        return False
    tensors, meta = found
    if meta["model"] != dataclasses.asdict(t.model_config):
        raise NmtError(
            f"the checkpoints in {t.out.checkpoints} are of another model shape "
            f"({meta['model']}); use another --run-dir or the same shape options"
        )
    t.model.load_state_dict(tensors["model"])
    if t.ema is not None:  # turned on at this resume: it starts from the weights
        t.ema.load(tensors.get("ema", tensors["model"]))
    t.optimizer.load_state_dict(tensors["optimizer"])
    set_optimizer_options(t)
    if t.scaler.is_enabled() and tensors.get("scaler"):
        t.scaler.load_state_dict(tensors["scaler"])
    if meta.get("world", 1) == t.dist.world:  # each rank continues its own dropout stream
        restore_rng(tensors, t.dist.rank, t.device)
    else:
        t.reporter.say(
            f"the checkpoint was written by {meta.get('world', 1)} ranks, "
            f"this run has {t.dist.world}: this epoch's data order and the "
            "dropout streams differ from an uninterrupted run"
        )
        torch.manual_seed(t.config.seed + 7919 * t.dist.rank + meta["step"])
    t.state = State(**meta["state"])
    t.saved_at = t.state.step
    if t.dist.is_main:
        t.out.truncate_metrics(t.state.step)
    t.reporter.say(f"resuming from step {t.state.step} (epoch {t.state.epoch + 1})")
    return True


def set_optimizer_options(t: Trainer) -> None:
    """Adam's settings from this run's config: a loaded optimizer state (a resume,
    --init-optimizer) brings the settings it was saved with, and the moments are what it is
    kept for."""
    for group in t.optimizer.param_groups:
        group["betas"] = (t.config.beta1, t.config.beta2)
        group["eps"] = t.config.adam_eps


def keep_if_best(t: Trainer, score: float, metrics: dict) -> None:
    """Rank 0: the model (the one validated: the moving average with --ema), if it is among the
    --keep-best best so far, into checkpoints/best."""
    meta = record(
        t,
        best={
            "metric": t.config.best_metric,
            "score": score,
            **{k: float(v) for k, v in metrics.items()},
        },
    )
    checkpoint.keep_best(
        t.out.best,
        t.config.keep_best,
        score,
        t.state.step,
        lambda: {"model": t.ema.weights if t.ema is not None else t.model.state_dict()},
        meta,
    )
