"""Talk to the user on stderr: messages, warnings and progress bars (stdout carries data only)."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

# rich is imported where something is shown: a filter on a pipe, whose stderr is no terminal,
# starts without it
_shown: Console | None = None
_log: io.TextIOWrapper | None = None  # the run directory's log.txt while a command holds the run
VERBOSE = bool(os.environ.get("NMT_VERBOSE"))  # --verbose


def log_to(path: Path | None, header: str = "") -> None:
    """Copy what is said into `path` (appended, one timestamped line each), or stop (None)."""
    global _log
    if _log is not None:
        _log.close()
        _log = None
    if path is not None:
        from nmt_cli.files import open_appending

        log = open_appending(path)
        log.reconfigure(line_buffering=True)  # a killed command keeps its lines
        _log = log
        note(f"=== {header}")


def note(message: str) -> None:
    """Into the run's log only (the terminal shows it in a live display instead)."""
    if _log is not None:
        import datetime

        stamp = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
        for line in str(message).splitlines() or [""]:
            _log.write(f"{stamp} {line}\n")


def printable(text: str) -> str:
    """`text` with each control character written as its escape (\\x1b): a file name or value
    that holds an escape sequence must not recolour, move or retitle the user's terminal.
    Line breaks stay."""
    return "".join(c if c.isprintable() or c == "\n" else ascii(c)[1:-1] for c in str(text))


def console() -> Console:
    """The console on stderr (logs keep whole lines)."""
    global _shown
    if _shown is None:
        from rich.console import Console

        _shown = Console(stderr=True, highlight=False, soft_wrap=True)
    return _shown


def say(message: str) -> None:
    message = printable(message)
    console().print(message, markup=False)
    note(message)


def verbose(message: str) -> None:
    """Said on the terminal under --verbose (what was chosen and why), into the run's log always."""
    if VERBOSE:
        say(message)
    else:
        note(message)


def done(message: str, next_command: str) -> None:
    """What a step made, and the command a user would run next."""
    say(f"{message}; next: {next_command}")


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    console().print(t)
    for row in [[title], header, *rows]:
        note("\t".join(row))


def warn(message: str) -> None:
    console().print(f"warning: {message}", style="yellow", markup=False)
    note(f"warning: {message}")


class _Unshown:
    """The progress display where stderr is no terminal: a live bar would only add noise to logs."""

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def advance(self, *args: Any, **kwargs: Any) -> None:
        pass

    def update(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextmanager
def progress(kind: str = "items") -> Iterator[Any]:
    """A rich progress display on stderr; `kind="bytes"` shows sizes and transfer speed."""
    if not sys.stderr.isatty():
        yield _Unshown()
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    if kind == "bytes":
        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        ]
    else:
        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        ]
    with Progress(*columns, console=console(), transient=False) as bar:
        yield bar


class TrainDisplay:
    """The trainer's reporter: a live line of step, loss, ppl, lr, tokens/s and ETA on a
    terminal; without one, a plain line every 30 seconds and at each validation."""

    def __init__(self, every: float = 30.0):
        import time

        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._time = time.monotonic
        self._last = -every
        self.every = every
        self.live = sys.stderr.isatty()
        self._bar = Progress(
            TextColumn("step {task.completed:,.0f}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=console(),
            disable=not self.live,
        )
        self._task: Any = None

    def __enter__(self) -> TrainDisplay:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def progress(self, state, total_steps, metrics: dict) -> None:
        if "valid_nll" in metrics:
            say(
                f"step {state.step}: valid nll {metrics['valid_nll']:.3f}, "
                f"ppl {metrics['valid_ppl']:.2f}"
                + (f", BLEU {metrics['valid_bleu']:.2f}" if "valid_bleu" in metrics else "")
                + (f", COMET {metrics['valid_comet']:.4f}" if "valid_comet" in metrics else "")
            )
            return
        info = (
            f"loss {metrics['loss']:.3f} ppl {metrics['ppl']:.1f} lr {metrics['lr']:.2e} "
            f"{metrics['tokens_per_s']:,.0f} tok/s"
        )
        if self._task is None:
            self._task = self._bar.add_task("train", total=total_steps, info=info)
        self._bar.update(self._task, completed=state.step, info=info)
        if self._time() - self._last >= self.every:
            self._last = self._time()
            line = (
                f"step {state.step}{f'/{total_steps}' if total_steps else ''} epoch {state.epoch + 1}: {info}"
            )
            say(line) if not self.live else note(line)

    def say(self, message: str) -> None:
        say(message)

    def record(self, record: dict) -> None:
        pass  # progress() shows what a person reads; metrics.jsonl keeps the rest
