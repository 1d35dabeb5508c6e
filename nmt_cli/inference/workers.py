"""Decoding spread over worker processes: `nmt translate --procs N` (CPU) and `--gpus N`.

The parent reads the input and writes the output; each worker loads the model once and
translates shares of each chunk of the input (what has arrived, up to 10,000 lines), `--threads`
split between them on a CPU, one GPU each with --gpus. Shares are answered in input order, and a
chunk's before more input is read, so the output streams as from one process,
and a line's translation is the same as one process gives it: batches are made within a share
as within a chunk, and a sampled line draws from its own line number's stream.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TextIO

from nmt_cli.config import TranslateConfig, cpus
from nmt_cli.errors import NmtError
from nmt_cli.inference.translator import Translator
from nmt_cli.textio import Counts, Request, requests

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor


@dataclass(frozen=True)
class Spread:
    """Where the decoding goes: the model each worker loads (models.load's arguments), and
    --procs CPU workers or --gpus GPU workers; one process decodes alone when neither is asked."""

    run_dir: Path
    paths: list[Path]
    checkpoint: str | None
    procs: int = 1
    gpus: int = 0

    @property
    def workers(self) -> int:
        return self.gpus or (self.procs if self.procs > 1 else 0)


_translator: Translator | None = None
_failed: BaseException | None = None


def _start(spread: Spread, config: TranslateConfig, devices) -> None:
    """A worker's start: load the model on the next free device. An error is kept for the first
    share to raise (a pool restarts workers whose start raises, for ever)."""
    global _translator, _failed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        import torch

        from nmt_cli.inference import models

        config = dataclasses.replace(config, device=devices.get())
        if config.device.startswith("cuda"):  # the worker's own GPU, not a context on GPU 0
            torch.cuda.set_device(torch.device(config.device))
        if config.threads:
            torch.set_num_threads(config.threads)
        _translator = Translator(models.load(spread.run_dir, spread.paths, spread.checkpoint), config)
    except BaseException as e:  # noqa: BLE001 - raised again in the parent
        _failed = e


def _translate(request: Request) -> tuple[list[str], int]:
    """A share's output lines, and how many of its lines were truncated."""
    if _failed is not None:
        raise _failed
    assert _translator is not None
    _translator.counts.lines = request.first  # line numbers: seeds, --scores
    before = _translator.counts.truncated
    out = _translator.output(request.lines, request.prefixes, request.constraints)
    return out, _translator.counts.truncated - before


def shares(request: Request, n: int) -> list[Request]:
    """`request` cut into at most `n` consecutive shares of nearly equal size."""
    size = -(-len(request.lines) // n)

    def cut(xs: list | None, i: int) -> list | None:
        return None if xs is None else xs[i : i + size]

    return [
        Request(
            request.first + i,
            request.lines[i : i + size],
            cut(request.prefixes, i),
            cut(request.constraints, i),
        )
        for i in range(0, len(request.lines), size)
    ]


def check(procs: int, gpus: int, config: TranslateConfig) -> None:
    """One line for a --procs or --gpus that cannot be had."""
    if procs > 1 and gpus:
        raise NmtError("--procs and --gpus both start workers: give one of them")
    if procs > 1 and config.device not in ("auto", "cpu"):
        raise NmtError(f"--procs decodes on the CPU: drop --device {config.device}, or give --gpus")
    if gpus:
        import torch

        if config.device not in ("auto", "cuda"):
            raise NmtError(f"--gpus gives each worker its GPU: drop --device {config.device}")
        if gpus > torch.cuda.device_count():
            raise NmtError(f"--gpus {gpus}, but {torch.cuda.device_count()} GPUs are visible")


def stream(
    spread: Spread,
    config: TranslateConfig,
    source: BinaryIO,
    sink: TextIO,
    advance: Callable[[int], None],
    prefixes: BinaryIO | None = None,
    constraints: BinaryIO | None = None,
) -> Counts:
    """Translator.stream over the workers of `spread`."""
    workers = spread.workers
    if spread.gpus:
        devices = [f"cuda:{i}" for i in range(spread.gpus)]
        threads = config.threads
    else:
        devices = ["cpu"] * workers
        threads = max(1, (config.threads or cpus()) // workers)
    # imported here: a translation without workers (most) starts without them
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    context = multiprocessing.get_context("spawn")  # not fork: torch's threads are not fork-safe
    queue = context.Queue()
    for device in devices:
        queue.put(device)
    counts = Counts()
    worker_config = dataclasses.replace(config, threads=threads)
    # concurrent.futures' pool, not multiprocessing's: a worker that dies (killed, out of
    # memory, a crash) breaks it and every share waiting on it raises, where multiprocessing's
    # would start another worker and wait for the lost share for ever
    pool = ProcessPoolExecutor(workers, context, _start, (spread, worker_config, queue))
    with pool:
        # A chunk's shares are all answered before more input is read: on a pipe, the input
        # may not come before its answers have gone out.
        for request in requests(source, config.chunk, counts, prefixes, constraints):
            waiting = [(pool.submit(_translate, s), s) for s in shares(request, workers)]
            for result, share in waiting:
                try:
                    out, truncated = result.result()
                except BrokenProcessPool:
                    raise NmtError(
                        f"{_died(pool)} while translating lines {share.first + 1}-"
                        f"{share.first + len(share.lines)}: lines {share.first + 1} onward were not "
                        "translated (out of memory? see the kernel's log)"
                    ) from None
                for text in out:
                    sink.write(text + "\n")
                sink.flush()
                counts.truncated += truncated
                advance(len(share.lines))
    return counts


def _died(pool: ProcessPoolExecutor, wait: float = 2.0) -> str:
    """Which worker of the broken `pool` died, and how, as far as the pool still knows.

    The pool wakes its callers as soon as a worker's pipe closes, which may come before that
    worker can be reaped (its exit code still unknown), and then ends the other workers with
    SIGTERM: each is waited for a moment, and one that ended otherwise is named first."""
    processes = getattr(pool, "_processes", None) or {}  # private: only to name the worker
    deadline = time.monotonic() + wait
    ended = {}
    for pid, process in list(processes.items()):
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode:
            ended[pid] = process.exitcode
    for pid, code in sorted(ended.items(), key=lambda item: item[1] == -signal.SIGTERM):
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        return f"a worker process died (pid {pid}, {how})"
    return "a worker process died"
