"""The training loop: it learns and logs, stops at its limits, skips what is not finite, waits
for the device only when it must, and runs on data in memory."""

import json
import math
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from conftest import (
    TINY,
    nmt_command,
    one_error_line,
    tiny_trainer,
)

from nmt_cli import train as train_mod
from nmt_cli.config import TrainConfig
from nmt_cli.engine import checkpoint, parts, state, step, trainer
from nmt_cli.engine.batches import (
    Planned,
    on_device,
)
from nmt_cli.rundir import RunDir
from nmt_cli.shards import Shard


def test_training_learns_and_logs(run_copy, nmt):
    result = nmt(
        "train",
        "--run-dir",
        run_copy,
        *TINY,
        "--max-steps",
        "60",
        "--eval-every",
        "30",
        "--save-every",
        "30",
        "--warmup",
        "20",
        "--lr-scale",
        "4",
    )
    assert result.code == 0, result.err
    records = [json.loads(x) for x in (run_copy / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert [r["step"] for r in valid] == [30, 60]
    # Both validations well below a model that knows nothing (ln V, uniform): at this learning
    # rate the second need not beat the first, which depends on the CPU's rounding.
    vocab = json.loads((run_copy / "bpe.json").read_text())["vocab_size"]
    assert max(r["valid_nll"] for r in valid) < math.log(vocab) - 1.0
    epoch = [r for r in records if r["kind"] == "epoch"][0]
    assert epoch["padding"] < 0.1
    assert [p.name for p in checkpoint.listed(run_copy / "checkpoints")] == [
        "checkpoint_00000030.pt",
        "checkpoint_00000060.pt",
    ]
    saved = json.loads((run_copy / "train.json").read_text())
    assert saved["max_steps"] == 60 and saved["d_model"] == 16
    # A plain-text log of the run: what each command said, and the training lines (every 30 s,
    # and the first), whether or not a terminal showed a live display instead.
    log = (run_copy / "log.txt").read_text().splitlines()
    starts = [line for line in log if "=== nmt " in line]
    assert [line.split("=== ")[1].split(" (")[0] for line in starts] == ["nmt prep", "nmt bpe", "nmt train"]
    train_log = log[log.index(starts[-1]) :]
    assert any(" step 1/60 epoch 1: loss " in line for line in train_log), train_log
    assert any("step 60: valid nll" in line for line in train_log)
    assert any("training stopped: reached --max-steps 60" in line for line in train_log)
    assert any("train.en\t28,997" in line for line in log)  # nmt bpe's table, as text
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", line) for line in log)


def test_max_time_counts_the_time_trained_before_a_resume(run_copy, nmt):
    first = nmt(
        "train", "--run-dir", run_copy, *TINY, "--max-steps", "8", "--save-every", "4", "--eval-every", "100"
    )
    assert first.code == 0, first.err
    saved = [
        json.loads(p.with_suffix(".json").read_text())["state"]["seconds"]
        for p in checkpoint.listed(run_copy / "checkpoints")
    ]
    assert 0 < saved[0] < saved[1]
    # A budget the first run already spent: the resumed run stops before its first update.
    budget = f"{saved[1] / 60 * 0.99:.6f}"
    second = nmt("train", "--run-dir", run_copy, *TINY, "--max-steps", "0", "--max-time", budget)
    assert second.code == 0, second.err
    assert f"reached --max-time {float(budget):g} minutes" in second.err
    records = [json.loads(x) for x in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 8
    assert [r["step"] for r in records if r["kind"] == "valid"] == [8]  # not validated twice
    third = nmt("train", "--run-dir", run_copy, *TINY, "--max-steps", "10", "--max-time", "0")
    assert third.code == 0, third.err
    records = [json.loads(x) for x in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert min(r["minutes"] for r in records if r["step"] > 8) >= saved[1] / 60


def test_non_finite_steps_are_skipped_then_stop(run_copy, nmt, monkeypatch):
    calls = {"n": 0}
    real = step.label_smoothed_loss

    def flaky(logits, target, eps, weights=None):
        calls["n"] += 1
        loss, nll = real(logits, target, eps, weights)
        if eps > 0 and calls["n"] in (3, 4):
            return loss * float("nan"), nll
        return loss, nll

    monkeypatch.setattr(step, "label_smoothed_loss", flaky)
    result = nmt("train", "--run-dir", run_copy, *TINY, "--max-steps", "8", "--eval-every", "100")
    assert result.code == 0, result.err
    assert "non-finite" in result.err
    meta = json.loads(checkpoint.listed(run_copy / "checkpoints")[-1].with_suffix(".json").read_text())
    assert meta["state"]["skipped"] == 2 and meta["step"] == 8

    monkeypatch.setattr(
        step,
        "label_smoothed_loss",
        lambda logits, target, eps, weights=None: (real(logits, target, eps)[0] * float("nan"),) * 2,
    )
    line = one_error_line(nmt("train", "--run-dir", run_copy, "--max-steps", "40", "--max-bad-steps", "3"))
    assert "3 updates in a row had non-finite loss" in line


def test_train_errors(tmp_path, run_copy, nmt):
    assert "run `nmt prep`" in one_error_line(nmt("train", "--run-dir", tmp_path / "none"))
    assert "--size" in one_error_line(nmt("train", "--run-dir", run_copy, "--size", "huge"))
    assert "fp16 needs a GPU" in one_error_line(
        nmt("train", "--run-dir", run_copy, *TINY, "--precision", "fp16", "--device", "cpu")
    )
    assert "no CUDA GPU" in one_error_line(nmt("train", "--run-dir", run_copy, *TINY, "--device", "cuda"))
    assert "heads" in one_error_line(nmt("train", "--run-dir", run_copy, *TINY, "--heads", "3"))
    with RunDir(run_copy).lock("train"):
        assert "in use by `nmt train`" in one_error_line(nmt("train", "--run-dir", run_copy, *TINY))


# -- the hot path does not wait for the device -------------------------------------------------


@pytest.mark.soak
def test_compile_traces_the_update_once_for_every_batch_shape(run_copy, nmt, monkeypatch):
    """`--compile` on batches of changing shapes: one graph (the model, its logits and the
    loss), traced once and never again (sizes dynamic from the start), with no break in it (the
    CPU's own dropout is left to the compiler); its kernels cached in the run directory for a
    resume, the time it took in the log. In the soak set: the suite compiles the update on 2
    ranks (test_ranks.py) and in one process (unit/test_step.py), each half a minute."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # as a user who set none
    result = nmt("train", "--run-dir", run_copy, *TINY, "--compile", "--max-steps", "8", "--eval-every", "4")
    assert result.code == 0, result.err
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()
    cache = RunDir(run_copy).compile_cache
    assert sum(1 for p in cache.rglob("*") if p.is_file()) > 0
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # the process's setting restored
    assert re.search(r"compiled the update \(model, logits, loss\) in \d", RunDir(run_copy).log.read_text())


def test_a_compiled_update_meets_lengths_on_multiples_of_8_and_is_traced_once(run_copy, monkeypatch):
    """Under --compile every batch's source and target lengths are multiples of 8 (a GPU's
    attention pads a misaligned mask, and a graph of dynamic lengths would hold a guard on
    S % 8): updates of sources of 32, 34 and 36 tokens are traced once. Traced with torch's
    eager backend, which counts what the compiler would compile, in seconds."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from nmt_cli.engine.batches import collate, on_grid, to_device

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, **{**kw, "backend": counter}))
    t = tiny_trainer(run_copy, compile=True)
    shapes = [b.shape for b in t.epochs.batches(0)]
    assert all(s % 8 == 0 and u % 8 == 0 for _, s, u in shapes), sorted({s for _, s, _ in shapes})
    split = t.epochs.fixed
    for length in (32, 34, 36):  # source tokens with the EOS
        rows = np.flatnonzero(split.src_lengths[split.keep] == length)[:4]
        sentences = split.keep[rows]
        s = int(on_grid(np.array([length]), split.limit, t.epochs.multiple)[0])
        u = int(on_grid(split.tgt_lengths[sentences], split.limit, t.epochs.multiple).max())
        planned = Planned(sentences, (len(sentences), s, u))
        t.step([to_device(collate(split.src, split.tgt, planned), t.device)])
    losses = torch.stack(t.figures.pending)[:, 0].tolist()
    torch._dynamo.reset()
    assert all(math.isfinite(x) for x in losses)
    assert counter.frame_count == 1 and t.state.step == 3


@pytest.mark.soak
def test_a_compiled_run_resumes_on_another_kind_of_cpu(run_copy):
    """A --compile run resumed with the CPU's kernels held to AVX2 (another kind of CPU, as a
    cluster's nodes differ) compiles kernels of its own beside the first kind's and trains on:
    kernels cached under one kind crashed a compiled step under another. Two compiles of the
    update: in the soak set."""
    cmd = nmt_command(
        "train", "--run-dir", run_copy, *TINY, "--compile", "--max-steps", 2, "--save-every", 2,
        "--eval-every", 100,
    )  # fmt: skip
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    cmd[cmd.index("--max-steps") + 1] = "4"
    avx2 = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=avx2)
    assert again.returncode == 0 and "resuming from step 2" in again.stderr, again.stderr
    kinds = [p for p in RunDir(run_copy).compile_cache.iterdir() if p.is_dir()]
    assert len(kinds) == 2 and all(any(p.rglob("*")) for p in kinds), kinds


