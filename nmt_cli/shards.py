"""The binarized token format, written and read here only.

A split of one language is two files: `{prefix}.bin`, every sentence's token ids back to back
(uint16 when the vocabulary fits, else uint32), and `{prefix}.idx`, a 16-byte header (magic and
dtype) followed by n+1 int64 offsets into the token array. Both are memory-mapped for reading.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_open

MAGIC = b"NMTIDX01"
HEADER = 16


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ShardWriter:
    """Append sentences (sequences of ids) to a new shard; both files appear atomically at close."""

    def __init__(self, prefix: Path, vocab_size: int):
        self.prefix = Path(prefix)
        self.dtype = dtype_for(vocab_size)
        self._stack = contextlib.ExitStack()
        self._bin = self._stack.enter_context(atomic_open(Path(f"{prefix}.bin"), "wb"))
        self._idx = self._stack.enter_context(atomic_open(Path(f"{prefix}.idx"), "wb"))
        self._idx.write(MAGIC + self.dtype.name.encode().ljust(HEADER - len(MAGIC), b"\0"))
        self._idx.write(np.zeros(1, dtype=np.int64).tobytes())
        self.sentences = 0
        self.tokens = 0

    def add(self, sentences: Sequence[Sequence[int]]) -> None:
        lengths = np.fromiter((len(s) for s in sentences), dtype=np.int64, count=len(sentences))
        flat = np.fromiter((t for s in sentences for t in s), dtype=self.dtype, count=int(lengths.sum()))
        self._bin.write(flat.tobytes())
        self._idx.write((self.tokens + np.cumsum(lengths)).tobytes())
        self.sentences += len(sentences)
        self.tokens += int(lengths.sum())

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)


class Shard:
    """Read-only, memory-mapped sentences of one split and language."""

    def __init__(self, prefix: Path):
        prefix = Path(prefix)
        idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for p in (idx_path, bin_path):
            if not p.exists():
                raise NmtError(f"{p} not found: run `nmt bpe` first")
        with open(idx_path, "rb") as f:
            header = f.read(HEADER)
        if header[: len(MAGIC)] != MAGIC:
            raise NmtError(f"{idx_path} is not an nmt token index (bad header); rerun `nmt bpe`")
        self.dtype = np.dtype(header[len(MAGIC) :].rstrip(b"\0").decode())
        self.offsets: np.ndarray = np.memmap(idx_path, dtype=np.int64, mode="r", offset=HEADER)
        size = bin_path.stat().st_size
        if size != int(self.offsets[-1]) * self.dtype.itemsize:
            raise NmtError(
                f"{bin_path} has {size} bytes but its index expects "
                f"{int(self.offsets[-1]) * self.dtype.itemsize}; rerun `nmt bpe`"
            )
        # np.memmap refuses empty files; an empty split is an empty array.
        self.tokens: np.ndarray = (
            np.memmap(bin_path, dtype=self.dtype, mode="r") if size else np.zeros(0, dtype=self.dtype)
        )

    @classmethod
    def in_memory(cls, sentences: Sequence[Sequence[int]], vocab_size: int) -> Shard:
        """Sentences held in memory, read like a shard on disk (BPE-dropout's per-epoch encoding)."""
        shard = cls.__new__(cls)
        shard.dtype = dtype_for(vocab_size)
        lengths = np.fromiter((len(s) for s in sentences), dtype=np.int64, count=len(sentences))
        shard.offsets = np.concatenate([[0], np.cumsum(lengths)])
        shard.tokens = np.fromiter(
            (t for s in sentences for t in s), dtype=shard.dtype, count=int(shard.offsets[-1])
        )
        return shard

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __iter__(self) -> Iterable[np.ndarray]:
        return (self[i] for i in range(len(self)))
