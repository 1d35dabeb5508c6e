"""--init-from: fine-tuning from another model, with or without its optimizer and schedule."""

import dataclasses
import json
import re
import shutil

import pytest
from conftest import (
    LONGER,
    TINY,
    UNTRAINED,
    final_weights,
    one_error_line,
)

from nmt_cli import train as train_mod
from nmt_cli.config import TrainConfig
from nmt_cli.engine import checkpoint
from nmt_cli.engine.schedule import learning_rate
from nmt_cli.inference.models import locate
from nmt_cli.rundir import RunDir


def test_fine_tuning_starts_from_the_model_on_its_bpe(trained_longer, tmp_path, nmt):
    """New data (Multi30k's test2017 as a corpus of its own) encoded with the trained model's
    BPE, then trained from its weights: it starts where that model was, with a fresh schedule."""
    text = trained_longer / "text"
    runs = {}
    for name, init in (("tuned", ["--init-from", trained_longer]), ("fresh", [])):
        run = tmp_path / name
        bpe = ["--from", trained_longer] if init else ["--vocab-size", "1000"]
        for command in (
            ["prep", "custom", "--train-src", text / "test2017.en", "--train-tgt", text / "test2017.de"],
            ["bpe", *bpe],
            [
                "train",
                *LONGER,
                "--max-steps",
                "10",
                "--eval-every",
                "10",
                "--save-every",
                "10",
                "--warmup",
                "100",
                *init,
            ],
        ):
            result = nmt(*command, "--run-dir", run)
            assert result.code == 0, (command, result.err)
        runs[name] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert (tmp_path / "tuned" / "bpe" / "spm.model").read_bytes() == (
        trained_longer / "bpe" / "spm.model"
    ).read_bytes()
    first = {name: next(r for r in records if r["kind"] == "train") for name, records in runs.items()}
    assert first["tuned"]["step"] == first["fresh"]["step"] == 1
    assert first["tuned"]["lr"] == first["fresh"]["lr"]  # the schedule starts afresh
    assert first["tuned"]["loss"] < first["fresh"]["loss"] - 1.5, first
    assert "starting from the weights of" in (tmp_path / "tuned" / "log.txt").read_text()
    # Fresh: Adam's own step count starts at 0 too.
    tensors, _ = checkpoint.load_tensors(tmp_path / "tuned" / "checkpoints" / "checkpoint_00000010.pt")
    assert {float(s["step"]) for s in tensors["optimizer"]["state"].values()} == {10.0}


def test_fine_tuning_can_keep_the_optimizer_and_the_schedule(trained_longer, tmp_path, nmt, monkeypatch):
    text, run = trained_longer / "text", tmp_path / "kept"
    start = checkpoint.listed(trained_longer / "checkpoints")[-1]
    before, meta = checkpoint.load_tensors(start)
    assert meta["step"] == 800
    for command in (
        ["prep", "custom", "--train-src", text / "test2017.en", "--train-tgt", text / "test2017.de"],
        ["bpe", "--from", trained_longer],
    ):
        assert nmt(*command, "--run-dir", run).code == 0
    steps = [
        "--max-steps",
        "810",
        "--eval-every",
        "10",
        "--save-every",
        "10",
        "--warmup",
        "100",
        "--lr-scale",
        "2",
    ]
    both = ["--init-optimizer", "--init-schedule"]
    result = nmt("train", "--run-dir", run, *LONGER, *steps, "--init-from", trained_longer, *both)
    assert result.code == 0, result.err
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["kind"] == "train")
    assert first["step"] == 810 and first["lr"] == pytest.approx(learning_rate(810, 64, 100, scale=2.0))
    after, meta = checkpoint.load_tensors(run / "checkpoints" / "checkpoint_00000810.pt")
    assert meta["step"] == 810 and meta["state"]["epoch"] == 0  # new data: its first epoch
    # Adam went on from the checkpoint's moments: its step count too.
    assert {float(s["step"]) for s in after["optimizer"]["state"].values()} == {810.0}
    # Ten updates scale the second moments kept by beta2^10 and add squared gradients, so no
    # element falls below beta2^10 of where it was (fresh moments would hold the gradients alone).
    beta2 = after["optimizer"]["param_groups"][0]["betas"][1]
    v_before, v_after = (t["optimizer"]["state"][0]["exp_avg_sq"] for t in (before, after))
    assert (v_after >= beta2**10 * v_before * (1 - 1e-5)).all()
    assert "with its optimizer state, at its step 800" in (run / "log.txt").read_text()
    # The checkpoint is read (and its sha256 verified) once for the weights and the optimizer.
    reads = []
    load = checkpoint.load_tensors
    monkeypatch.setattr(checkpoint, "load_tensors", lambda *a, **k: reads.append(a) or load(*a, **k))
    config = TrainConfig(init_from=str(trained_longer), init_optimizer=True, init_schedule=True)
    initial = train_mod.initial_model(RunDir(run), config)
    assert reads == [(start,)] and initial.step == 800 and initial.optimizer is not None
    assert initial.weights()["embed.weight"].equal(before["model"]["embed.weight"].float())
    # A package or an averaged model keeps no optimizer: one error line.
    other = tmp_path / "other"
    shutil.copytree(run, other)
    shutil.rmtree(other / "checkpoints")
    (other / "metrics.jsonl").unlink()
    package = tmp_path / "pkg"
    assert nmt("export", package, "--model", start).code == 0
    line = one_error_line(
        nmt("train", "--run-dir", other, *LONGER, *steps, "--init-from", package, "--init-optimizer")
    )
    assert "not a training checkpoint" in line
    assert "give --init-from" in one_error_line(nmt("train", "--run-dir", other, *LONGER, "--init-schedule"))


