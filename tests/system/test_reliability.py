"""The tool's promises under attack: it loses no work, never runs foreign code, always answers
clearly. (Hostile archives, checksums and pickles: test_prep_wmt14, test_fetch, test_checkpoints.)"""

import json
import random
import shutil
import signal
import subprocess
import time

import pytest
import torch
from conftest import TINY, nmt_command, one_error_line, signal_at_step, stopped_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nmt_cli.engine import checkpoint
from nmt_cli.rundir import RunDir

STEPS = 150


def _cmd(run_dir, steps: int = STEPS):
    return nmt_command(
        "train", "--run-dir", run_dir, *TINY, "--max-steps", steps, "--save-every", 1,
        "--keep-last", 3, "--eval-every", 8, "--seed", 5,
    )  # fmt: skip


def _newest_step(run_dir) -> int:
    for path in reversed(checkpoint.listed(run_dir / "checkpoints")):
        try:
            return json.loads(path.with_suffix(".json").read_text())["step"]
        except OSError:  # pruned by the running trainer meanwhile
            continue
    return 0


def _model(run_dir):
    tensors, meta = checkpoint.load_tensors(checkpoint.listed(run_dir / "checkpoints")[-1])
    return tensors["model"], meta


@pytest.mark.parametrize(
    "wanted", [3, pytest.param(30, marks=pytest.mark.soak)], ids=["3-kills", "soak-30-kills"]
)
def test_random_kills_lose_nothing(run_copy, tmp_path, wanted):
    """SIGKILLs at random moments of training and of checkpoint writes: every committed
    checkpoint stays whole, and the run ends bit-identical to one never stopped. Three in the
    suite (each kill is a torch start-up); thirty with `-m soak`. A kill comes at most 6 steps
    after a checkpoint: the run is as long as its kills need."""
    steps = min(STEPS, 10 + 7 * wanted)
    reference = tmp_path / "reference"
    shutil.copytree(run_copy, reference)
    subprocess.run(_cmd(reference, steps), check=True, capture_output=True)

    rng = random.Random(20)
    kills = 0
    took_over = 0
    refused = 0
    while kills < wanted:
        # Kill after a few more checkpoints, at a random moment of a step (training or saving):
        # counted in steps, not seconds, so a fast machine cannot finish before its kills.
        target = _newest_step(run_copy) + rng.randint(1, 6)
        proc = subprocess.Popen(_cmd(run_copy, steps), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while _newest_step(run_copy) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.03))
        if proc.poll() is not None:
            break  # finished before this kill
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        took_over += b"taking over the lock" in err
        refused += b"is in use by" in err
        kills += 1
        # Every committed checkpoint is whole: its sha256 matches its record.
        for path in checkpoint.listed(run_copy / "checkpoints"):
            checkpoint.load_tensors(path)
    final = subprocess.run(_cmd(run_copy, steps), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    assert kills == wanted, f"training finished before {wanted} kills: give it more steps"
    assert took_over > 0 and refused == 0  # a dead run's lock never blocks the next one
    a, meta_a = _model(reference)
    b, meta_b = _model(run_copy)
    assert meta_a["step"] == meta_b["step"] == steps
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ from the uninterrupted run"
    print(f"kills survived: {kills}")


def test_sigterm_then_resume_is_exact(run_copy, tmp_path):
    reference = tmp_path / "reference"
    shutil.copytree(run_copy, reference)
    cmd, ref_cmd = _cmd(run_copy), _cmd(reference)
    for c in (cmd, ref_cmd):
        c[c.index("--save-every") + 1] = "1000"  # only the SIGTERM checkpoint
        c[c.index("--max-steps") + 1] = "40"
    subprocess.run(ref_cmd, check=True, capture_output=True)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert stopped_step(signal_at_step(proc, run_copy, 10, signal.SIGTERM), signal.SIGTERM) >= 10
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    a, _ = _model(reference)
    b, _ = _model(run_copy)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP, signal.SIGQUIT], ids=lambda s: s.name)
