"""The one GPU call: the GPU paths checked, each check one that can fail, within 330 s on an H100
or H200 (the device's time includes its start, and a second try must fit). Run by
benchmarks/gpu_all.sh, which prepares Multi30k in the background and packs the logs.

    python benchmarks/gpu_all.py --out DIR --work DIR [--budget 300] [--data RUN] [--mirror DIR]
    python benchmarks/gpu_all.py --dry-run ...        # every section on the CPU, tiny sizes
    python benchmarks/gpu_all.py --sections tests machine compiled levers loop cold  # the second

In this order: the versions and a probe of torch's graph pools (a capture, the graph freed, a
capture into the same pool, then into a fresh one, each replayed against the values it must
give; the recorded graph's nodes counted where torch can dump them); decoding
replayed as CUDA graphs against the steps run one by one on four option sets, the fallback latch
reset before each and shown in every row, failing on torch's empty-graph warning; `nmt train
--device cuda` in bf16 for 30 updates, then resumed to 40; `--gpus 1` through torch's launcher
and NCCL; the shipped decoding defaults (beam 4, alpha 0.6) of a `base` model trained here for a
minute: eager and graphed steps x fp32, tf32, bf16 x batches of 32 and 64, in alternated rounds,
each with its lines equal to fp32 eager; the compiled update's graphs over three source lengths.
The second call (`benchmarks/gpu_second.sh`): tests/integration/test_gpu.py, `base` and `big` compiled with
a profile of a step, the training levers, the trainer's loop, a cold pass over new shapes.

Every section's verdict comes from a check in CHECKS, and each check has the broken rows it must
refuse (BROKEN): the dry run, and tests/unit/test_gpu_call.py, feed them to it. One JSON line per
figure in OUT/gpu_all.jsonl; a row with "ok": false is a failed check.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import gzip
import json
import os
import re
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
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
EMPTY = "CUDA Graph is empty"  # torch's warning at the end of a capture that recorded nothing


# -- the checks, and the broken rows each must refuse ------------------------------------------


def check_probe(row: dict) -> list[str]:
    problems = []
    if not row.get("fresh_pool_right"):
        problems.append("a capture into a fresh pool did not replay the right values")
    if not row.get("first_right"):
        problems.append("the first capture did not replay the right values")
    if row.get("nodes") == 0:  # None: not countable here (first_right shows the kernels ran)
        problems.append("the recorded graph has no nodes")
    if any(EMPTY in w for w in row.get("warnings", [])):
        problems.append("torch found a recorded graph empty")
    return problems


def check_graphs(row: dict) -> list[str]:
    problems = []
    if row.get("same") != row.get("of") or not row.get("of"):
        problems.append(f"{row.get('same')} of {row.get('of')} translations as the eager steps'")
    if row.get("failed") is not None:
        problems.append(f"recording failed: {row['failed']}")
    if row.get("recorded", 0) < 1 and row.get("device", "cpu") != "cpu":
        problems.append("no graph was recorded")
    if any(x is not None and x < 1 for x in row.get("graph_nodes", [])):
        problems.append(f"a recorded graph without nodes: {row['graph_nodes']}")
    if any(EMPTY in w or "without CUDA graphs" in w for w in row.get("warnings", [])):
        problems.append(f"warnings: {row['warnings']}")
    return problems


def check_train(row: dict) -> list[str]:
    problems = []
    if row.get("exit") != [0, 0]:
        problems.append(f"exit statuses {row.get('exit')}")
    if row.get("checkpoints") != [30, 40]:
        problems.append(f"checkpoints at {row.get('checkpoints')}, not 30 and 40")
    if not row.get("resumed_at_30"):
        problems.append("the second command did not resume from step 30")
    return problems


def check_gpus1(row: dict) -> list[str]:
    problems = []
    if row.get("exit") != 0:
        problems.append(f"exit status {row.get('exit')}")
    if not row.get("checkpoint"):
        problems.append("no checkpoint")
    return problems


def check_decode(row: dict) -> list[str]:
    problems = []
    if row.get("precision") == "fp32" and row.get("lines_as_fp32_eager") != row.get("of"):
        problems.append(
            f"fp32 lines unlike fp32 eager's: {row.get('lines_as_fp32_eager')} of {row.get('of')}"
        )
    if not row.get("of"):
        problems.append("no lines translated")
    if row.get("graphs") and row.get("device") != "cpu" and row.get("cuda_graphs") != "on":
        problems.append(f"graphs asked for, but: {row.get('cuda_graphs')}")
    if any(EMPTY in w or "without CUDA graphs" in w for w in row.get("warnings", [])):
        problems.append(f"warnings: {row['warnings']}")
    return problems


def check_recompiles(row: dict) -> list[str]:
    if not isinstance(row.get("graphs"), int) or row["graphs"] < 1:
        return [f"compiled graphs: {row.get('graphs')!r}"]
    return []


CHECKS: dict[str, Callable[[dict], list[str]]] = {
    "probe": check_probe,
    "graphs": check_graphs,
    "train": check_train,
    "gpus1": check_gpus1,
    "decode": check_decode,
    "recompiles": check_recompiles,
}
GOOD = {  # a row each check passes
    "probe": dict(first_right=True, fresh_pool_right=True, nodes=3, warnings=[]),
    "graphs": dict(
        device="cuda:0", same=64, of=64, failed=None, recorded=2, graph_nodes=[400, 400], warnings=[]
    ),
    "train": dict(exit=[0, 0], checkpoints=[30, 40], resumed_at_30=True),
    "gpus1": dict(exit=0, checkpoint=True),
    "decode": dict(
        device="cuda:0",
        precision="fp32",
        graphs=True,
        cuda_graphs="on",
        lines_as_fp32_eager=500,
        of=500,
        warnings=[],
    ),
    "recompiles": dict(graphs=2),
}
BROKEN = {  # changes to the good row, each of which its check must refuse
    "probe": [
        dict(fresh_pool_right=False),
        dict(first_right=False),
        dict(nodes=0),
        dict(warnings=[f"The {EMPTY}. This usually means ..."]),
    ],
    "graphs": [
        dict(same=63),
        dict(same=0, of=0),
        dict(failed="operation not permitted when stream is capturing"),
        dict(recorded=0),
        dict(graph_nodes=[400, 0]),
        dict(warnings=[f"The {EMPTY}. This usually means that the graph was captured on the wrong device"]),
        dict(warnings=["decoding without CUDA graphs: recording one failed (x)"]),
    ],
    "train": [dict(exit=[0, 1]), dict(checkpoints=[30]), dict(resumed_at_30=False)],
    "gpus1": [dict(exit=1), dict(checkpoint=False)],
    "decode": [
        dict(lines_as_fp32_eager=499),
        dict(of=0, lines_as_fp32_eager=0),
        dict(cuda_graphs="off: recording failed (x)"),
        dict(cuda_graphs=None),
        dict(warnings=[f"The {EMPTY}."]),
    ],
    "recompiles": [dict(graphs=0), dict(graphs=None)],
}


def checks_that_cannot_fail() -> list[str]:
    """Each check against its good row (it must pass) and each broken one (it must refuse)."""
    wrong = []
    for name, check in CHECKS.items():
        if check(GOOD[name]):
            wrong.append(f"{name}: refuses its good row: {check(GOOD[name])}")
        for change in BROKEN[name]:
            if not check({**GOOD[name], **change}):
                wrong.append(f"{name}: lets {change} through")
    return wrong


class Call(Bench):
    """gpu_perf's bench, with the folders of this call: `work` for runs and logs, `data` the
    prepared Multi30k run (made in the background), `mirror` the Multi30k files."""

    FIGURES = "gpu_all.jsonl"

    def __init__(self, args):
        super().__init__(args)
        self.work, self.data, self.mirror = args.work, args.data, args.mirror
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.minute: subprocess.Popen | None = None  # the model trained for the decoding section
        self.failed: list[str] = []

    def verdict(self, kind: str, **row) -> None:
        """A row with its check's verdict: "ok", and the problems where it is not."""
        problems = CHECKS[kind](row)
        if problems:
            self.failed.append(f"{kind}: {'; '.join(problems)}")
        self.emit(kind, **row, ok=not problems, **({"problems": problems} if problems else {}))

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


