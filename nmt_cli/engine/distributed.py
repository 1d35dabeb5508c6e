"""The process group a worker trains in, and DDP (launcher.py starts the workers).

Rank and world size come from the environment, as torchrun and torch's elastic launcher set it
(RANK, WORLD_SIZE, LOCAL_RANK), as SLURM does (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) or as
mpirun does (OMPI_COMM_WORLD_*, PMI_*). NCCL on GPUs, gloo on the CPU. With one process nothing
here starts a process group.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import inspect
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any, cast

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
    writes: Any = None  # the gloo group that waits for rank 0's writes (allow_writes)

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

    def from_main(self, obj: Any) -> Any:
        """Rank 0's picklable `obj`, on every rank (what the others pass is ignored)."""
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, group=self.host)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj, group=self.host)
        return out

    def wrap(
        self,
        model: torch.nn.Module,
        device: torch.device,
        compile: bool = False,
        dynamic: bool = True,
        batched_grad_copy: bool = False,
    ) -> torch.nn.Module:
        """The model as training calls it: DDP across ranks, then torch.compile. That order is
        torch's own advice: compiling the DDP module lets it split the graph at gradient
        buckets, so their all-reduce still overlaps the backward pass. Sizes are dynamic from the
        start: batches change shape at every step, and compiling for the first batch's shape
        only to compile again once sizes vary costs a second compile of the whole model. Each
        size its own symbol: lengths on a grid are often equal on both sides, and a graph that
        took them for one size would be compiled again at the first batch where they differ.
        Not `dynamic`: batches come in a few fixed shapes, each compiled for its own (as many
        recompilations allowed as there are lengths on the grid). `batched_grad_copy`: DDP copies
        and divides a bucket's gradients in one operation, not one per parameter (torch 2.13)."""
        if self.active:
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            # Broadcasts rank 0's initial weights, so every rank starts from the same model.
            # The only buffer is the positional table, the same everywhere: not broadcast again
            # before every forward pass (torch 2.13 renamed the option).
            options = inspect.signature(DistributedDataParallel).parameters
            no_sync = "forward_sync_buffers" if "forward_sync_buffers" in options else "broadcast_buffers"
            # The gradients are views of the all-reduce buckets: the optimizer reads them there
            # (no copy back out), and no second copy of every gradient is kept. The update sets
            # them to None after the step, so each backward's fresh gradient is copied into its
            # bucket once, as DDP divides it: zeroing them in place instead would add a pass to
            # clear them and turn the backward's write into a read-add-write. The rest stays
            # at DDP's defaults (25 MB buckets overlap the backward pass; compiled, fewer and
            # larger: compiled_bucket_mb), and static_graph is for parameters that go unused
            # and activation checkpointing, neither of which is here (docs/scaling.md).
            settings: dict[str, Any] = {"gradient_as_bucket_view": True, no_sync: False}
            if compile:
                settings["bucket_cap_mb"] = compiled_bucket_mb(model)
            if batched_grad_copy:
                if "batched_grad_copy" not in options:
                    raise NmtError(
                        f"--batched-grad-copy needs torch 2.13 or later (this is {torch.__version__})"
                    )
                settings["batched_grad_copy"] = True
            model = DistributedDataParallel(model, device_ids=ids, **settings)
        if not compile:
            return model
        if not dynamic:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
            return cast(torch.nn.Module, torch.compile(model, dynamic=False))
        from torch.fx.experimental import _config as shapes_config

        shapes_config.use_duck_shape = False
        return cast(torch.nn.Module, torch.compile(model, dynamic=True))

    def no_sync(self, model: torch.nn.Module):
        """Skip the gradient all-reduce (micro-batches before the last of an update)."""
        if self.active and hasattr(model, "no_sync"):
            return cast(Any, model).no_sync()  # DDP's (through a compiled wrapper too)
        return contextlib.nullcontext()

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier(group=self.host)

    def allow_writes(self, seconds: float) -> None:
        """Let wait_for_main wait `seconds` (every rank calls this together, once)."""
        if self.active:
            self.writes = torch.distributed.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=seconds)
            )

    def wait_for_main(self) -> None:
        """Every rank waits here for rank 0, as long as allow_writes said rather than the group's
        timeout: after what rank 0 alone does (writing a checkpoint), whose time grows with the
        model and the disk, the other ranks would otherwise wait in their next collective and
        time out. A group of its own: gloo bounds every wait of a group by its timeout."""
        if self.active:
            torch.distributed.barrier(group=self.writes if self.writes is not None else self.host)

    def close(self) -> None:
        if self.active:
            torch.distributed.destroy_process_group()


