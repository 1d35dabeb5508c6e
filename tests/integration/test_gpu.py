"""The CUDA paths, on a real GPU. Not part of the default suite (which hides GPUs); run with

    NMT_TEST_GPU=1 python -m pytest -m gpu tests/integration/test_gpu.py

(benchmarks/gpu_check.sh does). Without a visible GPU every test here is skipped.
"""

import contextlib
import json
import math
import shutil
import warnings

import pytest
import torch
from conftest import TINY, count_decoding_steps, run_ok

from nmt_cli import train as train_mod
from nmt_cli.engine import checkpoint, state, trainer
from nmt_cli.engine.batches import on_device
from nmt_cli.rundir import RunDir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = ["--device", "cuda"]
NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--relu-dropout", "0"]


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _last(run_dir):
    return checkpoint.load_tensors(checkpoint.listed(run_dir / "checkpoints")[-1])


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32", "tf32"])
def test_train_save_and_resume(run_copy, nmt, precision):
    common = [
        *TINY,
        *CUDA,
        "--precision",
        precision,
        "--save-every",
        "10",
        "--eval-every",
        "10",
        "--warmup",
        "10",
        "--lr-scale",
        "4",
    ]
    first = nmt("train", "--run-dir", run_copy, *common, "--max-steps", "20")
    assert first.code == 0, first.err
    second = nmt("train", "--run-dir", run_copy, *common, "--max-steps", "40")
    assert second.code == 0, second.err
    assert "resuming from step 20" in second.err
    tensors, meta = _last(run_copy)
    assert meta["step"] == 40 and meta["state"]["skipped"] <= 2
    assert all(torch.isfinite(v).all() for v in tensors["model"].values())
    assert tensors["rng_cuda"].shape[0] == 1
    if precision == "fp16":
        assert tensors["scaler"]["scale"] > 0  # the loss scale is saved and restored
    valid = [r["valid_nll"] for r in _metrics(run_copy) if r["kind"] == "valid"]
    assert len(valid) == 4 and valid[-1] < valid[0]


def test_train_step_never_waits_for_the_gpu(run_copy):
    """The hot path queues work only: a synchronising CUDA call raises here."""
    from nmt_cli.config import TrainConfig

    for precision in ("bf16", "fp16"):
        config = TrainConfig(size="tiny", max_tokens=1024, device="cuda", precision=precision, update_freq=2)
        t = train_mod.build_trainer(config, RunDir(run_copy), state.Quiet())
        groups = [t.epochs.batches(0)[i : i + 2] for i in range(0, 8, 2)]
        updates = list(on_device(t.epochs.fixed, groups, t.device))
        assert updates[0][0].src.is_cuda
        step = dict(clip_norm=1.0, lr=1e-4, autocast=t.autocast, group=t.dist)
        trainer.train_step(t.model, t.forward, t.optimizer, t.scaler, updates[0], **step)
        torch.cuda.synchronize(t.device)  # the first step initialises cuBLAS and the scaler
        torch.cuda.set_sync_debug_mode("error")
        try:
            figures = [
                trainer.train_step(t.model, t.forward, t.optimizer, t.scaler, batches, **step)
                for batches in updates[1:]
            ]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rows = torch.stack(figures).tolist()
        assert all(math.isfinite(r[0]) and r[2] > 0 for r in rows)