def dot_nodes(graph: torch.cuda.CUDAGraph, path: Path) -> int | None:
    """The nodes of a graph recorded in debug mode, counted in the DOT file CUDA writes of it
    (None where it wrote none)."""
    try:
        graph.debug_dump(str(path))
    except Exception:  # noqa: BLE001 - no count: the check then fails, the log says why
        traceback.print_exc()
        return None
    text = path.read_text(errors="replace") if path.exists() else ""
    if not text:
        return None
    named = set(re.findall(r"graph_\d+_node_\d+", text))  # CUDA's names for a graph's nodes
    return len(named or set(re.findall(r'^\s*"([^"]+)"\s*\[', text, re.M)))  # else declared ones


class Counted(torch.cuda.CUDAGraph):
    """A CUDA graph that keeps what it recorded (keep_graph: instantiated at its first replay),
    so that its nodes can be counted where torch's debug_dump writes them (torch 2.11 on an H200
    wrote no file: the count is then None, and the replayed values are the check)."""

    def __new__(cls, keep_graph: bool = True):
        return super().__new__(cls, True)

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.enable_debug_mode()


@contextlib.contextmanager
def counted_graphs():
    """torch.cuda.CUDAGraph as Counted inside (graphed.py makes its graphs through it)."""
    plain = torch.cuda.CUDAGraph
    torch.cuda.CUDAGraph = Counted  # type: ignore[misc]
    try:
        yield
    finally:
        torch.cuda.CUDAGraph = plain  # type: ignore[misc]


