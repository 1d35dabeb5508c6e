"""Checkpoints without pickle: tensors through torch.save, loaded with weights_only=True, and a
JSON record beside each that carries the metadata and the file's sha256.

A checkpoint exists once its JSON record exists: the tensor file is written and renamed first,
the record last, both atomically, so a kill at any moment leaves either the complete new
checkpoint or none. Loading verifies the sha256; a checkpoint that fails is skipped with a
warning in favour of the one before it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nmt_cli.config import ModelConfig
from nmt_cli.engine.listing import NAME, listed  # noqa: F401  (torch-free: the models' finder reads them)
from nmt_cli.errors import NmtError
from nmt_cli.files import (
    atomic_open,
    atomic_write_json,
    check_torch_zip,
    open_regular,
    read_json,
    sha256_file,
    sha256_of,
)


def save_tensors(path: Path, tensors: dict[str, Any], meta: dict) -> None:
    """Write `path` (.pt) and its record `path.with_suffix('.json')`, each atomically."""
    with atomic_open(path, "wb") as f:
        torch.save(tensors, f)
    atomic_write_json(
        path.with_suffix(".json"),
        {**meta, "file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size},
    )


def load_tensors(path: Path, verify: bool = True) -> tuple[dict[str, Any], dict]:
    """The tensors and record of a file written by save_tensors; refuses code and corruption."""
    record_path = path.with_suffix(".json")
    if not os.path.lexists(record_path) or not os.path.lexists(path):
        raise NmtError(f"{path if not os.path.lexists(path) else record_path} not found")
    meta = read_json(record_path, 1 << 20)
    # both read from descriptors checked to be regular files: a link to /dev/zero or a FIFO
    # would be hashed or unpickled for ever
    with os.fdopen(open_regular(path, os.O_RDONLY, follow=True), "rb") as f:
        if verify:
            size = os.fstat(f.fileno()).st_size
            if size != meta.get("bytes", size):
                raise NmtError(f"{path} is not the size {record_path.name} records: corrupt or cut short")
            if sha256_of(f) != meta.get("sha256"):
                raise NmtError(
                    f"{path} does not match the sha256 in {record_path.name}: it is corrupt or half-written"
                )
            f.seek(0)
        check_torch_zip(f, path, most_bytes(meta.get("model")))
        tensors = _unpickled(f, path)
    if not isinstance(tensors, dict):
        raise NmtError(f"{path} holds a {type(tensors).__name__}, not a checkpoint's tensors")
    return tensors, meta


def most_bytes(declared: Any) -> int | None:
    """The most a checkpoint of the model `declared` (its record's "model") holds: the weights,
    their moving average and Adam's two moments in fp32, and room for the ranks' generator
    states; None where the record declares no model it could be."""
    from nmt_cli.engine.model import undrawn

    try:
        with torch.device("meta"):  # shapes only: nothing is allocated
            count = sum(p.numel() for p in undrawn(ModelConfig(**declared)).parameters())
    except (TypeError, ValueError, RuntimeError, NmtError):
        return None
    return 4 * 4 * count + (256 << 20)


def _unpickled(f, path: Path) -> Any:
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise NmtError(
            f"refusing to load {path}: it holds Python objects other than tensors "
            f"(a pickle payload could run code). {first}"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise NmtError(f"{path} cannot be read ({type(e).__name__}: {e})") from None


def path_for(folder: Path, step: int) -> Path:
    return Path(folder) / f"checkpoint_{step:08d}.pt"


def step_of(path: Path) -> int:
    """The step of a checkpoint that `listed` found, from its name."""
    found = NAME.match(Path(path).with_suffix(".json").name)
    assert found is not None, path  # listed() keeps only names that match
    return int(found.group(1))


def prune(folder: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (record first, so none is left half-there)."""
    for path in listed(folder)[:-keep] if keep > 0 else []:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.with_suffix(".json"))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    # Temporary files of writes that were killed half-way.
    for tmp in Path(folder).glob(".checkpoint_*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


BEST = re.compile(r"best_(\d{8})\.json$")


def best_listed(folder: Path) -> list[tuple[float, Path]]:
    """The kept best models with their scores (lower is better), best first."""
    if not Path(folder).is_dir():
        return []
    found = []
    for p in Path(folder).iterdir():
        if BEST.match(p.name):
            # a damaged record is not a best model (read_json says so as NmtError)
            with contextlib.suppress(NmtError, OSError, ValueError, KeyError, TypeError):
                found.append((float(read_json(p, 1 << 20)["best"]["score"]), p.with_suffix(".pt")))
    return sorted(found)


def keep_best(
    folder: Path, n: int, score: float, step: int, tensors: Callable[[], dict[str, Any]], meta: dict
) -> None:
    """Keep the model of `step` among the `n` best in `folder` if its score earns it a place."""
    kept = best_listed(folder)
    if len(kept) >= n and score >= kept[n - 1][0]:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    save_tensors(Path(folder) / f"best_{step:08d}.pt", tensors(), meta)
    for _, path in [k for k in kept if k[1].name != f"best_{step:08d}.pt"][n - 1 :]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.with_suffix(".json"))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def load_latest(folder: Path, warn: Callable[[str], None]) -> tuple[dict, dict] | None:
    """The newest checkpoint that verifies; unverifiable ones are skipped with a warning."""
    for path in reversed(listed(folder)):
        try:
            return load_tensors(path)
        except NmtError as e:
            warn(f"skipping checkpoint {path.name}: {e}")
    return None


