"""Benchmark a training step: nmt against fairseq 0.12.2 on the CPU, or nmt alone on a GPU.

    python benchmarks/train_throughput.py [--shapes tiny base] [--rounds 3] [--fairseq-python PATH]
    python benchmarks/train_throughput.py --device cuda [--shapes base big] [--loop RUN_DIR]
    python benchmarks/train_throughput.py --loop RUN_DIR --loop-size small --loop-tokens 1024

CPU: a step is forward + label-smoothed loss + backward + Adam on 4096 source and 4096 target
tokens without padding, timed through nmt's own `train_step` (the trainer's code path). fairseq
runs in its own venv (benchmarks/peers/install_fairseq.sh). Also reports the matmul ceilings
measured in the same run, achieved model GFLOP/s, and the padding share of real Multi30k batches.
nmt's process keeps large blocks in glibc's heap, as the trainer does on a CPU; `--malloc glibc`
leaves glibc's setting, to measure what that buys.

`--levers`: each training speed lever that stays behind an option (--fixed-shapes,
--fold-scaling, --fused-qkv, --narrow-residual) and --attention-dropout 0 alone against none, on
one batch, in alternated rounds, per shape and precision (CPU or GPU).

GPU (`--device cuda`): each shape in bf16 on 16384 source and 16384 target tokens, eager and
`torch.compile`d, with model FLOPs utilisation against the bf16 matmul ceiling of the same GPU
measured in the same run (an 8192^3 product).

`--loop RUN_DIR` (any device): the trainer's whole loop (data, collation, copies to the device,
logging) against the bare `train_step` on the same real batches of RUN_DIR's training data (a
prepared and binarized run, e.g. Multi30k), in alternated rounds and by the same statistic, the
bare step's cold first pass beside them, and the time one checkpoint takes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, batch, cpu_name, matmul_ceiling, model_config, time_steps, train_flops  # noqa: E402

from nmt_cli.engine import distributed  # noqa: E402
from nmt_cli.engine.batches import Batch, to_device  # noqa: E402
from nmt_cli.engine.device import keep_large_blocks_in_heap  # noqa: E402
from nmt_cli.engine.model import Attention, Transformer  # noqa: E402
from nmt_cli.engine.step import Objective, train_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def model_of(shape_name: str, device: torch.device) -> Transformer:
    torch.manual_seed(0)
    return Transformer(model_config(SHAPES[shape_name])).to(device)


def device_batch(vocab: int, device: torch.device, sentences: int = 128) -> Batch:
    src, tgt_in, tgt_out = batch(vocab, sentences)
    return to_device((src.numpy(), tgt_in.numpy(), tgt_out.numpy()), device)


def nmt_step(
    shape_name: str,
    precision: str,
    repeats: int,
    device=torch.device("cpu"),
    compile: bool = False,
    sentences: int = 128,
) -> dict:
    shape = SHAPES[shape_name]
    model = model_of(shape_name, device)
    group = distributed.Group()
    forward = group.wrap(Objective(model, 0.1), device, compile)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    batches = [device_batch(shape["vocab"], device, sentences)]
    dtype = torch.bfloat16 if precision == "bf16" else None

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    def step():
        train_step(
            model,
            forward,
            optimizer,
            scaler,
            batches,
            clip_norm=0.0,
            lr=1e-4,
            autocast=autocast,
            group=group,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    seconds = time_steps(step, 5 if compile else 2, repeats)
    return {
        "system": "nmt",
        "shape": shape_name,
        "precision": precision,
        "compile": compile,
        "seconds": seconds,
        "tgt_tokens_per_s": batches[0].tokens / seconds,
    }


# The training speed levers behind options (TrainConfig), each against none of them; and
# --attention-dropout 0, which lets attention take its fused kernels (flash on a CPU; on a GPU
# the compiler's own), a recipe change whose effect on quality is the recipe's to measure.
LEVERS = ("none", "fixed_shapes", "fold_scaling", "fused_qkv", "narrow_residual", "attention_dropout_0")


def lever_steps(
    shape_name: str,
    precision: str,
    device: torch.device,
    rounds: int = 3,
    repeats: int = 5,
    sentences: int = 128,
    compile: bool = False,
) -> list[dict]:
    """Each lever of LEVERS alone, the step's target tokens/s on one batch (`sentences` of 32
    tokens a side, a quarter of them 4 tokens shorter: padding for --fixed-shapes to weigh 0),
    the levers taking turns `rounds` times; each lever's median beside none's."""
    src, tgt_in, tgt_out = (t.numpy().copy() for t in batch(SHAPES[shape_name]["vocab"], sentences))
    src[: sentences // 4, -4:], tgt_out[: sentences // 4, -4:] = 0, 0
    tgt_in[: sentences // 4, -3:] = 0
    dtype = torch.bfloat16 if precision == "bf16" else None

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    def step_of(lever: str):
        model = model_of(shape_name, device)
        model.set_kernels(fused_qkv=lever == "fused_qkv", narrow_residual=lever == "narrow_residual")
        if lever == "attention_dropout_0":
            for module in model.modules():
                if isinstance(module, Attention):
                    module.dropout = 0.0
        group = distributed.Group()
        forward = group.wrap(Objective(model, 0.1), device, compile, dynamic=lever != "fixed_shapes")
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        scaler = torch.amp.GradScaler("cuda", enabled=False)
        batches = [to_device((src, tgt_in, tgt_out), device, every_position=lever == "fixed_shapes")]

        def step():
            train_step(
                model, forward, optimizer, scaler, batches, clip_norm=0.0, lr=1e-4, autocast=autocast,
                group=group, fold=lever == "fold_scaling",
            )  # fmt: skip
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return step, batches[0].tokens

    steps = {lever: step_of(lever) for lever in LEVERS}
    times: dict[str, list[float]] = {lever: [] for lever in LEVERS}
    for r in range(rounds):
        for lever in LEVERS if r % 2 == 0 else LEVERS[::-1]:
            step, _ = steps[lever]
            times[lever].append(time_steps(step, 5 if compile and r == 0 else 2, repeats))
    none = statistics.median(times["none"])
    return [
        {
            "shape": shape_name,
            "precision": precision,
            "compile": compile,
            "lever": lever,
            "tgt_tokens_per_s": steps[lever][1] / statistics.median(seconds),
            "over_none": none / statistics.median(seconds),
            "rounds_seconds": seconds,
        }
        for lever, seconds in times.items()
    ]


def gpu_matmul_ceiling(dtype=torch.bfloat16, n: int = 8192, repeats: int = 10) -> float:
    """TFLOP/s of an n^3 matrix product on this GPU now."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)

    def product():
        a @ b
        torch.cuda.synchronize(a.device)

    return 2 * n**3 / time_steps(product, 3, repeats) / 1e12