# A compiled update under DDP is split into about this many graphs (see compiled_bucket_mb).
COMPILED_PIECES = 4


def compiled_bucket_mb(model: torch.nn.Module) -> float:
    """DDP's bucket size for a compiled model: its float32 gradients in COMPILED_PIECES buckets,
    25 MB (DDP's default) at least. The compiler splits the update into one graph per bucket,
    so that each bucket's all-reduce can start while the backward pass goes on; at 25 MB `big`
    was cut into dozens of graphs, each with its own launches and no fusion across the cuts,
    where a few pieces keep most of the overlap."""
    megabytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad) / 2**20
    return max(25.0, megabytes / COMPILED_PIECES)


# Where launchers other than torch's put a process's rank on its node.
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
# (rank, world size) as each launcher names them, after torch's own RANK/WORLD_SIZE: SLURM's
# srun, Open MPI's mpirun, and the PMI of MPICH, Intel MPI and srun --mpi=pmi2.
RANK_VARIABLES = (
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
)


def from_environment() -> tuple[int, int, int | None]:
    """(rank, world size, local rank or None when no launcher said it)."""
    env = os.environ
    local = next((int(env[v]) for v in LOCAL_RANK_VARIABLES if v in env), None)
    if "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return int(env.get("RANK", 0)), world, local if local is not None or world > 1 else 0
    for rank_name, size_name in RANK_VARIABLES:
        if rank_name in env and size_name in env and int(env[size_name]) > 1:
            return int(env[rank_name]), int(env[size_name]), local
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
        if device.type == "cuda":  # --device cuda:K: the main thread's GPU too
            torch.cuda.set_device(device)
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
    choose_gloo_interface(os.environ["MASTER_ADDR"])
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


def choose_gloo_interface(master_addr: str) -> str | None:
    """Set GLOO_SOCKET_IFNAME to the interface that reaches `master_addr`, unless the user set
    it or this host's name resolves to a routable address; returns the interface it set.

    Gloo binds the address the hostname resolves to. Where that is a loopback address (Ubuntu's
    /etc/hosts maps the hostname to 127.0.1.1), the other nodes are told to connect to it and
    gloo's full mesh fails ("Gloo connectFullMesh failed")."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None  # the user's choice, one interface name or a comma-separated list
    try:
        own = ipaddress.ip_address(socket.gethostbyname(socket.gethostname()))
    except (OSError, ValueError):
        own = None
    if own is not None and not own.is_loopback:
        return None
    interface = interface_towards(master_addr)
    if interface is None:
        return None
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    return interface


def interface_towards(host: str) -> str | None:
    """The name of this machine's network interface whose address routes to `host` (IPv4)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))  # UDP: no packet is sent
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if interface_address(name) == local:
            return name
    return None


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name` (Linux's SIOCGIFADDR), or None."""
    SIOCGIFADDR = 0x8915
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = name.encode()[:15].ljust(256, b"\0")
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)[20:24])
    except OSError:
        return None


LOST_CONTACT = "lost contact with the other ranks"

# What gloo's TCP transport says when the other end is gone or silent; it raises these as plain
# RuntimeErrors (torch 2.13), not as torch.distributed.DistError.
GLOO_LOST = ("gloo/transport/", "Connection reset by peer", "Connection closed by peer", "Broken pipe")


def is_lost_contact(error: BaseException) -> bool:
    """Whether `error` is a failure to reach the other ranks (their death, a timeout of a
    collective, a broken rendezvous), which a restart can get past, rather than this rank's
    own error (a compiler, CUDA or cuBLAS error, a bug), which a restart would meet again."""
    if isinstance(error, torch.distributed.DistError):  # DistBackendError, DistNetworkError, ...
        return True
    return isinstance(error, RuntimeError) and any(mark in str(error) for mark in GLOO_LOST)
