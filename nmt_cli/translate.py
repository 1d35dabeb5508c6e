"""`nmt translate` below the CLI: a stream of lines, a file or a run's split translated with a
progress bar (by one translator or its worker processes), and a warning for each kind of line
the translation had to change."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import BinaryIO, TextIO

from nmt_cli import ui
from nmt_cli.config import TranslateConfig
from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_open, atomic_write_json, read_json
from nmt_cli.inference import workers
from nmt_cli.inference.backend import choose
from nmt_cli.inference.models import Model, from_run
from nmt_cli.inference.translator import Translator
from nmt_cli.rundir import RunDir
from nmt_cli.textio import Counts


def translate_split(
    run: RunDir, split: str, config: TranslateConfig, model: Model | None = None
) -> tuple[Path, Path, str]:
    """Translate the run's split with `model` (default: the run's) unless a translation by the
    same model, settings and engine exists: the translation, the references and the engine."""
    manifest = run.load_manifest().get("prep")
    if not manifest:
        raise NmtError(f"{run.root} has no prepared data: run `nmt prep` first, or pass --ref")
    if split not in manifest["splits"]:
        raise NmtError(f"split {split!r} is not in {run.root} (it has {', '.join(manifest['splits'])})")
    src_path = run.require(run.text(split, manifest["src"], raw=True), "prep")
    ref_path = run.require(run.text(split, manifest["tgt"], raw=True), "prep")
    out = run.translation(split, manifest["tgt"])
    model = model or from_run(run, config.checkpoint)
    choice = choose(model, config)
    key = {
        "model": str(model.where),
        "model_sha256": model.sha256,
        "settings": dataclasses.asdict(config),
        "engine": choice.engine,
    }
    key_path = out.with_suffix(out.suffix + ".json")
    if out.exists() and key_path.exists() and read_json(key_path) == key:
        ui.say(f"reusing {out} (same model, settings and engine)")
        return out, ref_path, choice.engine
    with open(src_path, "rb") as source, atomic_open(out) as sink:
        translator = Translator(model, config, choice=choice)
        stream(translator, source, sink, f"translate {split}", manifest["splits"][split]["kept"])
    atomic_write_json(key_path, key)
    return out, ref_path, choice.engine


def stream(
    translator: Translator,
    source: BinaryIO,
    sink: TextIO,
    what: str,
    lines: int | None = None,
    prefixes: Path | None = None,
    constraints: Path | None = None,
) -> None:
    """`translator.stream` with a progress bar, then a warning for each kind of line it had
    to change; `prefixes` and `constraints`: files aligned with the input."""
    with contextlib.ExitStack() as files, ui.progress() as bar:
        starts, phrases = (files.enter_context(open(p, "rb")) if p else None for p in (prefixes, constraints))
        task = bar.add_task(what, total=lines)
        counts = translator.stream(source, sink, lambda n: bar.advance(task, n), starts, phrases)
    report_counts(counts, translator.max_src)


def spread_stream(
    model: Model,
    config: TranslateConfig,
    spread: workers.Spread,
    source: BinaryIO,
    sink: TextIO,
    prefixes: Path | None = None,
    constraints: Path | None = None,
) -> None:
    """`stream` over the worker processes of `spread`, which load `model` themselves (this
    process holds its description only: description.described)."""
    with contextlib.ExitStack() as files, ui.progress() as bar:
        starts, phrases = (files.enter_context(open(p, "rb")) if p else None for p in (prefixes, constraints))
        task = bar.add_task("translate", total=None)
        counts = workers.stream(spread, config, source, sink, lambda n: bar.advance(task, n), starts, phrases)
    report_counts(counts, model.max_src)


def report_counts(counts: Counts, max_src: int) -> None:
    """Warn about the lines a translation had to change."""
    if counts.truncated:
        ui.warn(
            f"{counts.truncated} lines were longer than {max_src} tokens and were "
            "truncated before translating"
        )
    if counts.damage.not_utf8:
        ui.warn(
            f"{counts.damage.not_utf8} input lines had bytes that are not UTF-8 (first at "
            f"line {counts.damage.first_bad_line}); they were replaced with U+FFFD"
        )


def translate_lines(model: Model, config: TranslateConfig, src: Path) -> tuple[list[str], str]:
    """The translations of the file `src`, one per line, and the engine that made them."""
    import io

    if not Path(src).is_file():
        raise NmtError(f"{src} not found")
    sink = io.StringIO()
    translator = Translator(model, config)
    with open(src, "rb") as source:
        stream(translator, source, sink, f"translate {Path(src).name}")
    return sink.getvalue().splitlines(), translator.engine
