"""The folders nmt writes a model into (`nmt export`, `nmt import`, the kept CTranslate2
conversion): one self-contained directory in nmt's package format (models.py reads it) or as
CTranslate2's model files (ct2_spec.py converts them) with nmt's text settings beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from nmt_cli.config.model import FOREIGN_DEFAULTS
from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_write_json, copy_regular, fsync_dir, new_file_mode, now, sha256_file
from nmt_cli.inference import shortlist
from nmt_cli.inference.ct2_spec import require_ctranslate2, save
from nmt_cli.inference.models import (
    CT2,
    CT2_SHORTLIST,
    CT2_WEIGHTS,
    NMT,
    PROVENANCE,
    SETTINGS,
    VERSION,
    WEIGHTS,
    Model,
    sha_key,
)
from nmt_cli.vocab import MAX_SPM_BYTES, Vocabularies, processor


def settings(model: Model, fmt: str, sha256: str, folder: Path, **extra) -> dict:
    """The nmt.json of `model` exported into `folder`: the sha256 of each file is of what the
    folder holds."""
    from nmt_cli import __version__
    from nmt_cli.config import DecodeOptions

    d = DecodeOptions()
    shape = dataclasses.asdict(model.config)
    tied = not model.config.src_vocab_size
    if tied:  # written as before the setting existed
        del shape["src_vocab_size"]
    own = [k for k, v in FOREIGN_DEFAULTS.items() if shape[k] == v]  # written as before they existed
    for k in own:
        del shape[k]
    foreign = len(own) < len(FOREIGN_DEFAULTS)
    return {
        "format": fmt,
        # a model of one tied embedding and nmt's own layers stays readable by an nmt from
        # before version 2 (3: a model with another's activation, positions, ...: `nmt import`)
        "version": VERSION if foreign else 1 if tied else 2,
        "nmt": __version__,
        "exported": now(),
        "model": shape,
        "src": model.src,
        "tgt": model.tgt,
        "text": model.text_settings,
        "sha256": sha256,
        **{sha_key(name): sha256_file(name) for _, name in _packaged(model, folder)},
        **dict((shortlist.SHA_KEY, sha256_file(held)) for held in _shortlist_in(folder)),
        "decoding": {"beam": d.beam, "alpha": d.alpha, "max_len_a": d.max_len_a, "max_len_b": d.max_len_b},
        **extra,
    }


def _shortlist_in(folder: Path) -> list[Path]:
    """The shortlist file an export in `folder` holds (as a package or as CTranslate2's), if any."""
    return [folder / name for name in (shortlist.NAME, CT2_SHORTLIST) if (folder / name).exists()]


def _packaged(model: Model, folder: Path) -> list[tuple[Path, Path]]:
    """Each sentencepiece model of `model` with its name in a package at `folder`."""
    return list(zip(model.vocabs.files(), Vocabularies.in_folder(folder, model.vocabs.joint).files()))


def export_nmt(model: Model, out: Path) -> None:
    """Write the package of `model` into the new directory `out`."""
    from safetensors.torch import save_file

    if model.load_weights is None:
        raise NmtError(
            f"{model.where} is a CTranslate2 export: export from the run directory or an nmt package instead"
        )
    with writing(model, out) as staging:
        if model.shortlist is not None:  # a CTranslate2 export carries it as its vmap.txt
            shortlist.copy(model, staging / shortlist.NAME)
        weights = {k: v.contiguous() for k, v in model.weights().items()}
        save_file(weights, str(staging / WEIGHTS), metadata={"format": "pt"})
        os.chmod(staging / WEIGHTS, new_file_mode())  # safetensors writes it 0600
        atomic_write_json(staging / SETTINGS, settings(model, NMT, sha256_file(staging / WEIGHTS), staging))


@contextlib.contextmanager
def writing(model: Model, out: Path) -> Iterator[Path]:
    """A sibling directory to write an export of `model` into, with its sentencepiece model and
    provenance; renamed to `out` at the end, so `out` appears complete or not at all."""
    with staged(out) as staging:
        for held, dest in _packaged(model, staging):
            # not through a link (a run's file linked to a private one would ship), kept no more
            # readable than it was, and a sentencepiece model: what ships is what was parsed
            copy_regular(held, dest, MAX_SPM_BYTES, follow=False)
            processor(dest)
        atomic_write_json(staging / PROVENANCE, model.provenance)
        yield staging


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A sibling directory of the new directory `out` to write into, renamed to `out` when the
    block ends, fsynced; removed if it raises."""
    out = Path(out)
    if out.is_symlink():  # renamed over at the end: a link would be left, and the export beside it
        raise NmtError(f"{out} is a symbolic link: give the new directory itself")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NmtError(f"{out} exists and is not empty: choose a new directory")
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:  # nothing half-written left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for written in staging.iterdir():  # durable before the rename makes the export visible
        with open(written, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(staging)
    if out.exists():
        out.rmdir()
    staging.rename(out)
    fsync_dir(out.parent)


QUANTIZATIONS = ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "float16", "bfloat16")


def export_ct2(model: Model, out: Path, quantization: str = "float32", extra: dict | None = None) -> None:
    """Write `model` as a CTranslate2 model directory, with nmt's text settings beside it (and
    the `extra` settings given)."""
    if model.ct2_dir is not None:
        raise NmtError(f"{model.where} is already a CTranslate2 export")
    if quantization not in QUANTIZATIONS:
        raise NmtError(f"unknown --quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    require_ctranslate2()
    with writing(model, out) as staging:
        save(model, staging, quantization)
        atomic_write_json(
            staging / SETTINGS,
            settings(
                model,
                CT2,
                sha256_file(staging / CT2_WEIGHTS),
                staging,
                quantization=quantization,
                **(extra or {}),
            ),
        )
