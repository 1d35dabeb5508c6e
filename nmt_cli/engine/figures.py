"""The training figures on their way from the device to the log.

train_step leaves one small tensor of figures per update on the device. Reading one waits for
the device to finish everything queued before it; on a GPU that drains the queue, and the GPU
idles while the host queues the next update. So the figures are read a window of updates at a
time, and between validations and checkpoints a window is read one window late: its copy to the
host is queued behind its updates, and by the time the next window closes it has long arrived.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class Window:
    rows: torch.Tensor  # (updates, STEP_FIGURES) on the host, or on its way there
    arrived: torch.cuda.Event | None  # recorded after the copy to the host was queued
    last_step: int
    epoch: int
    seconds: float  # host time between the window's opening and its closing


class Figures:
    """Windows of train_step's figures. `late`: read each window only once the next one closes
    (unless asked to wait); else at once, as on a CPU, where nothing is queued."""

    def __init__(self, late: bool):
        self.late = late
        self.pending: list[torch.Tensor] = []  # this window's updates
        self.closed: deque[Window] = deque()

    def add(self, figures: torch.Tensor) -> None:
        self.pending.append(figures)

    def close(self, last_step: int, epoch: int, seconds: float) -> None:
        """End the window of the updates added since the last close (if any)."""
        if not self.pending:
            return
        rows, arrived = torch.stack(self.pending), None
        self.pending = []
        if rows.device.type == "cuda":
            gpu = rows.device
            with torch.cuda.device(gpu):  # the pinned block and the event: the rows' GPU
                host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                host.copy_(rows, non_blocking=True)
                rows, arrived = host, torch.cuda.Event()
                arrived.record(torch.cuda.current_stream(gpu))
        self.closed.append(Window(rows, arrived, last_step, epoch, seconds))

    def ready(self, wait: bool) -> list[tuple[Window, list[list[float]]]]:
        """The closed windows to read now, with their rows: all of them when `wait`, else all
        but the newest when reading late."""
        keep = 1 if self.late and not wait else 0
        out = []
        while len(self.closed) > keep:
            window = self.closed.popleft()
            if window.arrived is not None:
                window.arrived.synchronize()
            out.append((window, window.rows.tolist()))
        return out