def test_the_compile_cache_is_the_runs_unless_the_user_chose_one(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from nmt_cli.engine.device import cpu_kind

    run, key = RunDir(tmp_path), "TORCHINDUCTOR_CACHE_DIR"
    for before in (None, default_cache_dir()):  # none set, or torch's default written in
        if before is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, before)
        with train_mod.compile_cache(run):
            assert os.environ[key] == str(run.compile_cache / cpu_kind())
        assert os.environ.get(key) == before
    # Each kind of CPU its own kernels: another kernel level or another oneDNN cap, another folder.
    monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    kinds = {cpu_kind()}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    kinds.add(cpu_kind())
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SOMETHING_ELSE")
    kinds.add(cpu_kind())
    assert len(kinds) == 3
    monkeypatch.setenv(key, str(tmp_path / "mine"))
    with train_mod.compile_cache(run):
        assert os.environ[key] == str(tmp_path / "mine")
    assert os.environ[key] == str(tmp_path / "mine")


@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_auto_precision_trains_in_bf16_where_the_cpu_has_it(run_copy, monkeypatch, cpu_bf16):
    class Said(state.Quiet):
        def __init__(self):
            self.lines: list[str] = []

        def say(self, message: str) -> None:
            self.lines.append(message)

    monkeypatch.setattr(parts, "cpu_has_bf16", lambda: cpu_bf16)
    config = dict(size="tiny", d_model=16, ffn=32, heads=2, num_encoder_layers=1, num_decoder_layers=1)
    said = Said()
    auto = train_mod.build_trainer(TrainConfig(device="cpu", **config), RunDir(run_copy), said)
    assert auto.precision == ("bf16" if cpu_bf16 else "fp32")
    assert any("bf16 autocast" in line for line in said.lines) == cpu_bf16
    kept = TrainConfig(device="cpu", precision="fp32", **config)
    fp32 = train_mod.build_trainer(kept, RunDir(run_copy), state.Quiet())
    assert fp32.precision == "fp32"


