"""The workers of a multi-process run, started through torch's elastic launcher (one per GPU
with NCCL, or CPU processes with gloo), their failures told apart (a worker's own error, or
lost contact), and the signals that stop them passed on. distributed.py is the group they train in.
"""

from __future__ import annotations

import contextlib
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

from nmt_cli.config import cpus
from nmt_cli.engine.distributed import LOST_CONTACT
from nmt_cli.errors import NmtError


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


class Stopped(Exception):
    """The launcher was sent `signum` (Ctrl-C, a pre-emption): the workers were stopped."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def launch(
    nprocs: int,
    command: list[str],
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str = "",
    max_restarts: int = 0,
    say: Callable[[str], None] = print,
    grace_s: int = 120,
) -> None:
    """Run `python COMMAND` in `nprocs` workers through torch's elastic launcher (what
    torchrun runs); returns when all finished, raises NmtError if one failed.

    On one node a failed job is restarted up to `max_restarts` times, each time as a fresh
    launch (new rendezvous, new port) whose workers resume from the last checkpoint: the
    elastic agent's own in-place restart left restarted gloo workers unable to reconnect
    ("connectFullMesh failed", cf. pytorch/pytorch#167288). Several nodes must restart
    together, so there the agent's restart is used. A worker's own error (say, out of memory)
    is reported as it is and not restarted: a restart would meet it again.

    SIGTERM, SIGINT, SIGHUP or SIGQUIT to this process is passed on to the workers, which save
    a checkpoint and exit; those still running after `grace_s` seconds are killed. Raises
    Stopped then.
    """
    attempts = 1 + (max_restarts if nnodes == 1 else 0)
    for attempt in range(1, attempts + 1):
        with _worker_threads(nprocs):
            failure = _launch_once(
                nprocs, command, nnodes, node_rank, rdzv_endpoint, max_restarts if nnodes > 1 else 0, grace_s
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


@contextlib.contextmanager
def _worker_threads(nprocs: int):
    """The workers started meanwhile share this machine's cores: OMP_NUM_THREADS is cores //
    workers unless the user set it. Each would otherwise take every core, and N workers that
    spin-wait on each other's cores run many times slower (torchrun sets 1 for the same reason)."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, cpus() // nprocs))
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]


def _launch_once(
    nprocs: int,
    command: list[str],
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str,
    max_restarts: int,
    grace_s: int,
) -> Failure | None:
    """One launch; what failed, or None if every worker finished."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
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
    # The agent sends the signal it got to the workers, waits this long, then SIGKILLs (a
    # LaunchConfig field of recent torch releases; its own default is 30 s).
    grace: dict[str, Any] = {}
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:
        grace["shutdown_timeout"] = grace_s
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
        **grace,
    )
    try:
        elastic_launch(config, sys.executable)("-u", *command)
        return None
    except SignalException as e:
        raise Stopped(int(e.sigval)) from None
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

    def own_error(message: str) -> bool:
        return message.startswith(WORKER_ERROR) and LOST_CONTACT not in message

    def key(item):
        rank, (code, when, message) = item
        killed = code < 0 and code != -signal.SIGTERM
        stopped = code == -signal.SIGTERM
        return not killed, not own_error(message), stopped, LOST_CONTACT in message, when, rank

    if not failures:
        return None
    rank, (code, _, message) = min(failures.items(), key=key)
    if code < 0:
        return Failure(f"rank {rank} was killed by {signal.Signals(-code).name}", True)
    if message.startswith(WORKER_ERROR):
        return Failure(f"rank {rank}: {message[len(WORKER_ERROR) :]}", not own_error(message))
    return Failure(f"rank {rank} exited with code {code}", True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