def gpu_main(args) -> dict:
    device = torch.device("cuda", 0)
    ceiling = gpu_matmul_ceiling()
    results = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "bf16_matmul_tflops": ceiling,
        "runs": [],
    }
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}), flush=True)
    sentences = 512  # 16384 source and 16384 target tokens a step
    for shape in args.shapes:
        flops = train_flops(SHAPES[shape], 32 * sentences, 32 * sentences, 32, 32)
        for compile in (False, True):
            ours = nmt_step(shape, "bf16", args.repeats, device, compile, sentences)
            tflops = flops / ours["seconds"] / 1e12
            row = {
                **ours,
                "model_tflops": tflops,
                "mfu": tflops / ceiling,
                "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            }
            torch.cuda.reset_peak_memory_stats(device)
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    return results


def copy_to_train_in(run_dir: Path, tmp: str) -> Path:
    """A copy of a prepared run to train in afresh: its checkpoints, metrics, averaged model and
    training config left behind."""
    import shutil

    run = Path(tmp) / "run"
    leave = ("checkpoints", "metrics.jsonl", "averaged.*", "train.json")
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns(*leave))
    return run


# Both sides' statistic: the median target tokens/s of windows of LOG_EVERY updates, those
# ending after update SETTLED (the first windows meet each batch shape's first kernels).
SETTLED = 20


def loop_windows(loop, run: Path) -> list[float]:
    """Train with `loop` (a Trainer in `run`, validation and checkpoints out of reach); the
    target tokens/s of its logged windows that end after update SETTLED."""
    loop.train()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_s"] for r in rows if r["kind"] == "train" and r["step"] > SETTLED]


def bare_windows(t, updates: list, sync, every: int) -> list[tuple[int, float, float]]:
    """train_step alone over `updates` (collated on the device beforehand) with t's model:
    (last update, target tokens, seconds) of each window of `every` updates."""
    step = dict(clip_norm=t.config.clip_norm, autocast=t.autocast, group=t.dist)
    windows = []
    for i in range(0, len(updates) - every + 1, every):
        sync()
        start = time.perf_counter()
        for n, batches in enumerate(updates[i : i + every], start=i + 1):
            train_step(t.model, t.forward, t.optimizer, t.scaler, batches, lr=t.rate(n), **step)
        sync()
        tokens = sum(b.tokens for batches in updates[i : i + every] for b in batches)
        windows.append((i + every, tokens, time.perf_counter() - start))
    return windows


