"""The torch device of --device, whether the CPU computes in bf16, and the autocast dtype of a
resolved --precision."""

from __future__ import annotations

import torch

from nmt_cli.config import resolve_device_name


def resolve_device(name: str) -> torch.device:
    return torch.device(resolve_device_name(name, torch.cuda.is_available()))


def dtype_of(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision; None for fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def cpu_has_bf16() -> bool:
    """Whether the CPU has bf16 arithmetic (AVX512_BF16 or AMX); without it bf16 is emulated and
    slower than fp32. torch offers no public query; these two private ones exist since 2.1."""
    checks = (getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(check() for check in checks if check is not None)
