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
