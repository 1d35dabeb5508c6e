"""Which device and number format a command runs in, from its --device and --precision."""

from __future__ import annotations

import torch

from nmt_cli.errors import NmtError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NmtError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
    return device


def dtype_of(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision; None for fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
