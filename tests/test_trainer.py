import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import TINY, UNTRAINED, nmt_command, one_error_line

from nmt_cli import training
from nmt_cli.config import TrainConfig
from nmt_cli.engine import checkpoint, state, step, trainer
from nmt_cli.engine.data import make_batches, padding_share
from nmt_cli.engine.loss import label_smoothed_loss
from nmt_cli.engine.schedule import learning_rate
from nmt_cli.files import sha256_file
from nmt_cli.rundir import RunDir
from nmt_cli.shards import Shard


def test_learning_rate_schedule():
    d, w = 512, 4000
    assert learning_rate(w, d, w) == pytest.approx(d**-0.5 * w**-0.5)  # the peak
    assert learning_rate(w // 2, d, w) == pytest.approx(learning_rate(w, d, w) / 2)  # linear
    assert learning_rate(4 * w, d, w) == pytest.approx(learning_rate(w, d, w) / 2)  # 1/sqrt
    assert learning_rate(w, d, w, scale=2.0) == pytest.approx(2 * learning_rate(w, d, w))


def test_label_smoothed_loss_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])  # p = (1/4, 3/4)
    target = torch.tensor([1, 1])
    loss, nll = label_smoothed_loss(logits, target, 0.0)
    assert nll.item() == pytest.approx(-math.log(0.75) - math.log(0.25))
    assert loss.item() == pytest.approx(nll.item())
    loss, nll = label_smoothed_loss(logits, target, 0.1)
    uniform = 2 * -(math.log(0.25) + math.log(0.75)) / 2
    assert loss.item() == pytest.approx(0.9 * nll.item() + 0.1 * uniform)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_label_smoothed_loss_gradient_matches_autograd(epsilon):
    import torch.nn.functional as F

    torch.manual_seed(0)
    logits = torch.randn(40, 30, requires_grad=True)
    target = torch.randint(0, 30, (40,))
    lprobs = F.log_softmax(logits, -1)
    nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)
    reference = ((1 - epsilon) * nll - epsilon * lprobs.mean(-1)).sum()
    (expected,) = torch.autograd.grad(3 * reference + 2 * nll.sum(), logits)
    loss, nll_sum = label_smoothed_loss(logits, target, epsilon)
    (got,) = torch.autograd.grad(3 * loss + 2 * nll_sum, logits)
    assert torch.allclose(loss, reference.detach(), atol=1e-4)
    assert torch.allclose(got, expected, atol=1e-6)


def test_batches_cover_every_sentence_once_with_little_padding(multi30k_bpe):
    run = RunDir(multi30k_bpe)
    s, t = Shard(run.tokens("train", "en")).lengths + 1, Shard(run.tokens("train", "de")).lengths + 1
    a = make_batches(s, t, 4096, seed=1, epoch=0)
    b = make_batches(s, t, 4096, seed=1, epoch=1)
    assert np.array_equal(np.sort(np.concatenate(a)), np.arange(len(s)))
    assert all(len(x) * max(s[x].max(), t[x].max()) <= 4096 for x in a)
    assert not all(np.array_equal(x, y) for x, y in zip(a, b))  # reshuffled each epoch
    assert all(np.array_equal(x, y) for x, y in zip(a, make_batches(s, t, 4096, 1, 0)))
    assert padding_share(a, s, t) <= 0.05


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
    assert valid[1]["valid_nll"] < valid[0]["valid_nll"]
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


def _train_cmd(run_dir, steps):
    return nmt_command(
        "train", "--run-dir", run_dir, *TINY, "--max-steps", steps, "--save-every", 1,
        "--eval-every", 5, "--seed", 3,
    )  # fmt: skip


def _final_weights(run_dir):
    tensors, meta = checkpoint.load_tensors(checkpoint.listed(run_dir / "checkpoints")[-1])
    return tensors, meta


