"""A model's CTranslate2 conversion, made once and kept: in its run directory (`ct2/`), or beside
its package (`.NAME.ct2/`), one folder per model and converter, named by what it is made from
(`identity`: the sha256 of the model's weights, sentencepiece models and shortlist), the
CTranslate2 version and the conversion's own version (`CONVERTER`).

A conversion is a CTranslate2 export (export.py) whose nmt.json also records what it was made
from; it is written into a folder of its own and renamed into place whole, so that two processes
converting at once leave one whole conversion. It is read as every export is (each file checked
against its sha256; model.bin again only where its size, time or inode changed since) and
refused in one line where it is damaged or made from something else.
Where the folder cannot be written (a read-only package), the conversion goes into a temporary
folder for this process alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_write_json, check_regular, read_json, sha256_file
from nmt_cli.inference.models import CT2_WEIGHTS, SETTINGS, SHORTLIST_MAX_BYTES, Model, from_dir
from nmt_cli.vocab import MAX_SPM_BYTES

# The conversion's version: raised whenever ct2_spec.py converts differently, so that what an
# older nmt converted is not read as the same model
CONVERTER = 1
STAMP = "verified.json"  # model.bin's size, time and inode when its sha256 was last checked


def root_of(model: Model) -> Path | None:
    """The folder `model`'s conversions are kept in: its run's ct2/ (a checkpoint), or beside its
    package; None for an ensemble or a CTranslate2 export."""
    if model.members or model.ct2_dir is not None:
        return None
    where = Path(model.where)
    if where.is_dir():
        return where.parent / f".{where.name}.ct2"
    run = where.parent.parent if where.parent.name == "checkpoints" else where.parent
    return run / "ct2"


def identity(model: Model) -> str:
    """What a conversion of `model` is made from: the sha256 of its weights (for a checkpoint of
    adapters also of the model they adapt, merged into them), of its sentencepiece models and of
    its shortlist, each file checked to be a regular one of bounded size first."""
    parts = [model.sha256]
    where = Path(model.where)
    record = where.with_suffix(".json")
    if where.is_file() and record.is_file():
        said = read_json(record, 1 << 20).get("adapters")
        if isinstance(said, dict):
            parts.append(str(said.get("base_sha256")))
    listed = [(f, MAX_SPM_BYTES) for f in model.vocabs.files()]
    if model.shortlist is not None:
        listed.append((model.shortlist, SHORTLIST_MAX_BYTES))
    for path, limit in listed:
        check_regular(path, limit)
        parts.append(sha256_file(path))
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()


def folder_of(model: Model) -> Path | None:
    """Where `model`'s conversion by this CTranslate2 and this nmt lies (whether it exists or not)."""
    import ctranslate2

    root = root_of(model)
    if root is None:
        return None
    return root / f"{identity(model)[:32]}-ct2-{ctranslate2.__version__}-v{CONVERTER}"


def cached(model: Model) -> Model | None:
    """`model`'s conversion where one was made already (checked: one error line where it is
    damaged or not of `model`), as the model to decode; None where there is none."""
    folder = folder_of(model)
    if folder is None or not folder.is_dir():
        return None
    try:
        # its weights hashed once, and again only where the file changed since (a big model's
        # hash would be most of each start)
        stamp = folder / STAMP
        unchanged = stamp.is_file() and read_json(stamp) == _stamp(folder / CT2_WEIGHTS)
        found = from_dir(folder, verify=not unchanged)
        made_from = read_json(folder / SETTINGS).get("converted_from")
    except NmtError as e:
        raise NmtError(f"{folder}, the CTranslate2 conversion of {model.where}: {e} (remove it)") from None
    if not unchanged:
        with contextlib.suppress(OSError):  # a folder it may not write: hashed at every start
            atomic_write_json(stamp, _stamp(folder / CT2_WEIGHTS))
    if made_from != identity(model):
        raise NmtError(
            f"{folder} is not the CTranslate2 conversion of {model.where} (it was made from other "
            "weights): remove it"
        )
    return dataclasses.replace(
        found, where=model.where, provenance=model.provenance or found.provenance, converted=True
    )


def _stamp(weights: Path) -> dict:
    """What says a file is the one hashed before: its size, modification time and inode."""
    st = os.stat(weights)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def converted(model: Model) -> tuple[Model, tempfile.TemporaryDirectory | None]:
    """`model` as a CTranslate2 model to decode: its kept conversion, made now if there is none.
    The temporary folder that holds it where none could be kept (it lives as long as the object)."""
    found = cached(model)
    if found is not None:
        return found, None
    from nmt_cli.inference.packages import export_ct2

    folder = folder_of(model)
    extra = {"converted_from": identity(model)}
    if folder is not None:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
        except OSError:
            pass  # not writable here: converted for this process alone below
        else:
            try:
                export_ct2(model, staging / "model", extra=extra)
                try:
                    os.rename(staging / "model", folder)
                except OSError:  # another process put its conversion there first
                    if not folder.is_dir():
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            found = cached(model)
            assert found is not None
            return found, None
    held = tempfile.TemporaryDirectory(prefix="nmt-ct2-")
    export_ct2(model, Path(held.name) / "model", extra=extra)
    found = from_dir(Path(held.name) / "model")
    return dataclasses.replace(found, where=model.where, provenance=model.provenance, converted=True), held