def section_probe(b: Call) -> None:
    """What this torch does with a graph pool whose graphs are gone (probe()), in a process of its
    own: a capture that leaves a stream capturing must not cost the other sections theirs."""
    import concurrent.futures
    import multiprocessing

    row: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if b.device.type != "cuda":
        return b.emit("probe", **row, skipped="no GPU")
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        row |= pool.submit(probe, str(b.device), str(b.logs)).result(timeout=120)
    b.verdict("probe", **row)


def probe(device_name: str, logs: str) -> dict:
    """A capture into a pool, the graph freed, a capture into the same pool (torch 2.13 refuses
    it: why graphed.py takes a pool per search), then one into a fresh pool, which must replay
    right; the first graph's nodes counted where torch dumps them."""
    device = torch.device(device_name)
    row: dict = {"gpu": torch.cuda.get_device_name(device)}
    with torch.cuda.device(device), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.arange(1024.0, device=device)

        def capture(pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
            side = torch.cuda.Stream(device)  # its own: a capture that failed may leave one capturing
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.device(device), torch.cuda.stream(side):
                (x * 2 + 1).sum()  # warm: the kernels loaded before a capture
                graph = Counted()
                graph.capture_begin(pool=pool)
                try:
                    y = x * 2 + 1
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(device).wait_stream(side)
            return graph, y

        def replayed_right(graph, y) -> bool:
            y.zero_()
            with torch.cuda.device(device):
                graph.replay()
            torch.cuda.synchronize(device)
            return bool(torch.equal(y, x * 2 + 1))

        def new_pool():
            with torch.cuda.device(device):  # a handle is the current GPU's
                return torch.cuda.graph_pool_handle()

        pool = new_pool()
        first, y = capture(pool)
        row["first_right"] = replayed_right(first, y)
        row["nodes"] = dot_nodes(first, Path(logs) / "probe_graph.dot")
        del first, y
        gc.collect()
        try:
            again, y = capture(pool)
            right = replayed_right(again, y)
            row["same_pool_after_free"] = "accepted, " + ("right" if right else "WRONG values")
            del again, y
        except RuntimeError as e:
            row["same_pool_after_free"] = "refused: " + str(e).splitlines()[0][:160]
        try:
            fresh, y = capture(new_pool())
            row["fresh_pool_right"] = replayed_right(fresh, y)
        except RuntimeError as e:
            row["fresh_pool_right"], row["fresh_pool_error"] = False, str(e).splitlines()[0][:160]
    row["warnings"] = sorted({str(w.message)[:160] for w in caught})
    return row


def section_graphs(b: Call) -> None:
    """Each search replayed as CUDA graphs finds what the steps run one by one find, on every GPU
    (up to two), four option sets: the translations, the scores, the graphs' nodes, the latch
    (reset before each set), torch's warnings."""
    import numpy as np

    devices = (
        [b.device] if b.dry else [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]
    )
    rng = np.random.default_rng(0)
    n = 8 if b.dry else 64
    vocab = b.shape("base")["vocab"]
    sources = [rng.integers(4, vocab, k).tolist() for k in rng.integers(20, 41, n)]
    recorded = graphed.Replayed._recorded
    graphs: list[torch.cuda.CUDAGraph] = []

    def keeping(self, key):
        out = recorded(self, key)
        graphs.append(self.graphs[key][0])
        return out

    graphed.Replayed._recorded = keeping
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
                graphs.clear()
                graphed._failed = None  # each set on its own: an earlier failure turns nothing off
                eager = decoding.translate(model, src, options, graphs=False)
                with warnings.catch_warnings(record=True) as caught, counted_graphs():
                    warnings.simplefilter("always")
                    replayed = decoding.translate(model, src, options, graphs=True)
                same = sum([h.tokens for h in x] == [h.tokens for h in y] for x, y in zip(eager, replayed))
                worst = max(abs(h.score - g.score) for x, y in zip(eager, replayed) for h, g in zip(x, y))
                nodes = [dot_nodes(g, b.logs / f"graph_{i}.dot") for i, g in enumerate(graphs)]
                b.verdict(
                    "graphs",
                    device=str(device),
                    beam=options.beam,
                    sample=options.sample,
                    same=same,
                    of=n,
                    worst_score_gap=round(worst, 6),
                    recorded=len(graphs),
                    graph_nodes=nodes,
                    failed=graphed._failed,
                    warnings=sorted({str(w.message)[:160] for w in caught}),
                )
                graphs.clear()
    finally:
        graphed.Replayed._recorded = recorded


def start_minute(b: Call) -> None:
    """A `base` model trained for about a minute in the background (bf16, ~25k tokens an
    update), for section_decode; the correctness sections share the GPU with it meanwhile."""
    if not (b.data / ".ready").exists():
        return b.emit("minute", skipped="no prepared data")
    run = b.fresh_run("minute")
    argv = [sys.executable, "-m", "nmt_cli", "train", "--run-dir", str(run), *b.size()]
    argv += (
        ["--device", "cpu", "--max-tokens", "1024"]
        if b.dry
        else ["--device", "cuda", "--max-tokens", "25000"]
    )
    argv += ["--max-time", "0.25" if b.dry else "1.25", "--max-steps", "100000"]
    argv += ["--warmup", "200" if b.dry else "800", "--lr-scale", "2", "--eval-every", "100000"]
    argv += ["--save-every", "100000"]
    log = (b.logs / "minute.log").open("w")
    b.minute = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    b.emit("minute", started=str(run))


def section_train(b: Call) -> None:
    """`nmt train --device cuda --precision bf16` in one process: 30 updates to a checkpoint,
    then the same command to 40, resumed from it."""
    if not b.wait_for_data(min(120.0, b.left() - 30)):
        return b.emit("train", skipped="no prepared data")
    if b.minute is None:
        start_minute(b)
    run = b.fresh_run("train")
    device = ["--device", "cpu"] if b.dry else ["--device", "cuda", "--precision", "bf16"]
    exits = []
    tokens = 1024 if b.dry else 8192
    args = ["train", "--run-dir", run, *b.size(), *device, "--max-tokens", tokens, "--eval-every", 30]
    args += ["--save-every", 30, "--warmup", 400]
    for steps in (30, 40):
        limit = max(10.0, min(90.0, b.left() - 20))
        exits.append(b.nmt(f"train{steps}", *args, "--max-steps", steps, timeout=limit))
    made = [s for s in (30, 40) if (run / "checkpoints" / f"checkpoint_{s:08d}.pt").exists()]
    resumed = any("resuming from step 30" in line for line in b.tail("train40", 400))
    b.verdict("train", exit=exits, checkpoints=made, resumed_at_30=resumed, tail=b.tail("train40", 3))


def section_gpus1(b: Call) -> None:
    """`nmt train --gpus 1`: torch's elastic launcher, a real NCCL group, a checkpoint whose RNG
    states are gathered (on the CPU: --procs 2, gloo)."""
    if not b.wait_for_data(min(60.0, b.left() - 30)):
        return b.emit("gpus1", skipped="no prepared data")
    run = b.fresh_run("gpus1")
    steps = 10 if b.dry else 30
    launch = ["--procs", "2", "--device", "cpu"] if b.dry else ["--gpus", "1"]
    code = b.nmt(
        "gpus1", "train", "--run-dir", run, *b.size(), *launch, "--max-tokens", 1024 if b.dry else 8192,
        "--max-steps", steps, "--eval-every", steps, "--save-every", steps,
        timeout=max(10.0, min(90.0, b.left() - 20)),
    )  # fmt: skip
    made = (run / "checkpoints" / f"checkpoint_{steps:08d}.pt").exists()
    b.verdict("gpus1", exit=code, checkpoint=made, tail=b.tail("gpus1", 3))


def section_decode(b: Call) -> None:
    """The shipped decoding defaults (beam 4, alpha 0.6) of the minute's model on Multi30k's
    validation set: eager and graphed steps x fp32, tf32, bf16 x batches of 32 and 64, timed in
    alternated rounds after a warm-up: sentences/s, BLEU, lines equal to fp32 eager's at the
    same batch size."""
    import sacrebleu

    from nmt_cli.inference.translator import Translator
    from nmt_cli.rundir import RunDir

    if b.minute is None:
        return b.emit("decode", skipped="no model was trained")
    try:
        b.minute.wait(timeout=max(1.0, b.left() - 70))
    except subprocess.TimeoutExpired:
        b.minute.kill()
        return b.emit("decode", skipped="the model's training did not end in time")
    run = RunDir(b.work / "minute")
    if b.minute.returncode != 0 or not any(run.checkpoints.glob("checkpoint_*.pt")):
        return b.emit("decode", skipped=f"training failed ({b.minute.returncode})", tail=b.tail("minute"))
    trained = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    trained = [r for r in trained if r.get("kind") == "train"]
    b.emit("minute", steps=trained[-1]["step"] if trained else 0)
    n = 40 if b.dry else 500
    with gzip.open(b.mirror / "val.en.gz", "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()[:n]
    with gzip.open(b.mirror / "val.de.gz", "rt", encoding="utf-8") as f:
        refs = f.read().splitlines()[:n]
    precisions = ("fp32",) if b.dry else ("fp32", "tf32", "bf16")  # tf32 is a GPU's alone
    variants = [(s, p, g) for s in (32, 64) for p in precisions for g in (False, True)]
    device = str(b.device)
    translators = {
        (s, p, g): Translator.load(run.root, device=device, precision=p, cuda_graphs=g, batch_size=s)
        for s, p, g in variants
    }
    graphed._failed = None
    outputs, caught = {}, {}
    for v in variants:  # also the warm-up
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            outputs[v] = translators[v].translate(lines)
        caught[v] = sorted({str(w.message)[:160] for w in seen})
    seconds: dict[tuple, list[float]] = {v: [] for v in variants}
    for r in range(2):
        for v in variants if r % 2 == 0 else variants[::-1]:
            if b.left() < 50:
                break
            b.sync()
            t = time.perf_counter()
            translators[v].translate(lines)
            b.sync()
            seconds[v].append(time.perf_counter() - t)
    for (size, precision, graphs), times in seconds.items():
        out, first = outputs[(size, precision, graphs)], outputs[(size, "fp32", False)]
        b.verdict(
            "decode",
            device=device,
            batch=size,
            precision=precision,
            graphs=graphs,
            cuda_graphs=translators[(size, precision, graphs)].cuda_graphs(),
            sentences_s=round(len(lines) / min(times), 1) if times else None,
            rounds_s=[round(x, 3) for x in times],
            bleu=round(sacrebleu.corpus_bleu(out, [refs]).score, 2),
            lines_as_fp32_eager=sum(a == c for a, c in zip(out, first)),
            of=len(lines),
            warnings=caught[(size, precision, graphs)],
        )


def section_tests(b: Call) -> None:
    """tests/integration/test_gpu.py (every test skips on a CPU: the dry run checks that it collects)."""
    env = {"NMT_TEST_GPU": "1", "NMT_SHARED_DATA": str(b.mirror.parent) if b.mirror else ""}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "tests/integration/test_gpu.py",
        "-p",
        "no:cacheprovider",
    ]
    argv += ["--durations", "8", "-rfEs"]
    code = b.command("tests", argv, max(10.0, min(240.0, b.left() - 150)), env)
    b.emit("tests", ok=code == 0, exit=code, tail=b.tail("tests", 14))


# -- speed (the second call) ------------------------------------------------------------------


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
            b.verdict("recompiles", **_compiles(b, multiple))
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


SECTIONS = {  # name: (seconds it needs on a GPU, on the CPU, the section)
    "probe": (10, 5, section_probe),
    "graphs": (15, 20, section_graphs),
    "train": (60, 60, section_train),
    "gpus1": (40, 40, section_gpus1),
    "decode": (60, 60, section_decode),
    "recompiles": (40, 20, section_recompiles),
    # the second call's (benchmarks/gpu_second.sh)
    "tests": (60, 10, section_tests),
    "machine": (15, 10, gpu_perf.section_machine),
    "compiled": (90, 30, section_compiled),
    "levers": (40, 20, section_levers),
    "loop": (80, 30, section_loop),
    "cold": (25, 10, gpu_perf.section_cold),
}
FIRST = ["probe", "graphs", "train", "gpus1", "decode", "recompiles"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="every section on the CPU, tiny sizes")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for all sections")
    ap.add_argument("--data", type=Path, required=True, help="where gpu_all.sh prepares Multi30k")
    ap.add_argument("--mirror", type=Path, default=None, help="the Multi30k files")
    ap.add_argument("--sections", nargs="*", default=FIRST, choices=list(SECTIONS))
    args = ap.parse_args()
    args.rounds, args.loop_tokens = 2, []  # gpu_perf.Bench's
    wrong = checks_that_cannot_fail()
    if wrong:
        sys.exit("gpu_all.py: checks that would not fail:\n" + "\n".join(wrong))
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_all.py: no CUDA GPU visible (--dry-run runs it on the CPU)")
    b = Call(args)
    b.emit("checks", broken_rows_refused=sum(map(len, BROKEN.values())))
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
            b.failed.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            b.emit(name, error=f"{type(e).__name__}: {str(e)[:300]}", ok=False)
        b.emit(name, seconds=round(time.perf_counter() - start, 1))
        if b.device.type == "cuda":
            with torch.cuda.device(b.device):
                torch.cuda.empty_cache()
    if b.minute is not None and b.minute.poll() is None:
        b.minute.kill()
    b.emit("done", left_s=round(b.left()), failed=b.failed)
    sys.exit(1 if b.failed else 0)


if __name__ == "__main__":
    main()
