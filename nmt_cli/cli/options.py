"""What the `nmt` commands share: the Typer app and the options several commands take."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli.config import DecodeOptions, TranslateConfig

app = typer.Typer(
    name="nmt",
    help="Transformer neural machine translation: prep -> bpe -> train -> average -> "
    "translate -> score, all in one run directory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

RunDirOption = Annotated[
    Path,
    typer.Option(
        "--run-dir", envvar="NMT_RUN_DIR", help="The run directory: every step reads and writes here."
    ),
]


def about(config: type, name: str, *names: str, **settings) -> typer.models.OptionInfo:
    """The option of `config`'s field `name`, its --help text the field's own (config.knob)."""
    import dataclasses

    from nmt_cli.config.translation import help_of

    field = {f.name: f for f in dataclasses.fields(config)}[name]
    return typer.Option(*names, help=help_of(config, field), **settings)


CheckpointOption = Annotated[Optional[Path], about(TranslateConfig, "checkpoint")]
ModelOption = Annotated[
    Optional[list[Path]],
    typer.Option(
        "--model",
        help="An `nmt export` directory, a run directory or a checkpoint (instead of --run-dir's "
        "model); give it again for an ensemble of models that share a vocabulary.",
    ),
]


def options_of(
    config: type,
    *leave_out: str,
    only: tuple[str, ...] = (),
    switches: tuple[str, ...] | None = None,
    panel: str | None = None,
    settings: dict[str, dict] | None = None,
    flags: dict[str, str] | None = None,
) -> Callable[[Callable], Callable]:
    """The command takes every field of the dataclass `config` (but `leave_out`; or `only` these)
    as an option, with the field's type, default and help: a new setting reaches the CLI without
    being declared again, and the command's signature holds only what fills no config. A bool
    field is a switch (--sample, not --sample/--no-sample) if named in `switches` (None: every
    bool); `settings`: a field's further typer.Option settings (an environment variable); `flags`:
    a field's option under another name (from_model: --from). config_of reads them back into the
    command's config."""
    import dataclasses
    import functools
    import inspect
    import typing

    hints, settings = typing.get_type_hints(config), settings or {}
    fields = [
        f for f in dataclasses.fields(config) if f.name not in leave_out and (not only or f.name in only)
    ]

    def flag(field: dataclasses.Field) -> tuple[str, ...]:
        if flags and field.name in flags:
            return (flags[field.name],)
        switch = hints[field.name] is bool and (switches is None or field.name in switches)
        return (f"--{field.name.replace('_', '-')}",) if switch else ()

    def option_type(field: dataclasses.Field) -> tuple[object, object]:
        """The option's type and default: a tuple field (tuple[X, ...]) is an option given again
        for each value, a list to typer (the config makes it a tuple again)."""
        hint = hints[field.name]
        args = typing.get_args(hint)
        if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
            return Optional[list[args[0]]], None
        return hint, field.default

    def add(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        added = [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=option_type(f)[1],
                annotation=Annotated[
                    option_type(f)[0],
                    about(config, f.name, *flag(f), rich_help_panel=panel, **settings.get(f.name, {})),
                ],
            )
            for f in fields
        ]

        @functools.wraps(command)
        def run(*args, **kwargs):
            for f in fields:  # read back from the context, as the command's other options
                kwargs.pop(f.name)
            return command(*args, **kwargs)

        run.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *added])
        return run

    return add


def decoding_options(*leave_out: str, only: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Every field of DecodeOptions (but `leave_out`; or `only` these) as an option of the
    command, in the "Decoding" panel of its --help."""
    return options_of(DecodeOptions, *leave_out, only=only, panel="Decoding")


def config_of(cls, ctx: typer.Context):
    """The config `cls` of a command's options: those named as its fields (one definition of
    what each means, in config/); paths become strings, as the configs keep them."""
    import dataclasses

    given = {f.name: ctx.params[f.name] for f in dataclasses.fields(cls) if f.name in ctx.params}
    for f in dataclasses.fields(cls):  # a config within the config (TranslateConfig.decode)
        if dataclasses.is_dataclass(f.default):
            given[f.name] = config_of(type(f.default), ctx)
    return cls(**{k: str(v) if isinstance(v, Path) else v for k, v in given.items()})


def done(message: str, next_command: str) -> None:
    from nmt_cli import ui

    ui.done(message, next_command)


def given_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether an option was set on the command line, through the environment or in --config."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "DEFAULT_MAP")


def _read_config_file(ctx: typer.Context, param, value: Optional[Path]) -> Optional[Path]:
    """--config FILE (YAML or JSON): its settings become the command's defaults, so that the
    command line overrides them; an unknown key is one error naming its line and the nearest
    option."""
    if value is None:
        return value
    from nmt_cli.cli.settings_file import read_settings
    from nmt_cli.errors import NmtError

    settings, lines = read_settings(Path(value))
    names = {p.name for p in ctx.command.params if p.name not in ("config_file", "print_config")}
    given = {}
    for key, setting in settings.items():
        name = str(key).replace("-", "_")
        if name not in names:
            import difflib

            near = difflib.get_close_matches(name, sorted(names), n=1)
            hint = f": did you mean {near[0]}?" if near else f" for `nmt {ctx.command.name}`"
            raise NmtError(f"{value}, line {lines.get(key, '?')}: unknown setting {key!r}{hint}")
        given[name] = [str(x) for x in setting] if isinstance(setting, list) else setting
    ctx.default_map = {**(ctx.default_map or {}), **given}
    return value


ConfigFileOption = Annotated[
    Optional[Path],
    typer.Option(
        "--config",
        help="A YAML or JSON file of this command's options (names as here, with - or _); the "
        "command line overrides it.",
        is_eager=True,
        callback=_read_config_file,
    ),
]
PrintConfigOption = Annotated[
    bool,
    typer.Option(
        "--print-config",
        help="Print the settings this command would use (a file --config takes), then stop.",
    ),
]


def print_settings(ctx: typer.Context, *configs, **extra) -> None:
    """Print the settings of `configs` (a config within a config flattened) and `extra` that
    are options of this command, as a file --config reads; secrets left out."""
    import dataclasses

    from nmt_cli.cli.settings_file import write_settings

    names = {p.name for p in ctx.command.params} - {"config_file", "print_config", "api_key"}
    flat: dict = {}
    for config in configs:
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            flat.update(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else {f.name: value})
    flat.update({k: str(v) if isinstance(v, Path) else v for k, v in extra.items()})
    sys.stdout.write(write_settings({k: v for k, v in flat.items() if k in names}))
