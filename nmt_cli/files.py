"""Files written so that a crash never leaves half of one: atomic writes (a temporary file,
fsynced, then renamed), sha256 and sizes, and the time stamp records carry."""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any


@functools.cache
def new_file_mode() -> int:
    """The permissions of any new file under the process's umask: mkstemp (and safetensors)
    create files 0600, and our outputs should be like any other file the user makes. Linux says
    the umask in /proc; elsewhere reading it means setting it."""
    mask = None
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path("/proc/self/status").read_text().splitlines()
        mask = int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    if mask is None:
        mask = os.umask(0)
        os.umask(mask)
    return 0o666 & ~mask


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Write to a temporary file beside `path`, fsync it, then rename it over `path`.

    If the block raises, `path` keeps its old content and the temporary file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    binary = "b" in mode
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(
            fd, mode, encoding=None if binary else encoding, newline=None if binary else "\n"
        ) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a crash right after os.replace keeps the new name)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def sha256_file(path: Path, each: Callable[[bytes], None] | None = None) -> str:
    """The sha256 of a file, read in 1 MiB pieces, each also handed to `each`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            if each is not None:
                each(chunk)
    return digest.hexdigest()


def file_stats(path: Path) -> dict:
    """Size, sha256 and (for text) line count of a file, in one streaming pass."""
    counts = {"bytes": 0, "lines": 0}

    def count(chunk: bytes) -> None:
        counts["bytes"] += len(chunk)
        counts["lines"] += chunk.count(b"\n")

    digest = sha256_file(path, count)
    return {"bytes": counts["bytes"], "sha256": digest, "lines": counts["lines"]}
