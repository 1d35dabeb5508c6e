"""`nmt translate` read without typer (cli/plain.py) where its options are plain: the same run
directory, models and config as typer reads from the same command line, or the same error; and
every command line it is not sure of left to typer."""

from pathlib import Path

import pytest

from nmt_cli import cli
from nmt_cli.cli import plain
from nmt_cli.errors import NmtError

READ_BOTH_WAYS = [
    ["translate"],
    ["translate", "--run-dir", "r", "--beam", "5", "--alpha=0.7", "--tgt-lang", "fr", "--src-lang", "en"],
    ["translate", "--model", "a", "--model", "b", "--checkpoint", "c.pt", "--engine", "nmt"],
    ["translate", "--threads", "2", "--run-dir=r"],
    ["translate", "--sample", "--topk", "10", "--temperature", "0.5", "--seed", "7", "--nbest", "2"],
    ["translate", "--scores", "--nbest", "3"],
    ["translate", "--topp", "0.9", "--epsilon", "0.02", "--sample", "--tag=<2de>"],
    ["translate", "--int8", "--shortlist", "--max-tokens", "100", "--batch-size", "3", "--device", "cpu"],
    ["translate", "--precision", "fp32", "--alignments", "--max-len-a", "1.5", "--max-len-b", "7"],
    ["translate", "--coverage-penalty", "0.2", "--repetition-penalty", "1.2", "--no-repeat-ngram", "3"],
    ["translate", "--min-len", "1", "--max-len", "20", "--mbr", "chrf", "--candidates", "8", "--tag", ""],
    ["translate", "--comet", "x", "--kiwi", "y", "--comet-precision", "bf16", "--rerank", "kiwi"],
    ["translate", "--alpha", "1e-1", "--beam", "0"],  # out of range: the config's one error, either way
    ["translate", "--engine", "neither"],
]

LEFT_TO_TYPER = [
    ["translate", "--help"],
    ["translate", "-h"],
    ["translate", "--beam", "x"],
    ["translate", "--alpha", "nan"],
    ["translate", "--beam", "1_0"],
    ["translate", "--beam", "4", "--beam", "5"],
    ["translate", "--beam"],
    ["translate", "--config", "settings.yaml"],
    ["translate", "--print-config"],
    ["translate", "--procs", "2"],
    ["translate", "--prefix", "p.txt"],
    ["translate", "--cuda-graphs"],  # --cuda-graphs/--no-cuda-graphs: not a switch
    ["translate", "--no-cuda-graphs"],
    ["translate", "--sample=1"],
    ["translate", "--tag", "-x"],
    ["translate", "stray"],
    ["translate", "--nope", "1"],
    ["translate", "--chunk", "5"],  # a TranslateConfig field that is not translate's option
    ["score", "--beam", "5"],
    ["--version"],
]


def read(args, how, monkeypatch):
    """What `translate` is handed for `args` (read by typer, or by plain.given), or the error."""
    handed = []
    monkeypatch.setattr(plain, "translate", lambda *a: handed.append(a))
    try:
        if how == "typer":
            assert cli._typed(args) == 0
            (run_dir, models, config, prefix, constraints, procs, gpus) = handed[0]
            assert (prefix, constraints, procs, gpus) == (None, None, 1, 0)
            return run_dir, models, config
        return plain.given(args)
    except NmtError as e:
        return str(e)


@pytest.mark.parametrize("args", READ_BOTH_WAYS, ids=" ".join)
def test_a_plain_command_line_is_read_as_typer_reads_it(args, monkeypatch):
    monkeypatch.delenv("NMT_RUN_DIR", raising=False)
    fast = read(args, "plain", monkeypatch)
    assert fast is not None and fast == read(args, "typer", monkeypatch)


def test_the_run_directory_from_the_environment_as_typer_takes_it(monkeypatch):
    monkeypatch.setenv("NMT_RUN_DIR", "elsewhere")
    fast = read(["translate", "--beam", "2"], "plain", monkeypatch)
    assert fast[0] == Path("elsewhere") and fast == read(["translate", "--beam", "2"], "typer", monkeypatch)


@pytest.mark.parametrize("args", LEFT_TO_TYPER, ids=" ".join)
def test_what_is_not_plain_is_left_to_typer(args):
    assert plain.given(args) is None
