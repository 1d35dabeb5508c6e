"""The `nmt` command: options become a typed config at this boundary, then one call does the work.

stdout carries data only (translations, scores); everything said to the user goes to stderr.
Nothing heavy is imported at module level, so `nmt --help` stays fast (no torch).
"""

from __future__ import annotations

import contextlib
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

try:  # typer >= 0.22 carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exceptions

from nmt_cli import __version__
from nmt_cli.cli_options import RunDirOption, app, done
from nmt_cli.errors import NmtError
from nmt_cli.recipes import RECIPES, resolved

_debug = bool(os.environ.get("NMT_DEBUG"))


def _version(value: bool) -> None:
    if value:
        print(f"nmt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks on errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    global _debug
    _debug = _debug or debug


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
    explicit = {name for name in given if _given(ctx, name)}
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


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether an option was set on the command line or through the environment."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


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


# translate, score, export, serve: the commands that use a trained model, declared there.
from nmt_cli import cli_use  # noqa: E402,F401


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


# The quickstart's model: the CPU recipe measured in docs/benchmarks.md (Multi30k quality).
@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def quickstart(
    ctx: typer.Context,
    run_dir: RunDirOption = Path("quickstart"),
    minutes: Annotated[
        float, typer.Option(help="Time budget of the whole pipeline; all but a minute of it trains.")
    ] = 15.0,
    mirror: Annotated[
        Optional[Path],
        typer.Option(
            envvar="NMT_MIRROR", help="Take Multi30k from this local folder instead of the network."
        ),
    ] = None,
    threads: Annotated[int, typer.Option(help="CPU threads (0: torch's default).")] = 0,
    lowercase: Annotated[
        bool, typer.Option("--lowercase", help="`nmt bpe --lowercase`: lowercase translations.")
    ] = False,
) -> None:
    """Multi30k English-German end to end: prep, bpe, train, average, translate, score, plot.

    Further options go to `nmt train` and override the recipe's, e.g. `--size tiny`.
    """
    from nmt_cli import quickstart as quickstart_mod
    from nmt_cli.engine.state import Interrupted
    from nmt_cli.rundir import RunDir

    # Options meant for `nmt train` are checked now, not after prep and bpe have run.
    train_ctx = (
        typer.main.get_command(app).get_command(ctx, "train").make_context("nmt train", list(ctx.args))
    )
    overrides = {name: value for name, value in train_ctx.params.items() if _given(train_ctx, name)}
    try:
        quickstart_mod.run(
            RunDir(run_dir), minutes, str(mirror) if mirror else None, threads, overrides, lowercase
        )
    except Interrupted as e:  # its checkpoint is saved: a rerun resumes
        from nmt_cli import ui

        ui.say(str(e))
        raise typer.Exit(128 + e.signum) from None


# -- output helpers -----------------------------------------------------------------------------


def _error(message: str) -> None:
    # One line, whatever the message contains. A rank that torchrun started also hands it to
    # torchrun through its error file.
    message = " ".join(str(message).split())
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from nmt_cli.engine.distributed import record_worker_error

        record_worker_error(message)
    print(f"nmt: error: {message}", file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: runs the app and turns every failure into one line on stderr and an exit code."""
    global _debug
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:  # accepted anywhere, not only before the command
        _debug = True
        args = [a for a in args if a != "--debug"]
    command = typer.main.get_command(app)
    try:
        result = command.main(args=args, prog_name="nmt", standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except typer.Exit as e:
        code = e.exit_code
    except click_exceptions.UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `nmt`: show the help
            e.show()
            sys.exit(2)
        where = e.ctx.command_path if e.ctx is not None else "nmt"
        _error(f"{e.format_message()} (see `{where} --help`)")
        code = 2
    except (KeyboardInterrupt, typer.Abort):
        _error("interrupted")
        code = 130
    except NmtError as e:
        if _debug:
            raise
        _error(str(e))
        code = 1
    except Exception as e:  # a bug of ours: still one line unless asked for the traceback
        if _debug:
            raise
        _error(
            f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback, "
            "and please report it)"
        )
        code = 1
    sys.exit(code)