def test_cpu_training_widens_onednn_kernel_cache_unless_the_user_set_it(run_copy, monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    tiny_trainer(run_copy)
    assert int(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) > 1024  # oneDNN's default
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    tiny_trainer(run_copy)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


def test_train_step_reads_nothing_back_from_the_device(run_copy):
    from conftest import host_reads

    t = tiny_trainer(run_copy, update_freq=2)
    groups = [t.epochs.batches(0)[i : i + 2] for i in range(0, 12, 2)]
    updates = list(on_device(t.epochs.fixed, groups, t.device))
    with host_reads() as reads:
        figures = [
            trainer.train_step(
                t.model,
                t.forward,
                t.optimizer,
                t.scaler,
                batches,
                clip_norm=1.0,
                lr=1e-3,
                autocast=t.autocast,
                group=t.dist,
            )
            for batches in updates
        ]
    assert reads["n"] == 0
    rows = torch.stack(figures).tolist()
    assert [r[2] for r in rows] == [sum(b.tokens for b in batches) for batches in updates]
    assert all(r[4] == 0.0 and math.isfinite(r[0]) and r[3] > 0 for r in rows)


def test_training_reads_its_figures_once_per_log_interval(run_copy):
    from conftest import host_reads

    t = tiny_trainer(run_copy, max_steps=40, eval_every=1000, save_every=1000)
    with host_reads() as reads:
        t.train()
    # Reads at step 1, every LOG_EVERY updates, and the final validation: about one per
    # interval, where reading every update would make at least 40.
    assert t.state.step == 40
    assert reads["n"] <= 40 // trainer.LOG_EVERY + 4, reads


def test_figures_read_a_window_late_log_what_reading_at_once_logs(run_copy, tmp_path):
    """The GPU's late reads (engine/figures.py), forced on the CPU: the same records, each at
    its own step; only the timings differ."""
    import shutil

    def train(run, late: bool) -> list[dict]:
        t = tiny_trainer(run, max_steps=45, eval_every=30, save_every=1000, lr_scale=4.0, clip_norm=1.0)
        t.figures.late = late
        t.train()
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in ("minutes", "tokens_per_s")} for r in rows]

    other = tmp_path / "other"
    shutil.copytree(run_copy, other)
    at_once, late = train(run_copy, False), train(other, True)
    assert [r["step"] for r in at_once if r["kind"] == "train"] == [1, 10, 20, 30, 40, 45]
    assert late == at_once


