"""What the `nmt` commands share: the Typer app and the options several commands take."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

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


BeamOption = Annotated[int, typer.Option(help="Beam size (1: greedy).")]
AlphaOption = Annotated[float, typer.Option(help="Length penalty ((5+|Y|)/6)^alpha.")]
MaxLenA = Annotated[float, typer.Option(help="Output length <= a * source length + b: a.")]
MaxLenB = Annotated[int, typer.Option(help="Output length <= a * source length + b: b.")]
CheckpointOption = Annotated[
    Optional[Path], typer.Option(help="Model file (default: the averaged model, else the latest checkpoint).")
]
DeviceOption = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
PrecisionOption = Annotated[str, typer.Option(help="auto (fp32), fp32, bf16, fp16 (GPU).")]
Int8Option = Annotated[
    bool, typer.Option("--int8", help="int8 weights, decoded by CTranslate2 (pip install 'nmt-cli[ct2]').")
]
ModelOption = Annotated[
    Optional[list[Path]],
    typer.Option(
        "--model",
        help="An `nmt export` directory, a run directory or a checkpoint (instead of --run-dir's "
        "model); give it again for an ensemble of models that share a vocabulary.",
    ),
]
EngineOption = Annotated[
    str, typer.Option(help="nmt or ctranslate2 (auto: nmt; ctranslate2 for a CTranslate2 export or --int8).")
]
ThreadsOption = Annotated[
    int, typer.Option(help="CPU threads (0: torch's default; CTranslate2: one per CPU this process may use).")
]


def done(message: str, next_command: str) -> None:
    from nmt_cli import ui

    ui.done(message, next_command)


def given_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether an option was set on the command line or through the environment."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")
