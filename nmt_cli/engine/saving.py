"""A run's checkpoints: what one holds (weights, optimizer, scaler, the moving average, every
rank's RNG state, the loop's state and its time so far), how a run comes back from the newest,
and its best models. Handed the parts and the state, never the trainer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nmt_cli.config import ModelConfig, TrainConfig
from nmt_cli.engine import adapters, checkpoint
from nmt_cli.engine.distributed import Group
from nmt_cli.engine.state import Outputs, Reporter, State, gather_rng, restore_rng
from nmt_cli.errors import NmtError
from nmt_cli.files import now

if TYPE_CHECKING:
    from nmt_cli.engine.ema import Average


@dataclass(frozen=True)
class Parts:
    """What a checkpoint holds besides the loop's state: the model and what trains it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: Average | None = None


class Checkpoints:
    """Where a run's checkpoints and best models go (`out`), written by rank 0 of `group`, each
    recorded with the run's configs and languages."""

    def __init__(
        self,
        out: Outputs,
        config: TrainConfig,
        model_config: ModelConfig,
        langs: tuple[str, str],
        group: Group,
        device: torch.device,
        reporter: Reporter,
        adapted: dict | None = None,
    ):
        """`adapted` (--adapters): the rank and the model adapted, which the checkpoints' records
        name; the checkpoints then hold the adapters alone."""
        self.out, self.config, self.model_config, self.langs = out, config, model_config, langs
        self.group, self.device, self.reporter = group, device, reporter
        self.adapted = adapted

    def record(self, step: int, **extra) -> dict:
        """The JSON record of a model saved now: what it is, and `extra`."""
        return {
            "format": 1,
            "saved": now(),
            "step": step,
            "model": dataclasses.asdict(self.model_config),
            "train": dataclasses.asdict(self.config),
            "src": self.langs[0],
            "tgt": self.langs[1],
            **extra,
        }

    def save(self, parts: Parts, state: State) -> None:
        """Every rank calls this at the same step (its RNG state is gathered); rank 0 writes.
        `state.seconds`: the time trained so far, by this process and those before it (--max-time
        budgets the whole run, however many times it was interrupted and resumed)."""
        rng = gather_rng(self.group, self.device)
        if self.group.is_main:
            self._write(parts, state, rng)
        self.group.wait_for_main()

    def _write(self, parts: Parts, state: State, rng: dict) -> None:
        weights = parts.model.state_dict()
        tensors = {
            "model": adapters.own(weights) if self.adapted else weights,
            "optimizer": parts.optimizer.state_dict(),
            "scaler": parts.scaler.state_dict() if parts.scaler.is_enabled() else {},
            **({"ema": parts.ema.weights} if parts.ema is not None else {}),
            **rng,
        }
        meta = self.record(state.step, state=dataclasses.asdict(state), world=self.group.world)
        if self.adapted:
            meta["adapters"] = self.adapted
        path = checkpoint.path_for(self.out.checkpoints, state.step)
        try:
            checkpoint.save_tensors(path, tensors, meta)
        except OSError as e:
            raise NmtError(
                f"could not write checkpoint {path} ({e.strerror or e}); the previous "
                "checkpoints are intact: free space or fix the disk, then rerun to "
                "resume"
            ) from None
        checkpoint.prune(self.out.checkpoints, self.config.keep_last)

    def resume(self, parts: Parts) -> State | None:
        """Load the newest checkpoint every rank can read into `parts`; its state, or None if
        there is none."""
        found = checkpoint.load_agreed(self.out.checkpoints, self.reporter.say, self.group.gather_objects)
        if found is None:
            return None
        tensors, meta = found
        # as a ModelConfig: a checkpoint from before a setting was added has its default
        if ModelConfig(**meta["model"]) != self.model_config:
            raise NmtError(
                f"the checkpoints in {self.out.checkpoints} are of another model shape "
                f"({meta['model']}); use another --run-dir or the same shape options"
            )
        if self.adapted:  # the adapters, onto the model the trainer loaded
            if meta.get("adapters", {}).get("base_sha256") != self.adapted["base_sha256"]:
                raise NmtError(
                    f"the checkpoints in {self.out.checkpoints} adapt another model than "
                    f"--init-from {self.adapted['base']}: use another --run-dir or the same model"
                )
            parts.model.load_state_dict({**parts.model.state_dict(), **tensors["model"]})
        else:
            parts.model.load_state_dict(tensors["model"])
        if parts.ema is not None:  # turned on at this resume: it starts from the weights
            parts.ema.load(tensors.get("ema", tensors["model"]))
        parts.optimizer.load_state_dict(tensors["optimizer"])
        set_optimizer_options(parts.optimizer, self.config)
        if parts.scaler.is_enabled() and tensors.get("scaler"):
            parts.scaler.load_state_dict(tensors["scaler"])
        world, rank = self.group.world, self.group.rank
        if meta.get("world", 1) == world:  # each rank continues its own dropout stream
            restore_rng(tensors, rank, self.device)
        else:
            self.reporter.say(
                f"the checkpoint was written by {meta.get('world', 1)} ranks, "
                f"this run has {world}: this epoch's data order and the "
                "dropout streams differ from an uninterrupted run"
            )
            torch.manual_seed(self.config.seed + 7919 * rank + meta["step"])
        state = State(**meta["state"])
        if self.group.is_main:
            self.out.truncate_metrics(state.step)
        self.reporter.say(f"resuming from step {state.step} (epoch {state.epoch + 1})")
        return state

    def keep_if_best(self, weights: dict[str, torch.Tensor], step: int, score: float, metrics: dict) -> None:
        """Rank 0: `weights` (the model validated: the moving average with --ema), if they are
        among the --keep-best best so far, into the best models."""
        meta = self.record(
            step,
            best={
                "metric": self.config.best_metric,
                "score": score,
                **{k: float(v) for k, v in metrics.items()},
            },
        )
        best = self.config.keep_best
        checkpoint.keep_best(self.out.best, best, score, step, lambda: {"model": weights}, meta)


def set_optimizer_options(optimizer: torch.optim.Optimizer, config: TrainConfig) -> None:
    """Adam's settings from this run's config: a loaded optimizer state (a resume,
    --init-optimizer) brings the settings it was saved with, and the moments are what it is
    kept for."""
    for group in optimizer.param_groups:
        group["betas"] = (config.beta1, config.beta2)
        group["eps"] = config.adam_eps