def load_agreed(
    folder: Path, warn: Callable[[str], None], gather: Callable[[Any], list[Any]]
) -> tuple[dict, dict] | None:
    """`load_latest` on every rank (`gather` is the ranks' all-gather), refused unless they all
    found the same checkpoint. DDP gave every rank rank 0's initial weights already: a rank that
    resumed from another checkpoint than the others (or from none) would silently train apart."""
    found = load_latest(folder, warn)
    everyone = gather((found[1]["step"], found[1]["sha256"]) if found else None)
    if any(x != everyone[0] for x in everyone):
        seen = ", ".join(f"rank {r}: {f'step {x[0]}' if x else 'none'}" for r, x in enumerate(everyone))
        raise NmtError(
            f"the ranks found different checkpoints to resume from ({seen}): "
            "--run-dir must be one directory that every node shares"
        )
    return found


def weights_of(tensors: dict, where: Path | str = "the checkpoint") -> dict[str, torch.Tensor]:
    """The weights a checkpoint's model is used with: the moving average where training kept one
    (--ema), else the training weights; one error line if it holds no such tensors."""
    found = tensors.get("ema") or tensors.get("model")
    if not isinstance(found, dict) or not all(isinstance(v, torch.Tensor) for v in found.values()):
        raise NmtError(f"{where} holds no model weights (a dict of tensors under 'model')")
    return found


def average(
    paths: list[Path], plain: Callable[[dict, dict, Path], dict] | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """The fp32 mean of the models in `paths`, holding at most two models in memory (three for
    an adapted run's: `plain(record, tensors, path)` gives each one's plain weights, as the mean
    of the adapters' products is not the product of their means)."""
    if not paths:
        raise NmtError("no checkpoints to average: train first (`nmt train`)")
    total: dict[str, torch.Tensor] | None = None
    first_meta: dict = {}
    for path in paths:
        tensors, meta = load_tensors(path)
        model = weights_of(tensors, path)
        del tensors  # the optimizer state is not needed: keep one model besides the sum
        if meta.get("adapters") and plain is not None:
            model = plain(meta, model, path)
        if total is None:
            total = {k: v.detach().to(torch.float32).clone() for k, v in model.items()}
            first_meta = meta
            continue
        if meta.get("model") != first_meta.get("model") or set(model) != set(total):
            raise NmtError(
                f"cannot average {path.name} with {paths[0].name}: the models have different shapes"
            )
        for k, v in model.items():
            if v.shape != total[k].shape:
                raise NmtError(
                    f"cannot average {path.name}: {k} has shape {tuple(v.shape)}, not {tuple(total[k].shape)}"
                )
            total[k] += v.to(torch.float32)
    assert total is not None
    for v in total.values():
        v /= len(paths)
    return total, first_meta


# A rank 0 write may take this long before the other ranks give up on it: ten minutes, and the
# checkpoint's bytes at the pace of a slow network disk (a write that stalls longer is lost).
WRITE_FLOOR_S = 600.0
SLOW_DISK_BYTES_S = 10e6


def write_seconds(model: torch.nn.Module, copies: int) -> float:
    """How long the other ranks wait for rank 0 to write a checkpoint of `copies` of `model`'s
    weights (the weights, Adam's two moments, the moving average)."""
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return WRITE_FLOOR_S + copies * size / SLOW_DISK_BYTES_S
