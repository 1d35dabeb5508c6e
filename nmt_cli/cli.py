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
from nmt_cli.errors import NmtError

app = typer.Typer(
    name="nmt",
    help="Transformer neural machine translation: prep -> bpe -> train -> average -> "
         "translate -> score, all in one run directory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_debug = bool(os.environ.get("NMT_DEBUG"))

RunDirOption = Annotated[Path, typer.Option(
    "--run-dir", envvar="NMT_RUN_DIR",
    help="The run directory: every step reads and writes here.")]


def _version(value: bool) -> None:
    if value:
        print(f"nmt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks on errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    global _debug
    _debug = _debug or debug


class RecipeName(str, Enum):
    wmt14_en_de = "wmt14-en-de"
    multi30k_en_de = "multi30k-en-de"
    custom = "custom"


@app.command()
def prep(
    recipe: Annotated[RecipeName, typer.Argument(help="The corpus: wmt14-en-de, multi30k-en-de "
                                                      "or custom (your own files).")],
    run_dir: RunDirOption = Path("run"),
    src: Annotated[str, typer.Option(help="Source language.")] = "en",
    tgt: Annotated[str, typer.Option(help="Target language.")] = "de",
    mirror: Annotated[Optional[Path], typer.Option(
        envvar="NMT_MIRROR", help="Take the recipe's files from this local folder instead of "
                                  "the network (same names, same checksums).")] = None,
    max_words: Annotated[int, typer.Option(help="Drop training pairs with a side longer "
                                                "than this many words.")] = 250,
    max_ratio: Annotated[Optional[float], typer.Option(
        help="Drop training pairs whose word-count ratio exceeds this (default: 9 for "
             "multi30k-en-de, else 1.5).", show_default=False)] = None,
    train_src: Annotated[Optional[Path], typer.Option(help="custom: training source (plain or .gz).")] = None,
    train_tgt: Annotated[Optional[Path], typer.Option(help="custom: training target.")] = None,
    valid_src: Annotated[Optional[Path], typer.Option(
        help="custom: validation source (default: every 100th training pair, up to 2000).")] = None,
    valid_tgt: Annotated[Optional[Path], typer.Option(help="custom: validation target.")] = None,
    test_src: Annotated[Optional[Path], typer.Option(help="custom: test source.")] = None,
    test_tgt: Annotated[Optional[Path], typer.Option(help="custom: test target.")] = None,
    workers: Annotated[Optional[int], typer.Option(
        help="Processes for cleaning (default: 1 for small corpora, else up to 4).")] = None,
) -> None:
    """Fetch, verify, extract and clean a corpus into the run directory."""
    from nmt_cli import prep as prep_mod
    from nmt_cli.config import PrepConfig
    from nmt_cli.rundir import RunDir

    def opt(p: Optional[Path]) -> Optional[str]:
        return str(p) if p is not None else None

    config = PrepConfig(recipe=recipe.value, src=src, tgt=tgt, mirror=opt(mirror),
                        max_words=max_words, max_ratio=max_ratio,
                        train_src=opt(train_src), train_tgt=opt(train_tgt),
                        valid_src=opt(valid_src), valid_tgt=opt(valid_tgt),
                        test_src=opt(test_src), test_tgt=opt(test_tgt))
    if workers is not None and workers < 1:
        raise NmtError("--workers must be at least 1")
    prep_mod.check_inputs(config)
    run = RunDir(run_dir)
    with run.lock("prep"):
        run.save_config("prep", config)
        summary = prep_mod.prepare(config, run, workers=workers)
    prep_mod.show(summary)
    _done(f"cleaned text in {run.root / 'text'}", f"nmt bpe --run-dir {run.root}")


@app.command()
def bpe(
    run_dir: RunDirOption = Path("run"),
    vocab_size: Annotated[int, typer.Option(
        help="Joint vocabulary size (0: 8000 under 100k training pairs, 16000 under 1M, "
             "else 32000).")] = 0,
    sample_lines: Annotated[int, typer.Option(
        help="Sentences (both sides) sampled to learn BPE from.")] = 500_000,
    seed: Annotated[int, typer.Option(help="Seed of the sample.")] = 1,
    threads: Annotated[int, typer.Option(help="Threads for learning and encoding.")] = os.cpu_count() or 1,
) -> None:
    """Learn a joint sentencepiece BPE model and binarize every split."""
    from nmt_cli import bpe as bpe_mod
    from nmt_cli.config import BpeConfig
    from nmt_cli.rundir import RunDir

    config = BpeConfig(vocab_size=vocab_size, sample_lines=sample_lines, seed=seed, threads=threads)
    run = RunDir(run_dir)
    if not run.root.is_dir():
        raise NmtError(f"run directory {run.root} not found: run `nmt prep` first "
                       "(or pass --run-dir)")
    with run.lock("bpe"):
        run.save_config("bpe", config)
        result = bpe_mod.run_bpe(config, run)
    bpe_mod.show(result)
    _done(f"binarized data in {run.root / 'data'}", f"nmt train --run-dir {run.root}")


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
    clip_norm: Annotated[float, typer.Option(help="Gradient norm clipping (0: off).")] = 0.0,
    max_steps: Annotated[int, typer.Option(help="Stop after this many updates (0: no limit).")] = 100_000,
    max_epochs: Annotated[int, typer.Option(help="Stop after this many epochs (0: no limit).")] = 0,
    max_time: Annotated[float, typer.Option(help="Stop after this many minutes (0: no limit).")] = 0.0,
    precision: Annotated[str, typer.Option(
        help="auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16 (GPU).")] = "auto",
    eval_every: Annotated[int, typer.Option(help="Validate every N updates.")] = 1000,
    eval_bleu: Annotated[bool, typer.Option(help="Also log greedy BLEU on the validation set.")] = False,
    patience: Annotated[int, typer.Option(help="Stop after N validations without improvement (0: off).")] = 0,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N updates.")] = 1000,
    keep_last: Annotated[int, typer.Option(help="Checkpoints kept.")] = 20,
    seed: Annotated[int, typer.Option(help="Seed of initialisation, dropout and batch order.")] = 1,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    compile: Annotated[bool, typer.Option(help="torch.compile the model.")] = False,
    threads: Annotated[int, typer.Option(help="CPU threads (0: torch's default).")] = 0,
    max_bad_steps: Annotated[int, typer.Option(help="Stop after this many non-finite updates "
                                                    "in a row.")] = 20,
    gpus: Annotated[int, typer.Option(help="GPUs on this node: one NCCL worker each, through "
                                           "torch's elastic launcher.")] = 0,
    procs: Annotated[int, typer.Option(help="CPU worker processes (gloo), e.g. --procs 2 "
                                            "--device cpu.")] = 1,
    nnodes: Annotated[int, typer.Option(help="Nodes taking part (run the same command on each).")] = 1,
    node_rank: Annotated[int, typer.Option(help="This node's rank among --nnodes.")] = 0,
    rdzv_endpoint: Annotated[str, typer.Option(help="HOST:PORT of node 0, for --nnodes > 1.")] = "",
    max_restarts: Annotated[int, typer.Option(help="Restart failed workers up to N times; they "
                                                   "resume from the last checkpoint.")] = 0,
) -> None:
    """Train a Transformer on the binarized data; resumes from the last checkpoint."""
    import dataclasses

    from nmt_cli import training, ui
    from nmt_cli.config import TrainConfig
    from nmt_cli.engine import distributed, trainer
    from nmt_cli.rundir import RunDir

    run = RunDir(run_dir)
    if not run.root.is_dir():
        raise NmtError(f"run directory {run.root} not found: run `nmt prep` and `nmt bpe` first")
    given = {f.name: ctx.params[f.name] for f in dataclasses.fields(TrainConfig)
             if f.name in ctx.params}
    explicit = {name for name in given if _given(ctx, name)}
    how = training.Launch(gpus, procs, nnodes, node_rank, rdzv_endpoint, max_restarts)
    if how.needed:  # launch checks `how` before any work
        training.launch(run, training.settings(run, given, explicit), how)
        return
    # Under torchrun or SLURM, rank 0 takes the lock.
    rank = distributed.from_environment()[0]
    with run.lock("train") if rank == 0 else contextlib.nullcontext():
        config = training.settings(run, given, explicit)
        try:
            result = training.train_here(run, config, rank)
        except trainer.Interrupted as e:
            ui.say(str(e))
            raise typer.Exit(128 + e.signum) from None
    if rank == 0:
        ui.done(f"step {result['step']}: checkpoints in {run.checkpoints}",
                f"nmt average --run-dir {run.root}")


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether an option was set on the command line or through the environment."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


@app.command()
def average(
    run_dir: RunDirOption = Path("run"),
    last: Annotated[int, typer.Option(help="Average the last N checkpoints (the paper: 5 for "
                                           "base, 20 for big).")] = 5,
) -> None:
    """Average the last N checkpoints into the run's model."""
    from nmt_cli import ui
    from nmt_cli.engine import checkpoint
    from nmt_cli.rundir import RunDir

    if last < 1:
        raise NmtError("--last must be at least 1")
    run = RunDir(run_dir)
    with run.lock("average"):
        record = checkpoint.average_run(run, last, ui.say)
    ui.say(f"averaged {len(record['averaged'])} checkpoints (up to step {record['step']}) into "
           f"{run.averaged}")


BeamOption = Annotated[int, typer.Option(help="Beam size (1: greedy).")]
AlphaOption = Annotated[float, typer.Option(help="Length penalty ((5+|Y|)/6)^alpha.")]
MaxLenA = Annotated[float, typer.Option(help="Output length <= a * source length + b: a.")]
MaxLenB = Annotated[int, typer.Option(help="Output length <= a * source length + b: b.")]
CheckpointOption = Annotated[Optional[Path], typer.Option(
    help="Model file (default: the averaged model, else the latest checkpoint).")]
DeviceOption = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
PrecisionOption = Annotated[str, typer.Option(
    help="auto (fp32 on CPU, bf16 on GPU), fp32, bf16, fp16 (GPU).")]
Int8Option = Annotated[bool, typer.Option(
    "--int8", help="int8 weights, decoded by CTranslate2 (pip install 'nmt-cli[ct2]').")]
ModelOption = Annotated[Optional[Path], typer.Option(
    "--model", help="A directory from `nmt export` (instead of the run's model).")]
EngineOption = Annotated[str, typer.Option(
    help="nmt or ctranslate2 (auto: nmt; ctranslate2 for a CTranslate2 export or --int8).")]
ThreadsOption = Annotated[int, typer.Option(help="CPU threads (0: torch's default).")]


@app.command()
def translate(
    run_dir: RunDirOption = Path("run"),
    model: ModelOption = None,
    checkpoint: CheckpointOption = None,
    beam: BeamOption = 4,
    alpha: AlphaOption = 0.6,
    max_len_a: MaxLenA = 1.0,
    max_len_b: MaxLenB = 50,
    nbest: Annotated[int, typer.Option(help="Hypotheses per line, printed as "
                                            "'line<TAB>score<TAB>text'.")] = 1,
    max_tokens: Annotated[int, typer.Option(help="Padded source tokens per batch.")] = 4096,
    batch_size: Annotated[int, typer.Option(help="Sentences per batch.")] = 32,
    device: DeviceOption = "auto",
    precision: PrecisionOption = "auto",
    int8: Int8Option = False,
    engine: EngineOption = "auto",
    threads: ThreadsOption = 0,
) -> None:
    """Translate stdin to stdout, one line per line, with cached beam search.

    Each line is answered as soon as input pauses, so it also works as a filter on an open pipe."""
    from nmt_cli import scoring, ui
    from nmt_cli.config import TranslateConfig
    from nmt_cli.translate import Translator

    config = TranslateConfig(checkpoint=str(checkpoint) if checkpoint else None, beam=beam,
                             alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b, nbest=nbest,
                             max_tokens=max_tokens, batch_size=batch_size, device=device,
                             precision=precision, int8=int8, engine=engine, threads=threads)
    translator = Translator(_load_model(run_dir, model, config.checkpoint), config)
    with ui.progress() as bar:
        task = bar.add_task("translate", total=None)
        counts = translator.stream(sys.stdin.buffer, sys.stdout,
                                   lambda n: bar.advance(task, n))
    scoring.report_counts(counts, translator.max_src)


@app.command()
def score(
    hyp: Annotated[Optional[Path], typer.Option(help="Translations (default: stdin, or with "
                                                     "no --ref, the run's test set).")] = None,
    ref: Annotated[Optional[Path], typer.Option(help="References, line-aligned with --hyp.")] = None,
    src: Annotated[Optional[Path], typer.Option(help="Translate this file (with --ref, instead "
                                                     "of --hyp) with the model.")] = None,
    model: ModelOption = None,
    run_dir: RunDirOption = Path("run"),
    split: Annotated[str, typer.Option(
        help="Without --ref: the run's split to translate and score.")] = "test",
    metrics: Annotated[str, typer.Option(help="Comma-separated: bleu, chrf, ter.")] = "bleu,chrf,ter",
    tokenize: Annotated[str, typer.Option(help="sacreBLEU tokenizer for BLEU.")] = "13a",
    lowercase: Annotated[bool, typer.Option("--lowercase", help="Case-insensitive scores.")] = False,
    moses_lc: Annotated[bool, typer.Option("--moses-lc", help="Lowercase + Moses normalise + "
                                           "Moses tokenise both sides, BLEU with --tokenize none "
                                           "(how Multi30k papers report).")] = False,
    lang: Annotated[Optional[str], typer.Option(help="Target language for --moses-lc "
                                                     "(default: the run's).")] = None,
    compare: Annotated[Optional[Path], typer.Option(help="Another system's translations: "
                                                         "paired bootstrap test against it.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    checkpoint: CheckpointOption = None,
    beam: BeamOption = 4,
    alpha: AlphaOption = 0.6,
    max_len_a: MaxLenA = 1.0,
    max_len_b: MaxLenB = 50,
    device: DeviceOption = "auto",
    precision: PrecisionOption = "auto",
    int8: Int8Option = False,
    engine: EngineOption = "auto",
    threads: ThreadsOption = 0,
) -> None:
    """Score translations with sacreBLEU BLEU, chrF and TER (and their signatures)."""
    import json

    from nmt_cli import scoring
    from nmt_cli.config import TranslateConfig
    from nmt_cli.rundir import RunDir, atomic_write_json
    from nmt_cli.textio import read_lines

    metric_names = scoring.parse_metrics(metrics)
    run = RunDir(run_dir)
    config = TranslateConfig(checkpoint=str(checkpoint) if checkpoint else None, beam=beam,
                             alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b,
                             device=device, precision=precision, int8=int8, engine=engine,
                             threads=threads)
    if src is not None:
        if ref is None or hyp is not None:
            raise NmtError("--src needs --ref, and not --hyp")
        hyps = scoring.translate_lines(_load_model(run_dir, model, config.checkpoint), config, src)
        refs, names = list(read_lines(ref)), (f"{src} translated", str(ref))
    elif ref is None:
        if hyp is not None:
            raise NmtError("--hyp needs --ref (or give neither to score the run's test set)")
        found = _load_model(run_dir, model, config.checkpoint) if model else None
        hyp_path, ref_path = scoring.translate_split(run, split, config, found)
        hyps, refs = list(read_lines(hyp_path)), list(read_lines(ref_path))
        names = (str(hyp_path), str(ref_path))
    else:
        refs = list(read_lines(ref))
        hyps = list(read_lines(hyp)) if hyp is not None else _stdin_lines()
        names = (str(hyp) if hyp else "stdin", str(ref))
    if moses_lc and lang is None:  # the run's target language, if there is a run
        prepped = run.load_manifest().get("prep", {}) if run.manifest_path.exists() else {}
        lang = prepped.get("tgt", "en")
    report = scoring.report(
        hyps, refs, names, metric_names, tokenize=tokenize,
        lowercase=lowercase, moses_lc_lang=lang if moses_lc else None,
        baseline=(str(compare), list(read_lines(compare))) if compare is not None else None)
    if ref is None and model is None:
        atomic_write_json(run.scores(split), report)
    if json_out:
        print(json.dumps(report, indent=2))
        return
    for r in report["scores"]:
        print(f"{r['text']}\t{r['signature']}")
    for m, c in report.get("compare", {}).items():
        if m != "baseline":
            print(f"{m}: system {c['system']:.2f} vs baseline {c['baseline']:.2f}, "
                  f"p = {c['p_value']:.4f} (paired bootstrap)")


@app.command()
def export(
    out: Annotated[Path, typer.Argument(help="The directory to write (new or empty).")],
    fmt: Annotated[str, typer.Option("--format", help="nmt: a self-contained package "
                                     "(safetensors); ctranslate2: a CTranslate2 model.")] = "nmt",
    quantization: Annotated[str, typer.Option(help="ctranslate2: float32, int8, int8_float32, "
                                              "float16, bfloat16.")] = "float32",
    run_dir: RunDirOption = Path("run"),
    model: ModelOption = None,
    checkpoint: CheckpointOption = None,
) -> None:
    """Write the model, its sentencepiece model, settings and provenance into one directory."""
    from nmt_cli import package

    found = _load_model(run_dir, model, str(checkpoint) if checkpoint else None)
    if fmt == "nmt":
        if quantization != "float32":
            raise NmtError("--quantization is for --format ctranslate2")
        package.export_nmt(found, out)
    elif fmt == "ctranslate2":
        from nmt_cli import ct2
        ct2.export(found, out, quantization)
    else:
        raise NmtError(f"unknown --format {fmt!r}: choose nmt or ctranslate2")
    _done(f"exported {found.where} to {out}", f"nmt translate --model {out} < input.txt")


@app.command()
def serve(
    model: Annotated[Path, typer.Option("--model", help="A directory from `nmt export`.")],
    port: Annotated[int, typer.Option(help="TCP port (0: any free one, printed).")] = 8080,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    beam: BeamOption = 4,
    max_wait_ms: Annotated[float, typer.Option(help="How long a request may wait for others "
                                               "to share its batch.")] = 5.0,
    max_batch: Annotated[int, typer.Option(help="Sentences decoded together at most.")] = 64,
    batching: Annotated[bool, typer.Option("--batching/--no-batching", help="Decode concurrent "
                                           "requests together.")] = True,
    max_queue: Annotated[int, typer.Option(help="Sentences waiting at most; beyond, 503.")] = 1024,
    max_sentences: Annotated[int, typer.Option(help="Sentences per request; beyond, 413.")] = 256,
    engine: EngineOption = "auto",
    device: DeviceOption = "auto",
    threads: ThreadsOption = 0,
) -> None:
    """An HTTP JSON service: POST /translate {"text": [...]} -> {"translations": [...]}."""
    from nmt_cli import package
    from nmt_cli import serve as serve_mod
    from nmt_cli.config import ServeConfig, TranslateConfig

    translate_config = TranslateConfig(beam=beam, engine=engine, device=device, threads=threads)
    config = ServeConfig(host=host, port=port, max_wait_ms=max_wait_ms, max_batch=max_batch,
                         batching=batching,
                         max_queue=max_queue, max_sentences=max_sentences)
    serve_mod.run(package.from_dir(model), translate_config, config)


def _load_model(run_dir: Path, model: Optional[Path], checkpoint: Optional[str]):
    from nmt_cli import package
    from nmt_cli.rundir import RunDir
    if model is not None:
        if checkpoint:
            raise NmtError("--model and --checkpoint name two models: give one")
        return package.from_dir(model)
    return package.from_run(RunDir(run_dir), checkpoint)


def _stdin_lines() -> list[str]:
    from nmt_cli.textio import Damage, decode_line
    damage = Damage()
    return [decode_line(raw, i, damage) for i, raw in enumerate(sys.stdin.buffer, 1)]


@app.command()
def plot(
    run_dir: RunDirOption = Path("run"),
    out: Annotated[Optional[Path], typer.Option(help="PNG to write (default: curves.png in the "
                                                     "run directory).")] = None,
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
    minutes: Annotated[float, typer.Option(help="Time budget of the whole pipeline; all but "
                                                "a minute of it trains.")] = 15.0,
    mirror: Annotated[Optional[Path], typer.Option(
        envvar="NMT_MIRROR", help="Take Multi30k from this local folder instead of the "
                                  "network.")] = None,
    threads: ThreadsOption = 0,
) -> None:
    """Multi30k English-German end to end: prep, bpe, train, average, translate, score, plot.

    Further options go to `nmt train` and override the recipe's, e.g. `--size tiny`.
    """
    from nmt_cli import quickstart as quickstart_mod
    from nmt_cli.engine import trainer
    from nmt_cli.rundir import RunDir

    # Options meant for `nmt train` are checked now, not after prep and bpe have run.
    train_ctx = typer.main.get_command(app).get_command(ctx, "train").make_context(
        "nmt train", list(ctx.args))
    import dataclasses

    from nmt_cli.config import TrainConfig
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = {name: value for name, value in train_ctx.params.items()
                 if _given(train_ctx, name)}
    for name in set(overrides) - fields:
        raise NmtError(f"--{name.replace('_', '-')} is not for `nmt quickstart`, which trains "
                       "in this process: run the steps one by one to use it")
    try:
        quickstart_mod.run(RunDir(run_dir), minutes, str(mirror) if mirror else None, threads,
                           overrides)
    except trainer.Interrupted as e:  # its checkpoint is saved: a rerun resumes
        from nmt_cli import ui
        ui.say(str(e))
        raise typer.Exit(128 + e.signum) from None


# -- output helpers -----------------------------------------------------------------------------

def _done(message: str, next_command: str) -> None:
    from nmt_cli import ui
    ui.done(message, next_command)


def _error(message: str) -> None:
    # One line, whatever the message contains. A rank that torchrun started also hands it to
    # torchrun through its error file.
    message = ' '.join(str(message).split())
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
        _error(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback, "
               "and please report it)")
        code = 1
    sys.exit(code)