def test_batches_collated_ahead_by_a_thread_are_the_same_batches(run_copy, tmp_path):
    """The GPU's collation thread (data.on_device's `ahead`), forced on the CPU: the same batches
    in the same order, its errors raised in the loop, the thread gone when the loop stops; and
    a run trained through it ends with the same weights, bit for bit."""
    import shutil

    from nmt_cli.engine.batches import on_device

    def collated(ahead: int, groups) -> list:
        return [
            [(b.src, b.tgt_in, b.targets) for b in group]
            for group in on_device(split, groups, t.device, ahead)
        ]

    t = tiny_trainer(run_copy)
    split, batches = t.epochs.fixed, t.epochs.batches(0)
    groups = [batches[i : i + 2] for i in range(0, 20, 2)]
    for a, b in zip(collated(0, groups), collated(2, groups), strict=True):
        assert all(all(torch.equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b))

    def broken():
        yield groups[0]
        raise OSError("the shard went away")

    with pytest.raises(OSError, match="went away"):
        collated(2, broken())
    stopped = on_device(split, groups, t.device, 2)
    next(stopped)
    stopped.close()
    assert not any(th.name == "nmt-collate" for th in threading.enumerate())

    other = tmp_path / "other"
    shutil.copytree(run_copy, other)
    weights = []
    for run, ahead in ((run_copy, 0), (other, 2)):
        trained = tiny_trainer(run, max_steps=12, eval_every=1000, save_every=1000, update_freq=2)
        trained.collate_ahead = ahead
        trained.train()
        weights.append(trained.model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_skipped_update_changes_nothing(run_copy):

    t = tiny_trainer(run_copy)
    (batches,) = on_device(t.epochs.fixed, [t.epochs.batches(0)[:1]], t.device)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.forward.label_smoothing = float("nan")
    figures = trainer.train_step(
        t.model,
        t.forward,
        t.optimizer,
        t.scaler,
        batches,
        clip_norm=0.0,
        lr=1e-3,
        autocast=t.autocast,
        group=t.dist,
    )
    assert figures[4].item() == 1.0
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    assert all(s["step"].item() == 0 for s in t.optimizer.state.values())  # Adam's count too


def test_out_of_memory_is_one_line_with_the_fix(run_copy, nmt, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer, "train_step", oom)
    line = one_error_line(nmt("train", "--run-dir", run_copy, *TINY, "--max-steps", "4"))
    assert "out of memory" in line and "lower --max-tokens" in line and "--update-freq" in line


def test_tensorboard_events_hold_the_series_of_metrics_jsonl_across_a_resume(run_copy, nmt):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def train(steps: int) -> None:
        args = ["--max-steps", steps, "--save-every", "20", "--eval-every", "20", "--tensorboard"]
        result = nmt("train", "--run-dir", run_copy, *TINY, "--warmup", "20", *args)
        assert result.code == 0, result.err

    train(30)
    # Lose the last checkpoint: the rerun resumes from step 20 and writes steps 21-30 anew;
    # metrics.jsonl is cut back to step 20, and TensorBoard must forget those steps too.
    for path in (run_copy / "checkpoints").glob("checkpoint_00000030.*"):
        path.unlink()
    train(40)
    records = RunDir(run_copy).metric_records()
    events = EventAccumulator(str(run_copy / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "valid/valid_nll", "epoch/padding"} <= tags
    for tag in ("train/loss", "train/lr", "valid/valid_nll", "valid/valid_ppl"):
        kind, name = tag.split("/")
        expected = [(r["step"], r[name]) for r in records if r["kind"] == kind]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in expected], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), tag
    assert [s for s, _ in expected] == [20, 40]


