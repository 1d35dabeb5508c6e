"""What keeping large blocks in glibc's heap buys a training step, each measurement in a fresh
process as `nmt train` is one.

    python benchmarks/malloc_ab.py [--rows tiny:bf16 base:bf16 base:fp32] [--rounds 2]
    python benchmarks/malloc_ab.py --rows --loop RUN_DIR [--loop-steps 600]

For each row, processes alternate --rounds times between glibc's own malloc setting and the one
the trainer makes on a CPU (`engine.device.keep_large_blocks_in_heap`); each times
`train_throughput.nmt_step` (forward, loss, backward and fused Adam on 4096 + 4096 tokens, 2
threads, median of 3 steps after 2 warm-up steps) and reports its peak resident memory.
`train_throughput.py` measures in one process after its matmul ceilings, whose freed blocks
have already raised glibc's threshold for what follows: a fresh process is what a user runs.

`--loop RUN_DIR` (a Multi30k run of `multi30k_quality.py`, binarized with BPE 8000): the
trainer's whole loop on the hour's recipe (d 256, FFN 512, dropout 0.3, 1024-token batches,
bf16, one thread) for --loop-steps updates, validation and checkpoints left out, in two processes
side by side as `--seeds 2` trains, one with each setting, then again with the sides swapped.
Writes benchmarks/out/malloc_ab.json (with --loop: malloc_ab_loop.json).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(shape: str, precision: str, heap: bool) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    from nmt_cli.engine.device import keep_large_blocks_in_heap

    if heap:
        keep_large_blocks_in_heap()
    torch.set_num_threads(2)
    from train_throughput import nmt_step

    step = nmt_step(shape, precision, 3)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tgt_tokens_per_s": step["tgt_tokens_per_s"], "peak_rss_mib": peak}))


def loop_child(run_dir: str, steps: int, heap: bool) -> None:
    import tempfile

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_throughput import copy_to_train_in, trained_tokens_per_s

    from nmt_cli.config import TrainConfig
    from nmt_cli.engine import state, trainer
    from nmt_cli.rundir import RunDir

    if not heap:
        trainer.keep_large_blocks_in_heap = lambda: False
    with tempfile.TemporaryDirectory() as tmp:
        run = copy_to_train_in(Path(run_dir), tmp)
        config = TrainConfig(
            size="small",
            d_model=256,
            ffn=512,
            dropout=0.3,
            max_tokens=1024,
            precision="bf16",
            threads=1,
            max_steps=steps,
            eval_every=10**6,
            save_every=10**6,
            warmup=1000,
        )
        tokens = trained_tokens_per_s(trainer.Trainer(config, RunDir(run), state.Quiet()), run)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tgt_tokens_per_s": tokens, "peak_rss_mib": peak}))


def loop_pairs(run_dir: Path, steps: int) -> dict:
    """Two rounds of two side-by-side processes, one per setting, sides swapped."""
    runs = {"glibc": [], "heap": []}
    for order in (("heap", "glibc"), ("glibc", "heap")):
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--loop-child", str(run_dir), str(steps), setting],
                stdout=subprocess.PIPE,
                text=True,
            )
            for setting in order
        ]
        for setting, proc in zip(order, procs):
            out, _ = proc.communicate()
            if proc.returncode:
                sys.exit(f"the {setting} process failed")
            runs[setting].append(json.loads(out.splitlines()[-1]))
    tokens = {k: [r["tgt_tokens_per_s"] for r in v] for k, v in runs.items()}
    return {
        "loop": str(run_dir),
        "steps": steps,
        "tgt_tokens_per_s": tokens,
        "peak_rss_mib": {k: [r["peak_rss_mib"] for r in v] for k, v in runs.items()},
        "heap_over_glibc": sum(tokens["heap"]) / sum(tokens["glibc"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*", default=["tiny:bf16", "base:bf16", "base:fp32"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loop", type=Path, metavar="RUN_DIR")
    ap.add_argument("--loop-steps", type=int, default=600)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--loop-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        shape, precision, heap = args.child
        return child(shape, precision, heap == "heap")
    if args.loop_child:
        run_dir, steps, heap = args.loop_child
        return loop_child(run_dir, int(steps), heap == "heap")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import cpu_name

    results = {"cpu": cpu_name(), "rows": []}
    for row in args.rows:
        shape, precision = row.split(":")
        runs = {"glibc": [], "heap": []}
        for _ in range(args.rounds):
            for setting in ("glibc", "heap"):
                done = subprocess.run(
                    [sys.executable, __file__, "--child", shape, precision, setting],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs[setting].append(json.loads(done.stdout.splitlines()[-1]))
        tokens = {k: [r["tgt_tokens_per_s"] for r in v] for k, v in runs.items()}
        summary = {
            "shape": shape,
            "precision": precision,
            "tgt_tokens_per_s": tokens,
            "peak_rss_mib": {k: [r["peak_rss_mib"] for r in v] for k, v in runs.items()},
            "heap_over_glibc": (sum(tokens["heap"]) / sum(tokens["glibc"])),
        }
        results["rows"].append(summary)
        print(json.dumps(summary), flush=True)
    if args.loop:
        results["loop"] = loop_pairs(args.loop, args.loop_steps)
        print(json.dumps(results["loop"]), flush=True)
    out = ROOT / "benchmarks" / "out" / ("malloc_ab_loop.json" if args.loop else "malloc_ab.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
