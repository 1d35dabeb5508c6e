"""A model described without its weights, and without loading torch: its settings,
vocabularies and languages, for a process that hands the decoding to workers which load it
themselves, or that decodes a kept CTranslate2 conversion (backend.loaded)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from nmt_cli.config.common import language
from nmt_cli.errors import NmtError
from nmt_cli.inference import checks, models
from nmt_cli.inference.models import SETTINGS, SHORTLIST, Model
from nmt_cli.rundir import RunDir

if TYPE_CHECKING:  # never loaded here: the point of a description
    import torch


def described(run_dir: Path, paths: list[Path] | None, checkpoint: str | None) -> Model:
    """The model `load` finds, without its weights: its settings, vocabularies and languages,
    for a process that hands the decoding to workers which load it themselves (a parent that
    loaded it would hold a copy, and on a GPU a context on GPU 0), or that decodes a kept
    CTranslate2 conversion (backend.loaded). A package is checked as `load` checks it but for
    its weights (hashed and their shapes checked where they are read); a run's checkpoint by its
    record."""
    if paths:
        if checkpoint:
            raise NmtError("--model and --checkpoint name two models: give --model for each")
        return models.ensemble([_one(Path(p)) for p in paths])
    return _of_run(RunDir(run_dir), checkpoint)


def _one(where: Path) -> Model:
    """`locate`'s model of `where`, without its weights where it is a run's."""
    path = Path(where)
    if path.is_file():
        return _of_run(models.run_of(path), str(path))
    if RunDir(path).manifest_path.is_file() and not os.path.lexists(path / SETTINGS):
        return _of_run(RunDir(path), None)
    if os.path.lexists(path / SETTINGS):
        return models.from_dir(path, shapes=False, verify=False)  # load() checks, where the weights are read
    return models.locate(path)  # its one error line


def _of_run(run: RunDir, checkpoint_path: str | None) -> Model:
    path = models.found_checkpoint(run, checkpoint_path)
    if path.is_dir():
        return models.from_dir(path)
    record_path, meta = models.record_of(path)
    if run.manifest_path.exists():  # checked as loading the run's model checks it
        run.load_manifest()

    def refuse() -> dict[str, torch.Tensor]:
        raise NmtError(f"{path}'s weights are for the processes that decode to load")

    return Model(
        where=path,
        config=checks.declared(meta.get("model"), record_path),
        vocabs=run.vocabularies(),
        src=language(meta.get("src", "en"), f"{record_path}: its src"),
        tgt=language(meta.get("tgt", "de"), f"{record_path}: its tgt"),
        sha256=str(meta.get("sha256", "")),
        load_weights=refuse,
        shortlist=models.if_there(run.spm_folder / SHORTLIST),
    )
