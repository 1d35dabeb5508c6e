"""Reading text the way users hand it to us: plain or gzip, any line ending, not always UTF-8."""

from __future__ import annotations

import gzip
import itertools
import queue
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

from nmt_cli.errors import NmtError

T = TypeVar("T")
# How long input may pause before what has arrived is handed on: short for a person at a pipe,
# long beside the microseconds between the lines of a file.
PAUSE = 0.02  # seconds
# Bytes of one line kept at most; the rest of a longer line is read and dropped, so that a line
# without end cannot fill the memory. Far past what any model reads (16,384 positions).
MAX_LINE = 1 << 20
# Bytes of input gathered into one chunk, and read ahead of it, at most (a chunk of 10,000 lines
# of MAX_LINE bytes each would be 10 GB).
MAX_CHUNK = 16 << 20


@dataclass
class Damage:
    """What reading had to repair: lines with bytes that are not UTF-8 (replaced by U+FFFD)."""

    not_utf8: int = 0
    first_bad_line: int = 0


def decode_line(raw: bytes, lineno: int, damage: Damage) -> str:
    """One line of bytes to text; the newline, a CR before it and NULs are dropped."""
    raw = raw.rstrip(b"\n").rstrip(b"\r").replace(b"\0", b"")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        damage.not_utf8 += 1
        damage.first_bad_line = damage.first_bad_line or lineno
        return raw.decode("utf-8", errors="replace")


def open_binary(path: Path) -> BinaryIO:
    f = open(path, "rb")
    if f.peek(2)[:2] == b"\x1f\x8b":  # gzip, whatever the file is called
        return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]
    return f


def read_lines(path: Path, damage: Damage | None = None) -> Iterator[str]:
    """Stream the lines of a plain or gzip text file."""
    path = Path(path)
    damage = damage if damage is not None else Damage()
    if not path.is_file():
        raise NmtError(f"{path} not found" if not path.exists() else f"{path} is not a file")
    lineno = 0
    try:
        with open_binary(path) as f:
            for lineno, raw in enumerate(lines_of(f), 1):
                yield decode_line(raw, lineno, damage)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise NmtError(f"{path} is truncated or corrupt after line {lineno} ({e}); fetch it again") from None


def lines_of(f: BinaryIO) -> Iterator[bytes]:
    """The lines of `f` as bytes, each at most MAX_LINE bytes (cut at a character's start), the
    rest of a longer line dropped unread into memory."""
    while raw := f.readline(MAX_LINE):
        if len(raw) == MAX_LINE and not raw.endswith(b"\n"):
            while (rest := f.readline(MAX_LINE)) and not rest.endswith(b"\n"):
                pass
            cut = len(raw)
            while cut and raw[cut - 1] & 0xC0 == 0x80:  # UTF-8 continuation bytes of a cut character
                cut -= 1
            raw = raw[: cut - 1 if cut and raw[cut - 1] >= 0xC0 else cut] + (b"\n" if rest else b"")
        yield raw


def chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """`items` in lists of `size` (the last one shorter), read lazily."""
    items = iter(items)
    while chunk := list(itertools.islice(items, size)):
        yield chunk


_END = object()


def arrivals(source: BinaryIO, most: int) -> Iterator[list[bytes]]:
    """The lines of `source` in lists of at most `most` lines and about MAX_CHUNK bytes: each
    list is what arrived before input paused for PAUSE seconds (or that much). A thread reads
    ahead, at most `most` lines and MAX_CHUNK bytes."""
    lines: queue.Queue = queue.Queue(maxsize=most)
    ahead, room = [0], threading.Condition()  # bytes read ahead, and a wait for room

    def read() -> None:
        try:
            for raw in lines_of(source):
                with room:
                    room.wait_for(lambda: ahead[0] < MAX_CHUNK)
                    ahead[0] += len(raw)
                lines.put(raw)
            lines.put(_END)
        except BaseException as e:  # noqa: B036 - handed to the reading side, raised there
            lines.put(e)

    def taken(item):
        if isinstance(item, bytes):
            with room:
                ahead[0] -= len(item)
                room.notify()
        return item

    threading.Thread(target=read, daemon=True, name="nmt-read").start()
    done = False
    while not done:
        got = [taken(lines.get())]  # wait as long as it takes for the first line
        size = len(got[0]) if isinstance(got[0], bytes) else 0
        while len(got) < most and size < MAX_CHUNK:
            try:
                got.append(taken(lines.get(timeout=PAUSE)))
            except queue.Empty:
                break
            if got[-1] is _END or isinstance(got[-1], BaseException):
                break
            size += len(got[-1])
        if got[-1] is _END or isinstance(got[-1], BaseException):
            last = got.pop()
            if isinstance(last, BaseException):
                raise last
            done = True
        if got:
            yield got


# -- the input of a translation, and the files aligned with it ----------------------------------


@dataclass
class Counts:
    """What a translation's input held: its lines, those cut to what the model reads, and the
    damage reading repaired."""

    lines: int = 0
    truncated: int = 0
    damage: Damage = field(default_factory=Damage)


@dataclass
class Request:
    """Lines to translate: the number (from 0) of the first, and the lines of the files aligned
    with the input, where given (constraints split into their phrases)."""

    first: int
    lines: list[str]
    prefixes: list[str] | None = None
    constraints: list[list[str]] | None = None


def requests(
    source: BinaryIO,
    chunk: int,
    counts: Counts,
    prefixes: BinaryIO | None = None,
    constraints: BinaryIO | None = None,
) -> Iterator[Request]:
    """The input in chunks of at most `chunk` lines, each as soon as input pauses, with the lines
    of the files aligned with it; `counts` counts them (each once its request is dealt with) and
    the damage of their bytes. An aligned file of another length is an error."""
    for raw in arrivals(source, chunk):
        first = counts.lines
        lines = [decode_line(x, first + i + 1, counts.damage) for i, x in enumerate(raw)]
        starts = _aligned(prefixes, "--prefix", first, len(raw), counts.damage)
        wanted = _aligned(constraints, "--constraints", first, len(raw), counts.damage)
        phrases = None if wanted is None else [[p for p in line.split("\t") if p.strip()] for line in wanted]
        yield Request(first, lines, starts, phrases)
        counts.lines += len(raw)
    for file, name in ((prefixes, "--prefix"), (constraints, "--constraints")):
        if file is not None and next(iter(file), None) is not None:
            raise NmtError(
                f"{name} has more lines than the input's {counts.lines}: give one line per input line"
            )


def _aligned(file: BinaryIO | None, name: str, first: int, n: int, damage: Damage) -> list[str] | None:
    """The next `n` lines of a file aligned with the input (None without one)."""
    if file is None:
        return None
    got = [decode_line(raw, first + i + 1, damage) for i, raw in enumerate(itertools.islice(file, n))]
    if len(got) < n:
        raise NmtError(
            f"{name} ends at line {first + len(got)}, before the input: give one line per input line"
        )
    return got