def test_resume_after_sigkill_is_bit_identical(run_copy, tmp_path):
    import shutil

    other = tmp_path / "uninterrupted"
    shutil.copytree(run_copy, other)
    subprocess.run(_train_cmd(other, 16), check=True, capture_output=True)

    proc = subprocess.Popen(_train_cmd(run_copy, 16), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = run_copy / "checkpoints" / "checkpoint_00000007.json"
    deadline = time.monotonic() + 120
    while not target.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(checkpoint.listed(run_copy / "checkpoints")) < 16  # it really was cut short
    subprocess.run(_train_cmd(run_copy, 16), check=True, capture_output=True)

    a, meta_a = _final_weights(other)
    b, meta_b = _final_weights(run_copy)
    assert meta_a["step"] == meta_b["step"] == 16
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert meta_a["state"] == {**meta_b["state"], "seconds": meta_a["state"]["seconds"]}


def test_an_interrupted_fine_tuning_resumes_from_its_own_checkpoint(trained_longer, tmp_path):
    """SIGTERM to a run started with --init-from, then the same command: it goes on from its own
    checkpoint (not from the initial model again) and ends bit-identical to a run not stopped."""
    runs = {}
    for name in ("uninterrupted", "interrupted"):
        runs[name] = tmp_path / name
        shutil.copytree(
            trained_longer,
            runs[name],
            ignore=UNTRAINED,
        )

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
    a, _ = _final_weights(runs["uninterrupted"])
    b, _ = _final_weights(run)
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


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

    def flaky(logits, target, eps):
        calls["n"] += 1
        loss, nll = real(logits, target, eps)
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
        lambda logits, target, eps: (real(logits, target, eps)[0] * float("nan"),) * 2,
    )
    line = one_error_line(nmt("train", "--run-dir", run_copy, "--max-steps", "40", "--max-bad-steps", "3"))
    assert "3 updates in a row had non-finite loss" in line


def test_average_identity_order_and_shapes(run_copy, nmt):
    assert (
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
        ).code
        == 0
    )
    folder = run_copy / "checkpoints"
    paths = checkpoint.listed(folder)
    one = checkpoint.load_tensors(paths[-1])[0]["model"]
    same, _ = checkpoint.average([paths[-1]] * 3)
    for k, v in one.items():
        assert torch.allclose(same[k], v.float(), atol=1e-6)
    forward, _ = checkpoint.average(paths)
    backward, _ = checkpoint.average(paths[::-1])
    for k in forward:
        assert torch.allclose(forward[k], backward[k], atol=1e-6)
    result = nmt("average", "--run-dir", run_copy, "--last", "2")
    assert result.code == 0, result.err
    tensors, meta = checkpoint.load_tensors(RunDir(run_copy).averaged)
    assert meta["averaged"] == [p.name for p in paths[-2:]] and meta["step"] == 6
    a, b = (checkpoint.load_tensors(p)[0]["model"] for p in paths[-2:])
    assert any(not torch.equal(a[k], b[k]) for k in a)  # two different models
    for k in a:  # their mean, element by element
        assert torch.allclose(tensors["model"][k], (a[k].float() + b[k].float()) / 2, atol=1e-7)


def test_average_refuses_other_shapes(run_copy, tmp_path, nmt):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(run_copy, other)
    assert nmt("train", "--run-dir", run_copy, *TINY, "--max-steps", "2", "--save-every", "2").code == 0
    assert (
        nmt(
            "train",
            "--run-dir",
            other,
            *TINY[:-2],
            "--d-model",
            "32",
            "--max-tokens",
            "256",
            "--max-steps",
            "2",
            "--save-every",
            "2",
        ).code
        == 0
    )
    ckpt = checkpoint.listed(other / "checkpoints")[-1]
    for suffix in (".pt", ".json"):
        shutil.copy(ckpt.with_suffix(suffix), run_copy / "checkpoints" / ("checkpoint_00000004" + suffix))
    line = one_error_line(nmt("average", "--run-dir", run_copy, "--last", "2"))
    assert "different shapes" in line


def test_pickle_payload_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "checkpoint_00000001.pt"
    torch.save({"model": Evil()}, path)
    meta = {"step": 1, "sha256": sha256_file(path)}
    path.with_suffix(".json").write_text(json.dumps(meta))
    from nmt_cli.errors import NmtError

    with pytest.raises(NmtError, match="refusing to load"):
        checkpoint.load_tensors(path)
    assert not marker.exists()


def test_corrupt_latest_checkpoint_is_skipped(run_copy, nmt):
    assert (
        nmt(
            "train",
            "--run-dir",
            run_copy,
            *TINY,
            "--max-steps",
            "4",
            "--save-every",
            "2",
            "--eval-every",
            "100",
        ).code
        == 0
    )
    latest = checkpoint.listed(run_copy / "checkpoints")[-1]
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    latest.write_bytes(bytes(data))
    result = nmt("train", "--run-dir", run_copy, "--max-steps", "6")
    assert result.code == 0, result.err
    assert "skipping checkpoint checkpoint_00000004.pt" in result.err
    assert "resuming from step 2" in result.err


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


def _tiny_trainer(run_dir, **options):
    from nmt_cli.config import TrainConfig

    config = TrainConfig(
        size="tiny",
        d_model=16,
        ffn=32,
        heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        max_tokens=256,
        device="cpu",
        **options,
    )
    return training.build_trainer(config, RunDir(run_dir), state.Quiet())


