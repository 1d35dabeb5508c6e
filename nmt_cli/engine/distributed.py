"""Everything that touches torch.distributed: process groups, the elastic launcher, DDP.

Rank and world size come from the environment, as torchrun and torch's elastic launcher set it
(RANK, WORLD_SIZE, LOCAL_RANK) or as SLURM does (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID).
NCCL on GPUs, gloo on the CPU. With one process nothing here starts a process group.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nmt_cli.errors import NmtError

# The backend of the default process group, by device type. NCCL takes CUDA tensors only, so a
# CUDA run also opens a gloo group for what lives on the host (RNG states, flags, objects).
BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


@dataclass
class Group:
    """This process's place among the training processes, and the collectives the trainer uses.

    Two kinds of collective: `all_reduce` sums tensors on this rank's device through the
    default group (NCCL on GPUs: queued on the stream, the host does not wait), and the `host_`
    ones exchange small CPU values through a gloo group, for decisions every rank must share.
    """

    rank: int = 0
    world: int = 1
    host: Any = None  # the gloo group for CPU tensors; None: the default group is gloo

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (on this rank's device) over ranks, in place."""
        if self.active:
            torch.distributed.all_reduce(tensor)
        return tensor

    def host_max(self, values: list[int]) -> list[int]:
        """Element-wise maximum of small integers over ranks: a decision every rank shares."""
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.host)
        return t.tolist()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of a same-shaped CPU tensor (e.g. RNG states), on every rank."""
        if not self.active:
            return [tensor]
        tensor = tensor.cpu()
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        torch.distributed.all_gather(out, tensor, group=self.host)
        return out

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj, group=self.host)
        return out

    def wrap(self, model: torch.nn.Module, device: torch.device, compile: bool = False) -> torch.nn.Module:
        """The model as training calls it: DDP across ranks, then torch.compile. That order is
        torch's own advice: compiling the DDP module lets it split the graph at gradient
        buckets, so their all-reduce still overlaps the backward pass."""
        if self.active:
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            # Broadcasts rank 0's initial weights, so every rank starts from the same model.
            # The only buffer is the positional table, the same everywhere: not broadcast again
            # before every forward pass (torch 2.13 renamed the option).
            options = inspect.signature(DistributedDataParallel).parameters
            no_sync = "forward_sync_buffers" if "forward_sync_buffers" in options else "broadcast_buffers"
            model = DistributedDataParallel(model, device_ids=ids, **{no_sync: False})
        return torch.compile(model) if compile else model

    def no_sync(self, model: torch.nn.Module):
        """Skip the gradient all-reduce (micro-batches before the last of an update)."""
        if self.active and hasattr(model, "no_sync"):
            return model.no_sync()
        return contextlib.nullcontext()

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier(group=self.host)

    def close(self) -> None:
        if self.active:
            torch.distributed.destroy_process_group()


# Where launchers other than torch's put a process's rank on its node.
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def from_environment() -> tuple[int, int, int | None]:
    """(rank, world size, local rank or None when no launcher said it)."""
    env = os.environ
    local = next((int(env[v]) for v in LOCAL_RANK_VARIABLES if v in env), None)
    if "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return int(env.get("RANK", 0)), world, local if local is not None or world > 1 else 0
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and int(env["SLURM_NTASKS"]) > 1:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), local
    return 0, 1, 0


def gpu_index(rank: int, local_rank: int | None, visible: int) -> int:
    """Which of the GPUs this process sees is its own."""
    if visible == 1:
        return 0  # one GPU bound to this task (SLURM --gpus-per-task, CUDA_VISIBLE_DEVICES)
    if local_rank is None:
        raise NmtError(
            f"rank {rank} sees {visible} GPUs but no launcher set LOCAL_RANK: start "
            "with `nmt train --gpus N`, torchrun or srun, or export LOCAL_RANK"
        )
    if local_rank >= visible:
        raise NmtError(
            f"rank {rank} is local rank {local_rank} but sees {visible} GPUs: start "
            "at most one process per GPU, or give each task its own GPU "
            "(srun --gpus-per-task=1)"
        )
    return local_rank


def shared_gpus(placements: list[tuple[str, str]]) -> str | None:
    """What is wrong if two ranks sit on one GPU; `placements` is each rank's (host, GPU id)."""
    seen: dict[tuple[str, str], int] = {}
    for rank, where in enumerate(placements):
        if where in seen:
            return (
                f"ranks {seen[where]} and {rank} both use GPU {where[1]} of {where[0]}: "
                "set LOCAL_RANK for each process (torchrun and `nmt train --gpus N` do)"
            )
        seen[where] = rank
    return None


