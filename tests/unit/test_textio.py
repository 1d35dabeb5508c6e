"""Reading lines: one line without end cannot fill the memory."""

import io

from nmt_cli import textio


class Endless(io.RawIOBase):
    """`size` bytes of "x" made as they are read, then "\\nnext\\n"."""

    def __init__(self, size: int):
        self.left, self.tail = size, b"\nnext\n"

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        if n:
            buffer[:n] = b"x" * n
            self.left -= n
            return n
        n = min(len(buffer), len(self.tail))
        buffer[:n], self.tail = self.tail[:n], self.tail[n:]
        return n


def test_a_line_longer_than_the_limit_is_cut_and_the_next_one_read():
    lines = list(textio.lines_of(io.BufferedReader(Endless(64 * textio.MAX_LINE))))
    assert [len(line) for line in lines] == [textio.MAX_LINE + 1, 5]
    assert lines[0] == b"x" * textio.MAX_LINE + b"\n" and lines[1] == b"next\n"


def test_a_cut_line_ends_at_a_whole_character(monkeypatch):
    monkeypatch.setattr(textio, "MAX_LINE", 10)
    text = ("a" + "é" * 20 + "\nz").encode()
    assert list(textio.lines_of(io.BytesIO(text))) == [("a" + "é" * 4 + "\n").encode(), b"z"]
    exact = b"y" * 10 + b"\n"  # a line of exactly the limit is whole
    assert list(textio.lines_of(io.BytesIO(exact + b"w"))) == [exact, b"w"]


def test_a_chunk_of_input_and_what_is_read_ahead_of_it_are_bounded_in_bytes(monkeypatch):
    """10,000 lines a chunk of lines up to 1 MiB each would hold 10 GB: a chunk ends past
    MAX_CHUNK bytes, and the reading thread stays that far ahead at most."""
    monkeypatch.setattr(textio, "MAX_CHUNK", 64 << 10)
    line = b"w" * (16 << 10) + b"\n"
    chunks = list(textio.arrivals(io.BytesIO(line * 40), 10_000))
    assert sum(chunks, []) == [line] * 40
    assert all(sum(map(len, c)) < textio.MAX_CHUNK + len(line) for c in chunks), [len(c) for c in chunks]
    assert len(chunks) >= 40 * len(line) // (textio.MAX_CHUNK + len(line))