def test_ctrl_c_a_closed_terminal_and_sigquit_stop_after_a_checkpoint(run_copy, signum):
    """Each signal that stops a run (as SIGTERM does, tested above) saves where it is and exits
    128 + its number with one line saying how to go on."""
    cmd = _cmd(run_copy)
    cmd[cmd.index("--save-every") + 1] = "1000"  # only the signal's checkpoint
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    step = stopped_step(signal_at_step(proc, run_copy, 10, signum), signum)
    assert step >= 10 and _newest_step(run_copy) == step


def test_disk_failure_while_checkpointing_keeps_the_previous_one(run_copy, nmt, monkeypatch):
    real_save = torch.save
    calls = {"n": 0}

    def failing_save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            f.write(b"half a checkpoint")
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    line = one_error_line(
        nmt(
            "train",
            "--run-dir",
            run_copy,
            *TINY,
            "--max-steps",
            "6",
            "--save-every",
            "2",
            "--eval-every",
            "100",
        )
    )
    assert "could not write checkpoint" in line and "No space left" in line
    assert "previous checkpoints are intact" in line
    saved = checkpoint.listed(run_copy / "checkpoints")
    assert [p.name for p in saved] == ["checkpoint_00000002.pt"]
    checkpoint.load_tensors(saved[0])  # whole and loadable
    assert not list((run_copy / "checkpoints").glob(".*.tmp"))
    monkeypatch.setattr(torch, "save", real_save)
    result = nmt("train", "--run-dir", run_copy, "--max-steps", "6")
    assert result.code == 0 and "resuming from step 2" in result.err


BAD_INPUTS = [
    # (arguments, stdin, what the one error line must say)
    (
        [
            "prep",
            "custom",
            "--train-src",
            "{tmp}/none.en",
            "--train-tgt",
            "{tmp}/b.de",
            "--run-dir",
            "{tmp}/r",
        ],
        b"",
        "not found",
    ),
    (
        ["prep", "custom", "--train-src", "{tmp}/a.en", "--train-tgt", "{tmp}/b.de", "--run-dir", "{tmp}/r"],
        b"",
        "has 3 lines but",
    ),
    (
        [
            "prep",
            "custom",
            "--train-src",
            "{tmp}/empty",
            "--train-tgt",
            "{tmp}/empty",
            "--run-dir",
            "{tmp}/r",
        ],
        b"",
        "no pairs left",
    ),
    (["prep", "custom", "--train-src", "{tmp}/a.en", "--run-dir", "{tmp}/r"], b"", "--train-tgt"),
    (
        [
            "prep",
            "custom",
            "--train-src",
            "{tmp}/a.en",
            "--train-tgt",
            "{tmp}/a.en",
            "--src",
            "en",
            "--tgt",
            "en",
            "--run-dir",
            "{tmp}/r",
        ],
        b"",
        "both 'en'",
    ),
    (["prep", "wmt14-en-de", "--mirror", "{tmp}/nowhere", "--run-dir", "{tmp}/r"], b"", "mirror folder"),
    (["prep", "multi30k-en-de", "--max-ratio", "0.5", "--run-dir", "{tmp}/r"], b"", "--max-ratio"),
    (["prep", "nonsense", "--run-dir", "{tmp}/r"], b"", "Invalid value"),
    (["bpe", "--run-dir", "{tmp}/norun"], b"", "run `nmt prep` first"),
    (["bpe", "--run-dir", "{run}", "--vocab-size", "10"], b"", "too small"),
    (["bpe", "--run-dir", "{run}", "--vocab-size", "lots"], b"", "--vocab-size"),
    (["train", "--run-dir", "{tmp}/norun"], b"", "run `nmt prep`"),
    (["train", "--run-dir", "{run}", "--size", "gigantic"], b"", "--size"),
    (["train", "--run-dir", "{run}", "--max-tokens", "0"], b"", "--max-tokens"),
    (["train", "--run-dir", "{run}", "--dropout", "1.5"], b"", "--dropout"),
    (["train", "--run-dir", "{run}", "--precision", "fp8"], b"", "--precision"),
    (["train", "--run-dir", "{run}", "--gpus", "8"], b"", "GPUs"),
    (["train", "--run-dir", "{run}", "--d-model", "30", "--heads", "4"], b"", "divisible"),
    (
        ["train", "--run-dir", "{trained}", "--d-model", "32", "--heads", "2", "--ffn", "32"],
        b"",
        "another model shape",
    ),
    (["average", "--run-dir", "{run}"], b"", "no checkpoints"),
    (["average", "--run-dir", "{run}", "--last", "0"], b"", "--last"),
    (["translate", "--run-dir", "{run}"], b"x\n", "nmt train"),
    (["translate", "--run-dir", "{trained}", "--beam", "0"], b"x\n", "--beam"),
    (["translate", "--run-dir", "{trained}", "--checkpoint", "{tmp}/a.en"], b"x\n", "not an nmt model"),
    (["translate", "--run-dir", "{trained}", "--precision", "fp16"], b"x\n", "GPU"),
    (["score", "--hyp", "{tmp}/a.en", "--ref", "{tmp}/b.de", "--run-dir", "{tmp}/r"], b"", "has 3 lines but"),
    (["score", "--ref", "{tmp}/none", "--run-dir", "{tmp}/r"], b"", "not found"),
    (["score", "--hyp", "{tmp}/a.en", "--run-dir", "{tmp}/r"], b"", "--ref"),
    (["score", "--run-dir", "{tmp}/norun"], b"", "nmt prep"),
    (["score", "--run-dir", "{trained}", "--split", "dev"], b"", "split 'dev'"),
    (
        [
            "score",
            "--hyp",
            "{tmp}/a.en",
            "--ref",
            "{tmp}/a.en",
            "--compare",
            "{tmp}/b.de",
            "--run-dir",
            "{tmp}/r",
        ],
        b"",
        "has 2 lines but",
    ),
]


