import subprocess
import sys

from conftest import one_error_line

from nmt_cli import __version__

COMMANDS = ["prep", "bpe", "train", "average", "translate", "score"]


def test_help_lists_every_command_without_importing_torch():
    code = (
        "import sys\nfrom nmt_cli.cli import main\ntry:\n    main(['--help'])\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "NO-TORCH" in done.stderr
    for command in COMMANDS:
        assert command in done.stdout


def test_python_m_and_version():
    done = subprocess.run(
        [sys.executable, "-m", "nmt_cli", "--version"], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == f"nmt {__version__}"


def test_usage_error_is_one_line(nmt):
    line = one_error_line(nmt("bpe", "--vocab-size", "many"))
    assert "--vocab-size" in line and "nmt bpe --help" in line


def test_unknown_recipe_is_one_line(nmt):
    line = one_error_line(nmt("prep", "wmt99"))
    assert "wmt99" in line


def test_the_suite_runs_without_a_gpu_unless_asked():
    """conftest hides GPUs, so `--device auto` means the CPU here on any machine."""
    import os

    import torch

    if os.environ.get("NMT_TEST_GPU") != "1":
        assert not torch.cuda.is_available() and os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_train_options_are_the_config_fields_with_the_same_defaults():
    """`nmt train`'s options and TrainConfig are written twice (declaration and dataclass):
    they must agree, name for name and default for default."""
    import dataclasses

    import typer

    from nmt_cli.cli import app
    from nmt_cli.config import TrainConfig
    from nmt_cli.training import Launch

    params = {p.name: p for p in typer.main.get_command(app).commands["train"].params}
    launch = {f.name: f for f in dataclasses.fields(Launch)}  # the launcher's options
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hidden = {"beta1", "adam_eps"}  # the paper's values, not options
    assert set(params) - set(launch) - {"ctx", "run_dir"} == set(fields) - hidden
    for name in set(fields) - hidden:
        assert params[name].default == fields[name].default, name
    for name, field in launch.items():
        assert params[name].default == field.default, name
