"""`nmt prep` and `nmt bpe`: the corpus, cleaned, and its BPE and binarized shards."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli.cli.options import RunDirOption, app, config_of, done, options_of
from nmt_cli.config import BpeConfig, PrepConfig
from nmt_cli.data.recipes import RECIPES, resolved
from nmt_cli.errors import NmtError

RecipeName = Enum("RecipeName", {name: name for name in RECIPES}, type=str)


@app.command()
@options_of(
    PrepConfig,
    "recipe",
    flags={"tags": "--tag", "weights": "--weight", "pairs": "--pair"},
    settings={"mirror": {"envvar": "NMT_MIRROR"}},
)
def prep(
    ctx: typer.Context,
    recipe: Annotated[
        RecipeName, typer.Argument(help=f"The corpus: {', '.join(RECIPES)} (custom: your own files).")
    ],
    run_dir: RunDirOption = Path("run"),
    workers: Annotated[
        Optional[int],
        typer.Option(help="Processes for cleaning (default: 1 for small corpora, else up to 4)."),
    ] = None,
) -> None:
    """Fetch, verify, extract and clean a corpus into the run directory."""
    import dataclasses

    from nmt_cli import prep as prep_mod
    from nmt_cli.rundir import RunDir

    config = resolved(dataclasses.replace(config_of(PrepConfig, ctx), recipe=recipe.value))
    if workers is not None and workers < 1:
        raise NmtError("--workers must be at least 1")
    prep_mod.check_inputs(config)
    run = RunDir(run_dir)
    with run.lock("prep"):
        run.save_config("prep", config)
        summary = prep_mod.prepare(config, run, workers=workers)
        prep_mod.show(summary)
        done(f"cleaned text in {run.root / 'text'}", f"nmt bpe --run-dir {run.root}")


@app.command()
@options_of(BpeConfig, switches=("lowercase", "separate"), flags={"from_model": "--from"})
def bpe(ctx: typer.Context, run_dir: RunDirOption = Path("run")) -> None:
    """Learn a joint sentencepiece BPE model (or one per side) and binarize every split."""
    from nmt_cli import bpe as bpe_mod
    from nmt_cli.rundir import RunDir

    config = config_of(BpeConfig, ctx)
    run = RunDir(run_dir)
    if not run.root.is_dir():
        raise NmtError(f"run directory {run.root} not found: run `nmt prep` first (or pass --run-dir)")
    with run.lock("bpe"):
        run.save_config("bpe", config)
        result = bpe_mod.run_bpe(config, run)
        bpe_mod.show(result)
        done(f"binarized data in {run.root / 'data'}", f"nmt train --run-dir {run.root}")
