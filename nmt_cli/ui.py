"""Talk to the user on stderr: messages, warnings and progress bars (stdout carries data only)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
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

console = Console(stderr=True, highlight=False)


def say(message: str) -> None:
    console.print(message, markup=False)


def warn(message: str) -> None:
    console.print(f"warning: {message}", style="yellow", markup=False)


@contextmanager
def progress(kind: str = "items") -> Iterator[Progress]:
    """A rich progress display on stderr; `kind="bytes"` shows sizes and transfer speed."""
    if kind == "bytes":
        columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn()]
    else:
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TaskProgressColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
    # Without a terminal (CI, pipes) a live bar only adds noise to logs.
    with Progress(*columns, console=console, transient=False,
                  disable=not sys.stderr.isatty()) as bar:
        yield bar
