"""The torch device of --device, whether the CPU computes in bf16, the autocast dtype of a
resolved --precision, and how the CPU's memory allocator and oneDNN's kernel cache are set for
training."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator

import torch

from nmt_cli.config import resolve_device_name
from nmt_cli.errors import NmtError


def resolve_device(name: str) -> torch.device:
    """The one place the engine's devices come from: the CPU, or a GPU with its index."""
    device = torch.device(resolve_device_name(name, torch.cuda.is_available()))
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise NmtError(f"--device {name}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    prefer_attention_kernels(device)
    return device


def on(device: torch.device):
    """A context in which torch's calls that act on "the current GPU" (streams, graphs, events,
    pinned copies) act on `device`; nothing off a GPU. Threads and worker processes start on
    GPU 0 whatever device they decode on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def prefer_attention_kernels(device: torch.device) -> None:
    """On a GPU, have scaled_dot_product_attention take the memory-efficient kernel (math where
    it cannot), not cuDNN's or flash attention, for the whole process.

    For bf16 and fp16 torch prefers cuDNN attention on Hopper GPUs, and cuDNN builds an
    execution plan for every new shape: the first pass over a run's batch shapes, and decoding
    (whose key length grows every step), paid it again and again. Flash attention needs no plan
    but was slower than the memory-efficient kernel for each of this model's attention calls
    (64-channel heads, short sentences) in training and decoding: benchmarks/gpu_perf.py measures
    all of them, docs/benchmarks.md has the figures. Every engine entry point resolves its device
    through resolve_device, so training and decoding both get this."""
    if device.type == "cuda":
        torch.backends.cuda.enable_flash_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
        torch.backends.cuda.enable_math_sdp(True)


def dtype_of(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision; None for fp32 and tf32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


class _Tf32:
    """The searches under matmuls("tf32") now, and torch's setting before the first of them."""

    lock = threading.Lock()
    users = 0
    before = "none"


@contextlib.contextmanager
def matmuls(precision: str) -> Iterator[None]:
    """fp32 matrix products on the GPU's TensorFloat-32 cores while inside, for --precision tf32
    (nothing for the others). torch's switch is the process's, so it is on while any search
    that asked for it runs: a process decodes in one precision at a time. torch's newer switch
    alone: reading the older one after setting the newer raises."""
    if precision != "tf32":
        yield
        return
    matmul = torch.backends.cuda.matmul
    with _Tf32.lock:
        if _Tf32.users == 0:
            _Tf32.before = matmul.fp32_precision
            matmul.fp32_precision = "tf32"
        _Tf32.users += 1
    try:
        yield
    finally:
        with _Tf32.lock:
            _Tf32.users -= 1
            if _Tf32.users == 0:
                matmul.fp32_precision = _Tf32.before


# oneDNN's instruction-set caps (ONEDNN_MAX_CPU_ISA) below bf16 arithmetic, and torch's own
# (ATEN_CPU_CAPABILITY): kernels held to them emulate bf16, whatever the CPU has.
NO_BF16_ISA = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
NO_BF16_CAPABILITY = {"default", "avx2"}


def cpu_has_bf16() -> bool:
    """Whether the CPU computes bf16 in hardware (AVX512_BF16 or AMX) and the kernels may use
    it; without, bf16 is emulated and slower than fp32. A process whose kernels are held to an
    older instruction set (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2: how CI runs an
    AVX2-only machine's arithmetic on a newer CPU) is told no, as that machine would be. torch
    offers no public query; these two private ones exist since 2.1."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in NO_BF16_ISA:
        return False
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in NO_BF16_CAPABILITY:
        return False
    checks = (getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(check() for check in checks if check is not None)


def cpu_kind() -> str:
    """The instruction sets this process's CPU kernels are built for, as a folder name: torch's
    kernel level, oneDNN's cap, and the CPU's vector extensions (hashed). Compiled kernels are
    kept apart by it: kernels compiled on one kind of CPU crashed a compiled step on another."""
    import hashlib

    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("flags")), "")
        flags = " ".join(
            sorted(f for f in line.split() if f.startswith(("avx", "amx", "fma", "f16c", "sse")))
        )
    capability = torch.backends.cpu.get_cpu_capability().lower()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").lower()
    digest = hashlib.sha256(f"{flags}|{cap}".encode()).hexdigest()[:8]
    return f"cpu-{capability}{'-' + cap if cap else ''}-{digest}"


def widen_onednn_cache(capacity: int = 16384) -> None:
    """Let oneDNN keep `capacity` compiled kernels instead of its default 1,024.

    bf16 matrix products on a CPU go through oneDNN, which compiles a kernel for every shape, and
    length-bucketed batches bring hundreds of shapes, each with a dozen products forward and
    backward. With 1,024 kept, kernels were evicted and compiled again, and a bf16 step grew
    slower over the run, below fp32 on an Intel Xeon with AMX; with 16,384 it kept pace
    (docs/benchmarks.md). oneDNN reads the variable once, at its first kernel, so this must run
    before any computation; a value the user set stays."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def keep_large_blocks_in_heap() -> bool:
    """Have glibc's malloc serve large blocks from its heap rather than from fresh mappings.

    glibc maps every block over its mmap threshold (32 MiB at most) afresh and unmaps it when
    freed, so each step's (tokens x vocabulary) logits, their gradient and other large tensors
    are page-faulted in anew every step on a CPU. With the threshold at 1 GiB (and freed memory
    kept rather than trimmed) they reuse the heap: faster steps at the same peak memory
    (docs/benchmarks.md). Process-wide; False where the C library is not glibc (macOS, musl),
    which is then left as it is."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, 1 << 30))
