"""`nmt quickstart`: Multi30k end to end, one command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli.cli.options import RunDirOption, app, given_on_command_line


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
    overrides = {
        name: value for name, value in train_ctx.params.items() if given_on_command_line(train_ctx, name)
    }
    try:
        quickstart_mod.run(
            RunDir(run_dir), minutes, str(mirror) if mirror else None, threads, overrides, lowercase
        )
    except Interrupted as e:  # its checkpoint is saved: a rerun resumes
        from nmt_cli import ui

        ui.say(str(e))
        raise typer.Exit(128 + e.signum) from None
