"""Data on its way to the model: a split's sentences, their batches (training batches of similar
lengths; padded source arrays for decoding too), and each batch as tensors on the device.

Everything the loss needs to know about a batch's shape (which target positions are real, how
many) is worked out here on the host, so that training never asks the GPU for it.

Training batches are padded to lengths on a grid, and the batches of one update have one shape
on every rank: kernels that choose a plan per shape (cuDNN's, oneDNN's, a compiled graph's) meet
a bounded set of shapes in a run instead of a new one every few batches, and no rank waits for
another's longer batch. An update is one batch of similar lengths shared out in equal parts, one
per rank and accumulated batch, so N ranks train on what one process does with --update-freq N.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from queue import Full, Queue
from typing import Any

import numpy as np
import torch

from nmt_cli.engine.device import on
from nmt_cli.engine.distributed import Group
from nmt_cli.shards import Shard
from nmt_cli.vocab import BOS, EOS, PAD

# A sentence's token ids: a list, or a shard's array of them.
Ids = Sequence[int] | np.ndarray


@dataclass
class Split:
    src: Shard
    tgt: Shard
    src_lengths: np.ndarray  # with the EOS
    tgt_lengths: np.ndarray  # with the BOS/EOS
    keep: np.ndarray  # sentences short enough for the model and the batch size
    limit: int  # the longest side kept, in tokens
    # Corpora of different sampling weights: (first sentence, end, weight), in order.
    weights: tuple[tuple[int, int, float], ...] = ()

    @classmethod
    def of(cls, s: Shard, t: Shard, limit: int, corpora: Sequence[dict] = ()) -> Split:
        """The pairs of `s` and `t`, those with a side over `limit` tokens left out."""
        ends = np.cumsum([c["pairs"] for c in corpora], dtype=np.int64)
        weights = tuple((int(e - c["pairs"]), int(e), float(c["weight"])) for e, c in zip(ends, corpora))
        return cls._made(s, t, limit, () if all(w == 1.0 for *_, w in weights) else weights)

    @staticmethod
    def tempered(corpora: Sequence[dict], temperature: float) -> tuple[dict, ...]:
        """`corpora` (pairs, weight) reweighted so that an epoch takes corpus i in proportion to
        m_i^(1/T), m_i being what it takes now (pairs x weight), the epoch's size unchanged: T 1
        changes nothing, a higher T evens the corpora out (multilingual NMT's sampling, Arivazhagan
        et al. 2019)."""
        if temperature == 1.0 or len(corpora) < 2:
            return tuple(corpora)
        taken = [c["pairs"] * c["weight"] for c in corpora]
        shares = [m ** (1.0 / temperature) for m in taken]
        total = sum(taken)
        return tuple(
            {**c, "weight": share / sum(shares) * total / c["pairs"]} if c["pairs"] else dict(c)
            for c, share in zip(corpora, shares)
        )

    @classmethod
    def _made(cls, s: Shard, t: Shard, limit: int, weights: tuple) -> Split:
        sl, tl = s.lengths + 1, t.lengths + 1
        keep = np.flatnonzero((sl <= limit) & (tl <= limit))
        return cls(s, t, sl, tl, keep, limit, weights)

    def reencoded(self, s: Shard, t: Shard) -> Split:
        """The same pairs encoded otherwise (BPE-dropout), with the same limit and weights."""
        return self._made(s, t, self.limit, self.weights)

    def chosen(self, seed: int, epoch: int) -> np.ndarray:
        """The sentences an epoch trains on: each kept one once, or as its corpus's weight says:
        weight 2.5 takes every pair twice and a different half of them a third time each epoch."""
        if not self.weights:
            return self.keep
        rng = np.random.default_rng([seed, epoch, 1])  # not make_batches's stream
        parts = []
        for start, end, weight in self.weights:
            mine = self.keep[(self.keep >= start) & (self.keep < end)]
            whole, part = divmod(weight, 1.0)
            parts += [mine] * int(whole)
            parts.append(np.sort(rng.choice(mine, size=round(part * len(mine)), replace=False)))
        return np.concatenate(parts)

    def batches(
        self, max_tokens: int, seed: int, epoch: int, parts: int = 1, multiple: int = 1, fixed: bool = False
    ) -> list[Planned]:
        """Every batch of the epoch, in its shuffled order, padded to grid lengths (multiples of
        `multiple` too), in runs of `parts` batches of one shape: the sentences of one batch of
        similar lengths, `parts` times as large, shared out (an update's batches, over its
        ranks and accumulations). `fixed`: each batch padded to one shape per length, L (the
        longer side) on both sides and max_tokens // L rows, so that the batches of a run
        come in as few shapes as there are lengths."""
        chosen = self.chosen(seed, epoch)
        src, tgt = (
            on_grid(lengths[chosen], self.limit, multiple) for lengths in (self.src_lengths, self.tgt_lengths)
        )
        planned = []
        for update in make_batches(src, tgt, max_tokens, seed, epoch, parts):
            shape = (-(-len(update) // parts), int(src[update].max()), int(tgt[update].max()))
            if fixed:
                length = max(shape[1:])
                shape = (max_tokens // length, length, length)
            planned += [Planned(chosen[part], shape) for part in np.array_split(update, parts)]
        return planned


class Epochs:
    """The training data, epoch by epoch: the pairs of an epoch (always `fixed`, or with
    BPE-dropout their encoding for that epoch, from `resample(epoch)`) and this rank's batches
    of at most `max_tokens` tokens, `update_freq` of them an update, shuffled from `seed`, their
    lengths multiples of `multiple`, of one shape per length if `shapes_fixed` (Split.batches).

    With `ahead` (on a GPU, which would otherwise wait for them), the next epoch's pairs and
    batches are made by a thread while this one trains; they are the same either way."""

    def __init__(
        self,
        fixed: Split,
        max_tokens: int,
        update_freq: int,
        seed: int,
        group: Group,
        resample: Callable[[int], tuple[Shard, Shard]] | None = None,
        ahead: bool = False,
        multiple: int = 1,
        shapes_fixed: bool = False,
    ):
        self.fixed, self.max_tokens, self.update_freq, self.seed = fixed, max_tokens, update_freq, seed
        self.group, self.resample, self.ahead, self.multiple = group, resample, ahead, multiple
        self.shapes_fixed = shapes_fixed
        self._current: tuple[int, tuple[Split, list[Planned]]] | None = None  # made once
        self._next: tuple[int, _Later] | None = None

    def data(self, epoch: int) -> Split:
        return self._epoch(epoch)[0]

    def batches(self, epoch: int) -> list[Planned]:
        """This rank's batches of `epoch`, each run of `update_freq` an update: every
        world-th one, as many on every rank, the ranks' batches of one update of one shape."""
        return self._epoch(epoch)[1]

    def _epoch(self, epoch: int) -> tuple[Split, list[Planned]]:
        if self._current is None or self._current[0] != epoch:
            made = self._next[1].get() if self._next is not None and self._next[0] == epoch else None
            self._current = (epoch, made or self._make(epoch))
            self._next = (epoch + 1, _Later(self._make, epoch + 1)) if self.ahead else None
        return self._current[1]

    def _make(self, epoch: int) -> tuple[Split, list[Planned]]:
        data = self.fixed if self.resample is None else self.fixed.reencoded(*self.resample(epoch))
        world = self.group.world
        parts = world * self.update_freq
        planned = data.batches(self.max_tokens, self.seed, epoch, parts, self.multiple, self.shapes_fixed)
        return data, planned[self.group.rank :: world]