# In a process of its own: glibc's malloc settings are process-wide and sticky.
_HEAP_PROBE = """
import ctypes, sys
import torch
from nmt_cli import train as train_mod
from nmt_cli.engine import state
from nmt_cli.config import TrainConfig
from nmt_cli.rundir import RunDir


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2


def mapped_by_64mib_tensor():
    before = libc.mallinfo2().hblks
    x = torch.empty(64 << 20, dtype=torch.uint8)
    return libc.mallinfo2().hblks - before


first = mapped_by_64mib_tensor()
config = TrainConfig(size="tiny", d_model=16, ffn=32, heads=2, num_encoder_layers=1,
                     num_decoder_layers=1, max_tokens=256, device="cpu")
train_mod.build_trainer(config, RunDir(sys.argv[1]), state.Quiet())
print(first, mapped_by_64mib_tensor())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_cpu_training_keeps_large_blocks_in_the_heap(run_copy):
    # Each step's logits and their gradient are such blocks: mapped afresh every step, they were
    # page-faulted in every step (docs/benchmarks.md, training step).
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_PROBE, str(run_copy)], capture_output=True, text=True, check=True
    )
    before, after = map(int, out.stdout.split())
    assert (before, after) == (1, 0)


def test_a_trainer_runs_on_data_in_memory_without_a_run_directory(tmp_path):
    """The engine is handed its data and where its results go: here lists of ids and an object
    that keeps figures in a list, no run directory."""

    class Kept:
        checkpoints, best = tmp_path / "ckpt", tmp_path / "ckpt" / "best"

        def __init__(self):
            self.figures = []

        def add_metric(self, record):
            self.figures.append(record)

        def truncate_metrics(self, step):
            self.figures = [r for r in self.figures if r["step"] <= step]

    rng = np.random.default_rng(0)
    src = [list(rng.integers(4, 60, rng.integers(3, 9))) for _ in range(200)]
    tgt = [list(reversed(s)) for s in src]
    shards = (Shard.in_memory(src, 64), Shard.in_memory(tgt, 64))
    data = parts.Data(train=shards, valid=shards, src="xx", tgt="yy", vocab_size=64)
    config = TrainConfig(
        size="tiny", d_model=16, ffn=32, heads=2, num_encoder_layers=1, num_decoder_layers=1,
        max_tokens=128, max_steps=6, eval_every=3, save_every=3, warmup=2, device="cpu",
    )  # fmt: skip
    out = Kept()
    setup = parts.build(config, data, state.Quiet())
    trainer.Trainer(config, data, out, state.Quiet(), setup).train()
    assert [r["step"] for r in out.figures if r["kind"] == "valid"] == [3, 6]
    assert [p.name for p in checkpoint.listed(out.checkpoints)] == [
        "checkpoint_00000003.pt",
        "checkpoint_00000006.pt",
    ]