def loop_against_bare(
    run_dir: Path, size: str, max_tokens: int, device: str, precision: str, steps: int = 200, rounds: int = 2
) -> dict:
    """Target tokens/s of the trainer's loop and of bare train_step on the same real batches.

    Both train a fresh model on the first `steps` updates of the run (over as many epochs as
    they take: a small corpus at ~25k tokens an update has a few dozen of them), measured
    alike: the median over windows of 10 updates ending after update 20 (the loop's own logged
    windows; the bare step's timed the same way, synchronised at their ends). The bare step runs
    first, cold: the first epoch of a run meets every batch shape once, and kernels choose and
    cache their plans per shape; that pass is reported on its own. Then the loop and the warm
    bare step take turns, `rounds` times each, in the same process."""
    import tempfile

    from nmt_cli import train as train_mod
    from nmt_cli.config import TrainConfig
    from nmt_cli.engine import state
    from nmt_cli.engine.batches import on_device
    from nmt_cli.engine.trainer import LOG_EVERY
    from nmt_cli.rundir import RunDir

    config = TrainConfig(
        size=size,
        max_tokens=max_tokens,
        device=device,
        precision=precision,
        max_steps=steps,
        eval_every=10**6,
        save_every=10**6,
        warmup=100,
    )
    with tempfile.TemporaryDirectory() as tmp:

        def fresh(name: str):
            run = copy_to_train_in(run_dir, str(Path(tmp) / name))
            return train_mod.build_trainer(config, RunDir(run), state.Quiet()), run

        t, _ = fresh("bare")
        device_of_t = t.device

        def sync():
            if device_of_t.type == "cuda":
                torch.cuda.synchronize(device_of_t)

        updates = []  # the loop's first `steps` updates, over as many epochs as they take
        for epoch in itertools.count():
            if len(updates) >= steps:
                break
            planned = [[b] for b in t.epochs.batches(epoch)[: steps - len(updates)]]
            updates += list(on_device(t.epochs.data(epoch), planned, t.device))
        cold = bare_windows(t, updates, sync, LOG_EVERY)
        bare, looped = [], []
        for r in range(rounds):
            loop, run = fresh(f"loop{r}")
            looped.append(loop_windows(loop, run))
            if r == rounds - 1:
                start = time.perf_counter()
                loop.save()
                save_seconds = time.perf_counter() - start
            del loop
            t, _ = fresh(f"bare{r}")
            warm = bare_windows(t, updates, sync, LOG_EVERY)  # every shape met before
            bare.append([w[1] / w[2] for w in warm if w[0] > SETTLED])
            del t
    bare_all = [x for round_ in bare for x in round_]
    loop_all = [x for round_ in looped for x in round_]
    return {
        "size": size,
        "max_tokens": max_tokens,
        "device": device,
        "precision": precision,
        "steps": steps,
        "rounds": rounds,
        "bare_cold_first_pass_tgt_tokens_per_s": sum(w[1] for w in cold) / sum(w[2] for w in cold),
        # the same updates' first pass (each batch shape new) against a warm pass, in seconds
        "cold_over_warm": sum(w[2] for w in cold) / sum(w[2] for w in warm),
        "bare_tgt_tokens_per_s": statistics.median(bare_all),
        "loop_tgt_tokens_per_s": statistics.median(loop_all),
        "loop_over_bare": statistics.median(loop_all) / statistics.median(bare_all),
        "bare_rounds": [statistics.median(x) for x in bare],
        "loop_rounds": [statistics.median(x) for x in looped],
        "checkpoint_seconds": save_seconds,
    }


