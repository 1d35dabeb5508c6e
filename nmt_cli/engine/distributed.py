"""Everything that touches torch.distributed: process groups, the elastic launcher, DDP.

Rank and world size come from the environment, as torchrun and torch's elastic launcher set it
(RANK, WORLD_SIZE, LOCAL_RANK) or as SLURM does (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID).
NCCL on GPUs, gloo on the CPU. With one process nothing here starts a process group.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from typing import Callable

import torch

from nmt_cli.errors import NmtError


@dataclass
class Group:
    """This process's place among the training processes."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Element-wise sum over ranks (float64, so token counts stay exact)."""
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        if not self.active:
            return model
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index] if device.type == "cuda" else None
        # Broadcasts rank 0's initial weights, so every rank starts from the same model.
        return DistributedDataParallel(model, device_ids=ids)

    def no_sync(self, model: torch.nn.Module):
        """Skip the gradient all-reduce (micro-batches before the last of an update)."""
        if self.active and hasattr(model, "no_sync"):
            return model.no_sync()
        return contextlib.nullcontext()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of a same-shaped tensor (e.g. RNG states), on every rank."""
        if not self.active:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        torch.distributed.all_gather(out, tensor)
        return out

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def close(self) -> None:
        if self.active and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def from_environment() -> tuple[int, int, int]:
    env = os.environ
    if "WORLD_SIZE" in env:
        return int(env.get("RANK", 0)), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and int(env["SLURM_NTASKS"]) > 1:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return 0, 1, 0


def setup(device: torch.device, timeout_s: float = 300.0) -> tuple[Group, torch.device]:
    """Join the process group the environment describes; returns it and this rank's device."""
    rank, world, local_rank = from_environment()
    group = Group(rank, world, local_rank)
    if "WORLD_SIZE" not in os.environ and world == 1:
        return group, device  # a plain single process: no process group at all
    if device.type == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise NmtError(f"rank {rank} wants GPU {local_rank} but this machine has "
                           f"{torch.cuda.device_count()}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if "MASTER_ADDR" not in os.environ:
        raise NmtError("WORLD_SIZE is set but MASTER_ADDR is not: start through `nmt train "
                       "--gpus N`, torchrun, or srun with MASTER_ADDR/MASTER_PORT exported")
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    # A rank that dies leaves the others waiting in a collective: the timeout bounds the wait.
    torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                         device_id=device if device.type == "cuda" else None)
    return group, device


def check_gpus(gpus: int) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > have:
        raise NmtError(f"--gpus {gpus} but this machine has {have} GPU{'s' if have != 1 else ''}: "
                       + (f"use --gpus {have}" if have else
                          "train on the CPU with --procs N --device cpu, or run on a GPU machine"))


def launch(nprocs: int, argv: list[str], nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str = "", max_restarts: int = 0,
           say: Callable[[str], None] = print) -> None:
    """Run `python -m nmt_cli train ARGV` in `nprocs` workers through torch's elastic launcher
    (what torchrun runs); returns when all finished, raises NmtError if one failed.

    On one node a failed job is restarted up to `max_restarts` times, each time as a fresh
    launch (new rendezvous, new port) whose workers resume from the last checkpoint: the
    elastic agent's own in-place restart left restarted gloo workers unable to reconnect
    ("connectFullMesh failed", cf. pytorch/pytorch#167288). Several nodes must restart
    together, so there the agent's restart is used.
    """
    attempts = 1 + (max_restarts if nnodes == 1 else 0)
    for attempt in range(1, attempts + 1):
        failure = _launch_once(nprocs, argv, nnodes, node_rank, rdzv_endpoint,
                               max_restarts if nnodes > 1 else 0)
        if failure is None:
            return
        if attempt == attempts:
            raise NmtError(f"distributed training failed: {failure}; the other workers were "
                           "stopped. Rerun the same command to resume from the last checkpoint")
        say(f"{failure}: restarting the workers, which resume from the last checkpoint "
            f"(restart {attempt} of {max_restarts})")


def _launch_once(nprocs: int, argv: list[str], nnodes: int, node_rank: int,
                 rdzv_endpoint: str, max_restarts: int) -> str | None:
    """One launch; what failed, or None if every worker finished."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nnodes == 1:
        # As torchrun --standalone: a c10d rendezvous on a free local port.
        backend, endpoint, configs = "c10d", f"127.0.0.1:{_free_port()}", {}
        run_id = uuid.uuid4().hex
    elif not rdzv_endpoint:
        raise NmtError("multi-node training needs --rdzv-endpoint HOST:PORT of node 0 "
                       "(the same on every node) and --node-rank")
    else:  # as torchrun --node-rank R --master-addr/--master-port: ranks fixed by the nodes
        backend, endpoint, configs = "static", rdzv_endpoint, {"rank": node_rank}
        run_id = os.environ.get("NMT_RUN_ID", "nmt")
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nprocs, run_id=run_id,
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=configs,
        max_restarts=max_restarts, monitor_interval=0.5, start_method="spawn")
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "nmt_cli", "train", *argv)
        return None
    except ChildFailedError as e:
        # The root cause is the rank that died first (the others fail after losing it).
        failures = sorted(e.failures.items(), key=lambda kv: (kv[1].exitcode >= 0, kv[1].timestamp))
        if failures:
            rank, first = failures[0]
            how = (f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0
                   else f"exited with code {first.exitcode}")
            return f"rank {rank} {how}"
        return str(e)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
