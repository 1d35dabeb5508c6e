"""The `nmt` commands that use a trained model: translate, score, export, serve."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli import ui
from nmt_cli.cli import plain
from nmt_cli.cli.options import (
    CheckpointOption,
    ConfigFileOption,
    ModelOption,
    PrintConfigOption,
    RunDirOption,
    app,
    config_of,
    decoding_options,
    done,
    options_of,
    print_settings,
)
from nmt_cli.cli.plain import LOADING, TRANSLATE_ONLY, TRANSLATE_SWITCHES
from nmt_cli.config import ScoreConfig, ServeConfig, TranslateConfig
from nmt_cli.errors import NmtError


@app.command()
@decoding_options()
@options_of(TranslateConfig, only=TRANSLATE_ONLY, switches=TRANSLATE_SWITCHES)
def translate(
    ctx: typer.Context,
    run_dir: RunDirOption = Path("run"),
    model: ModelOption = None,
    prefix: Annotated[
        Optional[Path],
        typer.Option(
            help="Each translation begins with the line of this file of the same number (target text)."
        ),
    ] = None,
    constraints: Annotated[
        Optional[Path],
        typer.Option(
            help="Each translation contains the phrases (target text, tab-separated) of the line of "
            "this file of the same number; an empty line: none. nmt's engine, beam search.",
        ),
    ] = None,
    procs: Annotated[
        int,
        typer.Option(
            min=1,
            help="Worker processes decoding shares of the input on the CPU, --threads split between "
            "them; the output as from one process.",
        ),
    ] = 1,
    gpus: Annotated[
        int,
        typer.Option(
            min=0,
            help="Worker processes decoding shares of the input, one GPU each (0: none); "
            "CTranslate2: a replica of the model on each GPU, in this process.",
        ),
    ] = 0,
    config_file: ConfigFileOption = None,
    print_config: PrintConfigOption = False,
) -> None:
    """Translate stdin to stdout, one line per line, with cached beam search.

    Each line is answered as soon as input pauses, so it also works as a filter on an open pipe."""
    config = config_of(TranslateConfig, ctx)
    if print_config:
        print_settings(ctx, config, run_dir=run_dir, model=[str(m) for m in model or []])
        return
    plain.translate(run_dir, list(model or []), config, prefix, constraints, procs, gpus)


@app.command()
@decoding_options("nbest")
@options_of(TranslateConfig, only=(*LOADING, "shortlist", "comet_precision"), switches=("int8", "shortlist"))
@options_of(ScoreConfig, switches=("lowercase", "moses_lc", "compound_split", "json"))
def score(ctx: typer.Context, model: ModelOption = None, run_dir: RunDirOption = Path("run")) -> None:
    """Score translations with sacreBLEU BLEU, chrF and TER (and their signatures)."""
    from nmt_cli import score

    config, translating = config_of(ScoreConfig, ctx), config_of(TranslateConfig, ctx)
    score.run(run_dir, config, translating, list(model or []), _stdin_lines)


@app.command("score-pairs")
@decoding_options(only=("alpha", "tag"))
@options_of(
    TranslateConfig,
    only=(*LOADING, "max_tokens", "batch_size", "kiwi", "comet_precision"),
    switches=("int8",),
)
def score_pairs(
    ctx: typer.Context,
    src: Annotated[Path, typer.Option(help="Source lines.")],
    tgt: Annotated[Path, typer.Option(help="Their translations to score, line-aligned with --src.")],
    run_dir: RunDirOption = Path("run"),
    model: ModelOption = None,
    min_score: Annotated[
        Optional[float],
        typer.Option(
            help="Keep the pairs scoring at least this (CometKiwi's score with --kiwi, else the "
            "log-probability per token) in --kept-src and --kept-tgt.",
        ),
    ] = None,
    kept_src: Annotated[
        Optional[Path], typer.Option(help="Where --min-score writes the kept sources.")
    ] = None,
    kept_tgt: Annotated[
        Optional[Path], typer.Option(help="Where --min-score writes the kept targets.")
    ] = None,
) -> None:
    """Score given translations (forced decoding): how likely the model finds each --tgt line
    as the translation of its --src line, for filtering a noisy corpus or reranking.

    Prints one line per pair: the log-probability (its EOS counted), the same per token, and the
    score a search gives it (divided by the length penalty of --alpha), tab-separated. With
    --kiwi, CometKiwi's score of the pair alone (no translation model is read)."""
    from nmt_cli import score_pairs as step
    from nmt_cli.inference.backend import loaded
    from nmt_cli.inference.translator import Translator

    config = config_of(TranslateConfig, ctx)
    keep = step.Keep.of(min_score, kept_src, kept_tgt)
    if config.kiwi is not None:  # quality estimation: no translation model is read
        step.kiwi_pairs(config, src, tgt, sys.stdout, keep)
        return
    found, choice = loaded(run_dir, model, config.checkpoint, config)
    ui.verbose(f"engine: {choice}")
    step.score_pairs(Translator(found, config, choice=choice), src, tgt, sys.stdout, keep)


