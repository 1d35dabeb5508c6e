"""Decoding on the CPU through weights packed once for oneDNN (docs/benchmarks.md)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nmt_cli.engine.model import Transformer

# Decoding on the CPU. A step multiplies a few hundred rows at most by each weight, and there
# oneDNN's GEMM on a weight reordered once into its own blocked layout is faster than torch's
# F.linear (MKL) (docs/benchmarks.md). On small weights the call costs more than it saves,
# hence PACK_MIN.
PACK_MIN = 2**17  # weight elements


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """A frozen linear layer whose weight lives in oneDNN's blocked layout: for decoding only."""

    bias: Tensor | None  # a buffer

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.packed = _pack(weight)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        return _packed_linear(x, self.packed, self.bias)


def can_pack(model: Transformer) -> bool:
    p = model.embed.weight
    return (
        p.device.type == "cpu"
        and p.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_for_cpu(model: Transformer) -> Transformer:
    """Make an fp32 CPU model faster to decode with: its linear layers of PACK_MIN elements or
    more, and the output projection, multiply by copies of their weights packed for oneDNN.
    In place; the model can no longer be trained (the packed copies are snapshots without
    gradients). Returns the model unchanged where oneDNN is not available."""
    if not can_pack(model):
        return model
    model.eval().requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.numel() >= PACK_MIN:
                setattr(module, name, PackedLinear(child.weight, child.bias))
    if model.embed.weight.numel() >= PACK_MIN:
        model.packed_output = PackedLinear(model.embed.weight, model.output_bias)
    return model