@pytest.fixture
def bad_input_world(tmp_path, run_copy, trained):
    (tmp_path / "a.en").write_text("one\ntwo\nthree\n")
    (tmp_path / "b.de").write_text("eins\nzwei\n")
    (tmp_path / "empty").write_text("")
    return {"tmp": str(tmp_path), "run": str(run_copy), "trained": str(trained)}


@pytest.mark.parametrize(
    "args,stdin,expected",
    BAD_INPUTS,
    ids=[" ".join(a[:2]) + f" #{i}" for i, (a, _, _) in enumerate(BAD_INPUTS)],
)
def test_bad_input_gives_one_clear_line(bad_input_world, nmt, args, stdin, expected):
    filled = [a.format(**bad_input_world) for a in args]
    result = nmt(*filled, stdin=stdin)
    line = one_error_line(result)
    assert expected in line, line


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.binary(max_size=300))
def test_translate_never_loses_a_line(trained, nmt, data):
    result = nmt("translate", "--run-dir", trained, "--max-len-b", "3", "--beam", "2", stdin=data)
    assert result.code == 0, result.err
    expected = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    assert result.out.count("\n") == expected
    assert result.out == "" or result.out.endswith("\n")


def test_translate_keeps_order_with_many_lines(trained, nmt):
    lines = [f"{i} dogs." if i % 3 else "" for i in range(120)]
    result = nmt(
        "translate", "--run-dir", trained, "--max-len-b", "3", stdin="\n".join(lines).encode() + b"\n"
    )
    out = result.out.split("\n")[:-1]
    assert len(out) == 120
    assert all(out[i] == "" for i in range(0, 120, 3))
    assert RunDir(trained).averaged.exists()
    assert json.loads(RunDir(trained).averaged.with_suffix(".json").read_text())["step"] == 40
