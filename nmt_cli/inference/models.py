"""A trained model on its own, found wherever it lies (a run directory, a checkpoint, a package, a
CTranslate2 export) with what a translation needs; several as one ensemble. packages.py writes
the packages read here, checks.py holds what their files must be, description.py describes a
model without loading torch.

A package is one directory:
    nmt.json           what it is: format, model shape, languages, text normalisation, the
                       decoding defaults, the sha256 of the weights and of each sentencepiece model
    model.safetensors  the weights, float32 (safetensors: tensors only, nothing to unpickle)
    spm.model          the joint sentencepiece model, or spm.source.model and spm.target.model
    provenance.json    how it was made: the data recipe and its checksums, the BPE and training
                       configs, the checkpoint(s) and step, the test scores with their signatures
A CTranslate2 export (packages.py) has the same nmt.json (format "ctranslate2"), sentencepiece
models and provenance.json beside CTranslate2's own files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nmt_cli.config import ModelConfig
from nmt_cli.config.common import language
from nmt_cli.errors import NmtError
from nmt_cli.files import check_regular, read_json, read_regular, sha256_file
from nmt_cli.inference import checks
from nmt_cli.rundir import RunDir
from nmt_cli.vocab import MAX_SPM_BYTES, Vocabularies

if TYPE_CHECKING:  # torch is loaded with the weights: a CTranslate2 export never needs it
    import torch

SETTINGS, WEIGHTS, PROVENANCE = "nmt.json", "model.safetensors", "provenance.json"
CT2_WEIGHTS = "model.bin"
# a model's lexical shortlist (shortlist.py): nmt's file, the setting that holds its sha256, and
# CTranslate2's name for it (its vocabulary map), and its size at most
SHORTLIST, SHORTLIST_SHA, CT2_SHORTLIST = "shortlist.txt", "shortlist_sha256", "vmap.txt"
SHORTLIST_MAX_BYTES = 256 << 20  # a shortlist file read at most
NMT, CT2 = "nmt", "ctranslate2"
# 2: a source embedding of its own; 3: the settings of a model made elsewhere (`nmt import`);
# a model that needs neither is still written as 1
VERSION = 3


def vocabulary_key(vocabs: Vocabularies) -> tuple:
    """What two models must share to read and write the same ids: the layout and the sha256 of
    each sentencepiece model."""
    return (vocabs.joint, *(sha256_file(p) for p in vocabs.files()))


def sha_key(spm_file: Path) -> str:
    """The setting that holds a sentencepiece model's sha256: spm_sha256 for the joint
    spm.model, spm_source_sha256 and spm_target_sha256 for separate ones."""
    return spm_file.name.removesuffix(".model").replace(".", "_") + "_sha256"


@dataclass
class Model:
    """A trained model and what translating with it needs, wherever it lies."""

    where: Path  # what the user named: a checkpoint file or a directory
    config: ModelConfig
    vocabs: Vocabularies
    src: str
    tgt: str
    sha256: str  # of the weights: identifies the model in caches
    load_weights: Callable[[], dict[str, torch.Tensor]] | None  # None: a CTranslate2 export
    ct2_dir: Path | None = None
    provenance: dict = field(default_factory=dict)
    members: tuple[Model, ...] = ()  # an ensemble's models, decoded together (`ensemble`)
    shortlist: Path | None = None  # its lexical shortlist (shortlist.py), if it has one
    converted: bool = False  # a CTranslate2 conversion nmt keeps of an nmt model (ct2_cache.py)

    def weights(self) -> dict[str, torch.Tensor]:
        """Its weights as nmt's engine loads them; a CTranslate2 export has none to give."""
        if self.load_weights is None:
            raise NmtError(f"{self.where} is a CTranslate2 export: its weights are CTranslate2's own")
        return self.load_weights()

    @property
    def max_src(self) -> int:
        """The most source pieces it reads: room for the EOS in every model of it."""
        return min(m.config.max_positions for m in self.parts) - 1

    @property
    def parts(self) -> tuple[Model, ...]:
        """The models a translation runs: an ensemble's members, or this one."""
        return self.members or (self,)

    @property
    def languages(self) -> dict[str, str]:
        """A multilingual model's language codes and their tokens (an M2M100 or NLLB import, or
        a run fine-tuned from one, as its provenance records them); empty for a model of one pair."""
        if self.members:
            return self.members[0].languages
        imported = self.provenance.get("imported", {}).get("languages")
        return dict(imported or self._fine_tuned.get("tokens", {}))

    @property
    def language_pair(self) -> tuple[str, str]:
        """The codes a multilingual model translates from and to unless told: its import's, or
        those of the pair its run was fine-tuned on."""
        return self._fine_tuned.get("src", self.src), self._fine_tuned.get("tgt", self.tgt)

    @property
    def _fine_tuned(self) -> dict:
        return self.provenance.get("data", {}).get("bpe", {}).get("languages") or {}

    @property
    def tags(self) -> tuple[str, ...]:
        """The corpus tags it was trained with (`nmt prep custom --tag`), as its provenance
        records them; an ensemble's: those of all its members."""
        if self.members:
            common = set.intersection(*(set(m.tags) for m in self.members))
            return tuple(t for t in self.members[0].tags if t in common)
        corpora = self.provenance.get("data", {}).get("prep", {}).get("splits", {}).get("train", {})
        return tuple(c["tag"] for c in corpora.get("corpora", []) if c.get("tag"))

    @property
    def text_settings(self) -> dict:
        # The one normalisation (normalize.py) is Moses punctuation for the source language,
        # non-printing characters to spaces, single spaces.
        return {"normalize": "moses-punct+printable+spaces", "lang": self.src}


