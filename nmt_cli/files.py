"""Files written so that a crash never leaves half of one: atomic writes (a temporary file,
fsynced, then renamed), sha256 and sizes, and the time stamp records carry; files that another
may have planted (a model's members, a run's logs) opened only if they are regular files, never
through a symbolic link."""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import io
import json
import os
import stat
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from nmt_cli.errors import NmtError


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
    with open(path, "rb") as f:
        return sha256_of(f, each)


def sha256_of(f: IO[bytes], each: Callable[[bytes], None] | None = None) -> str:
    """The sha256 of what is left to read of `f`, in 1 MiB pieces, each also handed to `each`."""
    digest = hashlib.sha256()
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


def open_regular(path: Path, flags: int, mode: int = 0o644, follow: bool = False) -> int:
    """A descriptor of `path` opened with `flags`, if it is a regular file (a link to /dev/zero
    or a FIFO would be read or written for ever), reached without a symbolic link unless
    `follow` (reading: a link to a regular file is read as that file)."""
    try:  # O_NONBLOCK: opening a FIFO must not wait for its writer
        fd = os.open(path, flags | (0 if follow else os.O_NOFOLLOW) | os.O_NONBLOCK, mode)
    except OSError as e:
        if os.path.islink(path):
            raise NmtError(
                f"{path} is a symbolic link: nmt reads and writes only regular files here"
            ) from None
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
            raise NmtError(f"{path} is not a regular file") from None
        raise NmtError(f"{path} cannot be opened ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NmtError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: Path, limit: int, follow: bool = True) -> bytes:
    """The bytes of the regular file `path` (or of the one a link leads to, if `follow`),
    refused past `limit` bytes."""
    with os.fdopen(open_regular(path, os.O_RDONLY, follow=follow), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise NmtError(f"{path} is larger than {limit} bytes: it is not what nmt wrote")
    return data


def read_json(path: Path, limit: int = 16 << 20, kind: type = dict):
    """The JSON of the regular file `path` (at most `limit` bytes), which must be a `kind`; one
    error line naming the file otherwise."""
    try:
        data = json.loads(read_regular(path, limit).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise NmtError(f"{path} is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, kind):
        raise NmtError(f"{path} holds a JSON {type(data).__name__}, not what nmt wrote there")
    return data


def copy_regular(src: Path, dest: Path, limit: int, follow: bool = True) -> None:
    """Copy the regular file `src` to `dest`, from the descriptor that was checked (a link to a
    device or a FIFO is refused, not read for ever; any link unless `follow`), refused past
    `limit` bytes; `dest` no more readable than `src` is."""
    with os.fdopen(open_regular(src, os.O_RDONLY, follow=follow), "rb") as f, open(dest, "wb") as out:
        os.fchmod(out.fileno(), stat.S_IMODE(os.fstat(f.fileno()).st_mode) & new_file_mode())
        copied = 0
        while chunk := f.read(min(1 << 20, limit + 1 - copied)):
            copied += len(chunk)
            if copied > limit:
                raise NmtError(f"{src} is larger than {limit} bytes: it is not what nmt wrote")
            out.write(chunk)


def check_regular(path: Path, limit: int) -> None:
    """Refuse `path` unless it is a regular file of at most `limit` bytes, not a link."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size > limit:
            raise NmtError(f"{path} is larger than {limit} bytes: it is not what nmt wrote")
    finally:
        os.close(fd)


def check_torch_zip(f: IO[bytes], where: Path, most: int | None = None) -> None:
    """Refuse a PyTorch file that torch.load would inflate, from its zip directory alone: the
    legacy format (before zip) declares each storage's size ahead of its bytes, and a deflated
    member of a few MB can declare gigabytes, where torch.save stores every member as it is. So:
    a zip, every member stored and within the file, and (`most`) no more bytes in all than the
    model it claims to be needs. `f` is left at its start."""
    size = os.fstat(f.fileno()).st_size
    try:
        with zipfile.ZipFile(f) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as e:
        raise NmtError(
            f"{where} is not a PyTorch zip file (torch.save's format since torch 1.6; {type(e).__name__})"
        ) from None
    total = 0
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED:
            raise NmtError(
                f"{where} holds a compressed member ({m.filename!r:.60}), which torch.save never writes: "
                "refusing to inflate it"
            )
        if m.file_size != m.compress_size or m.header_offset + m.file_size > size:
            raise NmtError(f"{where} declares a member ({m.filename!r:.60}) larger than the file holds")
        total += m.file_size
    if most is not None and total > most:
        raise NmtError(
            f"{where} holds {total / 2**20:.1f} MiB of data, more than the {most / 2**20:.1f} MiB "
            "the model it declares needs: it is damaged or was changed"
        )
    f.seek(0)


def open_appending(path: Path) -> io.TextIOWrapper:
    """`path` opened to append text (created if need be), only if it is a regular file."""
    return os.fdopen(
        open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, new_file_mode()), "a", encoding="utf-8"
    )
