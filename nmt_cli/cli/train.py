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
    about,
    app,
    config_of,
    given_on_command_line,
    print_settings,
)
from nmt_cli.config import LaunchConfig, TrainConfig
from nmt_cli.errors import NmtError


@app.command()
def train(
    ctx: typer.Context,
    run_dir: RunDirOption = Path("run"),
    size: Annotated[str, about(TrainConfig, "size")] = "base",
    num_encoder_layers: Annotated[Optional[int], about(TrainConfig, "num_encoder_layers")] = None,
    num_decoder_layers: Annotated[Optional[int], about(TrainConfig, "num_decoder_layers")] = None,
    d_model: Annotated[Optional[int], about(TrainConfig, "d_model")] = None,
    ffn: Annotated[Optional[int], about(TrainConfig, "ffn")] = None,
    heads: Annotated[Optional[int], about(TrainConfig, "heads")] = None,
    dropout: Annotated[Optional[float], about(TrainConfig, "dropout")] = None,
    attention_dropout: Annotated[Optional[float], about(TrainConfig, "attention_dropout")] = None,
    relu_dropout: Annotated[Optional[float], about(TrainConfig, "relu_dropout")] = None,
    post_norm: Annotated[bool, about(TrainConfig, "post_norm")] = False,
    max_tokens: Annotated[int, about(TrainConfig, "max_tokens")] = 4096,
    update_freq: Annotated[int, about(TrainConfig, "update_freq")] = 1,
    lr_scale: Annotated[float, about(TrainConfig, "lr_scale")] = 1.0,
    lr: Annotated[float, about(TrainConfig, "lr")] = 0.0,
    schedule: Annotated[str, about(TrainConfig, "schedule")] = "inverse-sqrt",
    min_lr: Annotated[float, about(TrainConfig, "min_lr")] = 0.0,
    warmup: Annotated[int, about(TrainConfig, "warmup")] = 4000,
    optimizer: Annotated[str, about(TrainConfig, "optimizer")] = "adam",
    weight_decay: Annotated[float, about(TrainConfig, "weight_decay")] = 0.0,
    ema: Annotated[float, about(TrainConfig, "ema")] = 0.0,
    beta2: Annotated[float, about(TrainConfig, "beta2")] = 0.98,
    label_smoothing: Annotated[float, about(TrainConfig, "label_smoothing")] = 0.1,
    bpe_dropout: Annotated[float, about(TrainConfig, "bpe_dropout")] = 0.0,
    clip_norm: Annotated[float, about(TrainConfig, "clip_norm")] = 0.0,
    max_steps: Annotated[int, about(TrainConfig, "max_steps")] = 100_000,
    max_epochs: Annotated[int, about(TrainConfig, "max_epochs")] = 0,
    max_time: Annotated[float, about(TrainConfig, "max_time")] = 0.0,
    precision: Annotated[str, about(TrainConfig, "precision")] = "auto",
    eval_every: Annotated[int, about(TrainConfig, "eval_every")] = 1000,
    eval_bleu: Annotated[bool, about(TrainConfig, "eval_bleu")] = False,
    patience: Annotated[int, about(TrainConfig, "patience")] = 0,
    save_every: Annotated[int, about(TrainConfig, "save_every")] = 1000,
    keep_last: Annotated[int, about(TrainConfig, "keep_last")] = 20,
    init_from: Annotated[Optional[str], about(TrainConfig, "init_from")] = None,
    init_optimizer: Annotated[bool, about(TrainConfig, "init_optimizer", "--init-optimizer")] = False,
    init_schedule: Annotated[bool, about(TrainConfig, "init_schedule", "--init-schedule")] = False,
    keep_best: Annotated[int, about(TrainConfig, "keep_best")] = 0,
    best_metric: Annotated[str, about(TrainConfig, "best_metric")] = "nll",
    seed: Annotated[int, about(TrainConfig, "seed")] = 1,
    tensorboard: Annotated[bool, about(TrainConfig, "tensorboard", "--tensorboard")] = False,
    device: Annotated[str, about(TrainConfig, "device")] = "auto",
    compile: Annotated[bool, about(TrainConfig, "compile")] = False,
    threads: Annotated[int, about(TrainConfig, "threads")] = 0,
    max_bad_steps: Annotated[int, about(TrainConfig, "max_bad_steps")] = 20,
    gpus: Annotated[int, about(LaunchConfig, "gpus")] = 0,
    procs: Annotated[int, about(LaunchConfig, "procs")] = 1,
    nnodes: Annotated[int, about(LaunchConfig, "nnodes")] = 1,
    node_rank: Annotated[int, about(LaunchConfig, "node_rank")] = 0,
    rdzv_endpoint: Annotated[str, about(LaunchConfig, "rdzv_endpoint")] = "",
    max_restarts: Annotated[int, about(LaunchConfig, "max_restarts")] = 0,
    stop_grace: Annotated[int, about(LaunchConfig, "stop_grace")] = 120,
    config_file: ConfigFileOption = None,
    print_config: PrintConfigOption = False,
) -> None:
    """Train a Transformer on the binarized data; resumes from the last checkpoint."""
    import dataclasses

    from nmt_cli import training, ui
    from nmt_cli.engine import distributed, state
    from nmt_cli.rundir import RunDir

    run = RunDir(run_dir)
    given = {f.name: ctx.params[f.name] for f in dataclasses.fields(TrainConfig) if f.name in ctx.params}
    explicit = {name for name in given if given_on_command_line(ctx, name)}
    how = config_of(LaunchConfig, ctx)
    if print_config:  # what this command would train with: a resume's saved settings included
        print_settings(ctx, training.settings(run, given, explicit), how, run_dir=run.root)
        return
    if not run.root.is_dir():
        raise NmtError(f"run directory {run.root} not found: run `nmt prep` and `nmt bpe` first")
    if how.needed:  # launch checks `how` before any work
        try:
            training.launch(run, training.settings(run, given, explicit), how)
        except state.Interrupted as e:
            ui.say(str(e))
            raise typer.Exit(128 + e.signum) from None
        return
    # Under torchrun or SLURM, rank 0 takes the lock.
    rank = distributed.from_environment()[0]
    with run.lock("train") if rank == 0 else contextlib.nullcontext():
        config = training.settings(run, given, explicit)
        try:
            result = training.train_here(run, config, rank)
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
