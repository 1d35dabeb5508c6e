"""torch.cuda's calls that nmt makes, replaced by strict recorders, so that the GPU paths' device
handling runs on a CPU and its mistakes fail a test here rather than decode wrongly on a GPU.

The recorders keep CUDA's rules: each thread has a current GPU (GPU 0 when it starts) and, per
GPU, a current stream; a stream, a graph's capture, a pool or an event taken without naming a
GPU is on the thread's current one; a kernel of tensors on GPU k runs on GPU k's current stream,
so a capture begun on another GPU or stream records nothing of it. A graph pool lives while a
graph recorded into it does: torch releases it with the last and refuses a capture into it after
(create_or_incref_pool's use_count assert), as the recorders do. Where torch would only warn (an
empty graph) or pick GPU 0 silently (`cuda` without an index), a recorder raises Mistake.
The code under test stands for its kernels with `launch(device)`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref

import torch


class Mistake(AssertionError):
    """A device mistake: an AssertionError, so that no `except RuntimeError` swallows it."""


class Stream:
    def __init__(self, cuda: StrictCuda, device: int, default: bool = False):
        self.cuda, self.device_index, self.default = cuda, device, default

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def wait_stream(self, other: Stream) -> None:
        assert isinstance(other, Stream)

    def synchronize(self) -> None:
        pass


class Graph:
    def __init__(self, cuda: StrictCuda):
        self.cuda, self.nodes, self.replays = cuda, 0, 0
        self.device: int | None = None
        self.stream: Stream | None = None
        self.pool = None

    def __del__(self) -> None:  # its pool is released with the last graph recorded into it
        if self.pool is not None:
            self.cuda.pools[self.pool] -= 1
            if not self.cuda.pools[self.pool]:
                self.cuda.released.add(self.pool)

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        cuda = self.cuda
        self.device = cuda.current()
        self.stream = cuda.current_stream(self.device)
        if self.stream.default:
            raise Mistake("a capture on the default stream (torch refuses it)")
        if pool is not None and pool[0] != self.device:
            raise Mistake(f"a capture on cuda:{self.device} into cuda:{pool[0]}'s memory pool")
        if pool in cuda.released:
            raise Mistake("a capture into a pool whose graphs were all freed (torch refuses it)")
        if pool is not None:
            cuda.pools[pool] = cuda.pools.get(pool, 0) + 1
            self.pool = pool
        if getattr(cuda.local, "capture", None) is not None:
            raise Mistake("a capture inside a capture")
        cuda.local.capture = self

    def capture_end(self) -> None:
        self.cuda.local.capture = None
        if self.nodes == 0:
            raise Mistake(
                f"the graph recorded on cuda:{self.device} is empty: the step's kernels ran elsewhere"
            )

    def replay(self) -> None:
        if self.nodes == 0:
            raise Mistake("replaying an empty graph")
        self.replays += 1


class Event:
    def __init__(self, cuda: StrictCuda):
        self.cuda = cuda
        self.stream: Stream | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.stream = stream if stream is not None else self.cuda.current_stream()

    def synchronize(self) -> None:
        assert self.stream is not None, "synchronize before record"


class StrictCuda:
    """The recorders: `install(monkeypatch)` puts them in torch.cuda's place."""

    def __init__(self, count: int = 2):
        self.count = count
        self.local = threading.local()
        self.recorded: list[weakref.ref[Graph]] = []  # the graphs made, alive or freed
        self.pools: dict[tuple[int, int], int] = {}  # each pool's graphs alive
        self.released: set[tuple[int, int]] = set()
        self.handles = itertools.count()
        self.kernels: list[tuple[int, int]] = []  # (GPU, the thread's current GPU) of each launch

    # -- the thread's current GPU and streams
    def index(self, device, what: str) -> int:
        """The GPU a call names, or the current one when it names none."""
        if device is None:
            return self.current()
        if isinstance(device, int):
            found = device
        else:
            device = torch.device(device)
            if device.type != "cuda":
                raise Mistake(f"torch.cuda.{what} given {device}")
            if device.index is None:
                raise Mistake(f"torch.cuda.{what}({device}): a GPU without its index is whichever is current")
            found = device.index
        if not 0 <= found < self.count:
            raise Mistake(f"torch.cuda.{what}: GPU {found} of {self.count}")
        return found

    def current(self) -> int:
        return getattr(self.local, "device", 0)

    def _streams(self) -> dict[int, Stream]:
        if not hasattr(self.local, "streams"):
            self.local.streams = {}
        return self.local.streams

    def current_stream(self, device=None) -> Stream:
        i = self.index(device, "current_stream")
        return self._streams().setdefault(i, Stream(self, i, default=True))

    def current_device(self) -> int:
        return self.current()

    def set_device(self, device) -> None:
        self.local.device = self.index(device, "set_device")

    @contextlib.contextmanager
    def device(self, device):
        before = self.current()
        self.local.device = self.index(device, "device")
        try:
            yield
        finally:
            self.local.device = before

    @contextlib.contextmanager
    def stream(self, stream: Stream):
        """As torch's: the stream's GPU becomes current too, and its stream that GPU's."""
        before_device, streams = self.current(), self._streams()
        before = self.current_stream(stream.device_index)
        self.local.device, streams[stream.device_index] = stream.device_index, stream
        try:
            yield
        finally:
            self.local.device, streams[stream.device_index] = before_device, before

    def Stream(self, device=None, priority: int = 0) -> Stream:  # noqa: N802 - torch's name
        return Stream(self, self.index(device, "Stream"))

    @property
    def graphs(self) -> list[Graph]:
        """The graphs made that are still alive."""
        return [g for ref in self.recorded if (g := ref()) is not None]

    def CUDAGraph(self) -> Graph:  # noqa: N802 - torch's name
        graph = Graph(self)
        self.recorded.append(weakref.ref(graph))
        return graph

    def graph_pool_handle(self) -> tuple[int, int]:
        return (self.current(), next(self.handles))

    def Event(self, **kwargs) -> Event:  # noqa: N802 - torch's name
        return Event(self)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def synchronize(self, device=None) -> None:
        self.index(device, "synchronize")

    # -- what the code under test calls in place of its kernels
    def launch(self, device: torch.device) -> None:
        """A kernel over tensors on `device`: it runs on that GPU's current stream, recorded by
        this thread's capture only if the capture is on that GPU and stream."""
        i = self.index(device, "launch")
        self.kernels.append((i, self.current()))
        capture = getattr(self.local, "capture", None)
        if capture is None:
            return
        if capture.device != i:
            raise Mistake(f"capturing on cuda:{capture.device} while the step's kernels run on cuda:{i}")
        if capture.stream is not self.current_stream(i):
            raise Mistake(f"capturing on a stream other than cuda:{i}'s current one")
        capture.nodes += 1

    def install(self, monkeypatch) -> StrictCuda:
        for name in (
            "current_stream",
            "set_device",
            "current_device",
            "device",
            "stream",
            "Stream",
            "CUDAGraph",
            "graph_pool_handle",
            "Event",
            "is_available",
            "device_count",
            "synchronize",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        # resolve_device sets the GPU's attention kernels for the process: put the CPU's back
        for flag in ("flash_sdp", "mem_efficient_sdp", "math_sdp", "cudnn_sdp"):
            enabled = getattr(torch.backends.cuda, f"{flag}_enabled", None)
            if enabled is not None:
                monkeypatch.setattr(torch.backends.cuda, f"enable_{flag}", lambda on: None)
        return self