def test_the_loop_reads_its_figures_a_window_late_and_logs_every_window(run_copy, tmp_path):
    """On a GPU the figures come a window late (engine/figures.py): every window logged once,
    at its own step, with the figures reading at once gives (up to the GPU's rounding)."""
    from nmt_cli.config import TrainConfig

    def train(run, late: bool) -> list[dict]:
        config = TrainConfig(
            size="tiny", max_tokens=1024, device="cuda", precision="fp32", max_steps=45, eval_every=30,
            save_every=1000, dropout=0.0, attention_dropout=0.0, relu_dropout=0.0,
        )  # fmt: skip
        t = train_mod.build_trainer(config, RunDir(run), state.Quiet())
        assert t.figures.late and t.collate_ahead and t.epochs.ahead  # threads collate, make epochs
        t.figures.late = late
        t.train()
        return [r for r in _metrics(run) if r["kind"] in ("train", "valid")]

    other = tmp_path / "other"
    shutil.copytree(run_copy, other)
    late, at_once = train(run_copy, True), train(other, False)
    assert [(r["kind"], r["step"]) for r in late] == [(r["kind"], r["step"]) for r in at_once]
    assert [r["step"] for r in late if r["kind"] == "train"] == [1, 10, 20, 30, 40, 45]
    for a, b in zip(late, at_once):
        key = "loss" if a["kind"] == "train" else "valid_nll"
        assert a[key] == pytest.approx(b[key], rel=1e-3)


def test_bf16_attention_takes_the_memory_efficient_kernel():
    """Training and decoding in bf16 attend with the kernel nmt chose (engine/device.py), not
    cuDNN's (a plan built per shape) or flash (slower for this model's heads)."""
    from torch.profiler import ProfilerActivity, profile

    from nmt_cli.config import ModelConfig
    from nmt_cli.engine.device import resolve_device
    from nmt_cli.engine.model import Transformer

    device = resolve_device("cuda")
    c = ModelConfig(vocab_size=100, num_encoder_layers=1, num_decoder_layers=1, d_model=64, ffn=128, heads=4)
    model = Transformer(c).to(device)
    src = torch.randint(4, 100, (8, 12), device=device)
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.autocast("cuda", dtype=torch.bfloat16):
        model(src, src).float().sum().backward()
    ops = {e.name for e in prof.events() if "attention" in e.name and e.name.startswith("aten::_")}
    assert any("efficient" in op for op in ops), ops
    assert not any("cudnn" in op or "flash" in op for op in ops), ops


def test_the_gpus_launcher_writes_checkpoints(run_copy, nmt):
    """`--gpus 1`: the elastic launcher and a real NCCL process group, through a checkpoint
    (whose RNG states are gathered) and a resume."""
    common = [*TINY, "--gpus", "1", "--save-every", "5", "--eval-every", "5"]
    result = nmt("train", "--run-dir", run_copy, *common, "--max-steps", "10")
    assert result.code == 0, result.err
    result = nmt("train", "--run-dir", run_copy, *common, "--max-steps", "15")
    assert result.code == 0, result.err
    tensors, meta = _last(run_copy)
    assert meta["step"] == 15 and meta["world"] == 1 and "rng_cuda" in tensors


def test_compile_on_cuda(run_copy, nmt):
    result = nmt(
        "train",
        "--run-dir",
        run_copy,
        *TINY,
        *CUDA,
        "--compile",
        "--max-steps",
        "20",
        "--save-every",
        "20",
        "--eval-every",
        "20",
    )
    assert result.code == 0, result.err
    assert _last(run_copy)[1]["step"] == 20


@pytest.fixture(scope="module")
def trained_on_cpu(tmp_path_factory, multi30k_bpe):
    """The tiny model trained a little on the CPU, so CPU and GPU decode the same weights."""
    run_dir = tmp_path_factory.mktemp("gpu-decode") / "run"
    shutil.copytree(multi30k_bpe, run_dir)
    run_ok(
        [
            "train",
            "--run-dir",
            run_dir,
            *TINY,
            "--device",
            "cpu",
            "--max-steps",
            "200",
            "--save-every",
            "200",
            "--eval-every",
            "1000",
            "--warmup",
            "50",
            "--lr-scale",
            "4",
        ]
    )
    return run_dir


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "tf32"])
def test_translate_on_cuda(trained_on_cpu, nmt, multi30k_dir, precision):
    import gzip

    lines = gzip.open(multi30k_dir / "test_2016_flickr.en.gz", "rt").read().splitlines()[:200]
    stdin = ("\n".join(lines[:100] + ["", "   "] + lines[100:]) + "\n").encode()
    gpu = nmt("translate", "--run-dir", trained_on_cpu, *CUDA, "--precision", precision, stdin=stdin)
    assert gpu.code == 0, gpu.err
    out = gpu.out.split("\n")[:-1]
    assert len(out) == 202 and out[100] == out[101] == ""
    cpu = nmt("translate", "--run-dir", trained_on_cpu, "--device", "cpu", stdin=stdin)
    same = sum(a == b for a, b in zip(out, cpu.out.split("\n")[:-1]))
    assert same >= (190 if precision == "fp32" else 150), same


