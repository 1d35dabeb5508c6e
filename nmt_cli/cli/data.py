"""`nmt prep` and `nmt bpe`: the corpus, cleaned, and its BPE and binarized shards."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli.cli.options import RunDirOption, app, done
from nmt_cli.errors import NmtError
from nmt_cli.recipes import RECIPES, resolved

RecipeName = Enum("RecipeName", {name: name for name in RECIPES}, type=str)


@app.command()
def prep(
    recipe: Annotated[
        RecipeName, typer.Argument(help=f"The corpus: {', '.join(RECIPES)} (custom: your own files).")
    ],
    run_dir: RunDirOption = Path("run"),
    src: Annotated[str, typer.Option(help="Source language.")] = "en",
    tgt: Annotated[str, typer.Option(help="Target language.")] = "de",
    mirror: Annotated[
        Optional[Path],
        typer.Option(
            envvar="NMT_MIRROR",
            help="Take the recipe's files from this local folder instead of "
            "the network (same names, same checksums).",
        ),
    ] = None,
    max_words: Annotated[
        int, typer.Option(help="Drop training pairs with a side longer than this many words.")
    ] = 250,
    max_ratio: Annotated[
        Optional[float],
        typer.Option(
            help="Drop training pairs whose word-count ratio exceeds this (default: the recipe's: "
            + ", ".join(f"{k.max_ratio:g} for {name}" for name, k in RECIPES.items())
            + ").",
            show_default=False,
        ),
    ] = None,
    train_src: Annotated[
        Optional[list[Path]],
        typer.Option(help="custom: training source (plain or .gz); again for each further corpus."),
    ] = None,
    train_tgt: Annotated[
        Optional[list[Path]], typer.Option(help="custom: training target, one per --train-src.")
    ] = None,
    tag: Annotated[
        Optional[list[str]],
        typer.Option(
            help="custom: per training corpus, a token put before its source lines, e.g. '<bt>' for "
            "back-translations ('' for none)."
        ),
    ] = None,
    weight: Annotated[
        Optional[list[float]],
        typer.Option(help="custom: per training corpus, times an epoch takes each pair on average (1)."),
    ] = None,
    valid_src: Annotated[
        Optional[Path],
        typer.Option(help="custom: validation source (default: every 100th training pair, up to 2000)."),
    ] = None,
    valid_tgt: Annotated[Optional[Path], typer.Option(help="custom: validation target.")] = None,
    test_src: Annotated[Optional[Path], typer.Option(help="custom: test source.")] = None,
    test_tgt: Annotated[Optional[Path], typer.Option(help="custom: test target.")] = None,
    workers: Annotated[
        Optional[int],
        typer.Option(help="Processes for cleaning (default: 1 for small corpora, else up to 4)."),
    ] = None,
) -> None:
    """Fetch, verify, extract and clean a corpus into the run directory."""
    from nmt_cli import prep as prep_mod
    from nmt_cli.config import PrepConfig
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
def bpe(
    run_dir: RunDirOption = Path("run"),
    vocab_size: Annotated[
        int,
        typer.Option(
            help="Joint vocabulary size (0: 8000 under 100k training pairs, 16000 under 1M, else 32000)."
        ),
    ] = 0,
    sample_lines: Annotated[
        int, typer.Option(help="Sentences (both sides) sampled to learn BPE from.")
    ] = 500_000,
    seed: Annotated[int, typer.Option(help="Seed of the sample.")] = 1,
    threads: Annotated[int, typer.Option(help="Threads for learning and encoding.")] = os.cpu_count() or 1,
    from_model: Annotated[
        Optional[Path],
        typer.Option(
            "--from",
            help="Encode with this model's sentencepiece model (a run directory, a "
            "package, or a .model file) instead of learning one.",
        ),
    ] = None,
    lowercase: Annotated[
        bool,
        typer.Option(
            "--lowercase",
            help="Lowercase everything the model encodes, so its translations are lowercase too "
            "(for setups scored lowercased, as Multi30k papers).",
        ),
    ] = False,
) -> None:
    """Learn a joint sentencepiece BPE model and binarize every split."""
    from nmt_cli import bpe as bpe_mod
    from nmt_cli.config import BpeConfig
    from nmt_cli.rundir import RunDir

    config = BpeConfig(
        vocab_size=vocab_size,
        sample_lines=sample_lines,
        seed=seed,
        threads=threads,
        from_model=str(from_model) if from_model else None,
        lowercase=lowercase,
    )
    run = RunDir(run_dir)
    if not run.root.is_dir():
        raise NmtError(f"run directory {run.root} not found: run `nmt prep` first (or pass --run-dir)")
    with run.lock("bpe"):
        run.save_config("bpe", config)
        result = bpe_mod.run_bpe(config, run)
        bpe_mod.show(result)
        done(f"binarized data in {run.root / 'data'}", f"nmt train --run-dir {run.root}")
