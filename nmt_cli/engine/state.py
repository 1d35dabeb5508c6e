"""What a training run is besides its tensors: its progress (saved with every checkpoint), the
RNG streams an exact resume restores, the weights it may start from, where its results go and
how it reports."""

from __future__ import annotations

import dataclasses
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from nmt_cli.config import ModelConfig
from nmt_cli.engine.distributed import Group
from nmt_cli.errors import NmtError


@dataclass
class State:
    """Progress that a resume needs besides the tensors."""

    step: int = 0  # updates made (a skipped update counts: its data is spent)
    epoch: int = 0
    batch: int = 0  # next batch of this epoch
    seconds: float = 0.0  # training time of earlier processes
    best_valid: float = math.inf
    bad_evals: int = 0  # evaluations since the best one
    skipped: int = 0  # updates skipped for non-finite loss or gradients
    bad_in_a_row: int = 0


class Outputs(Protocol):
    """Where a run's results go: checkpoints, best models and figures (rundir.RunDir is one)."""

    checkpoints: Path
    best: Path

    def add_metric(self, record: dict) -> None: ...

    def truncate_metrics(self, step: int) -> None: ...


class Reporter(Protocol):
    def progress(self, state: State, total_steps: int | None, metrics: dict) -> None: ...
    def say(self, message: str) -> None: ...
    def record(self, record: dict) -> None: ...  # each line metrics.jsonl gets, as written


class Quiet:
    def progress(self, state, total_steps, metrics) -> None:
        pass

    def say(self, message: str) -> None:
        pass

    def record(self, record: dict) -> None:
        pass


class Interrupted(Exception):
    """Training stopped by a signal after saving a checkpoint (`step`: the newest checkpoint's;
    None when there is none yet)."""

    def __init__(self, signum: int, step: int | None):
        self.signum, self.step = signum, step
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} at step {step}; a checkpoint was saved: run the same "
            "`nmt train` command again to resume"
            if step is not None
            else f"stopped by {name} before the first checkpoint: run the same `nmt train` command "
            "again to start over"
        )


@dataclass(frozen=True)
class Initial:
    """Weights to start from (--init-from) when the run has no checkpoint yet."""

    where: str
    config: ModelConfig
    weights: Callable[[], dict[str, torch.Tensor]]
    optimizer: dict | None = None  # Adam's state to keep (--init-optimizer)
    step: int = 0  # the step to go on from (--init-schedule)
    sha256: str = ""  # of its weights: the record of an adapted run's checkpoints names them

    def weights_for(self, config: ModelConfig) -> dict[str, torch.Tensor]:
        """The weights, if they fit a model of `config` (dropout is the training's own choice)."""

        def shape(c: ModelConfig) -> dict:
            return {k: v for k, v in dataclasses.asdict(c).items() if "dropout" not in k}

        mine, theirs = shape(config), shape(self.config)
        if mine != theirs:
            diff = ", ".join(f"{k} {v} (here {mine[k]})" for k, v in theirs.items() if mine[k] != v)
            raise NmtError(
                f"--init-from {self.where} is another model shape: {diff}; give "
                "the same shape options (--size, --d-model, ...)"
            )
        return self.weights()

    def load_into(self, model: torch.nn.Module, config: ModelConfig) -> None:
        """The weights into `model`; its adapters (--adapters), which they lack, stay its own."""
        from nmt_cli.engine import adapters

        model.load_state_dict({**adapters.own(model.state_dict()), **self.weights_for(config)})

    def start(
        self, model: torch.nn.Module, config: ModelConfig, optimizer, state: State, loaded: bool = False
    ) -> str:
        """Load the weights into a new run's `model` (unless `loaded` there already) and what
        --init-optimizer and --init-schedule keep into `optimizer` and `state`; says what it did."""
        if not loaded:
            self.load_into(model, config)
        if self.optimizer is not None:
            optimizer.load_state_dict(self.optimizer)
        state.step = self.step
        return (
            f"starting from the weights of {self.where}"
            + (", with its optimizer state" if self.optimizer is not None else "")
            + (f", at its step {self.step}" if self.step else "")
        )


def gather_rng(group: Group, device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's RNG states, one row per rank (a collective: every rank calls it)."""
    rng = {"rng_cpu": torch.stack(group.gather(torch.get_rng_state()))}
    if device.type == "cuda":
        rng["rng_cuda"] = torch.stack(group.gather(torch.cuda.get_rng_state(device)))
    return rng


def restore_rng(tensors: dict, rank: int, device: torch.device) -> None:
    """This rank's RNG states as `gather_rng` saved them, so its dropout stream continues."""
    rng_cpu = tensors["rng_cpu"]
    # clone(): torch.set_rng_state crashes (SIGSEGV) on a view such as a row.
    torch.set_rng_state((rng_cpu[rank] if rng_cpu.dim() == 2 else rng_cpu).clone())
    if device.type == "cuda" and "rng_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng_cuda"][rank].clone(), device)
