"""A decoding step recorded once as a CUDA graph and replayed at every later step.

A decoding step is a few hundred small kernels for one token per row, and on a GPU the host
took longer to launch them than the GPU to run them (docs/benchmarks.md, "GPU speed"). Over a
FixedCache (cache.py) every step launches the same kernels on the same tensors, so the step is
recorded once and each later step is one launch. The first step runs as it is on a side
stream, which warms what the recording needs (cuBLAS workspaces, the allocator), as
torch.cuda.graphs asks; the next ones are recorded (one graph for each of the cache's two
tensors under beam search, one otherwise), then replayed. Off a GPU the step just runs.

torch.cuda.graph would also synchronise and empty the allocator's cache before each recording;
a translation records a graph per batch, so this records with the graph's own calls instead."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

_failed: str | None = None  # why recording failed in this process: the steps run as they are
_pools: dict[int | None, Any] = {}  # each GPU's memory pool for the graphs recorded on it


class Replayed:
    """`body()` (a decoding step over a FixedCache: reads its inputs, writes its state, returns
    the logits), run as a replayed CUDA graph when `device` (the step's tensors') is a GPU: one
    graph for each `key` the step is called with (the cache's parity: which of its tensors the
    step reads). The logits it returns are the graph's own tensor, which the next step may
    overwrite: read them before.

    Every CUDA call here names `device` or runs inside torch.cuda.device(device): a stream or a
    capture taken from "the current GPU" (GPU 0 in a worker or a server's thread) records none of
    the step's kernels on another GPU, and replaying that empty graph returns stale logits."""

    def __init__(self, body: Callable[[], Tensor], device: torch.device):
        self.body, self.device = body, device
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
            # thread_local: a training run's collation thread may copy batches meanwhile. One
            # memory pool per GPU for every batch's graph (each would otherwise keep a private
            # pool of its own, and a server's reserved memory would grow with the batches it
            # decodes): safe as the graphs that share it are replayed in the order they were
            # recorded, on one stream (an ensemble's members, step by step), never at once.
            if self.device.index not in _pools:
                _pools[self.device.index] = torch.cuda.graph_pool_handle()
            graph.capture_begin(pool=_pools[self.device.index], capture_error_mode="thread_local")
            try:
                out = self.body()
            finally:
                graph.capture_end()
        self.graphs[key] = (graph, out)
        return out
