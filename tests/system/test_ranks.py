"""What a paper run combines, under several gloo ranks: each training feature gives on 2 (and 4)
ranks what one process gives with the same tokens per update, and the faults of a long run (a
killed worker, a pre-emption, a worker's own error) end as an uninterrupted run would or with
one line."""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    LONGER,
    TINY,
    UNTRAINED,
    children,
    env_of,
    hooked_env,
    nmt_command,
    rank_of,
    signal_at_step,
    stopped_step,
)

from nmt_cli.engine import checkpoint
from nmt_cli.rundir import RunDir

NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--relu-dropout", "0"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(nmt, run_dir: Path, args: list, ranks: int, update_freq: int):
    """`nmt train` in one process or on `ranks` gloo workers; its result must be a success."""
    launch = ["--procs", str(ranks), "--device", "cpu"] if ranks > 1 else []
    result = nmt("train", "--run-dir", run_dir, *args, "--update-freq", str(update_freq), *launch)
    assert result.code == 0, result.err
    return result


def _outcomes(nmt, source: Path, tmp_path: Path, args: list, layouts, ignore=None) -> dict:
    """Each (ranks, update_freq) of `layouts` trained on a copy of `source` (its files but
    `ignore`d ones) in tmp_path/ranks{ranks}: the outcome of each, by ranks."""
    outcomes = {}
    for ranks, update_freq in layouts:
        run = tmp_path / f"ranks{ranks}"
        shutil.copytree(source, run, ignore=ignore)
        _train(nmt, run, args, ranks, update_freq)
        outcomes[ranks] = _outcome(run)
    return outcomes


def _outcome(run_dir: Path) -> dict:
    """What a run leaves that several ranks must not change: validation figures, the kept-best
    set, how training stopped, and the final weights."""
    metrics = _metrics(run_dir)
    best = run_dir / "checkpoints" / "best"
    tensors, meta = checkpoint.load_tensors(checkpoint.listed(run_dir / "checkpoints")[-1])
    return {
        "valid": [(r["step"], r["valid_nll"], r.get("valid_bleu")) for r in metrics if r["kind"] == "valid"],
        "best": sorted(p.name for p in best.glob("*.pt")) if best.is_dir() else [],
        "stopped": next(
            line for line in (run_dir / "log.txt").read_text().splitlines()[::-1] if "stopped" in line
        ),
        "step": meta["step"],
        "model": tensors["model"],
    }


