"""The `nmt` command: options become a typed config at this boundary, then one call does the work.

One file per group of commands, registered here in the order `nmt --help` lists them:
prepare.py (prep, bpe), train.py (train, average, plot), use.py (translate, score, export, serve),
quickstart.py; options.py holds the app and the options several commands share.

stdout carries data only (translations, scores); everything said to the user goes to stderr.
Nothing heavy is imported at module level, so `nmt --help` stays fast (no torch).
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

try:  # typer >= 0.22 carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exceptions

from nmt_cli import __version__, ui
from nmt_cli.cli.options import app
from nmt_cli.errors import NmtError

_debug = bool(os.environ.get("NMT_DEBUG"))


def _version(value: bool) -> None:
    if value:
        print(f"nmt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks on errors.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", help="Say what was chosen and why (as the engine that decodes).")
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    global _debug
    _debug = _debug or debug
    ui.VERBOSE = ui.VERBOSE or verbose


# The commands, in the order of `nmt --help`.
# isort: off
from nmt_cli.cli import prepare  # noqa: E402,F401
from nmt_cli.cli import train  # noqa: E402,F401
from nmt_cli.cli import use  # noqa: E402,F401
from nmt_cli.cli import quickstart  # noqa: E402,F401

# isort: on

# -- output helpers -----------------------------------------------------------------------------


def _error(message: str) -> None:
    # One line, whatever the message contains. A rank that torchrun started also hands it to
    # torchrun through its error file.
    message = ui.printable(" ".join(str(message).split()))
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from nmt_cli.engine.launcher import record_worker_error

        record_worker_error(message)
    print(f"nmt: error: {message}", file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: runs the app and turns every failure into one line on stderr and an exit code."""
    global _debug
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:  # accepted anywhere, not only before the command
        _debug = True
        args = [a for a in args if a != "--debug"]
    if "--verbose" in args:
        ui.VERBOSE = True
        args = [a for a in args if a != "--verbose"]
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