def setup(device: torch.device, timeout_s: float = 300.0) -> tuple[Group, torch.device]:
    """Join the process group the environment describes; returns it and this rank's device."""
    rank, world, local_rank = from_environment()
    if "WORLD_SIZE" not in os.environ and world == 1:
        return Group(), device  # a plain single process: no process group at all
    if device.type == "cuda":
        device = torch.device("cuda", gpu_index(rank, local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    if "MASTER_ADDR" not in os.environ:
        raise NmtError(
            "WORLD_SIZE is set but MASTER_ADDR is not: start through `nmt train "
            "--gpus N`, torchrun, or srun with MASTER_ADDR/MASTER_PORT exported"
        )
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    backend = BACKENDS[device.type]
    # A rank that dies leaves the others waiting in a collective: the timeout bounds the wait.
    timeout = datetime.timedelta(seconds=timeout_s)
    torch.distributed.init_process_group(
        backend, timeout=timeout, device_id=device if device.type == "cuda" else None
    )
    host = None if backend == "gloo" else torch.distributed.new_group(backend="gloo", timeout=timeout)
    group = Group(rank, world, host)
    if device.type == "cuda":
        gpu = str(torch.cuda.get_device_properties(device).uuid)
        problem = shared_gpus(group.gather_objects((socket.gethostname(), gpu)))
        if problem:
            group.close()
            raise NmtError(problem)
    return group, device


def check_gpus(gpus: int) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > have:
        raise NmtError(
            f"--gpus {gpus} but this machine has {have} GPU{'s' if have != 1 else ''}: "
            + (
                f"use --gpus {have}"
                if have
                else "train on the CPU with --procs N --device cpu, or run on a GPU machine"
            )
        )


# A worker that stops on an error of its own (NmtError: out of memory, bad data, ranks that
# disagree) writes it to torch's per-worker error file, so the launcher reports that error
# instead of an exit code. Its mark tells it from the errors torch itself records.
WORKER_ERROR = "nmt worker error: "
LOST_CONTACT = "lost contact with the other ranks"


def record_worker_error(message: str) -> None:
    """Called by a worker that is about to exit on `message`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": WORKER_ERROR + message, "timestamp": int(time.time())}, f)


@dataclass
class Failure:
    message: str
    restartable: bool  # a crash or a lost rank, which a resume can get past


def launch(
    nprocs: int,
    command: list[str],
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str = "",
    max_restarts: int = 0,
    say: Callable[[str], None] = print,
) -> None:
    """Run `python COMMAND` in `nprocs` workers through torch's elastic launcher (what
    torchrun runs); returns when all finished, raises NmtError if one failed.

    On one node a failed job is restarted up to `max_restarts` times, each time as a fresh
    launch (new rendezvous, new port) whose workers resume from the last checkpoint: the
    elastic agent's own in-place restart left restarted gloo workers unable to reconnect
    ("connectFullMesh failed", cf. pytorch/pytorch#167288). Several nodes must restart
    together, so there the agent's restart is used. A worker's own error (say, out of memory)
    is reported as it is and not restarted: a restart would meet it again.
    """
    attempts = 1 + (max_restarts if nnodes == 1 else 0)
    for attempt in range(1, attempts + 1):
        failure = _launch_once(
            nprocs, command, nnodes, node_rank, rdzv_endpoint, max_restarts if nnodes > 1 else 0
        )
        if failure is None:
            return
        if not failure.restartable:
            raise NmtError(failure.message)
        if attempt == attempts:
            raise NmtError(
                f"distributed training failed: {failure.message}; the other workers "
                "were stopped. Rerun the same command to resume from the last "
                "checkpoint"
            )
        say(
            f"{failure.message}: restarting the workers, which resume from the last checkpoint "
            f"(restart {attempt} of {max_restarts})"
        )


def _launch_once(
    nprocs: int, command: list[str], nnodes: int, node_rank: int, rdzv_endpoint: str, max_restarts: int
) -> Failure | None:
    """One launch; what failed, or None if every worker finished."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nnodes == 1:
        # As torchrun --standalone: a c10d rendezvous on a free local port.
        backend, endpoint, configs = "c10d", f"127.0.0.1:{_free_port()}", {}
        run_id = uuid.uuid4().hex
    elif not rdzv_endpoint:
        raise NmtError(
            "multi-node training needs --rdzv-endpoint HOST:PORT of node 0 "
            "(the same on every node) and --node-rank"
        )
    else:  # as torchrun --node-rank R --master-addr/--master-port: ranks fixed by the nodes
        backend, endpoint, configs = "static", rdzv_endpoint, {"rank": node_rank}
        run_id = os.environ.get("NMT_RUN_ID", "nmt")
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nprocs,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=configs,
        max_restarts=max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-u", *command)
        return None
    except ChildFailedError as e:
        return root_cause(
            {
                rank: (f.exitcode, f.timestamp, f.message if isinstance(f.message, str) else "")
                for rank, f in e.failures.items()
            }
        ) or Failure(str(e), True)


def root_cause(failures: dict[int, tuple[int, int, str]]) -> Failure | None:
    """The failure that started it, from each failed rank's (exit code, time, message): a rank
    killed by a signal (other than the SIGTERM the launcher sends the survivors), else one that
    stopped on its own error rather than on losing the others, else the earliest."""

    def key(item):
        rank, (code, when, message) = item
        return code >= 0, code == -signal.SIGTERM, LOST_CONTACT in message, when, rank

    if not failures:
        return None
    rank, (code, _, message) = min(failures.items(), key=key)
    if code < 0:
        return Failure(f"rank {rank} was killed by {signal.Signals(-code).name}", True)
    if message.startswith(WORKER_ERROR) and LOST_CONTACT not in message:
        return Failure(f"rank {rank}: {message[len(WORKER_ERROR) :]}", False)
    return Failure(f"rank {rank} exited with code {code}", True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
