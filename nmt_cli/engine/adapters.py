"""Low-rank adapters (Hu et al. 2021, "LoRA"): fine-tuning that trains, beside each attention and
FFN projection W of a model, two small matrices B (out x r) and A (r x in) whose product is added
to it, y = x W^T + b + (x A^T) B^T, and leaves the model's own weights as they are. B starts at
zero, so training starts from the model itself.

A run's checkpoints hold only A and B, and their record names the model they adapt (--init-from,
with its sha256); what translates, averages or exports a checkpoint merges them into the weights,
W + B A, so every model nmt hands on is a plain one. The projections keep their names (A and B
are parameters of the same nn.Linear, added by a forward hook): the model's own weights load as
they are."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# the projections that get adapters: attention's queries, keys/values and output, the FFN's two
TARGETS = (".q", ".kv", ".out", ".inner", ".outer")
A, B = "lora_a", "lora_b"


def _add_low_rank(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + F.linear(F.linear(args[0], getattr(module, A)), getattr(module, B))


def attach(model: nn.Module, rank: int) -> int:
    """Adapters of `rank` on every target projection of `model` (drawn from torch's generator:
    seed it alike on every rank), the rest of the model frozen; returns their weights' count."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.endswith(TARGETS):
            fan_in = module.in_features
            # A as nn.Linear draws its weight (Kaiming-uniform, a = sqrt(5)), B zero
            a = torch.empty(rank, fan_in, device=module.weight.device).uniform_(-1, 1) / math.sqrt(fan_in)
            b = torch.zeros(module.out_features, rank, device=module.weight.device)
            module.register_parameter(A, nn.Parameter(a))
            module.register_parameter(B, nn.Parameter(b))
            module.register_forward_hook(_add_low_rank)
            count += a.numel() + b.numel()
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith((A, B)))
    return count


def is_adapter(name: str) -> bool:
    return name.endswith((f".{A}", f".{B}"))


def own(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters among a state dict's tensors: what a checkpoint of an adapted run holds."""
    return {k: v for k, v in weights.items() if is_adapter(k)}


def merged(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain weights of `base` adapted by `adapters` (W + B A), without them."""
    out = {k: v for k, v in base.items() if not is_adapter(k)}
    for name in adapters:
        if name.endswith(f".{A}"):
            layer = name.removesuffix(f".{A}")
            weight, a, b = out[f"{layer}.weight"], adapters[name], adapters[f"{layer}.{B}"]
            # checked before the product, which is as large as the weight it is added to: a
            # (30000, 1) B and a (1, 30000) A would make gigabytes before any shape was compared
            rank = a.shape[0] if a.dim() == 2 else -1
            if (
                weight.dim() != 2
                or tuple(a.shape) != (rank, weight.shape[1])
                or tuple(b.shape) != (weight.shape[0], rank)
                or not 0 < rank <= min(weight.shape)
            ):
                raise ValueError(
                    f"{layer}'s adapters are {tuple(b.shape)} x {tuple(a.shape)}, not of a rank at most "
                    f"{min(weight.shape)} for its {tuple(weight.shape)} weight"
                )
            delta = b.float() @ a.float()
            out[f"{layer}.weight"] = (weight.float() + delta).to(weight.dtype)
    return out
