"""A decoding step recorded once as a CUDA graph and replayed at every later step.

A decoding step is a few hundred small kernels for one token per row, and on a GPU the host
took longer to launch them than the GPU to run them (docs/benchmarks.md, "GPU"). Over a
FixedCache (cache.py) every step launches the same kernels on the same tensors, so the step is
recorded once and each later step is one launch. The first step runs as it is on a side
stream, which warms what the recording needs (cuBLAS workspaces, the allocator), as
torch.cuda.graphs asks; the next ones are recorded (one graph for each of the cache's two
tensors under beam search, one otherwise), then replayed. Off a GPU the step just runs.

torch.cuda.graph would also synchronise and empty the allocator's cache before each recording;
a translation records a graph per batch, so this records with the graph's own calls instead.

A search's graphs (both parities, every model of an ensemble) record into one memory pool of
their own (`Pool`), given back when they are freed. Not one pool per GPU for the process: torch
releases a pool once every graph recorded into it is freed, and refuses a later capture into it
(an internal assert in create_or_incref_pool), so such a pool served the first batch only and
every later one fell back to eager steps."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

_failed: str | None = None  # why recording failed in this process: the steps run as they are


class Pool:
    """The memory pool of one search's graphs, on each GPU they are recorded on: taken at the
    first recording there, released by torch with the last of its graphs."""

    def __init__(self) -> None:
        self.handles: dict[int | None, Any] = {}

    def on(self, device: torch.device) -> Any:
        """The pool's handle on `device`."""
        if device.index not in self.handles:
            with torch.cuda.device(device):  # a handle is the current GPU's
                self.handles[device.index] = torch.cuda.graph_pool_handle()
        return self.handles[device.index]


class Replayed:
    """`body()` (a decoding step over a FixedCache: reads its inputs, writes its state, returns
    the logits), run as a replayed CUDA graph when `device` (the step's tensors') is a GPU: one
    graph for each `key` the step is called with (the cache's parity: which of its tensors the
    step reads). The logits it returns are the graph's own tensor, which the next step may
    overwrite: read them before.

    Every CUDA call here names `device` or runs inside torch.cuda.device(device): a stream or a
    capture taken from "the current GPU" (GPU 0 in a worker or a server's thread) records none of
    the step's kernels on another GPU, and replaying that empty graph returns stale logits."""

    def __init__(self, body: Callable[[], Tensor], device: torch.device, pool: Pool | None = None):
        self.body, self.device, self.pool = body, device, pool or Pool()
        self.record = device.type == "cuda" and _failed is None
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.stream: torch.cuda.Stream | None = None

    def __call__(self, key: Hashable = 0) -> Tensor:
        if not self.record:
            return self.body()
        with torch.cuda.device(self.device):
            if self.stream is None:  # the first step, as it is, on the stream the graphs will use
                self.stream = torch.cuda.Stream(device=self.device)
                return self._on_stream(self.body)
            if key not in self.graphs:
                try:
                    self._on_stream(lambda: self._recorded(key))
                except RuntimeError as e:  # not seen: a fallback so that a translation never fails on it
                    global _failed
                    _failed = str(e).splitlines()[0] if str(e) else type(e).__name__
                    warnings.warn(
                        f"decoding without CUDA graphs: recording one failed ({_failed})", stacklevel=2
                    )
                    self.record = False
                    return self.body()
            graph, out = self.graphs[key]  # a recording computes nothing: this step is replayed too
            graph.replay()
            return out

    def _on_stream(self, fn: Callable[[], Tensor]) -> Tensor:
        assert self.stream is not None
        here = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(here)
        with torch.cuda.stream(self.stream):
            out = fn()
        here.wait_stream(self.stream)
        return out

    def _recorded(self, key: Hashable) -> Tensor:
        with torch.cuda.device(self.device):  # as in __call__: each function names its GPU
            graph = torch.cuda.CUDAGraph()
            # thread_local: a training run's collation thread may copy batches meanwhile. The
            # search's pool: its graphs share it safely, as they are replayed in the order they
            # were recorded, on one stream (an ensemble's members, step by step), never at once
            graph.capture_begin(pool=self.pool.on(self.device), capture_error_mode="thread_local")
            try:
                out = self.body()
            finally:
                graph.capture_end()
        self.graphs[key] = (graph, out)
        return out
