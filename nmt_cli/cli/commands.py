"""The typer app whole: the options of `nmt` itself, and every command registered, in the order
`nmt --help` lists them (one file per group: prepare.py, train.py, use.py, quickstart.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from nmt_cli import __version__, ui
from nmt_cli.cli.options import app


def _version(value: bool) -> None:
    if value:
        print(f"nmt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    # read by cli.main wherever it stands on the command line; declared here for --help
    debug: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks on errors.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", help="Say what was chosen and why (as the engine that decodes).")
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    ui.VERBOSE = ui.VERBOSE or verbose


# isort: off
from nmt_cli.cli import prepare  # noqa: E402,F401
from nmt_cli.cli import train  # noqa: E402,F401
from nmt_cli.cli import use  # noqa: E402,F401
from nmt_cli.cli import quickstart  # noqa: E402,F401

# isort: on
