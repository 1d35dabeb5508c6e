"""What incremental decoding keeps between steps (section 3.2.3's masked self-attention, one
new position at a time): the cached keys and values of the decoder. `DecoderCache` holds
exactly the positions and rows still needed (the CPU's); `FixedCache` keeps every tensor a step
touches at one shape and address for the whole search, so a GPU can replay the step as a CUDA
graph (graphed.py)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


class DecoderCache:
    """What incremental decoding keeps between steps, per decoder layer: the encoder-decoder K/V,
    computed once per sentence (B rows, shared by its beams), and the self-attention K/V of
    earlier positions (B*beam rows), so a step computes only its new position.

    Each self-attention K and V is a contiguous (rows, H, length + 1, K) tensor whose last
    position is free for the next step, laid out in one of two buffers preallocated for
    `max_len` positions. A reorder gathers the survivors from one buffer straight into the
    other, already shaped for the next step; when no reorder comes (greedy, nobody finished),
    the next append moves them likewise. On the CPU these copies, not arithmetic, are a large
    part of a step: gathering in place would copy twice, and attention over a strided slice of
    a max_len buffer makes scaled_dot_product_attention copy once more."""

    def __init__(self, memory_kv: list[tuple[Tensor, Tensor]], src_mask: Tensor, beam: int, max_len: int):
        k0 = memory_kv[0][0]
        b, self.heads, _, self.head_dim = k0.shape
        self.memory_kv, self.src_mask, self.beam = memory_kv, src_mask, beam
        size = b * beam * self.heads * max_len * self.head_dim
        # [layer's K, layer's V, next layer's K, ...], each with its two buffers
        self.buffers = [(k0.new_empty(size), k0.new_empty(size)) for _ in range(2 * len(memory_kv))]
        self.current = [0] * len(self.buffers)  # which buffer each tensor lies in
        self.tensors = [self._view(buf[0], b * beam, 1) for buf in self.buffers]
        self.length = 0  # positions cached so far
        self.max_len = max_len

    self_mask = None  # the cache holds exactly the positions the new one sees

    @property
    def offset(self) -> int:
        """The new position's index."""
        return self.length

    def _view(self, buffer: Tensor, rows: int, positions: int) -> Tensor:
        shape = (rows, self.heads, positions, self.head_dim)
        return buffer[: math.prod(shape)].view(shape)

    def _move(self, i: int, indices: Tensor | None) -> None:
        """Tensor i's filled positions (its rows `indices`, or all) into its other buffer,
        with one free position after them."""
        n, src = self.length, self.tensors[i]
        if n + 1 > self.max_len:
            raise ValueError(f"decoding past the cache's max_len {self.max_len}")
        self.current[i] ^= 1
        rows = src.shape[0] if indices is None else len(indices)
        dst = self._view(self.buffers[i][self.current[i]], rows, n + 1)
        if indices is None:
            dst[:, :, :n] = src[:, :, :n]
        else:
            torch.index_select(src[:, :, :n], 0, indices, out=dst[:, :, :n])
        self.tensors[i] = dst

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store one new position's K/V of `layer`; returns all cached K/V of that layer."""
        n = self.length
        for i, new in ((2 * layer, k), (2 * layer + 1, v)):
            if self.tensors[i].shape[2] == n:  # no reorder since the last step: make room
                self._move(i, None)
            self.tensors[i][:, :, n : n + 1] = new
        return self.tensors[2 * layer], self.tensors[2 * layer + 1]

    def advance(self) -> None:
        self.length += 1

    def reorder(self, indices: Tensor) -> None:
        """Keep rows `indices` (B'*beam of them, each sentence's beams together, sentences in
        their old order): beam search's survivors, and only the sentences still running."""
        for i in range(len(self.tensors)):
            self._move(i, indices)
        sentences = indices[:: self.beam] // self.beam
        if len(sentences) != self.src_mask.shape[0]:  # some sentences finished
            self.memory_kv = [
                (k.index_select(0, sentences), v.index_select(0, sentences)) for k, v in self.memory_kv
            ]
            self.src_mask = self.src_mask.index_select(0, sentences)


