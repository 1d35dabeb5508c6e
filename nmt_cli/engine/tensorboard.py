"""`nmt train --tensorboard`: the figures of metrics.jsonl as TensorBoard event files too.

TensorBoard's own writer (torch.utils.tensorboard over the `tensorboard` package, an optional
extra) makes the files; metrics.jsonl stays the record that nmt itself reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nmt_cli.engine.state import Reporter, State
from nmt_cli.errors import NmtError

# Not figures: what a record is and where it belongs.
NOT_SCALARS = ("kind", "step")


class TensorBoard:
    """A reporter that passes everything on to `inner` and writes each metrics record as
    scalars `{kind}/{name}` at its step, in `log_dir`."""

    def __init__(self, inner: Reporter, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise NmtError(
                "--tensorboard needs the tensorboard package: pip install 'nmt-cli[tensorboard]'"
            ) from None
        self._writer_class, self.inner, self.log_dir = SummaryWriter, inner, Path(log_dir)
        self.writer: Any = None  # made at the first record, with that record's step

    def __enter__(self) -> TensorBoard:
        return self

    def __exit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.close()

    def progress(self, state: State, total_steps: int | None, metrics: dict) -> None:
        self.inner.progress(state, total_steps, metrics)

    def say(self, message: str) -> None:
        self.inner.say(message)

    def record(self, record: dict) -> None:
        self.inner.record(record)
        if self.writer is None:
            # A resumed run's first record comes after its checkpoint's step: TensorBoard
            # drops what an earlier process wrote from there on, as metrics.jsonl was cut there.
            self.writer = self._writer_class(str(self.log_dir), purge_step=record["step"], flush_secs=30)
        for name, value in record.items():
            if name not in NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{record['kind']}/{name}", value, record["step"])
        if record["kind"] != "train":
            self.writer.flush()
