"""A run cut short (killed, or stopped by SIGTERM) and started again with the same command ends
with the weights of one that never stopped, whatever it trains with: bf16, AdamW with a cosine
schedule and a moving average; --bpe-dropout; --init-from; separate vocabularies on 2 gloo ranks.
(SIGTERM and random kills of a plain run: test_reliability; of ranks: test_distributed.)"""

import shutil
import signal
import subprocess
import time

import pytest
import torch
from conftest import LONGER, TINY, UNTRAINED, final_weights, nmt_command, run_ok, train_command

from nmt_cli.engine import checkpoint

ADAMW_COSINE = ["--optimizer", "adamw", "--weight-decay", "0.01", "--schedule", "cosine", "--lr", "0.002"]
ADAMW_COSINE += ["--warmup", "4", "--min-lr", "0.0001"]
COMBINED = ["--precision", "bf16", *ADAMW_COSINE, "--ema", "0.9"]


def _killed_and_resumed(command, run_dir, steps: int, kill_after: int) -> None:
    """Run `command(run_dir)`, SIGKILL it once checkpoint `kill_after` is written, then run it
    again to the end."""
    proc = subprocess.Popen(command(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = run_dir / "checkpoints" / f"checkpoint_{kill_after:08d}.json"
    deadline = time.monotonic() + 120
    while not target.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(checkpoint.listed(run_dir / "checkpoints")) < steps  # it really was cut short
    subprocess.run(command(run_dir), check=True, capture_output=True)


def _same_model(a_run, b_run) -> None:
    _same_weights(final_weights(a_run)[0], final_weights(b_run)[0])


def _same_weights(a: dict, b: dict) -> None:
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


# The features whose state a resume must restore, together as users combine them; each alone
# is the soak set's (the combined run passes through each one's code).
@pytest.mark.parametrize(
    "options",
    [
        COMBINED,
        # fp32 alone: test_reliability's SIGTERM resume is fp32 and bit-identical too
        pytest.param(["--precision", "fp32"], marks=pytest.mark.soak),
        pytest.param(["--precision", "bf16"], marks=pytest.mark.soak),
        pytest.param(["--precision", "fp32", *ADAMW_COSINE], marks=pytest.mark.soak),
        pytest.param(["--precision", "fp32", "--ema", "0.9"], marks=pytest.mark.soak),
    ],
    ids=["bf16-adamw-cosine-ema", "fp32", "bf16", "adamw-cosine", "ema"],
)
def test_resume_after_sigkill_is_bit_identical(run_copy, tmp_path, options):
    """With bf16 autocast (emulated where the CPU has no bf16 arithmetic), AdamW with a cosine
    schedule and a moving average of the weights together; each alone, and fp32, in the soak set."""
    command = lambda run: train_command(run, 16, *options)  # noqa: E731
    other = tmp_path / "uninterrupted"
    shutil.copytree(run_copy, other)
    subprocess.run(command(other), check=True, capture_output=True)
    _killed_and_resumed(command, run_copy, 16, 7)

    a, meta_a = final_weights(other)
    b, meta_b = final_weights(run_copy)
    assert meta_a["step"] == meta_b["step"] == 16
    _same_weights(a, b)
    assert ("ema" in a) == ("ema" in b) == ("--ema" in options)
    for name in a.get("ema", {}):
        assert torch.equal(a["ema"][name], b["ema"][name]), name
    assert meta_a["state"] == {**meta_b["state"], "seconds": meta_a["state"]["seconds"]}


def test_a_bpe_dropout_run_killed_resumes_exactly(tagged_bpe, tmp_path):
    """Each epoch encoded anew, in one process or after a kill alike (on the tagged run's 5,000
    pairs; that it trains on the epochs' own encodings: test_bpe_dropout)."""
    runs = [tmp_path / "uninterrupted", tmp_path / "killed"]
    for run in runs:
        shutil.copytree(tagged_bpe, run)
    cmd = lambda run_dir: [*train_command(run_dir, 12), "--bpe-dropout", "0.1"]  # noqa: E731
    subprocess.run(cmd(runs[0]), check=True, capture_output=True)
    _killed_and_resumed(cmd, runs[1], 12, 5)
    _same_model(*runs)


def test_an_interrupted_fine_tuning_resumes_from_its_own_checkpoint(trained_longer, tmp_path):
    """SIGTERM to a run started with --init-from, then the same command: it goes on from its own
    checkpoint (not from the initial model again) and ends bit-identical to a run not stopped."""
    runs = {}
    for name in ("uninterrupted", "interrupted"):
        runs[name] = tmp_path / name
        shutil.copytree(trained_longer, runs[name], ignore=UNTRAINED)

    def cmd(run_dir):
        return nmt_command(
            "train", "--run-dir", run_dir, *LONGER, "--max-steps", 40, "--save-every", 1000,
            "--eval-every", 1000, "--init-from", trained_longer,
        )  # fmt: skip

    subprocess.run(cmd(runs["uninterrupted"]), check=True, capture_output=True)
    run = runs["interrupted"]
    proc = subprocess.Popen(cmd(run), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and '"step": 10,' in metrics.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "no step 10 in 2 minutes"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "run the same `nmt train` command again to resume" in err
    saved = checkpoint.listed(run / "checkpoints")
    step = checkpoint.step_of(saved[-1])
    assert len(saved) == 1 and 10 <= step < 40  # the SIGTERM's own checkpoint
    again = subprocess.run(cmd(run), capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert f"resuming from step {step}" in again.stderr and "starting from the weights" not in again.stderr
    _same_model(runs["uninterrupted"], run)


def test_two_gloo_ranks_train_and_resume_a_separate_model(multi30k_bpe, tmp_path):
    """Both embeddings (`nmt bpe --separate`, untied) are trained, checkpointed and restored on 2
    ranks: update 2 made again from the checkpoint of update 1 gives the same weights as the
    first time."""
    run_dir = tmp_path / "run"
    shutil.copytree(multi30k_bpe, run_dir)
    run_ok(["bpe", "--run-dir", run_dir, "--separate", "--src-vocab-size", 600, "--tgt-vocab-size", 900])
    train = nmt_command("train", "--run-dir", run_dir, *TINY, "--max-steps", 2, "--save-every", 1,
                        "--eval-every", 100, "--procs", 2, "--device", "cpu")  # fmt: skip
    done = subprocess.run(train, capture_output=True)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = checkpoint.listed(run_dir / "checkpoints")
    before = checkpoint.load_tensors(first)[0]["model"]
    expected = checkpoint.load_tensors(second)[0]["model"]
    for table in ("src_embed.weight", "embed.weight"):  # the source's table and the target's
        assert not torch.equal(expected[table], before[table]), table
    for path in (second, second.with_suffix(".json")):
        path.unlink()
    done = subprocess.run(train, capture_output=True)
    assert done.returncode == 0, done.stderr[-2000:]
    again = final_weights(run_dir)[0]["model"]
    assert again.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(value, again[key]), key