def test_fine_tuning_errors(trained_longer, tmp_path, nmt):
    text, own = trained_longer / "text", tmp_path / "own"
    for command in (
        ["prep", "custom", "--train-src", text / "test2017.en", "--train-tgt", text / "test2017.de"],
        ["bpe", "--vocab-size", "1000"],
    ):
        assert nmt(*command, "--run-dir", own).code == 0
    once = ["--max-steps", "1"]  # should a check fail to stop it
    assert "nmt bpe --from" in one_error_line(
        nmt("train", "--run-dir", own, *LONGER, *once, "--init-from", trained_longer)
    )
    import shutil

    same_bpe = tmp_path / "same"
    shutil.copytree(trained_longer, same_bpe)
    shutil.rmtree(same_bpe / "checkpoints")
    line = one_error_line(nmt("train", "--run-dir", same_bpe, *TINY, *once, "--init-from", trained_longer))
    assert "another model shape" in line and "d_model 64 (here 16)" in line
    assert "not found" in one_error_line(
        nmt("train", "--run-dir", same_bpe, *LONGER, *once, "--init-from", tmp_path / "nowhere")
    )
    stray = tmp_path / "stray.pt"
    stray.write_bytes(b"not a checkpoint")
    for keep in ([], ["--init-optimizer"]):
        line = one_error_line(
            nmt("train", "--run-dir", same_bpe, *LONGER, *once, "--init-from", stray, *keep)
        )
        assert "is not an nmt model" in line, line
    assert "drop --vocab-size" in one_error_line(
        nmt("bpe", "--run-dir", same_bpe, "--from", trained_longer, "--vocab-size", "900")
    )
    assert "no sentencepiece model" in one_error_line(nmt("bpe", "--run-dir", same_bpe, "--from", tmp_path))


def test_fine_tuning_warms_up_briefly_unless_a_schedule_is_asked_for(trained_longer, tmp_path, nmt):
    """--init-from alone: a short warm-up to 1e-4 and a linear decay, not the paper's warm-up from
    scratch; any schedule option given, --init-schedule, or no --init-from: the options as given.
    The run records what it trains with."""
    run = RunDir(tmp_path / "run")
    given = dataclasses.asdict(TrainConfig())
    init = {**given, "init_from": str(trained_longer)}
    tuned = train_mod.settings(run, {**init, "max_steps": 3000}, set())
    assert (tuned.schedule, tuned.lr, tuned.warmup) == ("linear", 1e-4, 300)
    assert train_mod.settings(run, init, set()).warmup == 500  # at most 500
    assert train_mod.settings(run, {**init, "max_steps": 0}, set()).schedule == "constant"
    assert learning_rate(1, 64, tuned.warmup, 1.0, tuned.schedule, tuned.lr, 3000) < 1e-6
    paper = dataclasses.astuple(TrainConfig(**init))
    for option in train_mod.SCHEDULE_OPTIONS:
        assert dataclasses.astuple(train_mod.settings(run, init, {option})) == paper
    for options in ({**init, "init_schedule": True}, given):
        as_given = dataclasses.astuple(TrainConfig(**options))
        assert dataclasses.astuple(train_mod.settings(run, options, set())) == as_given
    shown = nmt(
        "train", "--run-dir", run.root, "--init-from", trained_longer, "--max-steps", "3000", "--print-config"
    )
    assert shown.code == 0, shown.err
    assert re.search(r"schedule\W+linear", shown.out) and re.search(r"warmup\W+300\b", shown.out), shown.out


@pytest.mark.parametrize("ranks", [[], ["--procs", "2", "--device", "cpu"]], ids=["one", "two-gloo-ranks"])
def test_the_moving_average_starts_from_the_model_it_fine_tunes(trained_longer, tmp_path, nmt, ranks):
    """--ema with --init-from and another --seed: two updates later the average is about where
    the model is, near the model it started from (it held the random weights the start replaced,
    which no later update would wash out at a decay of 0.9999)."""
    run = tmp_path / "run"
    shutil.copytree(trained_longer, run, ignore=UNTRAINED)
    steps = ["--max-steps", "2", "--save-every", "2", "--eval-every", "100", "--seed", "7"]
    init = ["--init-from", trained_longer, "--ema", "0.9999"]
    result = nmt("train", "--run-dir", run, *LONGER, *steps, *init, *ranks)
    assert result.code == 0, result.err
    tensors, _ = final_weights(run)
    start = locate(trained_longer).weights()  # what --init-from read

    def apart(weights: dict) -> float:  # relative L1 distance from the start
        return float(sum((weights[k].float() - v).abs().sum() for k, v in start.items())) / float(
            sum(v.abs().sum() for v in start.values())
        )

    assert apart(tensors["ema"]) <= 2 * apart(tensors["model"]), (
        apart(tensors["ema"]),
        apart(tensors["model"]),
    )