@app.command()
def export(
    out: Annotated[Path, typer.Argument(help="The directory to write (new or empty).")],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="nmt: a self-contained package (safetensors); ctranslate2: a CTranslate2 model; "
            "huggingface: a folder transformers loads (MarianMTModel, or M2M100 for a pre-norm model).",
        ),
    ] = "nmt",
    quantization: Annotated[
        str, typer.Option(help="ctranslate2: float32, int8, int8_float32, float16, bfloat16.")
    ] = "float32",
    run_dir: RunDirOption = Path("run"),
    model: ModelOption = None,
    checkpoint: CheckpointOption = None,
) -> None:
    """Write the model, its sentencepiece models, settings and provenance into one directory."""
    from nmt_cli.export import export as run_export

    done(*run_export(run_dir, model, str(checkpoint) if checkpoint else None, out, fmt, quantization))


@app.command("import")
def import_(
    folder: Annotated[
        Path,
        typer.Argument(
            help="A Hugging Face MarianMTModel, M2M100 or NLLB folder (e.g. Helsinki-NLP/opus-mt-en-de, "
            "facebook/nllb-200-distilled-600M, downloaded)."
        ),
    ],
    out: Annotated[Path, typer.Argument(help="The nmt package to write (a new or empty directory).")],
    src: Annotated[Optional[str], typer.Option(help="Source language (default: the folder's own).")] = None,
    tgt: Annotated[Optional[str], typer.Option(help="Target language (default: the folder's own).")] = None,
    trim: Annotated[
        Optional[list[Path]],
        typer.Option(
            help="A multilingual model's vocabulary cut to the pieces of this text (given again: of "
            "several files) and of --languages.",
        ),
    ] = None,
    languages: Annotated[
        Optional[str],
        typer.Option(
            help="With --trim: the language codes kept, comma-separated (default: --src and --tgt)."
        ),
    ] = None,
) -> None:
    """Read a Marian, M2M100 or NLLB model in the Hugging Face format as an nmt package: translate,
    serve, score, export it, or fine-tune it (`nmt bpe --from PACKAGE`, `nmt train --init-from PACKAGE`)."""
    from nmt_cli.hf.read import import_marian

    if languages and not trim:
        raise NmtError("--languages chooses what --trim keeps: give --trim FILE")
    kept = [code for code in (languages or "").split(",") if code]
    imported = import_marian(folder, out, src, tgt, trim or [], kept)
    c = imported.config
    done(
        f"imported {folder} ({c.num_encoder_layers}+{c.num_decoder_layers} layers, d_model {c.d_model}, "
        f"{c.src_vocab_size} source and {c.vocab_size} target pieces) to {out}",
        f"nmt translate --model {out} < input.txt",
    )


@app.command()
@options_of(
    ServeConfig,
    "shutdown_timeout",
    switches=(),
    panel="Serving",
    settings={"api_key": {"envvar": "NMT_API_KEY", "show_default": False}},
)
@decoding_options()
@options_of(
    TranslateConfig, only=("engine", "device", "threads", "cuda_graphs", "shortlist"), switches=("shortlist",)
)
def serve(
    ctx: typer.Context,
    model: Annotated[
        Path,
        typer.Option("--model", help="A directory from `nmt export`, a run directory or a checkpoint file."),
    ],
    config_file: ConfigFileOption = None,
    print_config: PrintConfigOption = False,
) -> None:
    """An HTTP JSON service: POST /translate {"text": [...]} -> {"translations": [...]}."""
    from nmt_cli.inference.backend import loaded
    from nmt_cli.serve import app as serve_mod

    translate_config, config = config_of(TranslateConfig, ctx), config_of(ServeConfig, ctx)
    if print_config:
        print_settings(ctx, translate_config, config, model=model)
        return
    serve_mod.require()  # before the model loads: a missing or old aiohttp is one line
    found, choice = loaded(Path("."), [model], None, translate_config)
    ui.verbose(f"engine: {choice}")
    serve_mod.run(found, translate_config, config, choice)


def _stdin_lines() -> list[str]:
    from nmt_cli.textio import Damage, decode_line

    damage = Damage()
    return [decode_line(raw, i, damage) for i, raw in enumerate(sys.stdin.buffer, 1)]
