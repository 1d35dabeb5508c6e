"""The one GPU call: the GPU paths checked, then measured, each section within the time it needs.
Run by benchmarks/gpu_all.sh, which prepares Multi30k in the background and packs the logs.

    python benchmarks/gpu_all.py --out DIR --work DIR [--budget 500] [--data RUN] [--mirror DIR]
    python benchmarks/gpu_all.py --dry-run ...   # every section on the CPU, tiny sizes

Correctness first: the machine (versions, the bf16 matmul ceiling); decoding replayed as CUDA
graphs on cuda:0 (and cuda:1 where there is one) equal to the steps run one by one, with the
nodes each recorded graph holds; `nmt train --device cuda` in one process; `--gpus 1` through
torch's launcher and NCCL; tests/test_gpu.py. Then speed: `base` and `big` compiled (compile
time, step, share of the ceiling) with a profile of one step each (top kernels, the share of the
wall time the GPU idles); the compiles over sources of 32, 34 and 36 tokens, as the trainer
pads them and as they are; each training lever behind an option against none; the trainer's
loop against the bare step at ~25k tokens an update over several epochs (and its cold first
pass); a `base` model trained for a minute in this call (while the tests run), decoding
test2016 in fp32 and bf16 with and without CUDA graphs (BLEU, sentences/s); a cold pass over
24 batch shapes against a warm one. One JSON line per figure in OUT/gpu_all.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_perf  # noqa: E402
from gpu_perf import Bench, make_step, step_row, top_kernels  # noqa: E402

from nmt_cli.config import DecodeOptions  # noqa: E402
from nmt_cli.engine import decoding, distributed, graphed, step  # noqa: E402
from nmt_cli.vocab import EOS, PAD  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--size", "tiny", "--d-model", "32", "--ffn", "64", "--heads", "2"]
TINY += ["--num-encoder-layers", "1", "--num-decoder-layers", "1"]


class Call(Bench):
    """gpu_perf's bench, with the folders of this call: `work` for runs and logs, `data` the
    prepared Multi30k run (made in the background), `mirror` the Multi30k files."""

    FIGURES = "gpu_all.jsonl"

    def __init__(self, args):
        super().__init__(args)
        self.work, self.data, self.mirror = args.work, args.data, args.mirror
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.minute: subprocess.Popen | None = None  # the model trained while the tests run

    def nmt(self, name: str, *args, timeout: float, env: dict | None = None) -> int:
        """`python -m nmt_cli ARGS` with its output in logs/NAME.log; its exit status (124:
        stopped at `timeout`)."""
        return self.command(name, [sys.executable, "-m", "nmt_cli", *map(str, args)], timeout, env)

    def command(self, name: str, argv: list[str], timeout: float, env: dict | None = None) -> int:
        with (self.logs / f"{name}.log").open("w") as log:
            try:
                done = subprocess.run(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                    env={**os.environ, **(env or {})},
                )
            except subprocess.TimeoutExpired:
                return 124
        return done.returncode

    def tail(self, name: str, lines: int = 6) -> list[str]:
        return (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:]

    def wait_for_data(self, seconds: float) -> bool:
        """Whether the background preparation of Multi30k is done (waiting up to `seconds`)."""
        end = time.perf_counter() + seconds
        while not (self.data / ".ready").exists() and time.perf_counter() < end:
            time.sleep(1)
        return (self.data / ".ready").exists()

    def fresh_run(self, name: str) -> Path:
        import shutil

        run = self.work / name
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(self.data, run, ignore=shutil.ignore_patterns("checkpoints", "metrics.jsonl"))
        return run

    def size(self) -> list[str]:
        return TINY if self.dry else ["--size", "base"]


# -- correctness ---------------------------------------------------------------------------------


def graph_nodes(graph: torch.cuda.CUDAGraph) -> int | None:
    """The nodes a recorded graph holds (CUDA's count), or None where this torch or the CUDA
    Python bindings cannot tell."""
    try:
        from cuda.bindings import runtime

        raw = runtime.cudaGraph_t(init_value=graph.raw_cuda_graph())
        error, _, count = runtime.cudaGraphGetNodes(raw)
        return int(count) if int(error) == 0 else None
    except Exception:  # noqa: BLE001 - a figure we may not get: the equality check stands alone
        return None


def section_graphs(b: Call) -> None:
    """Each search replayed as CUDA graphs finds what the steps run one by one find, on every GPU
    (up to two): the translations, the scores, the graphs' nodes, no fallback, no empty graph."""
    import numpy as np

    devices = (
        [b.device] if b.dry else [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]
    )
    rng = np.random.default_rng(0)
    n = 8 if b.dry else 64
    vocab = b.shape("base")["vocab"]
    sources = [rng.integers(4, vocab, k).tolist() for k in rng.integers(20, 41, n)]
    nodes: list[int | None] = []
    recorded = graphed.Replayed._recorded

    def counting(self, key):
        out = recorded(self, key)
        nodes.append(graph_nodes(self.graphs[key][0]) if self.graphs else None)
        return out

    graphed.Replayed._recorded = counting
    try:
        for device in devices:
            torch.manual_seed(0)
            model = gpu_perf.Transformer(gpu_perf.model_config(b.shape("base"))).to(device).eval()
            src = torch.full((n, 41), PAD)
            for r, s in enumerate(sources):
                src[r, : len(s)], src[r, len(s)] = torch.tensor(s), EOS
            src = src.to(device)
            for options in (
                DecodeOptions(beam=4, max_len_a=0.0, max_len_b=30),
                DecodeOptions(beam=1, max_len_a=0.0, max_len_b=30),
                DecodeOptions(beam=4, nbest=2, repetition_penalty=1.3, no_repeat_ngram=3, max_len_b=30),
                DecodeOptions(sample=True, nbest=2, seed=1, max_len_b=30),
            ):
                nodes.clear()
                eager = decoding.translate(model, src, options, graphs=False)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    replayed = decoding.translate(model, src, options, graphs=True)
                same = sum([h.tokens for h in x] == [h.tokens for h in y] for x, y in zip(eager, replayed))
                worst = max(abs(h.score - g.score) for x, y in zip(eager, replayed) for h, g in zip(x, y))
                b.emit(
                    "graphs",
                    device=str(device),
                    beam=options.beam,
                    sample=options.sample,
                    same=same,
                    of=n,
                    worst_score_gap=round(worst, 6),
                    graph_nodes=list(nodes),
                    failed=graphed._failed,
                    warnings=sorted({str(w.message)[:120] for w in caught}),
                    ok=same == n and graphed._failed is None and all(x != 0 for x in nodes),
                )
    finally:
        graphed.Replayed._recorded = recorded


def section_train(b: Call) -> None:
    """`nmt train --device cuda` in one process (what died at its first update), to a checkpoint."""
    if not b.wait_for_data(min(120.0, b.left() - 30)):
        return b.emit("train", skipped="no prepared data")
    run = b.fresh_run("train")
    steps = 10 if b.dry else 60
    device = ["--device", "cpu" if b.dry else "cuda"]
    code = b.nmt(
        "train", "train", "--run-dir", run, *b.size(), *device, "--max-tokens", 1024 if b.dry else 8192,
        "--max-steps", steps, "--eval-every", steps // 2, "--save-every", steps // 2, "--warmup", 400,
        timeout=max(10.0, min(150.0, b.left() - 20)),
    )  # fmt: skip
    made = (run / "checkpoints" / f"checkpoint_{steps:08d}.pt").exists()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if made else []
    speed = [r["tokens_per_s"] for r in rows if r.get("kind") == "train" and r["step"] > 10]
    b.emit("train", ok=code == 0 and made, exit=code, tokens_per_s=speed[-1:] or None, tail=b.tail("train"))


def section_gpus1(b: Call) -> None:
    """`nmt train --gpus 1`: torch's elastic launcher, a real NCCL group, a checkpoint whose RNG
    states are gathered (on the CPU: --procs 2, gloo)."""
    if not b.wait_for_data(min(60.0, b.left() - 30)):
        return b.emit("gpus1", skipped="no prepared data")
    run = b.fresh_run("gpus1")
    steps = 10 if b.dry else 40
    launch = ["--procs", "2", "--device", "cpu"] if b.dry else ["--gpus", "1"]
    code = b.nmt(
        "gpus1", "train", "--run-dir", run, *b.size(), *launch, "--max-tokens", 1024 if b.dry else 8192,
        "--max-steps", steps, "--eval-every", steps, "--save-every", steps,
        timeout=max(10.0, min(150.0, b.left() - 20)),
    )  # fmt: skip
    made = (run / "checkpoints" / f"checkpoint_{steps:08d}.pt").exists()
    b.emit("gpus1", ok=code == 0 and made, exit=code, tail=b.tail("gpus1"))


def start_minute(b: Call) -> None:
    """A `base` model trained for a minute in the background (bf16, ~25k tokens an update), for
    section_decode; it shares the GPU with the tests meanwhile."""
    if not (b.data / ".ready").exists():
        return b.emit("minute", skipped="no prepared data")
    run = b.fresh_run("minute")
    argv = [sys.executable, "-m", "nmt_cli", "train", "--run-dir", str(run), *b.size()]
    argv += (
        ["--device", "cpu", "--max-tokens", "1024"]
        if b.dry
        else ["--device", "cuda", "--max-tokens", "25000"]
    )
    argv += [
        "--max-time",
        "0.15" if b.dry else "1",
        "--max-steps",
        "100000",
        "--warmup",
        "200" if b.dry else "1000",
    ]
    argv += ["--lr-scale", "2", "--eval-every", "100000", "--save-every", "100000"]
    log = (b.logs / "minute.log").open("w")
    b.minute = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    b.emit("minute", started=str(run))


def section_tests(b: Call) -> None:
    """tests/test_gpu.py (every test skips on a CPU: the dry run checks that it collects)."""
    env = {"NMT_TEST_GPU": "1", "NMT_SHARED_DATA": str(b.mirror.parent) if b.mirror else ""}
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider"]
    argv += ["--durations", "8", "-rfEs"]
    code = b.command("tests", argv, max(10.0, min(240.0, b.left() - 150)), env)
    b.emit("tests", ok=code == 0, exit=code, tail=b.tail("tests", 14))


# -- speed ---------------------------------------------------------------------------------------


def section_compiled(b: Call) -> None:
    """`base` and `big` compiled as --compile compiles the update: the compile's seconds, the
    step (bf16, 512 sentences of 32 tokens a side) and its share of the measured ceiling, and a
    profile of one step: its costliest kernels and the share of the wall time the GPU idles."""
    sentences = 16 if b.dry else 512
    for name in ("base",) if b.dry else ("base", "big"):  # on the CPU both are one tiny model
        if b.left() < (20 if b.dry else 70):
            return b.emit("compiled", shape=name, skipped="budget")
        model = b.model(name)
        one, batch = make_step(b, model, True, True, sentences)
        t = time.perf_counter()
        one()
        b.sync()
        compile_s = time.perf_counter() - t
        seconds = b.timed(one, 3, 10)
        b.emit("compiled", compile_s=round(compile_s, 1), **step_row(b, name, seconds, batch))
        top_kernels(b, one, f"{name} compiled step, bf16")
        del model, one
        torch._dynamo.reset()


def section_recompiles(b: Call) -> None:
    """How many graphs the compiled update makes over sources of 32, 34 and 36 tokens (a
    quarter of each batch's rows shorter, so the attention mask is real): padded as the trainer
    pads them under --compile (multiples of 8), and as they are."""
    from nmt_cli.engine.trainer import ALIGN

    compile_ = torch.compile
    if b.dry:  # what would be compiled, counted without building the CPU's kernels
        torch.compile = functools.partial(compile_, backend="eager")
    try:
        for multiple in (ALIGN, 1):
            if b.left() < (15 if b.dry else 45):
                return b.emit("recompiles", skipped="budget")
            b.emit("recompiles", **_compiles(b, multiple))
    finally:
        torch.compile = compile_
        torch._dynamo.reset()


def _compiles(b: Call, multiple: int) -> dict:
    """Three updates of one compiled model, sources of 32, 34, 36 tokens padded to `multiple`."""
    import numpy as np
    from torch._dynamo.utils import counters

    from nmt_cli.engine.batches import on_grid, to_device

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = gpu_perf.Transformer(gpu_perf.model_config(dict(layers=2, d=256, ffn=1024, heads=4, vocab=8000)))
    model = model.to(b.device)
    forward = distributed.Group().wrap(step.Objective(model, 0.1), b.device, compile=True)
    rng = np.random.default_rng(0)
    lengths = []
    for n in (32, 34, 36):
        s = int(on_grid(np.array([n]), 1024, multiple)[0])
        src = rng.integers(4, 8000, (64, s))
        src[:, n - 1 :] = PAD
        src[:, n - 1] = EOS
        src[:16, n - 4 :] = PAD
        tgt = rng.integers(4, 8000, (64, s + 1))
        batch = to_device((src, tgt[:, :-1], tgt[:, 1:]), b.device)
        with torch.autocast(b.device.type, dtype=torch.bfloat16):
            loss, _ = forward(batch.src, batch.tgt_in, batch.positions, batch.targets)
        loss.backward()
        b.sync()
        lengths.append(s)
    return {
        "padded_to_multiple_of": multiple,
        "source_lengths": lengths,
        "graphs": counters["stats"]["unique_graphs"],
        "frames": dict(counters["frames"]),
    }


def section_levers(b: Call) -> None:
    """Each training lever behind an option against none (train_throughput.lever_steps), base in
    bf16 on 512 sentences of 32 tokens a side."""
    from train_throughput import lever_steps

    name = "tiny" if b.dry else "base"
    for row in lever_steps(
        name, "bf16", b.device, rounds=2, repeats=2 if b.dry else 5, sentences=16 if b.dry else 512
    ):
        b.emit("levers", **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})


