"""`nmt train`, `nmt average` and `nmt plot`: a model trained, its checkpoints averaged, its curves."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli.cli.options import (
    ConfigFileOption,
    PrintConfigOption,
    RunDirOption,
    app,
    config_of,
    given_on_command_line,
    options_of,
    print_settings,
)
from nmt_cli.config import LaunchConfig, TrainConfig
from nmt_cli.errors import NmtError


@app.command()
@options_of(LaunchConfig, panel="Launching")
@options_of(TrainConfig, "beta1", "adam_eps", switches=("init_optimizer", "init_schedule", "tensorboard"))
def train(
    ctx: typer.Context,
    run_dir: RunDirOption = Path("run"),
    config_file: ConfigFileOption = None,
    print_config: PrintConfigOption = False,
) -> None:
    """Train a Transformer on the binarized data; resumes from the last checkpoint."""
    import dataclasses

    from nmt_cli import train as train_mod
    from nmt_cli import ui
    from nmt_cli.engine import distributed, state
    from nmt_cli.rundir import RunDir

    run = RunDir(run_dir)
    given = {f.name: ctx.params[f.name] for f in dataclasses.fields(TrainConfig) if f.name in ctx.params}
    explicit = {name for name in given if given_on_command_line(ctx, name)}
    how = config_of(LaunchConfig, ctx)
    if print_config:  # what this command would train with: a resume's saved settings included
        print_settings(ctx, train_mod.settings(run, given, explicit), how, run_dir=run.root)
        return
    if not run.root.is_dir():
        raise NmtError(f"run directory {run.root} not found: run `nmt prep` and `nmt bpe` first")
    if how.needed:  # launch checks `how` before any work
        try:
            train_mod.launch(run, train_mod.settings(run, given, explicit), how)
        except state.Interrupted as e:
            ui.say(str(e))
            raise typer.Exit(128 + e.signum) from None
        return
    # Under torchrun or SLURM, rank 0 takes the lock.
    rank = distributed.from_environment()[0]
    with run.lock("train") if rank == 0 else contextlib.nullcontext():
        config = train_mod.settings(run, given, explicit)
        try:
            result = train_mod.train_here(run, config, rank)
        except state.Interrupted as e:
            if rank == 0:
                ui.say(str(e))
            raise typer.Exit(128 + e.signum) from None
    if rank == 0:
        ui.done(
            f"step {result['step']}: checkpoints in {run.checkpoints}", f"nmt average --run-dir {run.root}"
        )


@app.command()
def average(
    run_dir: RunDirOption = Path("run"),
    last: Annotated[
        int, typer.Option(help="Average the last N checkpoints (the paper: 5 for base, 20 for big).")
    ] = 5,
    best: Annotated[
        int, typer.Option(help="Instead, average the N best models kept by `nmt train --keep-best`.")
    ] = 0,
) -> None:
    """Average the last N checkpoints (or the N best) into the run's model."""
    from nmt_cli import average, ui
    from nmt_cli.rundir import RunDir

    if last < 1 or best < 0:
        raise NmtError("--last must be at least 1, and --best not negative")
    run = RunDir(run_dir)
    with run.lock("average"):
        record = average.average_run(run, last, ui.say, best)
        ui.say(
            f"averaged {len(record['averaged'])} checkpoints (up to step {record['step']}) "
            f"into {run.averaged}"
        )


@app.command()
def plot(
    run_dir: RunDirOption = Path("run"),
    out: Annotated[
        Optional[Path], typer.Option(help="PNG to write (default: curves.png in the run directory).")
    ] = None,
) -> None:
    """Draw the run's training curves (loss, validation BLEU, lr, tokens/s) into a PNG."""
    from nmt_cli import plot as plot_mod
    from nmt_cli import ui
    from nmt_cli.rundir import RunDir

    path = plot_mod.plot(RunDir(run_dir), out)
    ui.say(f"curves drawn into {path}")