def load(run_dir: Path, paths: list[Path] | None, checkpoint: str | None) -> Model:
    """The model of --model (several: their ensemble), else the run's (--checkpoint)."""
    if paths:
        if checkpoint:
            raise NmtError("--model and --checkpoint name two models: give --model for each")
        return ensemble([locate(p) for p in paths])
    return from_run(RunDir(run_dir), checkpoint)


def ensemble(models: list[Model]) -> Model:
    """Several models that share a vocabulary, as one: translating with it averages their
    log-probabilities at every step of one beam search. One model stays itself."""
    if len(models) == 1:
        return models[0]
    first = models[0]
    key = vocabulary_key(first.vocabs)  # read once, not for every member
    for m in models[1:]:
        if m.ct2_dir is not None or first.ct2_dir is not None:
            raise NmtError(
                f"{m.where if m.ct2_dir else first.where} is a CTranslate2 export: an "
                "ensemble decodes nmt models (packages, runs or checkpoints)"
            )
        if (m.src, m.tgt) != (first.src, first.tgt):
            raise NmtError(
                f"{m.where} translates {m.src}-{m.tgt}, {first.where} {first.src}-{first.tgt}: "
                "an ensemble needs one language pair"
            )
        if m.config.vocab_size != first.config.vocab_size or vocabulary_key(m.vocabs) != key:
            raise NmtError(
                f"{m.where} and {first.where} have different sentencepiece models: an "
                "ensemble needs one vocabulary (train with `nmt bpe --from`)"
            )

    def refuse() -> dict[str, torch.Tensor]:
        raise NmtError("an ensemble is several models: export each of them")

    shas = [m.sha256 for m in models]
    return Model(
        where=Path(" + ".join(str(m.where) for m in models)),
        config=first.config,
        vocabs=first.vocabs,
        src=first.src,
        tgt=first.tgt,
        sha256=hashlib.sha256(" ".join(shas).encode()).hexdigest(),
        load_weights=refuse,
        provenance={"ensemble": [{"model": str(m.where), "sha256": m.sha256} for m in models]},
        members=tuple(models),
        shortlist=first.shortlist,  # one vocabulary: one shortlist
    )


def found_checkpoint(run: RunDir, checkpoint_path: str | None) -> Path:
    """The file (or package) of the run's model: --checkpoint, else the averaged model, else the
    latest checkpoint."""
    from nmt_cli.engine import listing

    if checkpoint_path:
        path = Path(checkpoint_path)
    elif run.averaged.exists() and run.averaged.with_suffix(".json").exists():
        path = run.averaged
    else:
        found = listing.listed(run.checkpoints)
        if not found:
            raise NmtError(f"no model in {run.root}: run `nmt train` (and `nmt average`) first")
        path = found[-1]
    if not path.is_dir() and not path.exists():
        raise NmtError(f"{path} not found")
    return path