def section_loop(b: Call) -> None:
    """The trainer's loop against the bare step on the same real batches at ~25k tokens an
    update (base, bf16), over the epochs the updates take; the cold first pass beside them."""
    from train_throughput import loop_against_bare

    if not b.wait_for_data(min(60.0, b.left() - 60)):
        return b.emit("loop", skipped="no prepared data")
    if b.dry:
        row = loop_against_bare(b.data, "tiny", 1024, "cpu", "fp32", steps=40, rounds=1)
    else:
        row = loop_against_bare(b.data, "base", 25000, "cuda", "bf16", steps=100, rounds=2)
    b.emit("loop", **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})


def section_decode(b: Call) -> None:
    """The minute's model decoding Multi30k test2016 (beam 4, batches of 64) in fp32 and bf16,
    with and without CUDA graphs, in alternated rounds: sentences/s, BLEU, lines equal to fp32
    without graphs."""
    import sacrebleu

    from nmt_cli.rundir import RunDir
    from nmt_cli.translator import Translator

    if b.minute is None:
        return b.emit("decode", skipped="no model was trained")
    try:
        b.minute.wait(timeout=max(1.0, b.left() - 60))
    except subprocess.TimeoutExpired:
        b.minute.kill()
        return b.emit("decode", skipped="the model's training did not end in time")
    run = RunDir(b.work / "minute")
    if b.minute.returncode != 0 or not any(run.checkpoints.glob("checkpoint_*.pt")):
        return b.emit("decode", skipped=f"training failed ({b.minute.returncode})", tail=b.tail("minute"))
    rows = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    trained = [r for r in rows if r.get("kind") == "train"]
    b.emit(
        "minute",
        steps=trained[-1]["step"] if trained else 0,
        tokens_per_s=trained[-1]["tokens_per_s"] if trained else None,
    )
    n = 40 if b.dry else 1000
    with gzip.open(b.mirror / "test_2016_flickr.en.gz", "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()[:n]
    with gzip.open(b.mirror / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        refs = f.read().splitlines()[:n]
    variants = [(p, g) for p in ("fp32", "bf16") for g in (False, True)]
    device = str(b.device)
    translators = {
        (p, g): Translator.load(run.root, device=device, precision=p, cuda_graphs=g, batch_size=64)
        for p, g in variants
    }
    outputs = {v: translators[v].translate(lines) for v in variants}  # also the warm-up
    seconds: dict[tuple, list[float]] = {v: [] for v in variants}
    for r in range(2):
        for v in variants if r % 2 == 0 else variants[::-1]:
            if b.left() < 15:
                break
            b.sync()
            t = time.perf_counter()
            translators[v].translate(lines)
            b.sync()
            seconds[v].append(time.perf_counter() - t)
    first = outputs[("fp32", False)]
    for (precision, graphs), times in seconds.items():
        out = outputs[(precision, graphs)]
        b.emit(
            "decode",
            precision=precision,
            graphs=graphs,
            sentences_s=round(len(lines) / min(times), 1) if times else None,
            rounds_s=[round(x, 3) for x in times],
            bleu=round(sacrebleu.corpus_bleu(out, [refs]).score, 2),
            lines_as_fp32_eager=sum(a == c for a, c in zip(out, first)),
            of=len(lines),
        )


SECTIONS = {  # name: (seconds it needs on a GPU, on the CPU), the most valuable first
    "machine": (15, 10, gpu_perf.section_machine),
    "graphs": (30, 20, section_graphs),
    "train": (45, 30, section_train),
    "gpus1": (45, 30, section_gpus1),
    "tests": (60, 10, section_tests),
    "compiled": (90, 30, section_compiled),
    "recompiles": (50, 20, section_recompiles),
    "levers": (40, 20, section_levers),
    "loop": (80, 30, section_loop),
    "decode": (45, 15, section_decode),
    "cold": (25, 10, gpu_perf.section_cold),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="every section on the CPU, tiny sizes")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=500.0, help="seconds for all sections")
    ap.add_argument("--data", type=Path, required=True, help="where gpu_all.sh prepares Multi30k")
    ap.add_argument("--mirror", type=Path, default=None, help="the Multi30k files")
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    args = ap.parse_args()
    args.rounds, args.loop_tokens = 2, []  # gpu_perf.Bench's
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_all.py: no CUDA GPU visible (--dry-run runs it on the CPU)")
    b = Call(args)
    for name in args.sections:
        needs, needs_dry, section = SECTIONS[name]
        if b.left() < (needs_dry if b.dry else needs):
            b.emit(name, skipped="budget", left_s=round(b.left()))
            continue
        start = time.perf_counter()
        try:
            section(b)
        except Exception as e:  # one section's failure must not cost the others their figures
            traceback.print_exc()
            b.emit(name, error=f"{type(e).__name__}: {str(e)[:300]}")
        b.emit(name, seconds=round(time.perf_counter() - start, 1))
        if name == "gpus1":  # the minute's model trains while the tests run
            start_minute(b)
        if b.device.type == "cuda":
            with torch.cuda.device(b.device):
                torch.cuda.empty_cache()
    if b.minute is not None and b.minute.poll() is None:
        b.minute.kill()
    b.emit("done", left_s=round(b.left()))


if __name__ == "__main__":
    main()
