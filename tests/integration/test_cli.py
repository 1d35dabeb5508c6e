import dataclasses
import subprocess
import sys

from conftest import one_error_line

from nmt_cli import __version__
from nmt_cli.config import DecodeOptions

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


_DECODING = {f.name for f in dataclasses.fields(DecodeOptions)}

# Each command's options that fill a config: (config, {field: option name where they differ},
# fields that are not options of that command); and the command's options that are no config's.
FILLED = {
    "prep": (
        [("PrepConfig", {}, {"recipe"})],
        {"recipe", "run_dir", "workers"},
    ),
    "bpe": ([("BpeConfig", {}, set())], {"run_dir"}),
    "train": (
        [("TrainConfig", {}, {"beta1", "adam_eps"}), ("LaunchConfig", {}, set())],
        {"run_dir", "config_file", "print_config"},
    ),
    "translate": (
        [("TranslateConfig", {}, {"decode", "chunk"}), ("DecodeOptions", {}, set())],
        {"run_dir", "model", "prefix", "constraints", "procs", "gpus", "config_file", "print_config"},
    ),
    "score": (
        [
            ("TranslateConfig", {}, {"decode", "chunk", "max_tokens", "batch_size"}),
            ("DecodeOptions", {}, {"nbest"}),
            ("ScoreConfig", {}, set()),
        ],
        {"model", "run_dir"},
    ),
    "score-pairs": (
        [
            ("TranslateConfig", {}, {"decode", "chunk", "shortlist", "comet"}),  # scored over every piece
            ("DecodeOptions", {}, _DECODING - {"alpha", "tag"}),
        ],
        {"src", "tgt", "run_dir", "model", "min_score", "kept_src", "kept_tgt"},
    ),
    "serve": (
        [
            ("ServeConfig", {}, {"shutdown_timeout"}),
            (
                "TranslateConfig",
                {},
                {
                    "checkpoint",
                    "decode",
                    "max_tokens",
                    "batch_size",
                    "chunk",
                    "precision",
                    "int8",
                    "comet",
                    "kiwi",
                    "comet_precision",
                },
            ),
            ("DecodeOptions", {}, set()),
        ],
        {"model", "config_file", "print_config"},
    ),
}


def test_every_config_field_is_its_option_with_the_same_default_and_help():
    """A config's fields and the options of the commands that fill it are declared apart (the
    dataclass, the Typer signature): they must agree name for name, default for default, and
    the --help text must be the field's own (config.knob), written once."""
    import dataclasses

    import typer

    from nmt_cli import config
    from nmt_cli.cli import app
    from nmt_cli.config.translation import help_of

    commands = typer.main.get_command(app).commands
    for command, (configs, own) in FILLED.items():
        params = {p.name: p for p in commands[command].params}
        covered = set(own)
        for name, renamed, hidden in configs:
            for field in dataclasses.fields(getattr(config, name)):
                where = f"{command} {name}.{field.name}"
                if field.name in hidden:
                    continue
                option = params.get(renamed.get(field.name, field.name))
                assert option is not None, f"{where} has no option"
                covered.add(option.name)
                default = option.default if option.default is not None or field.default != () else ()
                assert default == field.default, where
                assert option.help == help_of(getattr(config, name), field), where
        assert set(params) == covered, f"{command}: options that fill no config"
