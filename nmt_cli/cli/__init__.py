"""The `nmt` command: options become a typed config at this boundary, then one call does the work.

commands.py builds the typer app (options.py holds it and the options several commands share);
plain.py reads a plain `nmt translate` without it, so that a filter on a pipe starts at once.

stdout carries data only (translations, scores); everything said to the user goes to stderr.
Nothing heavy is imported at module level, so `nmt --help` stays fast (no torch).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from nmt_cli import ui
from nmt_cli.errors import NmtError

_debug = bool(os.environ.get("NMT_DEBUG"))


def __getattr__(name: str) -> Any:
    if name == "app":  # the typer app, built on first use
        from nmt_cli.cli.commands import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _error(message: str) -> None:
    # One line, whatever the message contains. A rank that torchrun started also hands it to
    # torchrun through its error file.
    message = ui.printable(" ".join(str(message).split()))
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from nmt_cli.engine.launcher import record_worker_error

        record_worker_error(message)
    print(f"nmt: error: {message}", file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: runs the command and turns every failure into one line on stderr and an exit code."""
    global _debug
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:  # accepted anywhere, not only before the command
        _debug = True
        args = [a for a in args if a != "--debug"]
    if "--verbose" in args:
        ui.VERBOSE = True
        args = [a for a in args if a != "--verbose"]
    try:
        from nmt_cli.cli import plain

        read = plain.given(args)
        if read is None:
            code = _typed(args)
        else:
            plain.translate(*read)
            code = 0
    except KeyboardInterrupt:
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


def _typed(args: list[str]) -> int:
    """`args` read by the typer app; typer's own exits and usage errors as exit codes."""
    import typer

    try:  # typer >= 0.22 carries its own copy of click
        from typer._click import exceptions as click_exceptions
    except ImportError:  # pragma: no cover - older typer uses click itself
        from click import exceptions as click_exceptions  # type: ignore[no-redef]

    from nmt_cli.cli.commands import app

    command = typer.main.get_command(app)
    try:
        result = command.main(args=args, prog_name="nmt", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except typer.Exit as e:
        return e.exit_code
    except click_exceptions.UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `nmt`: show the help
            e.show()
            sys.exit(2)
        where = e.ctx.command_path if e.ctx is not None else "nmt"
        _error(f"{e.format_message()} (see `{where} --help`)")
        return 2
    except typer.Abort:
        _error("interrupted")
        return 130
