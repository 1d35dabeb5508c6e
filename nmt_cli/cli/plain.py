"""`nmt translate` as a plain Unix filter, started without typer.

Typer builds every command and reads its options through pydantic: a tenth of a second or more
before the first line, most of a one-line call on CTranslate2. A command line of `nmt translate`
whose options are all plain (a config field with its value, --run-dir, --model) is read here,
from the same fields and option lists the typer command is built from (use.py), into the same
config, then handed to the same `translate`; anything else (--help, --config, a value that is
not plainly a number, an option given twice, a name it does not know) is left to typer, which
reads it or says what is wrong. tests/integration/test_plain_pipe.py holds both readings equal.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import typing
from pathlib import Path

from nmt_cli.config import DecodeOptions, TranslateConfig

# TranslateConfig's settings of how a model is loaded and run, options of every command that
# translates or scores with one
LOADING = ("checkpoint", "device", "precision", "int8", "engine", "threads", "cuda_graphs")
# `nmt translate`'s TranslateConfig options (every DecodeOptions field is one too), and those of
# them that are switches (--int8; a bool field not named here is --x/--no-x)
TRANSLATE_ONLY = (*LOADING, "max_tokens", "batch_size", "shortlist", "comet", "kiwi", "comet_precision")
TRANSLATE_SWITCHES = ("int8", "shortlist")

NUMBER = {int: re.compile(r"-?[0-9]+"), float: re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")}


def _fields() -> dict[str, tuple[str, type]]:
    """--option -> (the field it sets, of which config: "decode" or ""), its plain type."""
    out = {}
    for config, where, only, switches in (
        (DecodeOptions, "decode", None, None),  # decoding_options(): every bool a switch
        (TranslateConfig, "", TRANSLATE_ONLY, TRANSLATE_SWITCHES),
    ):
        hints = typing.get_type_hints(config)
        for f in dataclasses.fields(config):
            if only is not None and f.name not in only:
                continue
            kind = hints[f.name]
            kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # X | None
            if kind is bool and switches is not None and f.name not in switches:
                continue  # --x/--no-x: typer's
            out[f"--{f.name.replace('_', '-')}"] = (f"{where}.{f.name}".lstrip("."), kind)
    return out


def given(args: list[str]) -> tuple[Path, list[Path], TranslateConfig] | None:
    """The run directory, models and config of `nmt translate ARGS` where every option is plain;
    None where typer must read them."""
    if args[:1] != ["translate"]:
        return None
    fields, settings, decode = _fields(), {}, {}
    run_dir, models, seen = None, [], set()
    rest = args[1:]
    while rest:
        option, rest = rest[0], rest[1:]
        name, eq, value = option.partition("=")
        if not name.startswith("--") or (name in seen and name != "--model"):
            return None
        seen.add(name)
        field, kind = fields.get(name, ("", str))  # --run-dir, --model (and the unknown): a value
        if kind is bool:  # a switch
            if eq:
                return None
        elif not eq:
            if not rest:
                return None
            value, rest = rest[0], rest[1:]
        if value.startswith("-") and not NUMBER[float].fullmatch(value):
            return None  # typer reads an option's value as it will
        if name == "--run-dir":
            run_dir = Path(value)
        elif name == "--model":
            models.append(Path(value))
        elif not field:
            return None
        else:
            if kind is bool:
                parsed: object = True
            elif kind in NUMBER:
                if not NUMBER[kind].fullmatch(value):
                    return None
                parsed = kind(value)
            elif kind is str:
                parsed = value
            else:
                return None
            where, _, key = field.rpartition(".")
            (decode if where else settings)[key] = parsed
    run_dir = run_dir or Path(os.environ.get("NMT_RUN_DIR") or "run")
    return run_dir, models, TranslateConfig(**settings, decode=DecodeOptions(**decode))


def translate(
    run_dir: Path,
    model: list[Path],
    config: TranslateConfig,
    prefix: Path | None = None,
    constraints: Path | None = None,
    procs: int = 1,
    gpus: int = 0,
) -> None:
    """`nmt translate`'s work once its options are read (by typer, or by `given`)."""
    from nmt_cli import ui
    from nmt_cli.errors import NmtError
    from nmt_cli.inference import models, workers
    from nmt_cli.inference.backend import loaded
    from nmt_cli.inference.translator import Translator, check_options
    from nmt_cli.translate import spread_stream, stream

    workers.check(procs, gpus, config)
    for path, name in ((prefix, "--prefix"), (constraints, "--constraints")):
        if path is not None and not path.is_file():
            raise NmtError(f"{name} {path} not found")
    spread = workers.Spread(run_dir, model, config.checkpoint, procs, gpus)
    # with workers, they load the model: this process reads and writes the lines only
    found, choice = loaded(
        run_dir, model, config.checkpoint, config, constraints is not None, procs, not spread.workers
    )
    check_options(choice, config.decode, constraints is not None)
    ui.verbose(f"engine: {choice}")
    if choice.engine == "ctranslate2":
        if procs > 1:
            raise NmtError(
                "--procs is for nmt's engine: CTranslate2 decodes several batches at once itself, "
                "one per --threads"
            )
        if spread.workers and not found.converted:  # described only: read (and checked) here
            found = models.load(run_dir, model, config.checkpoint)
        spread = dataclasses.replace(spread, gpus=0)  # its replicas share the batches here
    if spread.workers:
        spread_stream(found, config, spread, sys.stdin.buffer, sys.stdout, prefix, constraints)
        return
    translator = Translator(found, config, gpus, choice)
    stream(translator, sys.stdin.buffer, sys.stdout, "translate", None, prefix, constraints)
