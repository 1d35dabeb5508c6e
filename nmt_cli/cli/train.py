"""`nmt train`, `nmt average` and `nmt plot`: a model trained, its checkpoints averaged, its curves."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli.cli.options import RunDirOption, app, given_on_command_line
from nmt_cli.errors import NmtError


@app.command()
def train(
    ctx: typer.Context,
    run_dir: RunDirOption = Path("run"),
    size: Annotated[str, typer.Option(help="Model preset: tiny, small (CPU), base, big.")] = "base",
    num_encoder_layers: Annotated[Optional[int], typer.Option(help="Override the preset.")] = None,
    num_decoder_layers: Annotated[Optional[int], typer.Option(help="Override the preset.")] = None,
    d_model: Annotated[Optional[int], typer.Option(help="Override the preset.")] = None,
    ffn: Annotated[Optional[int], typer.Option(help="Override the preset.")] = None,
    heads: Annotated[Optional[int], typer.Option(help="Override the preset.")] = None,
    dropout: Annotated[Optional[float], typer.Option(help="Residual/embedding dropout.")] = None,
    attention_dropout: Annotated[Optional[float], typer.Option(help="On attention weights.")] = None,
    relu_dropout: Annotated[Optional[float], typer.Option(help="After the FFN ReLU.")] = None,
    post_norm: Annotated[bool, typer.Option(help="The paper's post-norm sub-layers.")] = False,
    max_tokens: Annotated[int, typer.Option(help="Tokens per batch (either side, per rank).")] = 4096,
    update_freq: Annotated[int, typer.Option(help="Batches accumulated into one update.")] = 1,
    lr_scale: Annotated[float, typer.Option(help="Multiplies the paper's schedule.")] = 1.0,
    warmup: Annotated[int, typer.Option(help="Warm-up steps of the schedule.")] = 4000,
    beta2: Annotated[float, typer.Option(help="Adam beta2 (t2t later used 0.997).")] = 0.98,
    label_smoothing: Annotated[float, typer.Option(help="Label smoothing.")] = 0.1,
    bpe_dropout: Annotated[
        float,
        typer.Option(help="BPE-dropout: re-encode the training side every epoch, each merge dropped with P."),
    ] = 0.0,
    clip_norm: Annotated[float, typer.Option(help="Gradient norm clipping (0: off).")] = 0.0,
    max_steps: Annotated[int, typer.Option(help="Stop after this many updates (0: no limit).")] = 100_000,
    max_epochs: Annotated[int, typer.Option(help="Stop after this many epochs (0: no limit).")] = 0,
    max_time: Annotated[float, typer.Option(help="Stop after this many minutes (0: no limit).")] = 0.0,
    precision: Annotated[
        str,
        typer.Option(
            help="auto (bf16 on a GPU and on a CPU with bf16 arithmetic, else fp32), fp32, bf16, fp16 (GPU)."
        ),
    ] = "auto",
    eval_every: Annotated[int, typer.Option(help="Validate every N updates.")] = 1000,
    eval_bleu: Annotated[bool, typer.Option(help="Also log greedy BLEU on the validation set.")] = False,
    patience: Annotated[int, typer.Option(help="Stop after N validations without improvement (0: off).")] = 0,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N updates.")] = 1000,
    keep_last: Annotated[int, typer.Option(help="Checkpoints kept.")] = 20,
    init_from: Annotated[
        Optional[str],
        typer.Option(
            help="Start from this model's weights (a run directory, a checkpoint or a package "
            "from `nmt export`) with a fresh optimizer and schedule; its BPE must be this "
            "run's (`nmt bpe --from`)."
        ),
    ] = None,
    init_optimizer: Annotated[
        bool,
        typer.Option(
            "--init-optimizer", help="With --init-from: keep its Adam moments (a training checkpoint's)."
        ),
    ] = False,
    init_schedule: Annotated[
        bool,
        typer.Option(
            "--init-schedule",
            help="With --init-from: go on from its step, and so its learning-rate schedule "
            "(--max-steps counts its steps too).",
        ),
    ] = False,
    keep_best: Annotated[
        int, typer.Option(help="Also keep the N best models by --best-metric, in checkpoints/best (0: none).")
    ] = 0,
    best_metric: Annotated[
        str, typer.Option(help="nll, or bleu (with --eval-bleu): what --keep-best and --patience watch.")
    ] = "nll",
    seed: Annotated[int, typer.Option(help="Seed of initialisation, dropout and batch order.")] = 1,
    tensorboard: Annotated[
        bool,
        typer.Option(
            "--tensorboard",
            help="Also write the figures as TensorBoard events in RUN/tensorboard ('.[tensorboard]').",
        ),
    ] = False,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    compile: Annotated[bool, typer.Option(help="torch.compile the model.")] = False,
    threads: Annotated[int, typer.Option(help="CPU threads (0: torch's default).")] = 0,
    max_bad_steps: Annotated[
        int, typer.Option(help="Stop after this many non-finite updates in a row.")
    ] = 20,
    gpus: Annotated[
        int, typer.Option(help="GPUs on this node: one NCCL worker each, through torch's elastic launcher.")
    ] = 0,
    procs: Annotated[int, typer.Option(help="CPU worker processes (gloo), e.g. --procs 2 --device cpu.")] = 1,
    nnodes: Annotated[int, typer.Option(help="Nodes taking part (run the same command on each).")] = 1,
    node_rank: Annotated[int, typer.Option(help="This node's rank among --nnodes.")] = 0,
    rdzv_endpoint: Annotated[str, typer.Option(help="HOST:PORT of node 0, for --nnodes > 1.")] = "",
    max_restarts: Annotated[
        int, typer.Option(help="Restart failed workers up to N times; they resume from the last checkpoint.")
    ] = 0,
    stop_grace: Annotated[
        int,
        typer.Option(
            help="Seconds the workers get to save a checkpoint and exit after the launcher is "
            "signalled (SIGTERM, Ctrl-C) before they are killed."
        ),
    ] = 120,
) -> None:
    """Train a Transformer on the binarized data; resumes from the last checkpoint."""
    import dataclasses

    from nmt_cli import training, ui
    from nmt_cli.config import TrainConfig
    from nmt_cli.engine import distributed, state
    from nmt_cli.rundir import RunDir

    run = RunDir(run_dir)
    if not run.root.is_dir():
        raise NmtError(f"run directory {run.root} not found: run `nmt prep` and `nmt bpe` first")
    given = {f.name: ctx.params[f.name] for f in dataclasses.fields(TrainConfig) if f.name in ctx.params}
    explicit = {name for name in given if given_on_command_line(ctx, name)}
    how = training.Launch(gpus, procs, nnodes, node_rank, rdzv_endpoint, max_restarts, stop_grace)
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
