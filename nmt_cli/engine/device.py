"""The torch device of --device, and the autocast dtype of a resolved --precision."""

from __future__ import annotations

import torch

from nmt_cli.config import resolve_device_name


def resolve_device(name: str) -> torch.device:
    return torch.device(resolve_device_name(name, torch.cuda.is_available()))


def dtype_of(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision; None for fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