class _Later:
    """fn(*args) computed by a daemon thread (a run that stops does not wait for it); get()
    waits for the result, or raises the error it met."""

    def __init__(self, fn: Callable, *args):
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn, args), name="nmt-next-epoch", daemon=True).start()

    def _run(self, fn: Callable, args: tuple) -> None:
        try:
            self._result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised again in get()
            self._error = e
        finally:
            self._done.set()

    def get(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


@dataclass
class Batch:
    src: torch.Tensor  # (B, S) source ids + EOS, padded
    tgt_in: torch.Tensor  # (B, T) BOS + target ids, padded
    positions: torch.Tensor | None  # (N,) where the real target tokens are in the flat (B*T)
    targets: torch.Tensor  # (N,) those tokens; with no positions, (B*T,) every position's, PAD too
    tokens: int  # real target tokens


def to_device(
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray], device: torch.device, every_position: bool = False
) -> Batch:
    """A collated (src, tgt_in, tgt_out) as a Batch on `device`: the real target tokens and
    where they are, or (`every_position`, for batches of fixed shapes) every position's target,
    PAD too. On a GPU the arrays go through pinned memory, so the copies are queued behind the
    running work instead of waiting for it."""
    src, tgt_in, tgt_out = arrays
    flat = tgt_out.reshape(-1)
    positions = np.flatnonzero(flat != PAD)
    host = [src, tgt_in, flat] if every_position else [src, tgt_in, flat[positions], positions]
    tensors = [torch.from_numpy(a) for a in host]
    if device.type == "cuda":
        tensors = [t.pin_memory() for t in tensors]
    src_t, tgt_in_t, targets_t, *where = (t.to(device, non_blocking=True) for t in tensors)
    return Batch(src_t, tgt_in_t, where[0] if where else None, targets_t, len(positions))


def on_device(
    split: Split,
    groups: Iterable[list[Planned]],
    device: torch.device,
    ahead: int = 0,
    every_position: bool = False,
) -> Iterator[list[Batch]]:
    """Each group of batches (the batches of one update) collated and copied to `device`
    (to_device, `every_position` as there).

    Lazily: the next group is collated while the device still runs the updates queued before
    it. With `ahead`, a thread of its own collates up to that many groups in advance, so that
    the training thread only queues work (on a GPU, where the host is the bottleneck of a
    small model's step)."""
    made = (
        [to_device(collate(split.src, split.tgt, planned), device, every_position) for planned in group]
        for group in groups
    )
    if not ahead:
        yield from made
        return
    yield from _in_a_thread(made, ahead, device)