class FixedCache:
    """DecoderCache's contents at fixed shapes: the rows of every sentence the search began
    with (a finished sentence's rows go on being computed and are never read), the
    self-attention K/V of `max_len` positions in (2 * layers, rows, H, max_len, K) tensors,
    the new position's index on the device (`offset`) and masks that hide the positions not
    yet written. A step's kernels then read and write the same tensors every time, which a CUDA
    graph needs.

    Beam search moves rows at every step: `reorder` gathers all layers at once from one K/V
    tensor into the other (one pass over what is written), and the step reads the one that
    holds them (`parity`: a graph is recorded for each). With one row per sentence (greedy,
    sampling) no row ever moves and one tensor is kept.

    The search sees only the rows it keeps (its compact rows); `slots` maps each to its row here.
    The step's token ids go in `tokens` (`put`), its logits come out in the rows' order (`take`).
    """

    def __init__(self, memory_kv: list[tuple[Tensor, Tensor]], src_mask: Tensor, beam: int, max_len: int):
        k0 = memory_kv[0][0]
        b, heads, _, head_dim = k0.shape
        device, dtype = k0.device, k0.dtype
        self.memory_kv, self.beam, self.max_len = memory_kv, beam, max_len
        self.rows = b * beam
        shape = (2 * len(memory_kv), self.rows, heads, max_len, head_dim)
        self.kvs = [k0.new_zeros(shape) for _ in range(2 if beam > 1 else 1)]
        self.parity = 0  # which of `kvs` holds the rows
        # additive masks in the model's dtype: scaled_dot_product_attention adds them as they are
        self.src_mask = torch.zeros(src_mask.shape, dtype=dtype, device=device)
        self.src_mask.masked_fill_(~src_mask, -math.inf)
        self.offset = torch.zeros(1, dtype=torch.long, device=device)
        self._positions = torch.arange(max_len, device=device)
        self.self_mask = torch.zeros((1, 1, 1, max_len), dtype=dtype, device=device)
        self._hide_unwritten()
        self.tokens = torch.zeros((self.rows, 1), dtype=torch.long, device=device)
        self._all_rows = torch.arange(self.rows, device=device)
        self.slots = self._all_rows
        self.length = 0  # steps begun, on the host (the device's count is `offset`)

    @property
    def compact(self) -> bool:
        """Whether some sentence has finished: the search's rows are fewer than the rows here."""
        return len(self.slots) < self.rows

    def _hide_unwritten(self) -> None:
        seen = torch.where(self._positions <= self.offset, 0.0, -math.inf)
        self.self_mask.view(-1).copy_(seen)

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new position's K/V of `layer`; returns the layer's K/V of all `max_len`
        positions (`self_mask` hides those not written yet)."""
        kv = self.kvs[self.parity]
        keys, values = kv[2 * layer], kv[2 * layer + 1]
        keys.index_copy_(2, self.offset, k)
        values.index_copy_(2, self.offset, v)
        return keys, values

    def advance(self) -> None:
        """The step's last kernels (on the device, inside a graph): move to the next position."""
        self.offset.add_(1)
        self._hide_unwritten()

    def put(self, tokens: Tensor) -> None:
        """The search's step input (R', 1) into the fixed rows: a step begins."""
        if self.length + 1 > self.max_len:
            raise ValueError(f"decoding past the cache's max_len {self.max_len}")
        self.length += 1
        if self.compact:
            self.tokens.index_copy_(0, self.slots, tokens)
        else:
            self.tokens.copy_(tokens)

    def take(self, logits: Tensor) -> Tensor:
        """The fixed rows' output (rows, ...) -> the search's rows (R', ...)."""
        return logits.index_select(0, self.slots) if self.compact else logits

    def reorder(self, indices: Tensor) -> None:
        """Keep the search's rows `indices` (each sentence's beams together, sentences in their
        old order), as DecoderCache.reorder: each sentence keeps its rows here, a finished one's
        are left as they are."""
        # the row here each survivor comes from (the search's rows are these rows until one ends)
        parents = self.slots.index_select(0, indices) if self.compact else indices
        if len(indices) < self.rows:
            place = torch.arange(len(indices), device=indices.device) % self.beam
            self.slots = parents // self.beam * self.beam + place
            gather = self._all_rows.index_copy(0, self.slots, parents)
        else:
            gather = parents
        if self.beam == 1:  # each sentence's one row stays where it is: nothing moves
            return
        here, there, n = self.kvs[self.parity], self.kvs[1 - self.parity], self.length
        torch.index_select(here[:, :, :, :n], 1, gather, out=there[:, :, :, :n])
        self.parity ^= 1