def padding_share() -> float | None:
    """Padding of real batches: Multi30k, BPE 8000, --max-tokens 4096 (needs the data run)."""
    run = ROOT / "benchmarks" / "out" / "multi30k"
    if not (run / "data" / "train.en.idx").exists():
        return None
    from nmt_cli.engine.batches import Split
    from nmt_cli.engine.batches import padding_share as share
    from nmt_cli.shards import Shard

    split = Split.of(Shard(run / "data" / "train.en"), Shard(run / "data" / "train.de"), 256)
    return share(split.batches(4096, 1, 0), split.src_lengths, split.tgt_lengths)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shapes", nargs="*")
    ap.add_argument("--precisions", nargs="*", default=["fp32", "bf16"])
    ap.add_argument("--fairseq-python", default=str(ROOT.parent / "peers" / "fairseq" / "bin" / "python"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="CPU: nmt and fairseq alternate this many times")
    ap.add_argument(
        "--loop",
        type=Path,
        metavar="RUN_DIR",
        help="also time the trainer's loop against the bare step on this run's data",
    )
    ap.add_argument(
        "--loop-size",
        default=None,
        help="preset of the loop measurement (default: base on a GPU, small on the CPU)",
    )
    ap.add_argument(
        "--loop-tokens",
        type=int,
        default=None,
        help="--max-tokens of the loop measurement (default: 8192 GPU, 1024 CPU)",
    )
    ap.add_argument(
        "--malloc",
        default="heap",
        choices=["heap", "glibc"],
        help="CPU: nmt's large blocks from the heap, as the trainer sets it (default), or glibc's "
        "own setting, to measure what that buys (fairseq runs in processes of its own, unchanged)",
    )
    ap.add_argument(
        "--levers",
        action="store_true",
        help="instead: each training speed lever (--fixed-shapes, ...) against none, per shape and precision",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    out = args.out or ROOT / "benchmarks" / "out" / f"train_throughput{'_gpu' if gpu else ''}.json"
    if args.levers:
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        if not gpu:
            torch.set_num_threads(2)
            keep_large_blocks_in_heap()
        results = {"cpu": cpu_name(), "levers": []}
        for shape in args.shapes or ["tiny", "base"]:
            for precision in args.precisions:
                for row in lever_steps(shape, precision, device, args.rounds, args.repeats):
                    results["levers"].append(row)
                    print(json.dumps(row), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        return
    if gpu:
        args.shapes = args.shapes or ["base", "big"]
        results = gpu_main(args)
    else:
        torch.set_num_threads(2)
        results = cpu_main(args) if args.shapes != [] else {"cpu": cpu_name()}
    if args.loop:
        size = args.loop_size or ("base" if gpu else "small")
        tokens = args.loop_tokens or (8192 if gpu else 1024)
        results["loop"] = loop_against_bare(args.loop, size, tokens, args.device, "bf16" if gpu else "fp32")
        print(json.dumps(results["loop"]), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


def fairseq_step(args, shape: str, precision: str) -> dict | None:
    """fairseq's step in its own venv (None when it is not installed)."""
    if not Path(args.fairseq_python).exists():
        return None
    script = ROOT / "benchmarks" / "peers" / "fairseq_train.py"
    done = subprocess.run(
        [
            args.fairseq_python,
            str(script),
            "--shape",
            shape,
            "--precision",
            precision,
            "--repeats",
            str(args.repeats),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": done.stderr[-500:]}


def median_run(runs: list[dict]) -> dict:
    """The run with the median step time (the lower middle one of an even number); all the
    rounds' times beside it."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return {**ordered[(len(ordered) - 1) // 2], "rounds_seconds": [r["seconds"] for r in runs]}


def cpu_main(args) -> dict:
    args.shapes = args.shapes or ["tiny", "base"]
    if args.malloc == "heap":
        keep_large_blocks_in_heap()  # as the trainer does on a CPU
    results = {
        "threads": torch.get_num_threads(),
        "malloc": args.malloc,
        "cpu": cpu_name(),
        "ceiling_gflops": {"fp32": matmul_ceiling(torch.float32), "bf16": matmul_ceiling(torch.bfloat16)},
        "padding_share_multi30k": padding_share(),
        "runs": [],
    }
    heading = ("cpu", "ceiling_gflops", "padding_share_multi30k")
    print(json.dumps({k: results[k] for k in heading}), flush=True)
    for shape in args.shapes:
        flops = train_flops(SHAPES[shape], 4096, 4096, 32, 32)
        for precision in args.precisions:
            # nmt and fairseq alternate, --rounds times; each side's median step is compared.
            rounds = [
                (nmt_step(shape, precision, args.repeats), fairseq_step(args, shape, precision))
                for _ in range(args.rounds)
            ]
            ours = median_run([r[0] for r in rounds])
            peers = [r[1] for r in rounds if r[1] is not None]
            peer = None
            if peers:
                ok = [x for x in peers if "seconds" in x]
                peer = median_run(ok) if ok else peers[-1]
            row = {
                "shape": shape,
                "precision": precision,
                "nmt": ours,
                "fairseq": peer,
                "nmt_gflops": flops / ours["seconds"] / 1e9,
                "nmt_share_of_ceiling": (
                    flops / ours["seconds"] / 1e9 / results["ceiling_gflops"][precision]
                ),
            }
            if peer and "seconds" in peer:
                row["ratio"] = peer["seconds"] / ours["seconds"]
                row["fairseq_gflops"] = flops / peer["seconds"] / 1e9
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    return results


if __name__ == "__main__":
    main()
