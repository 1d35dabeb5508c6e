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
from nmt_cli.rundir import atomic_open

MAGIC = b"NMTIDX01"
HEADER = 16

# The special pieces, with the same ids in the sentencepiece model (bpe.py) and the model.
PAD, UNK, BOS, EOS = 0, 1, 2, 3


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
        self.offsets = np.memmap(idx_path, dtype=np.int64, mode="r", offset=HEADER)
        size = bin_path.stat().st_size
        if size != int(self.offsets[-1]) * self.dtype.itemsize:
            raise NmtError(
                f"{bin_path} has {size} bytes but its index expects "
                f"{int(self.offsets[-1]) * self.dtype.itemsize}; rerun `nmt bpe`"
            )
        # np.memmap refuses empty files; an empty split is an empty array.
        self.tokens = (
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


# -- token batching ------------------------------------------------------------------------------


def make_batches(
    src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_tokens: int, seed: int, epoch: int
) -> list[np.ndarray]:
    """Sentence indices grouped into batches of similar lengths, at most `max_tokens` padded
    tokens on either side, in an order shuffled from (seed, epoch).

    Lengths include the EOS (or BOS) each side gets. Sorting by the longer side, then source,
    then target length (ties broken at random) keeps padding small on both sides, smaller than
    sorting by source then target.
    """
    rng = np.random.default_rng([seed, epoch])
    n = len(src_lengths)
    order = np.lexsort((rng.random(n), tgt_lengths, src_lengths, np.maximum(src_lengths, tgt_lengths)))
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    src_l, tgt_l = src_lengths[order], tgt_lengths[order]
    for i in range(n):
        longest_i = max(longest, int(src_l[i]), int(tgt_l[i]))
        if i > start and longest_i * (i - start + 1) > max_tokens:
            batches.append(order[start:i])
            start, longest_i = i, max(int(src_l[i]), int(tgt_l[i]))
        longest = longest_i
    if start < n:
        batches.append(order[start:n])
    rng.shuffle(batches)  # type: ignore[arg-type]
    return batches


def padding_share(batches: list[np.ndarray], src_lengths: np.ndarray, tgt_lengths: np.ndarray) -> float:
    """The share of batch positions (both sides) that are padding."""
    real = padded = 0
    for b in batches:
        s, t = src_lengths[b], tgt_lengths[b]
        real += int(s.sum() + t.sum())
        padded += len(b) * int(s.max() + t.max())
    return 1 - real / padded if padded else 0.0


def pad_sources(sentences: Sequence[Sequence[int]]) -> np.ndarray:
    """(B, S): each sentence's ids and its EOS, then PAD."""
    source = np.full((len(sentences), max(len(x) for x in sentences) + 1), PAD, dtype=np.int64)
    for row, x in enumerate(sentences):
        source[row, : len(x)] = x
        source[row, len(x)] = EOS
    return source


def collate(src: Shard, tgt: Shard, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Padded (B, S) source ids + EOS, (B, T) decoder input BOS + ids, (B, T) output ids + EOS."""
    ys = [tgt[int(i)] for i in indices]
    t_len = max(len(y) for y in ys) + 1
    tgt_in = np.full((len(ys), t_len), PAD, dtype=np.int64)
    tgt_out = np.full((len(ys), t_len), PAD, dtype=np.int64)
    for row, y in enumerate(ys):
        tgt_in[row, 0] = BOS
        tgt_in[row, 1 : len(y) + 1] = y
        tgt_out[row, : len(y)] = y
        tgt_out[row, len(y)] = EOS
    return pad_sources([src[int(i)] for i in indices]), tgt_in, tgt_out
