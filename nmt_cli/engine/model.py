"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017), as tensor2tensor runs it.

Changes after the paper, from tensor2tensor: sub-layers are pre-norm, x + Sublayer(LayerNorm(x)),
with a final LayerNorm on the encoder and decoder outputs (`post_norm=True` gives the paper's
LayerNorm(x + Sublayer(x))); dropout also on attention probabilities and after the FFN ReLU;
Xavier-uniform weights, N(0, d_model^-0.5) embeddings; LayerNorm eps 1e-6. A model made elsewhere
(`nmt import`: Marian's) sets what it does otherwise in its ModelConfig: the FFN's activation,
LayerNorm's eps, the sinusoids' layout, a fixed bias on the output scores, unscaled embeddings.

Shape letters: B batch (sentences, or sentences x beams), S source length, T target length,
D d_model, H heads, K head size (D / H), F FFN size, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt_cli.config import ModelConfig
from nmt_cli.vocab import PAD

if TYPE_CHECKING:
    from nmt_cli.engine.cache import DecoderCache, FixedCache, RowCache


def sinusoids(length: int, d: int, layout: str = "tensor2tensor", offset: int = 0) -> Tensor:
    """Positional encodings, section 3.5: sin on the first half of the channels, cos on the second,
    of positions `offset` to `offset + length`.
    tensor2tensor's frequencies run from 1 to 1/10000 over the half; Marian's (`layout`
    "marian", as transformers computes them, in float64) from 1 to 10000^(-2(h-1)/d).
    Under torch.device("meta") (shapes only), an empty table: arange's kernel there imports
    torch's compiler."""
    if torch.get_default_device().type == "meta":
        return torch.empty(length, d)
    if offset:
        return sinusoids(length + offset, d, layout)[offset:].clone()
    if layout == "marian":
        i = torch.arange((d + 1) // 2, dtype=torch.float64)
        angles64 = torch.arange(length, dtype=torch.float64)[:, None] / 10000 ** (2 * i / d)[None, :]
        return torch.cat([torch.sin(angles64), torch.cos(angles64[:, : d // 2])], dim=1).float()
    half = d // 2
    scale = math.log(10000.0) / max(half - 1, 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -scale)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * freqs[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    return F.pad(table, (0, d - 2 * half))  # (length, D)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """F.dropout, with the CPU's mask drawn four elements per random number.

    For F.dropout torch's CPU generator makes one draw per element, and the `small` preset spent
    a fifth of its training time there. Each 64-bit draw here gives four 16-bit lanes, an element
    is kept when its lane is at or above a threshold, and the scale is that of the probability
    the threshold gives. GPUs keep F.dropout (Philox, fast), and so does a compiled model, which
    cannot trace `random_` and would break its graph at every dropout."""
    if not training or p == 0.0:
        return x
    if p >= 1.0 or x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    threshold = round(p * 65536)
    n = x.numel()
    draws = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1)
    keep = draws.view(torch.int16)[:n].view(x.shape) >= threshold - 32768
    return x * keep * (65536 / (65536 - threshold))


class Attention(nn.Module):
    """Multi-head scaled dot-product attention, section 3.2 (self- or encoder-decoder)."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)  # keys and values in one matmul
        self.out = nn.Linear(d, d)
        # Self-attention's queries, keys and values from one product of the three matrices side
        # by side (Transformer.set_kernels): the same function, in one kernel instead of two.
        self.fused_qkv = False

    def split(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)  # (B, H, n, K)

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv(x).chunk(2, dim=-1)
        return self.split(k), self.split(v)

    def forward(
        self, x: Tensor, kv: tuple[Tensor, Tensor], mask: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        return self.attend(self.split(self.q(x)), kv, mask, causal)

    def attend_self(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """x attending to itself (every position at once)."""
        if not self.fused_qkv:
            return self(x, self.keys_values(x), mask, causal)
        weight = torch.cat([self.q.weight, self.kv.weight])  # (3D, D)
        q, k, v = F.linear(x, weight, torch.cat([self.q.bias, self.kv.bias])).chunk(3, dim=-1)
        return self.attend(self.split(q), (self.split(k), self.split(v)), mask, causal)

    def attend(self, q: Tensor, kv: tuple[Tensor, Tensor], mask: Tensor | None, causal: bool) -> Tensor:
        """The heads' queries (B, H, n, K) over keys and values (B, H, m, K) -> (B, n, D)."""
        k, v = kv
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
        )
        b, h, n, k_ = y.shape
        return self.out(y.transpose(1, 2).reshape(b, n, h * k_))  # (B, n, D)

    def weights(self, x: Tensor, kv: tuple[Tensor, Tensor], mask: Tensor | None = None) -> Tensor:
        """The attention probabilities (B, H, n, m) with which `forward` mixes the values."""
        q, (k, _) = self.split(self.q(x)), kv
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        return scores.softmax(-1)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "swish": F.silu, "gelu": F.gelu}


class FeedForward(nn.Module):
    """Position-wise FFN, section 3.3, with dropout after the ReLU (or the model's activation)."""

    def __init__(self, d: int, ffn: int, relu_dropout: float, activation: str = "relu"):
        super().__init__()
        self.inner, self.outer = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.relu_dropout, self.activation = relu_dropout, ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        h = dropout(self.activation(self.inner(x)), self.relu_dropout, self.training)
        return self.outer(h)


class Residual(nn.Module):
    """x + Dropout(Sublayer(LayerNorm(x))) in pre-norm; LayerNorm(x + Dropout(Sublayer(x))) in post-norm."""

    def __init__(self, d: int, dropout: float, post_norm: bool, eps: float = 1e-6):
        super().__init__()
        self.norm = nn.LayerNorm(d, eps=eps)
        self.dropout, self.post_norm = dropout, post_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        y = dropout(sublayer(self.inner(x)), self.dropout, self.training)
        # autocast's LayerNorm answers in float32: the stream keeps its own dtype (a narrowed one)
        return self.norm(x + y).to(x.dtype) if self.post_norm else x + y

    def inner(self, x: Tensor) -> Tensor:
        """What the sublayer is given: x itself in post-norm, LayerNorm(x) in pre-norm."""
        return x if self.post_norm else self.norm(x)


class EncoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = Attention(c.d_model, c.heads, c.attention_dropout)
        self.ffn = FeedForward(c.d_model, c.ffn, c.relu_dropout, c.activation)
        self.res1 = Residual(c.d_model, c.dropout, c.post_norm, c.norm_eps)
        self.res2 = Residual(c.d_model, c.dropout, c.post_norm, c.norm_eps)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.res1(x, lambda h: self.self_attn.attend_self(h, src_mask))
        return self.res2(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = Attention(c.d_model, c.heads, c.attention_dropout)
        self.cross_attn = Attention(c.d_model, c.heads, c.attention_dropout)
        self.ffn = FeedForward(c.d_model, c.ffn, c.relu_dropout, c.activation)
        self.res1 = Residual(c.d_model, c.dropout, c.post_norm, c.norm_eps)
        self.res2 = Residual(c.d_model, c.dropout, c.post_norm, c.norm_eps)
        self.res3 = Residual(c.d_model, c.dropout, c.post_norm, c.norm_eps)

    def forward(
        self,
        x: Tensor,
        memory_kv: tuple[Tensor, Tensor],
        src_mask: Tensor,
        cache: DecoderCache | FixedCache | RowCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        def cross_attention(h: Tensor) -> Tensor:
            if cache is None or cache.beam == 1:
                return self.cross_attn(h, memory_kv, src_mask)
            # The beams of a sentence share its memory: attend with their queries side by side
            # instead of copying the memory K/V for every beam. (B*beam, 1, D) -> (B, beam, D)
            b = h.shape[0] // cache.beam
            y = self.cross_attn(h.view(b, cache.beam, -1), memory_kv, src_mask)
            return y.view(b * cache.beam, 1, -1)

        x = self.res1(x, lambda h: self.attend_self(h, cache, layer))
        x = self.res2(x, cross_attention)
        return self.res3(x, self.ffn)

    def attend_self(
        self, h: Tensor, cache: DecoderCache | FixedCache | RowCache | None = None, layer: int = 0
    ) -> Tensor:
        if cache is None:  # training: every position at once, each sees only its past
            return self.self_attn.attend_self(h, causal=True)
        k, v = cache.append(layer, *self.self_attn.keys_values(h))
        return self.self_attn(h, (k, v), cache.self_mask)  # the new position sees the cached ones

    def cross_weights(self, x: Tensor, memory_kv: tuple[Tensor, Tensor], src_mask: Tensor) -> Tensor:
        """The encoder-decoder attention probabilities (B, H, T, S) of teacher-forced `x`: those
        `forward` mixes the memory with."""
        x = self.res1(x, self.attend_self)
        return self.cross_attn.weights(self.res2.inner(x), memory_kv, src_mask)


class Transformer(nn.Module):
    """Encoder-decoder with source, target and output embeddings tied (section 3.4). Separate
    source and target vocabularies untie the source's (`src_embed`); the target's stays the
    output projection."""

    positions: Tensor  # (max_positions, D) the sinusoids, a buffer
    output_bias: Tensor | None  # (V,) added to the output scores where the model has one, a buffer

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.d_model, padding_idx=PAD)
        self.src_embed = None  # with a joint vocabulary, the source is embedded by `embed`
        if c.src_vocab_size:
            self.src_embed = nn.Embedding(c.src_vocab_size, c.d_model, padding_idx=PAD)
        self.register_buffer(
            "positions",
            sinusoids(c.max_positions, c.d_model, c.positions, c.position_offset),
            persistent=False,
        )
        # Marian's final_logits_bias: a fixed part of the model, as in transformers (not trained)
        self.register_buffer("output_bias", torch.zeros(c.vocab_size) if c.output_bias else None)
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c.num_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_decoder_layers))
        # Pre-norm leaves the last residual sum unnormalised: tensor2tensor adds a final LayerNorm.
        self.encoder_norm = nn.LayerNorm(c.d_model, eps=c.norm_eps) if not c.post_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(c.d_model, eps=c.norm_eps) if not c.post_norm else nn.Identity()
        # A faster copy of the output projection for decoding, set by packing.pack_for_cpu.
        self.packed_output: nn.Module | None = None
        self.narrow_residual = False  # set_kernels
        self.reset_parameters()

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        return cast("Sequence[DecoderLayer]", self.decoder)

    def set_kernels(self, fused_qkv: bool = False, narrow_residual: bool = False) -> None:
        """How training computes the model. `fused_qkv`: self-attention's three projections in one
        matrix product (the same function). `narrow_residual`: under autocast, the residual
        stream between sub-layers in autocast's dtype (bf16, fp16) as a model of bf16 weights
        keeps it, instead of float32: half the memory traffic of the sums, each one rounded."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.fused_qkv = fused_qkv
        self.narrow_residual = narrow_residual

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        for table in (self.embed, self.src_embed) if self.src_embed is not None else (self.embed,):
            nn.init.normal_(table.weight, 0.0, self.config.d_model**-0.5)
            with torch.no_grad():
                table.weight[PAD].zero_()

    def embed_tokens(
        self, tokens: Tensor, offset: int | Tensor = 0, table: nn.Embedding | None = None
    ) -> Tensor:
        """Token embeddings (`table`, default the target's) scaled by sqrt(D), plus positions,
        with dropout: (B, n) -> (B, n, D). An `offset` on the device is the position of a
        single token: (1,) for every row (a CUDA graph's step reads it there), or (B,) each
        row's own (cache.RowCache)."""
        n = tokens.shape[1]
        if isinstance(offset, Tensor):
            where = self.positions.index_select(0, offset)[:, None]
        elif offset + n > self.config.max_positions:
            raise ValueError(
                f"sequence of {offset + n} tokens exceeds max_positions {self.config.max_positions}"
            )
        else:
            where = self.positions[offset : offset + n]
        x = (self.embed if table is None else table)(tokens)
        if self.config.scale_embedding:
            x = x * math.sqrt(self.config.d_model)
        x = x + where.to(x.dtype)
        if self.narrow_residual and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return dropout(x, self.config.dropout, self.training)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """(B, S) source ids -> (B, S, D) memory and the (B, 1, 1, S) mask of real tokens."""
        src_mask = (src != PAD)[:, None, None, :]
        x = self.embed_tokens(src, table=self.src_embed)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.encoder_norm(x), src_mask

    def memory_keys_values(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each decoder layer's encoder-decoder K/V, (B, H, S, K) each."""
        return [layer.cross_attn.keys_values(memory) for layer in self.decoder_layers]

    def decode(
        self,
        tgt_in: Tensor,
        memory_kv: list[tuple[Tensor, Tensor]],
        src_mask: Tensor,
        cache: DecoderCache | FixedCache | RowCache | None = None,
    ) -> Tensor:
        """(B, T) shifted target ids -> (B, T, D) decoder states; with `cache`, T is the one
        new position and the cache grows by it."""
        offset = cache.offset if cache is not None else 0
        x = self.embed_tokens(tgt_in, offset)
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory_kv[i], src_mask, cache, i)
        if cache is not None:
            cache.advance()
        return self.decoder_norm(x)

    def logits(self, h: Tensor) -> Tensor:
        """(..., D) decoder states -> (..., V) scores through the tied embedding."""
        if self.packed_output is not None:
            return self.packed_output(h)
        return F.linear(h, self.embed.weight, self.output_bias)

    def cross_attention(self, src: Tensor, tgt_in: Tensor, layer: int = -1) -> Tensor:
        """(B, T, S): how much each position of the shifted targets attends to each source
        position in decoder layer `layer`'s encoder-decoder attention, heads averaged."""
        memory, src_mask = self.encode(src)
        kv = self.memory_keys_values(memory)
        x, last = self.embed_tokens(tgt_in), layer % len(self.decoder)
        for i in range(last):
            x = self.decoder[i](x, kv[i], src_mask)
        return self.decoder_layers[last].cross_weights(x, kv[last], src_mask).mean(1)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced decoder states (B, T, D) for a batch of sources and shifted targets."""
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, self.memory_keys_values(memory), src_mask)


class _NoDraws(torch.overrides.TorchFunctionMode):
    """Skips the fills the layers' reset_parameters and ours draw weights with: the tensor's
    own, and the torch.nn.init functions that take the place of what they call."""

    FILLS = frozenset(
        {Tensor.normal_, Tensor.uniform_, Tensor.zero_, Tensor.fill_}
        | {nn.init.normal_, nn.init.uniform_, nn.init.constant_, nn.init.kaiming_uniform_}
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def undrawn(config: ModelConfig) -> Transformer:
    """A Transformer whose weights are allocated but never drawn: to load weights into (a strict
    `load_state_dict` then overwrites every one) or, under `torch.device("meta")`, to read its
    shapes. Drawing is most of what building a big model costs, and on the meta device the
    draws' kernels import torch's compiler, which `translate` and `serve` otherwise never need."""
    with _NoDraws():
        return Transformer(config)