class RowCache:
    """DecoderCache for a search that sentences join between its steps and leave at any step
    (nmt serve's running batch): each row is at a position of its own, the steps since its
    sentence began. A step's K/V tensors are (rows, H, n, K) with n the positions of the
    longest live row: each row writes its new K/V at its own position and attends to its own
    positions alone (`self_mask`; None while every row is at the same one); the encoder-decoder
    K/V of each sentence are padded to the longest live source (`src_mask` hides the padding),
    as in a batch.

    As in DecoderCache, a step's first append moves every tensor once into its next shape,
    gathering the rows a reorder kept on the way; positions a row has not reached are zeros
    (masked, but never garbage that a zero weight would turn into NaN)."""

    def __init__(self, layers: int, heads: int, head_dim: int, beam: int, dtype: torch.dtype, device):
        self.beam, self.dtype = beam, dtype
        empty = torch.empty((0, heads, 0, head_dim), dtype=dtype, device=device)
        self.memory_kv = [(empty, empty) for _ in range(layers)]
        self.src_mask = torch.zeros((0, 1, 1, 0), dtype=torch.bool, device=device)
        self.sources = np.zeros(0, dtype=np.int64)  # each sentence's source length (with EOS)
        self.kvs = [empty] * (2 * layers)  # self-attention K, V of each layer, (R, H, n, K)
        self.kept: Tensor | None = None  # rows of `kvs` a reorder kept, gathered at the next move
        self.added = 0  # rows that joined since, after them
        self.offset = torch.zeros(0, dtype=torch.long, device=device)  # each row's position
        self.positions = np.zeros(0, dtype=np.int64)  # the same on the host
        self.self_mask: Tensor | None = None
        self._rows = torch.zeros(0, dtype=torch.long, device=device)

    def join(self, memory_kv: list[tuple[Tensor, Tensor]], src_mask: Tensor) -> None:
        """Sentences (their encoder-decoder K/V and source mask) begin: `beam` rows each, after
        the live ones, at position 0 (their self-attention K/V made at the next move)."""
        width = max(self.src_mask.shape[-1], src_mask.shape[-1])
        self.memory_kv = [
            (torch.cat([_wide(k0, width), _wide(k1, width)]), torch.cat([_wide(v0, width), _wide(v1, width)]))
            for (k0, v0), (k1, v1) in zip(self.memory_kv, memory_kv)
        ]
        self.src_mask = torch.cat([_wide(self.src_mask, width), _wide(src_mask, width)])
        self.sources = np.concatenate([self.sources, src_mask.sum((1, 2, 3)).cpu().numpy()])
        rows = src_mask.shape[0] * self.beam
        self.added += rows
        self.offset = torch.cat([self.offset, self.offset.new_zeros(rows)])
        self.positions = np.concatenate([self.positions, np.zeros(rows, dtype=np.int64)])
        self._rows = torch.arange(len(self.positions), device=self.offset.device)

    def _move(self, n: int) -> None:
        """Every K/V tensor into (rows kept, H, n, K): the kept rows' first positions copied, the
        rest zeros."""
        if self.kept is None and not self.added and self.kvs[0].shape[2] == n:
            return
        for i, kv in enumerate(self.kvs):
            old = len(self.kept) if self.kept is not None else kv.shape[0]
            dst = kv.new_empty((old + self.added, kv.shape[1], n, kv.shape[3]))
            m = min(n, kv.shape[2])
            if self.kept is None:
                dst[:old, :, :m] = kv[:, :, :m]
            else:
                torch.index_select(kv[:, :, :m], 0, self.kept, out=dst[:old, :, :m])
            dst[:old, :, m:] = 0
            dst[old:] = 0
            self.kvs[i] = dst
        self.kept, self.added = None, 0

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store each row's new K/V of `layer` at its position; returns the layer's K/V of the
        positions the longest row has reached (`self_mask` hides, in each row, those past its
        own)."""
        if layer == 0:  # a step begins
            n = int(self.positions.max()) + 1
            self._move(n)
            if self.positions.min() == n - 1:
                self.self_mask = None
            else:
                seen = torch.arange(n, device=self.offset.device)[None, :] <= self.offset[:, None]
                mask = torch.zeros(seen.shape, dtype=self.dtype, device=seen.device)
                self.self_mask = mask.masked_fill_(~seen, -math.inf)[:, None, None, :]
        keys, values = self.kvs[2 * layer], self.kvs[2 * layer + 1]
        if self.self_mask is None:  # every row at the last position
            keys[:, :, -1:] = k
            values[:, :, -1:] = v
        else:
            keys[self._rows, :, self.offset] = k[:, :, 0]
            values[self._rows, :, self.offset] = v[:, :, 0]
        return keys, values

    def advance(self) -> None:
        self.offset += 1
        self.positions += 1

    def reorder(self, indices: Tensor) -> None:
        """Keep rows `indices` (each sentence's beams together, sentences in their old order):
        beam search's survivors and the sentences still running; the memory of those that left
        is dropped and trimmed to the longest source left."""
        if self.added:  # the rows that joined are made first
            self._move(self.kvs[0].shape[2])
        host = indices.cpu().numpy()
        self.kept = indices if self.kept is None else self.kept.index_select(0, indices)
        self.offset = self.offset.index_select(0, indices)
        self.positions = self.positions[host]
        self._rows = torch.arange(len(host), device=indices.device)
        sentences = host[:: self.beam] // self.beam
        if len(sentences) == len(self.sources):  # none left
            return
        self.sources = self.sources[sentences]
        width = int(self.sources.max()) if len(sentences) else 0
        picked = torch.from_numpy(sentences).to(indices.device)
        self.memory_kv = [
            (k.index_select(0, picked)[:, :, :width], v.index_select(0, picked)[:, :, :width])
            for k, v in self.memory_kv
        ]
        self.src_mask = self.src_mask.index_select(0, picked)[..., :width]


def _wide(x: Tensor, width: int) -> Tensor:
    """(B, H, S, K) K/V, or a (B, 1, 1, S) mask, padded to S = `width` (K/V with zeros, the mask
    with False)."""
    if x.dim() == 4 and x.dtype == torch.bool:
        return F.pad(x, (0, width - x.shape[-1]), value=False)
    return F.pad(x, (0, 0, 0, width - x.shape[2]))