def record_of(path: Path) -> tuple[Path, dict]:
    """A checkpoint file's record and its path."""
    record_path = path.with_suffix(".json")
    if not record_path.exists():
        raise NmtError(
            f"{path} is not an nmt model (expected a .pt file with its .json record, "
            "or a directory from `nmt export`)"
        )
    return record_path, read_json(record_path, 1 << 20)


def from_run(
    run: RunDir, checkpoint_path: str | None, loaded: tuple[dict, dict] | None = None, adapted: bool = True
) -> Model:
    """The run's model: --checkpoint, else the averaged model, else the latest checkpoint.
    `loaded`: that checkpoint's tensors and record, when the caller has read them already;
    `adapted`: whether a checkpoint of adapters may be it (not as another's base)."""
    from nmt_cli.engine import checkpoint

    path = found_checkpoint(run, checkpoint_path)
    if path.is_dir():
        return from_dir(path)
    record_path, said = (path.with_suffix(".json"), loaded[1]) if loaded else record_of(path)
    if not adapted and said.get("adapters"):
        # one level of adapters is merged: a base that is itself adapted could name its own
        # checkpoint as its base, and be read again at every level
        raise NmtError(f"{path} holds adapters too: the base of adapters must be a plain model")
    tensors, meta = loaded or checkpoint.load_tensors(path)  # verifies the sha256 once, here
    config = checks.declared(meta.get("model"), record_path)
    vocabs = run.vocabularies()
    weights = {k: v.float() for k, v in checkpoint.weights_of(tensors, path).items()}
    if meta.get("adapters"):
        weights = with_adapters(meta, weights, path)
    checks.same_shapes(config, {k: tuple(v.shape) for k, v in weights.items()}, record_path, path.name)
    return Model(
        where=path,
        config=config,
        vocabs=vocabs,
        src=language(meta.get("src", "en"), f"{record_path}: its src"),
        tgt=language(meta.get("tgt", "de"), f"{record_path}: its tgt"),
        sha256=meta["sha256"],
        load_weights=lambda: weights,
        provenance=run.provenance(path.name, meta),
        shortlist=if_there(run.spm_folder / SHORTLIST),
    )


