"""The run directory: the only place that knows its file names; atomic writes, lock and manifest.

Layout (each step writes only its own part, and records it in manifest.json):

    prep.json bpe.json ...      the config of each step, saved before the step works
    manifest.json               what each step produced: files, sizes, sha256, line/token counts
    downloads/                  archives fetched by `nmt prep` (with .part files while resuming)
    extracted/                  the members of those archives that a recipe reads
    text/{split}.{lang}         cleaned text, one sentence per line (the model's input)
    text/{split}.raw.{lang}     evaluation splits as released: the references for scoring
    bpe/spm.model, bpe/spm.vocab  the joint sentencepiece model
    bpe/spm.{source,target}.model/.vocab  or the model of each side (`nmt bpe --separate`)
    data/{split}.{lang}.bin/.idx  binarized token data (see shards.py)
    checkpoints/checkpoint_{step:08d}.pt/.json   training checkpoints (engine/checkpoint.py)
    checkpoints/best/best_{step:08d}.pt/.json    the best models by validation (--keep-best)
    metrics.jsonl               every logged training/validation figure, one JSON object a line
    tensorboard/                the same figures as TensorBoard event files (`--tensorboard`)
    averaged.pt/.json           the average of the last checkpoints (`nmt average`)
    translations/{split}.{lang}(.json)  translations made by `nmt score`, and their settings
    scores/{split}.json         the scores `nmt score` computed for a split
    curves.png                  the training curves drawn by `nmt plot`
    log.txt                     what each command said while it held the run, timestamped
    cache/compile/              torch.compile's kernels for `nmt train --compile`, reused on resume
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nmt_cli.config.common import language
from nmt_cli.errors import NmtError
from nmt_cli.files import (
    atomic_write_json,
    atomic_write_text,
    file_stats,
    now,
    open_appending,
    open_regular,
    read_json,
    read_regular,
)
from nmt_cli.vocab import Vocabularies

MAX_METRICS_BYTES = 1 << 30  # a record per log line of a months-long run is a fraction of it


class RunDir:
    """Paths inside one run directory, plus its manifest and lock."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    # -- step configs and the manifest
    def config_path(self, step: str) -> Path:
        return self.root / f"{step}.json"

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    @property
    def lock_path(self) -> Path:
        return self.root / ".lock"

    # -- prep
    @property
    def downloads(self) -> Path:
        return self.root / "downloads"

    @property
    def extracted(self) -> Path:
        return self.root / "extracted"

    def text(self, split: str, lang: str, raw: bool = False) -> Path:
        return self.root / "text" / (f"{split}.raw.{lang}" if raw else f"{split}.{lang}")

    # -- bpe
    @property
    def spm_folder(self) -> Path:
        """The sentencepiece models (vocab.Vocabularies.in_folder names them), each with its
        pieces and scores beside it (.vocab)."""
        return self.root / "bpe"

    def vocabularies(self, required: bool = True) -> Vocabularies:
        """The sentencepiece models `nmt bpe` made: the joint one, else one per side; `required`:
        an error naming the fix when they are not there."""
        found = Vocabularies.in_folder(self.root / "bpe")
        for path in found.files() if required else ():
            self.require(path, "bpe")
        return found

    def tokens(self, split: str, lang: str) -> Path:
        """Prefix of the binarized data of one split and language (shards.py adds .bin/.idx)."""
        return self.root / "data" / f"{split}.{lang}"

    # -- train, average
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def best(self) -> Path:
        """The best models by a validation metric (`nmt train --keep-best`), apart from pruning."""
        return self.root / "checkpoints" / "best"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def averaged(self) -> Path:
        """The averaged model (`nmt average`); its record is averaged.json."""
        return self.root / "averaged.pt"

    # -- translate, score
    def translation(self, split: str, lang: str) -> Path:
        """`nmt score`'s translation of a split (its record, .json, says by which model)."""
        return self.root / "translations" / f"{split}.{lang}"

    def scores(self, split: str) -> Path:
        return self.root / "scores" / f"{split}.json"

    @property
    def log(self) -> Path:
        """What every command said while it held the run, timestamped (ui.log_to)."""
        return self.root / "log.txt"

    @property
    def plot(self) -> Path:
        return self.root / "curves.png"

    @property
    def compile_cache(self) -> Path:
        return self.root / "cache" / "compile"

    # -- helpers
    def relative(self, path: Path) -> str:
        return str(Path(path).relative_to(self.root))

    def require(self, path: Path, step: str) -> Path:
        """Fail with the fix when a step's input is missing."""
        if not path.exists():
            raise NmtError(f"{path} not found: run `nmt {step}` first (with --run-dir {self.root})")
        return path

    def save_config(self, step: str, config: Any) -> None:
        from nmt_cli.config import to_json

        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config_path(step), to_json(config))

    def splits(self) -> list[str]:
        """The splits `nmt prep` produced, train first."""
        entry = self.load_manifest().get("prep")
        if not entry:
            raise NmtError(
                f"{self.root} has no prepared data: run `nmt prep` first (with --run-dir {self.root})"
            )
        return list(entry["splits"])

    def metric_records(self) -> list[dict]:
        """The records of metrics.jsonl, oldest first; a line cut short by a kill is left out."""
        if not self.metrics.exists():
            return []
        records = []
        text = read_regular(self.metrics, MAX_METRICS_BYTES).decode("utf-8", errors="replace")
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "kind" in record and "step" in record:
                records.append(record)
        return records

    def add_metric(self, record: dict) -> None:
        with open_appending(self.metrics) as f:
            f.write(json.dumps(record) + "\n")

    def truncate_metrics(self, step: int) -> None:
        """Drop the records after `step` (a resume redoes those steps)."""
        if self.metrics.exists():
            kept = [r for r in self.metric_records() if r["step"] <= step]
            atomic_write_text(self.metrics, "".join(json.dumps(r) + "\n" for r in kept))

    def load_manifest(self) -> dict:
        if not self.manifest_path.exists():
            return {}
        try:
            manifest = read_json(self.manifest_path)
            # of the types every reader of it takes for granted: checked once, here
            for step, entry in manifest.items():
                if not isinstance(entry, dict):
                    raise NmtError(f"{self.manifest_path}: its {step!r} is not a record of a step")
            prep = manifest.get("prep", {})
            for side in ("src", "tgt"):
                if side in prep:
                    language(prep[side], f"{self.manifest_path}: prep's {side}")
            splits = prep.get("splits", {})
            if not isinstance(splits, dict) or not all(isinstance(v, dict) for v in splits.values()):
                raise NmtError(f"{self.manifest_path}: prep's splits are not records of splits")
            return manifest
        except NmtError as e:  # it names the file and what is wrong with it
            raise NmtError(f"{e}; delete it and rerun the steps") from None

    def record(self, step: str, files: list[Path], **facts: Any) -> dict:
        """Record in the manifest what `step` produced: each file's size, sha256 and lines."""
        entry = {"finished": now(), **facts, "files": {self.relative(p): file_stats(p) for p in files}}
        manifest = self.load_manifest()
        manifest[step] = entry
        atomic_write_json(self.manifest_path, manifest)
        return entry

    def provenance(self, model_file: str, meta: dict) -> dict:
        """How the model of checkpoint `model_file` (its record `meta`) was made: the data and
        its checksums, the steps' configs, its step, and the test scores `nmt score` measured
        with it."""
        manifest = self.load_manifest() if self.manifest_path.exists() else {}
        scores = {}
        for split in self.splits() if manifest.get("prep") else []:
            # A split's scores belong to this model only if `nmt score` translated it with it.
            p, key = self.scores(split), self.translation(split, manifest["prep"]["tgt"])
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
            p = self.config_path(step)
            if p.exists():
                configs[step] = read_json(p)
        return {
            "model_file": model_file,
            "model_sha256": meta.get("sha256"),
            "step": meta.get("step"),
            "averaged": meta.get("averaged"),
            "configs": configs,
            "data": {k: manifest[k] for k in ("prep", "bpe") if k in manifest},
            "scores": scores,
        }

    @contextlib.contextmanager
    def lock(self, command: str) -> Iterator[None]:
        """Hold the run directory for one writer; a lock left by a dead process is taken over.

        The kernel drops an flock when its holder dies, so a lock file that still names a
        holder but can be locked belonged to a process that was killed.
        """
        from nmt_cli import ui

        self.root.mkdir(parents=True, exist_ok=True)
        fd = open_regular(self.lock_path, os.O_RDWR | os.O_CREAT)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                holder = _read_holder(fd)
                raise NmtError(
                    f"run directory {self.root} is in use by `nmt {holder.get('command', '?')}` "
                    f"(pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
                    f"{holder.get('started', '?')}): wait for it to finish or use another "
                    "--run-dir"
                ) from None
            stale = _read_holder(fd)
            if stale:
                ui.warn(
                    f"taking over the lock of `nmt {stale.get('command', '?')}` "
                    f"(pid {stale.get('pid', '?')}), which ended without releasing it"
                )
            me = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "started": now()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
            ui.log_to(self.log, f"nmt {command} (pid {me['pid']} on {me['host']})")
            try:
                yield
            except BaseException as e:
                ui.note(f"stopped: {type(e).__name__}: {e}")
                raise
            finally:
                ui.log_to(None)
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _read_holder(fd: int) -> dict:
    data = os.pread(fd, 4096, 0)
    if not data.strip():
        return {}
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return {"command": "?"}