def _differences(a: dict, b: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each weight of two runs' outcomes, side by side."""
    pairs = {}
    for name, x in a["model"].items():
        y = b["model"][name]
        if name.endswith("attn.kv.bias"):  # as in test_distributed's equivalence test: the key
            x, y = x[len(x) // 2 :], y[len(y) // 2 :]  # bias's gradient is rounding noise
        pairs[name] = (x, y)
    return pairs


def _noise(single: dict, ranks: dict) -> float:
    """The largest difference of a weight between two runs: between 1 and 2 ranks, the rounding
    of reductions summed in another order, which Adam's steps carry on. Over all the weights:
    which weight it lands on changes from run to run (gloo's order of a sum is not fixed)."""
    return max(float((x - y).abs().max()) for x, y in _differences(single, ranks).values())


def _assert_same(single: dict, ranks: dict, floor: float | None = None) -> None:
    """The discrete outcomes exact; the weights equal to rounding, or where `floor` is given
    (measured in the same test), within ten times it."""
    assert ranks["step"] == single["step"]
    assert (
        ranks["stopped"].split("training stopped: ")[-1] == single["stopped"].split("training stopped: ")[-1]
    )
    assert [v[0] for v in ranks["valid"]] == [v[0] for v in single["valid"]]
    for (_, nll_a, bleu_a), (_, nll_b, bleu_b) in zip(single["valid"], ranks["valid"]):
        assert nll_b == pytest.approx(nll_a, abs=1e-4)
        assert (bleu_a is None) == (bleu_b is None)
        if bleu_a is not None:
            assert bleu_b == pytest.approx(bleu_a, abs=0.05)
    assert ranks["best"] == single["best"]
    for name, (x, y) in _differences(single, ranks).items():
        if floor is None:
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-5), name
        else:
            assert float((x - y).abs().max()) <= 10 * floor + 1e-5, name


def test_bleu_keep_best_patience_and_tensorboard_on_two_and_four_ranks(trained_longer, tmp_path, nmt):
    """The combination that killed multi-rank runs at their first validation: the best models
    by BLEU, patience on BLEU, TensorBoard; fine-tuned from a trained model so that BLEU moves,
    keeping its Adam moments under a new --beta2 (a fresh Adam's first steps on a trained model
    turn rounding noise in near-zero gradients into steps of the learning rate's size)."""
    args = [
        *LONGER,
        *NO_DROPOUT,
        "--init-from",
        trained_longer,
        "--init-optimizer",
        "--beta2",
        "0.997",
        "--eval-bleu",
        "--keep-best",
        "1",
        "--best-metric",
        "bleu",
        "--patience",
        "2",
        "--tensorboard",
        "--eval-every",
        "4",
        "--save-every",
        "4",
        "--max-steps",
        "20",
        "--warmup",
        "100",
        # bf16 autocast (auto on some CPUs) flips greedy choices on weights that agree to 1e-5
        "--precision",
        "fp32",
    ]
    outcomes = _outcomes(nmt, trained_longer, tmp_path, args, ((1, 4), (2, 2), (4, 1)), UNTRAINED)
    for ranks in outcomes:
        run = tmp_path / f"ranks{ranks}"
        assert list((run / "tensorboard").iterdir()), "no TensorBoard events"
        tensors, _ = checkpoint.load_tensors(checkpoint.listed(run / "checkpoints")[-1])
        assert tuple(tensors["optimizer"]["param_groups"][0]["betas"]) == (0.9, 0.997)
    assert any(bleu for _, _, bleu in outcomes[1]["valid"]), "BLEU never moved: the test proves little"
    assert len(outcomes[1]["valid"]) >= 2 and len(outcomes[1]["best"]) == 1
    # Fine-tuning in fp32 on a trained model, the weights of 1 and 2 ranks part by more than
    # rounding on some CPUs (AVX2 against AVX-512): each pair is held to the other's parting,
    # so that neither floor is measured on the pair it checks.
    _assert_same(outcomes[1], outcomes[2], floor=_noise(outcomes[1], outcomes[4]))
    _assert_same(outcomes[1], outcomes[4], floor=_noise(outcomes[1], outcomes[2]))


def test_nll_keep_best_from_a_checkpoint_with_a_fresh_optimizer_on_two_ranks(trained_longer, tmp_path, nmt):
    """--init-from a checkpoint file with a fresh optimizer and schedule (the warm-up's small
    first steps), the best models by NLL, patience on NLL and a time budget not reached."""
    start = checkpoint.listed(trained_longer / "checkpoints")[-1]
    args = [
        *LONGER,
        *NO_DROPOUT,
        "--init-from",
        start,
        "--keep-best",
        "2",
        "--best-metric",
        "nll",
        "--patience",
        "2",
        "--max-time",
        "30",
        "--eval-every",
        "3",
        "--save-every",
        "6",
        "--max-steps",
        "12",
    ]
    outcomes = _outcomes(nmt, trained_longer, tmp_path, args, ((1, 2), (2, 1)), UNTRAINED)
    assert len(outcomes[1]["valid"]) >= 2 and len(outcomes[1]["best"]) == 2
    _assert_same(outcomes[1], outcomes[2])


def test_tagged_weighted_corpora_with_bpe_dropout_in_bf16_on_two_ranks(tagged_bpe, tmp_path, nmt):
    """Tagged back-translation as it is trained: two corpora, one tagged and weighted, with
    BPE-dropout, in bf16 autocast (emulated where the CPU has no bf16 arithmetic)."""
    args = [
        *TINY,
        *NO_DROPOUT,
        "--bpe-dropout",
        "0.1",
        "--precision",
        "bf16",
        "--keep-best",
        "1",
        "--eval-every",
        "10",
        "--save-every",
        "10",
        "--max-steps",
        "20",
    ]
    outcomes = _outcomes(nmt, tagged_bpe, tmp_path, args, ((1, 2), (2, 1)))
    _assert_same(outcomes[1], outcomes[2])


def test_compile_on_two_ranks_traces_the_model_once_without_a_break(run_copy, tmp_path):
    """--compile under DDP on 2 gloo ranks: no rank compiles again as batch shapes change, no
    graph break falls in nmt's code (DDP's own wrapper breaks the graph by torch's design), and
    the log says how long it took. What is traced is the question here, so the ranks compile
    with torch's eager backend (seconds, not a minute of kernel building); the kernels built
    and cached: tests/integration/test_compiled.py (one process) and test_trainer.py's soak tests."""
    env = hooked_env(
        tmp_path / "hook",
        "import functools, torch\ntorch.compile = functools.partial(torch.compile, backend='eager')\n",
    )
    done = subprocess.run(
        nmt_command(
            "train",
            "--run-dir",
            run_copy,
            *TINY,
            "--compile",
            "--max-steps",
            8,
            "--eval-every",
            4,
            "--procs",
            2,
            "--device",
            "cpu",
        ),  # fmt: skip
        env={**env, "TORCH_LOGS": "dynamo,graph_breaks,recompiles"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "training stopped: reached --max-steps 8" in done.stderr
    assert "torchdynamo start tracing" in done.stderr  # the logs reached the ranks
    assert "Recompiling" not in done.stderr
    breaks = [line for line in done.stderr.splitlines() if "Graph break in user code at" in line]
    assert not [line for line in breaks if "/nmt_cli/" in line], breaks
    assert re.search(r"compiled the update \(model, logits, loss\) in \d", RunDir(run_copy).log.read_text())


def test_max_time_stops_every_rank_together(run_copy, nmt):
    result = _train(
        nmt, run_copy, [*TINY, "--max-time", "0.1", "--max-steps", "0", "--eval-every", "100000"], 2, 1
    )
    assert "training stopped: reached --max-time 0.1 minutes" in result.err
    meta = json.loads(checkpoint.listed(run_copy / "checkpoints")[-1].with_suffix(".json").read_text())
    assert meta["world"] == 2 and meta["state"]["seconds"] >= 6


# -- the faults of a long run, on 2 ranks

STEPS = 40


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return nmt_command(
        "train", "--run-dir", run_dir, *TINY, "--max-steps", STEPS, "--save-every", 5,
        "--eval-every", 10, "--procs", 2, "--device", "cpu", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(multi30k_bpe, tmp_path_factory) -> dict:
    """The final weights of a 2-rank run that nothing interrupted (dropout on)."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    shutil.copytree(multi30k_bpe, run)
    subprocess.run(_cmd(run), check=True, capture_output=True, timeout=300)
    tensors, meta = checkpoint.load_tensors(checkpoint.listed(run / "checkpoints")[-1])
    assert meta["step"] == STEPS
    return tensors["model"]


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.02)


def _final(run_dir: Path) -> dict:
    tensors, meta = checkpoint.load_tensors(checkpoint.listed(run_dir / "checkpoints")[-1])
    assert meta["step"] == STEPS
    return tensors["model"]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_killed_worker_is_restarted_and_the_run_ends_bit_identical(run_copy, uninterrupted):
    launcher = subprocess.Popen(_cmd(run_copy, "--max-restarts", "1"), stderr=subprocess.PIPE, text=True)
    _wait_for(run_copy / "checkpoints" / "checkpoint_00000005.json", launcher)
    victim = next(p for p in children(launcher.pid) if rank_of(p) == 1)
    # The workers share the cores instead of each taking all of them (and spin-waiting), unless
    # the user (or CI) chose a count: that one is kept.
    shared = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert env_of(victim, "OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS", shared)
    os.kill(victim, signal.SIGKILL)
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err
    assert "rank 1 was killed by SIGKILL: restarting the workers" in err
    assert "resuming from step" in err
    assert _equal(_final(run_copy), uninterrupted)


def test_sigterm_to_the_launcher_saves_and_the_same_command_resumes_bit_identical(run_copy, uninterrupted):
    cmd = _cmd(run_copy)
    launcher = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    _wait_for(run_copy / "checkpoints" / "checkpoint_00000005.json", launcher)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "internal error" not in err, err
    step = stopped_step(err, signal.SIGTERM)
    assert 5 <= step < STEPS and checkpoint.listed(run_copy / "checkpoints")[-1].name.endswith(
        f"{step:08d}.pt"
    )
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"resuming from step {step}" in again.stderr
    assert _equal(_final(run_copy), uninterrupted)


@pytest.mark.parametrize(
    "signum",
    [
        signal.SIGINT,
        pytest.param(signal.SIGHUP, marks=pytest.mark.soak),
        pytest.param(signal.SIGQUIT, marks=pytest.mark.soak),
    ],
    ids=lambda s: s.name,
)
def test_every_stopping_signal_to_the_launcher_is_passed_on_and_saved(run_copy, signum):
    """Ctrl-C, a closed terminal, SIGQUIT: the launcher passes each on, the workers save where
    they are and the job exits 128 + its number (SIGTERM and the resume: the test above). In the
    suite Ctrl-C; the launcher forwards the other two by the same code, and the workers' handler
    of each is test_reliability's (one process): SIGHUP and SIGQUIT here are the soak set's."""
    launcher = subprocess.Popen(_cmd(run_copy, "--save-every", "1000"), stderr=subprocess.PIPE, text=True)
    step = stopped_step(signal_at_step(launcher, run_copy, 10, signum), signum)
    assert step >= 10 and checkpoint.listed(run_copy / "checkpoints")[-1].name.endswith(f"{step:08d}.pt")


def test_a_worker_that_does_not_stop_is_killed_after_the_grace(run_copy, tmp_path):
    """--stop-grace: a worker still running that long after the signal is killed; the launcher
    does not wait for it (here rank 1 hangs in its signal handler)."""
    env = hooked_env(
        tmp_path / "hook",
        "import os, time\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from nmt_cli.engine import trainer\n"
        "    trainer.Trainer._on_signal = lambda self, signum, frame: time.sleep(600)\n",
    )
    launcher = subprocess.Popen(
        _cmd(run_copy, "--stop-grace", "3"), stderr=subprocess.PIPE, text=True, env=env
    )
    _wait_for(run_copy / "checkpoints" / "checkpoint_00000005.json", launcher)
    launcher.send_signal(signal.SIGTERM)
    start = time.monotonic()
    _, err = launcher.communicate(timeout=120)
    assert time.monotonic() - start < 60, err  # not the 600 s the worker would take
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    assert not [p for p in children(launcher.pid)]


def test_patience_stops_every_rank_at_the_same_update(run_copy):
    """--patience on 2 ranks: rank 0's decision, shared, stops both at one update and the job
    ends well (the validation loss never moves: steps of 1e-30 change no output)."""
    done = subprocess.run(
        _cmd(run_copy, "--lr-scale", "1e-30", "--patience", "2", "--eval-every", "3"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "validation loss did not improve in 2 evaluations (--patience)" in done.stderr, done.stderr
    valid = [r for r in _metrics(run_copy) if r["kind"] == "valid"]
    assert [r["step"] for r in valid] == [3, 6, 9]  # the first, then two without improvement
    assert checkpoint.listed(run_copy / "checkpoints")[-1].name.endswith("00000009.pt")


def test_a_workers_own_error_is_one_line_and_not_restarted(run_copy, tmp_path):
    """An error that is the worker's own (here the message CUDA gives an illegal memory access,
    raised on purpose on rank 1) is the job's one error line, not a restart into the same error."""
    env = hooked_env(
        tmp_path / "hook",
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from nmt_cli.engine import trainer\n"
        "    real = trainer.Trainer.step\n"
        "    def step(self, batches):\n"
        "        if self.state.step == 7:\n"
        "            raise RuntimeError('CUDA error: an illegal memory access was encountered')\n"
        "        return real(self, batches)\n"
        "    trainer.Trainer.step = step\n",
    )
    done = subprocess.run(
        _cmd(run_copy, "--max-restarts", "2"), capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("nmt: error:")]
    assert len(errors) == 1, done.stderr
    assert "rank 1" in errors[0] and "illegal memory access" in errors[0], errors
    assert "lost contact" not in errors[0] and "restarting" not in done.stderr
    assert "Traceback" not in done.stderr


def test_only_rank_zero_writes_the_best_models(run_copy, tmp_path):
    """Two 'nodes' with a run directory each: what rank 1 writes lands in its own directory."""
    from test_distributed import _two_nodes

    node1 = tmp_path / "node1"
    shutil.copytree(run_copy, node1)
    done = _two_nodes([run_copy, node1], ["--max-steps", "6", "--keep-best", "2", "--eval-every", "3"])
    assert [code for code, _ in done] == [0, 0], done
    assert len(list((run_copy / "checkpoints" / "best").glob("*.pt"))) == 2
    assert not (node1 / "checkpoints").exists()


def test_batched_grad_copy_on_two_ranks_ends_bit_identical(run_copy, uninterrupted):
    """The same update: DDP's batched gradient copy changes how, not what, is copied."""
    done = subprocess.run(_cmd(run_copy, "--batched-grad-copy"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _equal(_final(run_copy), uninterrupted)


SLOW_FIRST_WRITE = """
import os, sys, time
if os.environ.get("RANK") == "0":
    from nmt_cli.engine import checkpoint
    save = checkpoint.save_tensors
    def slow(*args, _slowed=[], **kwargs):
        if not _slowed:
            _slowed.append(1)
            print("rank 0's first checkpoint write stalls", file=sys.stderr, flush=True)
            time.sleep(12)
        return save(*args, **kwargs)
    checkpoint.save_tensors = slow
"""


def test_a_stalled_checkpoint_write_on_rank_zero_times_no_rank_out(run_copy, uninterrupted, tmp_path):
    """Rank 0 writes the checkpoints alone: the others wait for it as long as a write may take,
    not the group's timeout (5 s here, for a write that stalls 12 s), and the run ends as one
    that nothing slowed."""
    env = hooked_env(tmp_path / "hook", SLOW_FIRST_WRITE)
    cmd = _cmd(run_copy, "--dist-timeout", "5")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "rank 0's first checkpoint write stalls" in done.stderr
    assert _equal(_final(run_copy), uninterrupted)