def test_translate_with_and_without_cuda_graphs_alike(trained_on_cpu, nmt, multi30k_dir):
    """`--no-cuda-graphs` (each step's kernels launched one by one) and the default (steps
    replayed as CUDA graphs) print the same translations, in fp32 and bf16; the Python API
    takes the setting too."""
    import gzip

    from nmt_cli.inference.translator import Translator

    lines = gzip.open(multi30k_dir / "test_2016_flickr.en.gz", "rt").read().splitlines()[:300]
    stdin = ("\n".join(lines) + "\n").encode()
    for precision in ("fp32", "bf16"):
        common = ["translate", "--run-dir", trained_on_cpu, *CUDA, "--precision", precision]
        graphs, eager = nmt(*common, stdin=stdin), nmt(*common, "--no-cuda-graphs", stdin=stdin)
        assert graphs.code == 0 and eager.code == 0, (graphs.err, eager.err)
        same = sum(a == b for a, b in zip(graphs.out.split("\n"), eager.out.split("\n")))
        assert same >= (300 if precision == "fp32" else 285), (precision, same)
    api = Translator.load(trained_on_cpu, device="cuda", precision="fp32", cuda_graphs=False)
    assert api.translate(lines) == nmt(*common[:-1], "fp32", stdin=stdin).out.split("\n")[:-1]


def test_translate_gpus_one_worker_each_equals_one_process(trained_on_cpu, nmt, multi30k_dir):
    """`--gpus 1` (nmt's engine: a worker process; CTranslate2: its replica on GPU 0, where
    its wheel has CUDA) answers as one process on the GPU does."""
    import gzip

    lines = gzip.open(multi30k_dir / "test_2016_flickr.en.gz", "rt").read().splitlines()[:100]
    stdin = ("\n".join(lines) + "\n").encode()
    engines = [["--engine", "nmt"]]
    with contextlib.suppress(ImportError):
        import ctranslate2

        if ctranslate2.get_cuda_device_count() > 0:
            engines.append(["--engine", "ctranslate2"])
    for engine in engines:
        common = ["translate", "--run-dir", trained_on_cpu, "--precision", "fp32", *engine]
        one = nmt(*common, *CUDA, stdin=stdin)
        spread = nmt(*common, "--gpus", "1", stdin=stdin)
        assert one.code == 0 and spread.code == 0, (engine, one.err, spread.err)
        assert spread.out == one.out and one.out.count("\n") == 100, engine


def test_beam_search_reads_the_gpu_once_per_step(trained_on_cpu):
    from nmt_cli.config import DecodeOptions
    from nmt_cli.engine import decoding
    from nmt_cli.inference.backend_nmt import load_model
    from nmt_cli.inference.models import from_run
    from nmt_cli.rundir import RunDir

    path = checkpoint.listed(trained_on_cpu / "checkpoints")[-1]
    model = load_model(from_run(RunDir(trained_on_cpu), str(path)), torch.device("cuda", 0), "fp32")
    src = torch.randint(4, 1000, (16, 12), device="cuda")
    src[:, -1] = 3  # EOS
    steps = count_decoding_steps(model)
    decoding.translate(model, src, DecodeOptions(beam=4), graphs=False)  # counts every step
    decoding.translate(model, src, DecodeOptions(beam=4))  # warm-up
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            decoding.translate(model, src, DecodeOptions(beam=4))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert steps["n"] > 0 and len(syncs) <= 2 * steps["n"] + 4, (len(syncs), steps["n"])