def with_adapters(meta: dict, held: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """The plain weights of a checkpoint of an adapted run (`nmt train --adapters`): the model
    its record names, with the checkpoint's adapters merged into it."""
    from nmt_cli.engine import adapters

    said = meta["adapters"]
    if not isinstance(said, dict) or not all(adapters.is_adapter(k) for k in held):
        raise NmtError(f"{path} is damaged: its record says adapters, and it holds other tensors")
    where = Path(str(said.get("base", "")))
    try:
        base = locate(where, adapted=False)
    except NmtError as e:
        raise NmtError(f"{path} holds the adapters of {where}, which cannot be read: {e}") from None
    if base.sha256 != said.get("base_sha256"):
        raise NmtError(f"{path} adapts {where}, which has changed since (its sha256 differs)")
    try:
        return adapters.merged(base.weights(), held)
    except (KeyError, RuntimeError, ValueError) as e:
        raise NmtError(f"{path}'s adapters do not fit {where} ({type(e).__name__}: {e})") from None


def locate(where: Path, loaded: tuple[dict, dict] | None = None, adapted: bool = True) -> Model:
    """The model one path names: a package or export, a run directory (as `from_run`), or a
    checkpoint file of a run (in its checkpoints/, or averaged.pt at its top; `loaded` and
    `adapted` as in `from_run`)."""
    path = Path(where)
    if path.is_file():
        return from_run(run_of(path), str(path), loaded, adapted)
    if os.path.lexists(path / SETTINGS):
        return from_dir(path)
    if RunDir(path).manifest_path.is_file():
        return from_run(RunDir(path), None, adapted=adapted)
    raise NmtError(
        f"{where} is not a model: give a directory from `nmt export`, a run directory or a checkpoint file"
        if path.exists()
        else f"{where} not found"
    )


def run_of(checkpoint_file: Path) -> RunDir:
    """The run a checkpoint file lies in: in its checkpoints/, or averaged.pt at its top."""
    path = Path(checkpoint_file)
    return RunDir(path.parent.parent if path.parent.name == "checkpoints" else path.parent)


def from_dir(path: Path, shapes: bool = True, verify: bool = True) -> Model:
    """A package or a CTranslate2 export. Its members may come from anyone: each must be a
    regular file (no link to /dev/zero, no FIFO) under a size cap, and the weights and the
    sentencepiece model must match the sha256 its settings record. `shapes`: whether the
    weights' shapes are checked against the settings too (`check_shapes`, which imports torch:
    not where only the description is wanted, `described`); `verify`: whether the weights are
    hashed (not where they are not read: `described`, and a conversion nmt verified unchanged
    since, ct2_cache.py)."""
    path = Path(path)
    settings_path = path / SETTINGS
    if not os.path.lexists(settings_path):
        raise NmtError(f"{path} is not a model exported by `nmt export` (it has no {SETTINGS})")
    checks.members_are_regular(path)
    try:
        s = json.loads(read_regular(settings_path, 1 << 20).decode("utf-8"))
        fmt, src, tgt, sha = s["format"], s["src"], s["tgt"], s["sha256"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise NmtError(f"{settings_path} is damaged ({type(e).__name__}: {e})") from None
    config = checks.declared(s.get("model"), settings_path)
    src, tgt = language(src, f"{settings_path}: its src"), language(tgt, f"{settings_path}: its tgt")
    if not isinstance(sha, str):
        raise NmtError(f"{settings_path} is damaged: its sha256 is {sha!r:.40}")
    version = s.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise NmtError(f"{settings_path} is damaged: its version is {version!r}, not a number nmt writes")
    if version > VERSION:
        raise NmtError(f"{path} was exported by a newer nmt (package version {version}): upgrade nmt")
    vocabs, provenance_path = Vocabularies.in_folder(path), path / PROVENANCE
    provenance = read_json(provenance_path) if provenance_path.exists() else {}
    if fmt not in (NMT, CT2):
        raise NmtError(f"{settings_path}: unknown format {fmt!r}")
    weights_path = path / (WEIGHTS if fmt == NMT else CT2_WEIGHTS)
    for needed in (weights_path, *vocabs.files()):
        if not needed.is_file():
            raise NmtError(f"{path} is incomplete: {needed.name} is missing")
    for spm in vocabs.files():
        check_regular(spm, MAX_SPM_BYTES)
        key = sha_key(spm)  # exports before the sha256 of spm.model lack it
        if (key in s or not vocabs.joint) and sha256_file(spm) != s.get(key):
            raise NmtError(f"{spm} does not match the sha256 in {SETTINGS}: it is corrupt or was changed")
    # a shortlist is read only where the settings record its sha256 (it is parsed into a table
    # as wide as its widest row, and an export before the record shipped whatever the run held)
    listed: Path | None = path / (SHORTLIST if fmt == NMT else CT2_SHORTLIST)
    if listed is not None and os.path.lexists(listed) and SHORTLIST_SHA in s:
        if sha256_file(listed) != s[SHORTLIST_SHA]:
            raise NmtError(f"{listed} does not match the sha256 in {SETTINGS}: it is corrupt or was changed")
    else:
        listed = None
    if fmt == CT2:  # CTranslate2 reads its file itself: verified here, before it does
        if verify:
            checks.verified(weights_path, sha)
        return Model(
            path, config, vocabs, src, tgt, sha, None, ct2_dir=path, provenance=provenance, shortlist=listed
        )

    def load_weights() -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(weights_path))

    # the file is what the settings say before anything of it is parsed (a damaged header
    # parsed first would be a confusing error, or hours of work); a crafted file whose sha256
    # was recorded with it is bounded by check_shapes
    if verify:
        checks.verified(weights_path, sha)
    if shapes:
        checks.check_shapes(config, weights_path, settings_path)
    return Model(path, config, vocabs, src, tgt, sha, load_weights, provenance=provenance, shortlist=listed)


def if_there(path: Path) -> Path | None:
    return path if os.path.lexists(path) else None
