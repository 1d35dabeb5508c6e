"""What incremental decoding keeps between steps (section 3.2.3's masked self-attention, one
new position at a time): the cached keys and values of the decoder."""

from __future__ import annotations

import math

import torch
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
