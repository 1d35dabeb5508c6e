"""Shared by the benchmarks and the peer scripts (which run in the peers' own venvs, so this
file imports only the standard library and nmt_cli.config at the top, and torch where a function
needs it)."""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# nmt's presets, read from nmt_cli/config/training.py (standard library only, so the peers' venvs import
# it too), with the vocabulary each benchmark uses (the figures of ../shared/PEERS.md).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nmt_cli.config import PRESETS  # noqa: E402

VOCAB = {"tiny": 8000, "base": 32000, "big": 32000}
SHAPES = {
    name: dict(
        layers=PRESETS[name]["num_encoder_layers"],
        d=PRESETS[name]["d_model"],
        ffn=PRESETS[name]["ffn"],
        heads=PRESETS[name]["heads"],
        vocab=vocab,
    )
    for name, vocab in VOCAB.items()
}


def model_config(shape: dict):
    """The ModelConfig of one of SHAPES (or a shape written alike)."""
    from nmt_cli.config import ModelConfig

    return ModelConfig(
        vocab_size=shape["vocab"],
        num_encoder_layers=shape["layers"],
        num_decoder_layers=shape["layers"],
        d_model=shape["d"],
        ffn=shape["ffn"],
        heads=shape["heads"],
    )


def batch(vocab: int, sentences: int = 128, length: int = 32, seed: int = 0):
    """4096 source + 4096 target tokens without padding: (src, tgt_in, tgt_out), ids >= 4."""
    import torch

    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (sentences, length), generator=g)
    tgt = torch.randint(4, vocab, (sentences, length + 1), generator=g)
    return src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()


def train_flops(shape: dict, src_tokens: int, tgt_tokens: int, s_len: int, t_len: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward), matmuls only."""
    L, d, f, v = shape["layers"], shape["d"], shape["ffn"], shape["vocab"]
    enc = src_tokens * L * (2 * (4 * d * d + 2 * d * f) + 4 * s_len * d)
    dec = tgt_tokens * L * (2 * (4 * d * d + 2 * d * d + 2 * d * f) + 4 * t_len * d + 4 * s_len * d)
    dec += src_tokens * L * 2 * (2 * d * d)  # encoder-decoder keys and values
    out = tgt_tokens * 2 * d * v  # tied output projection
    return 3.0 * (enc + dec + out)


def time_steps(step, warmup: int, repeats: int) -> float:
    """Median seconds of `step()` after `warmup` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_ceiling(dtype, rows: int = 4096, d: int = 1024, repeats: int = 5) -> float:
    """GFLOP/s of a (rows x d) by (d x d) linear layer in `dtype` on this machine now: the shape
    and the call (F.linear, oneDNN) of a training step's matmuls."""
    import torch

    x, w = torch.randn(rows, d).to(dtype), torch.randn(d, d).to(dtype)
    seconds = time_steps(lambda: torch.nn.functional.linear(x, w), 2, repeats)
    return 2 * rows * d * d / seconds / 1e9


def cpu_name() -> str:
    import platform

    flags = ""
    try:
        info = open("/proc/cpuinfo").read()
        name = next(
            line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")
        )
        have = set(next(line for line in info.splitlines() if line.startswith("flags")).split())
        flags = ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have)
        return f"{name} ({flags})"
    except (OSError, StopIteration):
        return platform.processor()


@contextlib.contextmanager
def checkout(revision: str, where: Path) -> Iterator[Path]:
    """A git worktree of this repository at `revision` in `where` (before/after comparisons),
    removed on the way out."""
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(where), revision],
        cwd=root,
        check=True,
        capture_output=True,
    )
    try:
        yield where
    finally:
        # unchecked: a failed removal must not hide what went wrong inside
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=root)


def nmt(*args: str, log: Path) -> str:
    """`nmt ARGS` in a process of its own, stderr appended to `log`; its stdout, or the
    benchmark's end with one line naming the log."""
    with open(log, "a", encoding="utf-8") as err:
        done = subprocess.run(
            [sys.executable, "-m", "nmt_cli", *args], stdout=subprocess.PIPE, stderr=err, text=True
        )
    if done.returncode:
        sys.exit(f"nmt {' '.join(args)} failed (exit {done.returncode}); see {log}")
    return done.stdout