def test_decoding_replays_its_steps_as_cuda_graphs_and_finds_what_eager_steps_find(trained_on_cpu):
    """On a GPU each decoding step after the first few is a replayed CUDA graph (graphed.py):
    the model's decode runs twice a batch (warm-up, recording), three times under beam search
    (a graph for each of the cache's two tensors), and every search finds what the steps run
    one kernel at a time find."""
    from nmt_cli.config import DecodeOptions
    from nmt_cli.engine import decoding, graphed
    from nmt_cli.inference.backend_nmt import load_model
    from nmt_cli.inference.models import from_run
    from nmt_cli.rundir import RunDir

    path = checkpoint.listed(trained_on_cpu / "checkpoints")[-1]
    model = load_model(from_run(RunDir(trained_on_cpu), str(path)), torch.device("cuda", 0), "fp32")
    src = torch.randint(4, 1000, (24, 14), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    src[:, -1] = 3  # EOS
    src[5, 6:], src[5, 5] = 0, 3  # PAD after a shorter sentence
    steps = count_decoding_steps(model)
    # one search after another in one process, each recording its graphs: torch refuses a capture
    # into a pool whose graphs are all freed, which a pool kept for the process met at the second
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for options in (
            DecodeOptions(beam=4),
            DecodeOptions(beam=1),
            DecodeOptions(beam=4, nbest=2, repetition_penalty=1.3),
            DecodeOptions(sample=True, nbest=2, seed=1),
        ):
            steps["n"] = 0
            eager = decoding.translate(model, src, options, graphs=False)
            taken = steps["n"]
            steps["n"] = 0
            replayed = decoding.translate(model, src, options)
            assert graphed._failed is None
            recorded = 3 if options.beam > 1 and not options.sample else 2
            assert steps["n"] == recorded < taken, (steps["n"], taken, options)
            assert [[h.tokens for h in hs] for hs in replayed] == [[h.tokens for h in hs] for hs in eager]
            flat = [h.score for hs in replayed for h in hs]
            assert flat == pytest.approx([h.score for hs in eager for h in hs], abs=1e-4)
    assert not [w for w in caught if "without CUDA graphs" in str(w.message)]
    bf16 = model.to(torch.bfloat16)
    eager = decoding.translate(bf16, src, DecodeOptions(beam=4), graphs=False)
    replayed = decoding.translate(bf16, src, DecodeOptions(beam=4))
    same = sum(a[0].tokens == b[0].tokens for a, b in zip(eager, replayed))
    assert same >= 20, same


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_equal_one_with_update_freq_two(run_copy, tmp_path, nmt):
    single = tmp_path / "single"
    shutil.copytree(run_copy, single)
    common = [
        *TINY,
        *NO_DROPOUT,
        "--precision",
        "fp32",
        "--max-steps",
        "20",
        "--save-every",
        "20",
        "--eval-every",
        "20",
    ]
    assert nmt("train", "--run-dir", single, *common, *CUDA, "--update-freq", "2").code == 0
    result = nmt("train", "--run-dir", run_copy, *common, "--gpus", "2")
    assert result.code == 0, result.err
    a, _ = _last(single)
    b, meta = _last(run_copy)
    assert meta["world"] == 2
    for name in a["model"]:
        assert torch.allclose(a["model"][name], b["model"][name], rtol=1e-3, atol=1e-4), name
    valid = [[r["valid_nll"] for r in _metrics(d) if r["kind"] == "valid"] for d in (single, run_copy)]
    assert valid[0][-1] == pytest.approx(valid[1][-1], abs=1e-3)