def _in_a_thread(items: Iterator, ahead: int, device: torch.device) -> Iterator:
    """`items`, made by a thread of their own up to `ahead` in advance; an error there is raised
    here, and the thread stops when the consumer does."""
    queue: Queue = Queue(maxsize=ahead)
    stop = threading.Event()
    done = object()

    def put(entry: tuple) -> bool:
        while not stop.is_set():
            try:
                queue.put(entry, timeout=0.1)
                return True
            except Full:
                pass
        return False

    def make() -> None:
        try:
            with on(device):  # a new thread starts on GPU 0: this rank's GPU, not a context there
                for item in items:
                    if not put((item, None)):
                        return
            put((done, None))
        except BaseException as e:  # noqa: BLE001 - raised again in the consumer
            put((done, e))

    thread = threading.Thread(target=make, name="nmt-collate", daemon=True)
    thread.start()
    try:
        while True:
            item, error = queue.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        thread.join()


# -- batching: training batches of similar lengths, and padded arrays ---------------------------


@dataclass(frozen=True)
class Planned:
    """A training batch: its sentences, and the (rows, source length, target length) it is
    padded to. Rows past its sentences are filler that no target token comes from."""

    sentences: np.ndarray
    shape: tuple[int, int, int]


def grid_length(n: int) -> int:
    """`n` tokens rounded up to the length grid: steps of 2 up to 64 tokens, then sixteen
    steps per doubling (68, 72, ..., 128, 136, ...): past 32 tokens, at most a sixteenth longer."""
    step = max(2, 1 << max(0, (n - 1).bit_length() - 5))
    return -(-n // step) * step


def on_grid(lengths: np.ndarray, limit: int, multiple: int = 1) -> np.ndarray:
    """Each length on the grid, rounded up to a multiple of `multiple`, but never past `limit`
    (the model's positions)."""
    grid = np.array([grid_length(n) for n in range(int(lengths.max(initial=0)) + 1)], dtype=np.int64)
    grid = -(-grid // multiple) * multiple
    return np.minimum(grid[lengths], limit)


def make_batches(
    src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_tokens: int, seed: int, epoch: int, parts: int = 1
) -> list[np.ndarray]:
    """Sentence indices grouped into batches of similar lengths, at most `max_tokens` padded
    tokens on either side in each of `parts` equal shares, in an order shuffled from
    (seed, epoch).

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
        if i > start and longest_i * -(-(i - start + 1) // parts) > max_tokens:
            batches.append(order[start:i])
            start, longest_i = i, max(int(src_l[i]), int(tgt_l[i]))
        longest = longest_i
    if start < n:
        batches.append(order[start:n])
    rng.shuffle(batches)
    return batches


def padding_share(batches: list[Planned], src_lengths: np.ndarray, tgt_lengths: np.ndarray) -> float:
    """The share of batch positions (both sides) that are padding."""
    real = padded = 0
    for b in batches:
        real += int(src_lengths[b.sentences].sum() + tgt_lengths[b.sentences].sum())
        rows, s, t = b.shape
        padded += rows * (s + t)
    return 1 - real / padded if padded else 0.0


def pad_sources(sentences: Sequence[Ids], rows: int = 0, length: int = 0) -> np.ndarray:
    """(B, S): each sentence's ids and its EOS, then PAD; at least `rows` x `length`, the rows
    past the sentences an EOS alone (a row of PAD alone would leave attention nothing to see)."""
    shape = (max(rows, len(sentences)), max(length, max((len(x) for x in sentences), default=0) + 1))
    source = np.full(shape, PAD, dtype=np.int64)
    source[len(sentences) :, 0] = EOS
    for row, x in enumerate(sentences):
        source[row, : len(x)] = x
        source[row, len(x)] = EOS
    return source


def pad_targets(ys: Sequence[Ids], rows: int = 0, length: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(B, T) decoder input BOS + ids, and (B, T) output ids + EOS, PAD after them; at least
    `rows` x `length`, the rows past the sentences a BOS in and nothing to predict."""
    shape = (max(rows, len(ys)), max(length, max((len(y) for y in ys), default=0) + 1))
    tgt_in = np.full(shape, PAD, dtype=np.int64)
    tgt_out = np.full(shape, PAD, dtype=np.int64)
    tgt_in[:, 0] = BOS
    for row, y in enumerate(ys):
        tgt_in[row, 1 : len(y) + 1] = y
        tgt_out[row, : len(y)] = y
        tgt_out[row, len(y)] = EOS
    return tgt_in, tgt_out


def collate(src: Shard, tgt: Shard, planned: Planned) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Padded (B, S) source ids + EOS, (B, T) decoder input BOS + ids, (B, T) output ids + EOS,
    of the planned shape."""
    rows, s, t = planned.shape
    indices = planned.sentences
    tgt_in, tgt_out = pad_targets([tgt[int(i)] for i in indices], rows, t)
    return pad_sources([src[int(i)] for i in indices], rows, s), tgt_in, tgt_out
