"""Checkpoints: averaging, a resume's optimizer, and checkpoints that are damaged, hostile or of
another model. (An exact resume after a kill: tests/system/test_resumes.)"""

import json
import os
import shutil

import pytest
import torch
from conftest import (
    TINY,
    final_weights,
    one_error_line,
)

from nmt_cli.engine import checkpoint
from nmt_cli.files import sha256_file
from nmt_cli.rundir import RunDir


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


def test_a_resume_keeps_its_optimizer(run_copy, nmt):
    assert nmt("train", "--run-dir", run_copy, *TINY, "--max-steps", 2, "--save-every", 2).code == 0
    line = one_error_line(nmt("train", "--run-dir", run_copy, "--optimizer", "adamw", "--max-steps", 4))
    assert "trains with --optimizer adam, whose state its checkpoints hold" in line


def test_ema_is_validated_kept_as_best_averaged_and_translated_with(run_copy, tmp_path, nmt):
    """--ema changes nothing in training and everything downstream: the same training losses,
    another validation NLL (the average's), and the average is the best model kept, what `nmt
    average` averages and what translation loads."""
    from nmt_cli.inference.models import from_run

    plain = tmp_path / "plain"
    shutil.copytree(run_copy, plain)
    common = [*TINY, "--max-steps", 12, "--save-every", 12, "--eval-every", 12, "--keep-best", 1]
    assert nmt("train", "--run-dir", plain, *common).code == 0
    assert nmt("train", "--run-dir", run_copy, *common, "--ema", "0.999").code == 0

    def metrics(run, kind, key):
        return [r[key] for r in RunDir(run).metric_records() if r["kind"] == kind]

    assert metrics(plain, "train", "loss") == metrics(run_copy, "train", "loss")
    assert metrics(plain, "valid", "valid_nll") != metrics(run_copy, "valid", "valid_nll")
    tensors, _ = final_weights(run_copy)
    ema, weights = tensors["ema"], tensors["model"]
    assert any(not torch.equal(ema[k], weights[k]) for k in ema)
    best = checkpoint.load_tensors(next((run_copy / "checkpoints" / "best").glob("*.pt")))[0]["model"]
    assert all(torch.equal(best[k], ema[k]) for k in ema)
    assert all(torch.equal(from_run(RunDir(run_copy), None).load_weights()[k], ema[k]) for k in ema)
    assert nmt("average", "--run-dir", run_copy, "--last", 1).code == 0
    averaged = checkpoint.load_tensors(RunDir(run_copy).averaged)[0]["model"]
    assert all(torch.equal(averaged[k], ema[k]) for k in ema)
