"""What a model's files must be before nmt builds anything from them: a package's members
regular files and few, its weights those its settings name (sha256) and of the shape they
declare, its settings within their bounds. models.py reads a model through them."""

from __future__ import annotations

import os
from pathlib import Path

from nmt_cli.config import ModelConfig
from nmt_cli.errors import NmtError
from nmt_cli.files import open_regular, sha256_file

MAX_MEMBERS = 100  # entries of an export folder: nmt writes about a dozen
MAX_HEADER = 1 << 20  # bytes of a safetensors header


def members_are_regular(path: Path) -> None:
    """Every entry of an export is a regular file, and there are few: a folder of many more than
    nmt writes is refused, not scanned for ever (nor checked in part, a FIFO past the part)."""
    with os.scandir(path) as entries:
        for n, entry in enumerate(entries):
            if n >= MAX_MEMBERS:
                raise NmtError(
                    f"{path} holds more than {MAX_MEMBERS} entries: an export holds only the files nmt wrote"
                )
            if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
                raise NmtError(
                    f"{entry.path} is not a regular file: an export holds only the files nmt wrote"
                )


def verified(weights_path: Path, sha: str) -> None:
    """Refuse weights whose sha256 is not the one their package's settings record."""
    if sha256_file(weights_path) != sha:
        raise NmtError(f"{weights_path} does not match the sha256 in nmt.json: it is corrupt or was changed")


def declared(settings, source: Path) -> ModelConfig:
    """The model settings a model file declares, each within its bounds (ModelConfig), before
    anything is built from them; an NmtError naming the file otherwise."""
    if not isinstance(settings, dict):
        raise NmtError(f"{source} is damaged: it declares no model settings")
    try:
        return ModelConfig(**settings)
    except TypeError as e:  # a setting missing or unknown
        raise NmtError(f"{source} is damaged ({e})") from None
    except NmtError as e:
        raise NmtError(f"{source}: {e}") from None


def check_shapes(config: ModelConfig, weights_path: Path, settings_path: Path) -> None:
    """Refuse a package whose declared model shape is not the one its weights file holds (the
    file's header alone is read). A model is built from the declared shape before any weight is
    loaded: a package that declared more than it holds could make its user allocate at will."""
    from safetensors import safe_open

    # safetensors parses the whole JSON header it is given: its size is bounded first (a model's
    # is tens of KB; a crafted one of a million keys would cost seconds and a GB to parse)
    with os.fdopen(open_regular(weights_path, os.O_RDONLY, follow=True), "rb") as raw:
        head = raw.read(8)
    size = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < size <= MAX_HEADER:
        raise NmtError(f"{weights_path} is not a safetensors file nmt wrote (a header of {size} bytes)")
    try:
        with safe_open(str(weights_path), "pt") as f:
            held = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a bad header
        raise NmtError(f"{weights_path} is not a safetensors file ({type(e).__name__}: {e})") from None
    same_shapes(config, held, settings_path, weights_path.name)


def same_shapes(config: ModelConfig, held: dict[str, tuple], declared_by: Path, holder: str) -> None:
    """Refuse weights whose shapes (`held`) are not those of a model of `config`, compared on
    the meta device: nothing of the declared model is allocated (a record that declares a
    larger model than its weights would otherwise have it built first)."""
    import torch

    from nmt_cli.engine.model import undrawn

    try:
        with torch.device("meta"):  # shapes only: nothing is allocated
            declared = {k: tuple(v.shape) for k, v in undrawn(config).state_dict().items()}
    except (ValueError, TypeError, RuntimeError) as e:
        raise NmtError(f"{declared_by} declares an impossible model shape ({e})") from None
    if declared != held:
        differ = sorted(k for k in declared.keys() | held.keys() if declared.get(k) != held.get(k))
        raise NmtError(
            f"{declared_by} declares a model shape that {holder} does not hold "
            f"({len(differ)} tensors differ, e.g. {differ[0]}: declared {declared.get(differ[0])}, "
            f"held {held.get(differ[0])}): it is damaged or was changed"
        )
