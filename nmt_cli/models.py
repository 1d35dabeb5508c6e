"""A trained model on its own, found wherever it lies (a run directory, a checkpoint, a package, a
CTranslate2 export) with what a translation needs; several as one ensemble. export.py writes
the packages read here.

A package is one directory:
    nmt.json           what it is: format, model shape, languages, text normalisation, the
                       decoding defaults, the sha256 of the weights and of each sentencepiece model
    model.safetensors  the weights, float32 (safetensors: tensors only, nothing to unpickle)
    spm.model          the joint sentencepiece model, or spm.source.model and spm.target.model
    provenance.json    how it was made: the data recipe and its checksums, the BPE and training
                       configs, the checkpoint(s) and step, the test scores with their signatures
A CTranslate2 export (export.py) has the same nmt.json (format "ctranslate2"), sentencepiece
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

from nmt_cli import shortlist
from nmt_cli.config import ModelConfig
from nmt_cli.config.common import language
from nmt_cli.errors import NmtError
from nmt_cli.files import check_regular, open_regular, read_json, read_regular, sha256_file
from nmt_cli.rundir import RunDir
from nmt_cli.vocab import MAX_SPM_BYTES, Vocabularies

if TYPE_CHECKING:  # torch is loaded with the weights: a CTranslate2 export never needs it
    import torch

SETTINGS, WEIGHTS, PROVENANCE = "nmt.json", "model.safetensors", "provenance.json"
CT2_WEIGHTS = "model.bin"
CT2_SHORTLIST = "vmap.txt"  # CTranslate2's name for its vocabulary map: shortlist.py's file
NMT, CT2 = "nmt", "ctranslate2"
# 2: a source embedding of its own; 3: the settings of a model made elsewhere (`nmt import`);
# a model that needs neither is still written as 1
VERSION = 3
MAX_MEMBERS = 100  # entries of an export folder: nmt writes about a dozen
MAX_HEADER = 1 << 20  # bytes of a safetensors header


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
        return ensemble([_described(Path(p)) for p in paths])
    return _described_run(RunDir(run_dir), checkpoint)


def _described(where: Path) -> Model:
    """`locate`'s model of `where`, without its weights where it is a run's."""
    path = Path(where)
    if path.is_file():
        return _described_run(_run_of(path), str(path))
    if RunDir(path).manifest_path.is_file() and not os.path.lexists(path / SETTINGS):
        return _described_run(RunDir(path), None)
    if os.path.lexists(path / SETTINGS):
        return from_dir(path, shapes=False, verify=False)  # load() checks, where the weights are read
    return locate(path)  # its one error line


def _described_run(run: RunDir, checkpoint_path: str | None) -> Model:
    path = _found(run, checkpoint_path)
    if path.is_dir():
        return from_dir(path)
    record_path, meta = _record(path)
    if run.manifest_path.exists():  # checked as loading the run's model checks it
        run.load_manifest()

    def refuse() -> dict[str, torch.Tensor]:
        raise NmtError(f"{path}'s weights are for the processes that decode to load")

    return Model(
        where=path,
        config=_declared(meta.get("model"), record_path),
        vocabs=run.vocabularies(),
        src=language(meta.get("src", "en"), f"{record_path}: its src"),
        tgt=language(meta.get("tgt", "de"), f"{record_path}: its tgt"),
        sha256=str(meta.get("sha256", "")),
        load_weights=refuse,
        shortlist=_if_there(run.spm_folder / shortlist.NAME),
    )


def _found(run: RunDir, checkpoint_path: str | None) -> Path:
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


def _record(path: Path) -> tuple[Path, dict]:
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

    path = _found(run, checkpoint_path)
    if path.is_dir():
        return from_dir(path)
    record_path, said = (path.with_suffix(".json"), loaded[1]) if loaded else _record(path)
    if not adapted and said.get("adapters"):
        # one level of adapters is merged: a base that is itself adapted could name its own
        # checkpoint as its base, and be read again at every level
        raise NmtError(f"{path} holds adapters too: the base of adapters must be a plain model")
    tensors, meta = loaded or checkpoint.load_tensors(path)  # verifies the sha256 once, here
    config = _declared(meta.get("model"), record_path)
    vocabs = run.vocabularies()
    weights = {k: v.float() for k, v in checkpoint.weights_of(tensors, path).items()}
    if meta.get("adapters"):
        weights = with_adapters(meta, weights, path)
    same_shapes(config, {k: tuple(v.shape) for k, v in weights.items()}, record_path, path.name)
    return Model(
        where=path,
        config=config,
        vocabs=vocabs,
        src=language(meta.get("src", "en"), f"{record_path}: its src"),
        tgt=language(meta.get("tgt", "de"), f"{record_path}: its tgt"),
        sha256=meta["sha256"],
        load_weights=lambda: weights,
        provenance=_provenance(run, path, meta),
        shortlist=_if_there(run.spm_folder / shortlist.NAME),
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
        return from_run(_run_of(path), str(path), loaded, adapted)
    if os.path.lexists(path / SETTINGS):
        return from_dir(path)
    if RunDir(path).manifest_path.is_file():
        return from_run(RunDir(path), None, adapted=adapted)
    raise NmtError(
        f"{where} is not a model: give a directory from `nmt export`, a run directory or a checkpoint file"
        if path.exists()
        else f"{where} not found"
    )


def _run_of(checkpoint_file: Path) -> RunDir:
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
    _members_are_regular(path)
    try:
        s = json.loads(read_regular(settings_path, 1 << 20).decode("utf-8"))
        fmt, src, tgt, sha = s["format"], s["src"], s["tgt"], s["sha256"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise NmtError(f"{settings_path} is damaged ({type(e).__name__}: {e})") from None
    config = _declared(s.get("model"), settings_path)
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
    listed: Path | None = path / (shortlist.NAME if fmt == NMT else CT2_SHORTLIST)
    if listed is not None and os.path.lexists(listed) and shortlist.SHA_KEY in s:
        if sha256_file(listed) != s[shortlist.SHA_KEY]:
            raise NmtError(f"{listed} does not match the sha256 in {SETTINGS}: it is corrupt or was changed")
    else:
        listed = None
    if fmt == CT2:  # CTranslate2 reads its file itself: verified here, before it does
        if verify:
            _verified(weights_path, sha)
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
        _verified(weights_path, sha)
    if shapes:
        check_shapes(config, weights_path, settings_path)
    return Model(path, config, vocabs, src, tgt, sha, load_weights, provenance=provenance, shortlist=listed)


def _if_there(path: Path) -> Path | None:
    return path if os.path.lexists(path) else None


def _members_are_regular(path: Path) -> None:
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


def _verified(weights_path: Path, sha: str) -> None:
    if sha256_file(weights_path) != sha:
        raise NmtError(
            f"{weights_path} does not match the sha256 in {SETTINGS}: it is corrupt or was changed"
        )


def _declared(settings, source: Path) -> ModelConfig:
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


def _provenance(run: RunDir, path: Path, meta: dict) -> dict:
    manifest = run.load_manifest() if run.manifest_path.exists() else {}
    scores = {}
    for split in run.splits() if manifest.get("prep") else []:
        # A split's scores belong to this model only if `nmt score` translated it with it.
        p, key = run.scores(split), run.translation(split, manifest["prep"]["tgt"])
        key = key.with_suffix(key.suffix + ".json")
        made = read_json(key) if key.exists() else {}
        if p.exists() and made and made.get("model_sha256") == meta.get("sha256"):
            report = read_json(p)
            scores[split] = {
                "settings": made.get("settings"),
                "scores": [
                    {k: s[k] for k in ("metric", "score", "signature")} for s in report.get("scores", [])
                ],
            }
    configs = {}
    for step in ("prep", "bpe", "train"):
        p = run.config_path(step)
        if p.exists():
            configs[step] = read_json(p)
    return {
        "model_file": path.name,
        "model_sha256": meta.get("sha256"),
        "step": meta.get("step"),
        "averaged": meta.get("averaged"),
        "configs": configs,
        "data": {k: manifest[k] for k in ("prep", "bpe") if k in manifest},
        "scores": scores,
    }
