"""`nmt prep` and `nmt bpe`: the corpus, cleaned, and its BPE and binarized shards."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli.cli.options import RunDirOption, about, app, config_of, done, options_of
from nmt_cli.config import BpeConfig, PrepConfig
from nmt_cli.errors import NmtError
from nmt_cli.recipes import RECIPES, resolved

RecipeName = Enum("RecipeName", {name: name for name in RECIPES}, type=str)


@app.command()
def prep(
    recipe: Annotated[
        RecipeName, typer.Argument(help=f"The corpus: {', '.join(RECIPES)} (custom: your own files).")
    ],
    run_dir: RunDirOption = Path("run"),
    src: Annotated[Optional[str], about(PrepConfig, "src")] = None,
    tgt: Annotated[Optional[str], about(PrepConfig, "tgt")] = None,
    mirror: Annotated[Optional[Path], about(PrepConfig, "mirror", envvar="NMT_MIRROR")] = None,
    max_words: Annotated[int, about(PrepConfig, "max_words")] = 250,
    max_ratio: Annotated[Optional[float], about(PrepConfig, "max_ratio", show_default=False)] = None,
    train_src: Annotated[Optional[list[Path]], about(PrepConfig, "train_src")] = None,
    train_tgt: Annotated[Optional[list[Path]], about(PrepConfig, "train_tgt")] = None,
    tag: Annotated[Optional[list[str]], about(PrepConfig, "tags", "--tag")] = None,
    weight: Annotated[Optional[list[float]], about(PrepConfig, "weights", "--weight")] = None,
    valid_src: Annotated[Optional[Path], about(PrepConfig, "valid_src")] = None,
    valid_tgt: Annotated[Optional[Path], about(PrepConfig, "valid_tgt")] = None,
    test_src: Annotated[Optional[Path], about(PrepConfig, "test_src")] = None,
    test_tgt: Annotated[Optional[Path], about(PrepConfig, "test_tgt")] = None,
    workers: Annotated[
        Optional[int],
        typer.Option(help="Processes for cleaning (default: 1 for small corpora, else up to 4)."),
    ] = None,
) -> None:
    """Fetch, verify, extract and clean a corpus into the run directory."""
    from nmt_cli import prep as prep_mod
    from nmt_cli.rundir import RunDir

    def opt(p: Optional[Path]) -> Optional[str]:
        return str(p) if p is not None else None

    config = resolved(
        PrepConfig(
            recipe=recipe.value,
            src=src,
            tgt=tgt,
            mirror=opt(mirror),
            max_words=max_words,
            max_ratio=max_ratio,
            train_src=tuple(str(p) for p in train_src or ()),
            train_tgt=tuple(str(p) for p in train_tgt or ()),
            tags=tuple(tag or ()),
            weights=tuple(weight or ()),
            valid_src=opt(valid_src),
            valid_tgt=opt(valid_tgt),
            test_src=opt(test_src),
            test_tgt=opt(test_tgt),
        )
    )
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
@options_of(BpeConfig, switches=("lowercase",), flags={"from_model": "--from"})
def bpe(ctx: typer.Context, run_dir: RunDirOption = Path("run")) -> None:
    """Learn a joint sentencepiece BPE model and binarize every split."""
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