def test_compile_traces_the_model_once_for_every_batch_shape(run_copy, nmt):
    """`--compile` on batches of changing shapes: one graph, traced once and never again (sizes
    dynamic from the start), with no break in it (the CPU's own dropout is left to the compiler)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    result = nmt("train", "--run-dir", run_copy, *TINY, "--compile", "--max-steps", "8", "--eval-every", "4")
    assert result.code == 0, result.err
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_auto_precision_trains_in_bf16_where_the_cpu_has_it(run_copy, monkeypatch, cpu_bf16):
    class Said(state.Quiet):
        def __init__(self):
            self.lines: list[str] = []

        def say(self, message: str) -> None:
            self.lines.append(message)

    monkeypatch.setattr(trainer, "cpu_has_bf16", lambda: cpu_bf16)
    config = dict(size="tiny", d_model=16, ffn=32, heads=2, num_encoder_layers=1, num_decoder_layers=1)
    said = Said()
    auto = training.build_trainer(TrainConfig(device="cpu", **config), RunDir(run_copy), said)
    assert auto.precision == ("bf16" if cpu_bf16 else "fp32")
    assert any("bf16 autocast" in line for line in said.lines) == cpu_bf16
    kept = TrainConfig(device="cpu", precision="fp32", **config)
    fp32 = training.build_trainer(kept, RunDir(run_copy), state.Quiet())
    assert fp32.precision == "fp32"


def test_cpu_training_widens_onednn_kernel_cache_unless_the_user_set_it(run_copy, monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    _tiny_trainer(run_copy)
    assert int(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) > 1024  # oneDNN's default
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    _tiny_trainer(run_copy)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


def test_train_step_reads_nothing_back_from_the_device(run_copy):
    from conftest import host_reads

    from nmt_cli.engine.data import on_device

    t = _tiny_trainer(run_copy, update_freq=2)
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
                label_smoothing=0.1,
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

    t = _tiny_trainer(run_copy, max_steps=40, eval_every=1000, save_every=1000)
    with host_reads() as reads:
        t.train()
    # Reads at step 1, every LOG_EVERY updates, and the final validation: about one per
    # interval, where reading every update would make at least 40.
    assert t.state.step == 40
    assert reads["n"] <= 40 // trainer.LOG_EVERY + 4, reads


def test_a_skipped_update_changes_nothing(run_copy):
    from nmt_cli.engine.data import on_device

    t = _tiny_trainer(run_copy)
    (batches,) = on_device(t.epochs.fixed, [t.epochs.batches(0)[:1]], t.device)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    figures = trainer.train_step(
        t.model,
        t.forward,
        t.optimizer,
        t.scaler,
        batches,
        label_smoothing=float("nan"),
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


def test_patience_is_rank_zeros_decision_for_every_rank(run_copy):
    from nmt_cli.engine import distributed

    class TwoRanks(distributed.Group):
        """Rank 1 of two, whose rank 0 has run out of patience (what host_max would bring)."""

        def host_max(self, values):
            return [max(v, other) for v, other in zip(values, [0, 0, 1])]

    t = _tiny_trainer(run_copy, patience=2)
    t._started = time.monotonic()
    assert t.agreed_stop() is None
    t.dist = TwoRanks(rank=1, world=2)
    t.state.bad_evals = 0  # this rank's own count would go on
    assert "did not improve in 2 evaluations" in t.agreed_stop()


def test_the_best_models_by_bleu_are_kept_and_averaged(trained_longer, tmp_path, nmt):
    """--keep-best 2 --best-metric bleu keeps the two evaluations of highest validation BLEU
    (whatever the pruning of the last checkpoints does), and `nmt average --best 2` averages
    exactly those. (A model that ends its sentences: validation BLEU is then quick.)"""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_longer, run)
    shape = [*TINY, "--d-model", "64", "--ffn", "128", "--max-tokens", "512"]
    result = nmt(
        "train",
        "--run-dir",
        run,
        *shape,
        "--max-steps",
        "840",
        "--eval-every",
        "10",
        "--save-every",
        "840",
        "--keep-last",
        "1",
        "--eval-bleu",
        "--keep-best",
        "2",
        "--best-metric",
        "bleu",
    )
    assert result.code == 0, result.err
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    bleu = {r["step"]: r["valid_bleu"] for r in records if r["kind"] == "valid" and r["step"] > 800}
    assert len(bleu) == 4 and len(set(bleu.values())) > 1, bleu
    top = sorted(bleu, key=lambda s: (-bleu[s], s))[:2]
    kept = sorted((run / "checkpoints" / "best").glob("best_*.pt"))
    assert [int(p.stem.split("_")[1]) for p in kept] == sorted(top)
    for p in kept:
        meta = json.loads(p.with_suffix(".json").read_text())
        assert meta["best"]["valid_bleu"] == bleu[meta["step"]]
    result = nmt("average", "--run-dir", run, "--best", "2")
    assert result.code == 0, result.err
    record = json.loads((run / "averaged.json").read_text())
    assert record["averaged"] == [p.name for p in kept]
    mean = checkpoint.average(kept)[0]
    averaged = checkpoint.load_tensors(run / "averaged.pt")[0]["model"]
    assert all(torch.equal(averaged[k], v) for k, v in mean.items())


def test_patience_watches_the_best_metric(run_copy):
    # The loss falls while BLEU falls too: only the chosen metric counts.
    figures = [
        {"valid_nll": 3.0, "valid_bleu": 10.0, "valid_ppl": 1.0},
        {"valid_nll": 2.0, "valid_bleu": 9.0, "valid_ppl": 1.0},
        {"valid_nll": 1.0, "valid_bleu": 8.0, "valid_ppl": 1.0},
    ]
    for metric, improved in (("bleu", [True, False, False]), ("nll", [True, True, True])):
        t = _tiny_trainer(run_copy, eval_bleu=True, best_metric=metric)
        t._started = time.monotonic()
        t.validate = iter(figures).__next__
        got = []
        for _ in figures:
            t.evaluate()
            got.append(t.state.bad_evals == 0)
        assert got == improved, metric


def test_best_metric_errors(run_copy, nmt):
    assert "needs --eval-bleu" in one_error_line(
        nmt("train", "--run-dir", run_copy, *TINY, "--best-metric", "bleu")
    )
    assert "train with --keep-best" in one_error_line(nmt("average", "--run-dir", run_copy, "--best", "2"))


LONGER = [*TINY, "--d-model", "64", "--ffn", "128", "--max-tokens", "512"]  # trained_longer's


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
    moved = after["optimizer"]["state"][0]["exp_avg_sq"] - before["optimizer"]["state"][0]["exp_avg_sq"]
    assert moved.abs().max() < before["optimizer"]["state"][0]["exp_avg_sq"].abs().max()
    assert "with its optimizer state, at its step 800" in (run / "log.txt").read_text()
    # The checkpoint is read (and its sha256 verified) once for the weights and the optimizer.
    reads = []
    load = checkpoint.load_tensors
    monkeypatch.setattr(checkpoint, "load_tensors", lambda *a, **k: reads.append(a) or load(*a, **k))
    config = TrainConfig(init_from=str(trained_longer), init_optimizer=True, init_schedule=True)
    initial = training.initial_model(RunDir(run), config)
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


def test_bpe_dropout_encodes_each_epoch_anew_and_deterministically(multi30k_bpe):
    import sentencepiece as spm

    from nmt_cli.bpe import dropout_encoding

    run = RunDir(multi30k_bpe)
    fixed = Shard(run.tokens("train", "en"))
    e0 = dropout_encoding(run, "en", 0.1, seed=1, epoch=0)
    assert len(e0) == len(fixed) == 28_997  # what prep kept
    same = subprocess.run(  # another process, as a resumed run or another rank is
        [
            sys.executable,
            "-c",
            "import sys, hashlib; from nmt_cli.bpe import dropout_encoding;"
            "from nmt_cli.rundir import RunDir;"
            "s = dropout_encoding(RunDir(sys.argv[1]), 'en', 0.1, 1, 0);"
            "print(hashlib.sha256(s.tokens.tobytes() + s.offsets.tobytes()).hexdigest())",
            str(multi30k_bpe),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    import hashlib

    assert same == hashlib.sha256(e0.tokens.tobytes() + e0.offsets.tobytes()).hexdigest()
    e1 = dropout_encoding(run, "en", 0.1, seed=1, epoch=1)
    other_seed = dropout_encoding(run, "en", 0.1, seed=2, epoch=0)
    differ = lambda a, b: sum(not np.array_equal(a[i], b[i]) for i in range(2000))  # noqa: E731
    # Dropping 10% of merges re-segments most captions, into more and shorter pieces...
    assert differ(e0, fixed) > 1500 and differ(e1, e0) > 1000 and differ(other_seed, e0) > 1000
    assert 1.1 < e0.lengths.sum() / fixed.lengths.sum() < 1.4
    # ... of the same text.
    sp = spm.SentencePieceProcessor(model_file=str(run.spm_model))
    assert all(sp.decode(e0[i].tolist()) == sp.decode(fixed[i].tolist()) for i in range(0, 28_997, 7))
    assert differ(dropout_encoding(run, "en", 0.0, seed=1, epoch=0), fixed) == 0


def test_bpe_dropout_keeps_corpus_tags_whole(tagged_bpe):
    """A tag is a piece of its own that no merge builds: BPE-dropout leaves it as it is (it
    raised KeyError: '<' on every tagged corpus), and at rate 0 gives the binarized data."""
    from nmt_cli.bpe import dropout_encoding

    run = RunDir(tagged_bpe)
    fixed = Shard(run.tokens("train", "en"))
    kept = dropout_encoding(run, "en", 0.0, 1, 0)
    assert all(np.array_equal(kept[i], fixed[i]) for i in range(len(fixed)))
    clean = run.load_manifest()["prep"]["splits"]["train"]["corpora"][0]["pairs"]  # then the tagged
    tag = int(fixed[clean][1])  # a tagged line begins with U+2581, then the tag
    dropped = dropout_encoding(run, "en", 0.3, 1, 0)
    assert all(int(dropped[i][1]) == tag for i in range(clean, len(fixed)))
    assert not any(tag in dropped[i].tolist() for i in range(clean))
    assert sum(not np.array_equal(dropped[i], fixed[i]) for i in range(clean, len(fixed))) > 1000


def test_bpe_dropout_trains_on_its_own_epochs_and_resumes_exactly(run_copy, tmp_path):
    import shutil

    from nmt_cli.config import TrainConfig
    from nmt_cli.training import _resample

    config = TrainConfig(size="tiny", d_model=16, ffn=32, heads=2, max_tokens=256, bpe_dropout=0.1)
    t = training.build_trainer(
        config, RunDir(run_copy), state.Quiet(), resample=_resample(RunDir(run_copy), config)
    )
    fixed, e0, e1 = t.epochs.fixed, t.epochs.data(0), t.epochs.data(1)
    assert t.epochs.data(1) is e1  # an epoch is encoded once
    assert fixed.src_lengths.sum() < e0.src_lengths.sum() and fixed.tgt_lengths.sum() < e0.tgt_lengths.sum()
    assert not np.array_equal(e0.src.tokens, e1.src.tokens)
    assert (
        t.valid_data.src_lengths.sum() == Shard(RunDir(run_copy).tokens("valid", "en")).lengths.sum() + 1014
    )
    t.dist.close()
    # Killed and resumed, a BPE-dropout run ends with the weights of one that never stopped.
    other = tmp_path / "uninterrupted"
    shutil.copytree(run_copy, other)
    cmd = lambda run_dir: [*_train_cmd(run_dir, 12), "--bpe-dropout", "0.1"]  # noqa: E731
    subprocess.run(cmd(other), check=True, capture_output=True)
    proc = subprocess.Popen(cmd(run_copy), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = run_copy / "checkpoints" / "checkpoint_00000005.json"
    deadline = time.monotonic() + 120
    while not target.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(checkpoint.listed(run_copy / "checkpoints")) < 12
    subprocess.run(cmd(run_copy), check=True, capture_output=True)
    a, _ = _final_weights(other)
    b, _ = _final_weights(run_copy)
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    # And its weights are not those of the fixed encoding.
    plain = tmp_path / "plain"
    shutil.copytree(other, plain)
    shutil.rmtree(plain / "checkpoints")
    subprocess.run(_train_cmd(plain, 12), check=True, capture_output=True)
    c, _ = _final_weights(plain)
    assert not torch.equal(a["model"]["embed.weight"], c["model"]["embed.weight"])


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
from nmt_cli import training
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
training.build_trainer(config, RunDir(sys.argv[1]), state.Quiet())
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
    data = trainer.Data(train=shards, valid=shards, src="xx", tgt="yy", vocab_size=64)
    config = TrainConfig(
        size="tiny", d_model=16, ffn=32, heads=2, num_encoder_layers=1, num_decoder_layers=1,
        max_tokens=128, max_steps=6, eval_every=3, save_every=3, warmup=2, device="cpu",
    )  # fmt: skip
    out = Kept()
    trainer.Trainer(config, data, out, state.Quiet()).train()
    assert [r["step"] for r in out.figures if r["kind"] == "valid"] == [3, 6]
    assert [p.name for p in checkpoint.listed(out.checkpoints)] == [
        "checkpoint_00000003.pt",
        "checkpoint_00000006.pt",
    ]
