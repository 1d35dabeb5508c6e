"""Benchmark a training step: nmt against fairseq 0.12.2, same shape, same batch, one run.

    python benchmarks/train_throughput.py [--shapes tiny base] [--fairseq-python PATH]

A step is forward + label-smoothed loss + backward + Adam on 4096 source and 4096 target tokens
without padding, timed through nmt's own `train_step` (the trainer's code path). fairseq runs
in its own venv (benchmarks/peers/install_fairseq.sh). Also reports the matmul ceilings measured
in the same run, achieved model GFLOP/s, and the padding share of real Multi30k batches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, batch, cpu_name, matmul_ceiling, time_steps, train_flops  # noqa: E402

from nmt_cli.engine import distributed  # noqa: E402
from nmt_cli.engine.model import ModelConfig, Transformer  # noqa: E402
from nmt_cli.engine.trainer import train_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def nmt_step(shape_name: str, precision: str, repeats: int) -> dict:
    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=shape["vocab"], num_encoder_layers=shape["layers"],
                         num_decoder_layers=shape["layers"], d_model=shape["d"],
                         ffn=shape["ffn"], heads=shape["heads"])
    model = Transformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                 foreach=True)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    batches = [list(batch(shape["vocab"]))]
    dtype = torch.bfloat16 if precision == "bf16" else None

    def autocast():
        return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)

    group = distributed.Group()
    seconds = time_steps(lambda: train_step(model, model, optimizer, scaler, batches,
                                            label_smoothing=0.1, clip_norm=0.0, lr=1e-4,
                                            autocast=autocast, group=group), 2, repeats)
    return {"system": "nmt", "shape": shape_name, "precision": precision, "seconds": seconds,
            "tgt_tokens_per_s": batches[0][2].numel() / seconds}


def padding_share() -> float | None:
    """Padding of real batches: Multi30k, BPE 8000, --max-tokens 4096 (needs the data run)."""
    run = ROOT / "benchmarks" / "out" / "multi30k"
    if not (run / "data" / "train.en.idx").exists():
        return None
    from nmt_cli.shards import Shard, make_batches, padding_share as share
    s = Shard(run / "data" / "train.en").lengths + 1
    t = Shard(run / "data" / "train.de").lengths + 1
    return share(make_batches(s, t, 4096, 1, 0), s, t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["tiny", "base"])
    ap.add_argument("--precisions", nargs="*", default=["fp32", "bf16"])
    ap.add_argument("--fairseq-python", default=str(ROOT.parent / "peers" / "fairseq" / "bin" / "python"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "train_throughput.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    results = {"threads": torch.get_num_threads(), "cpu": cpu_name(),
               "ceiling_gflops": {"fp32": matmul_ceiling(torch.float32),
                                  "bf16": matmul_ceiling(torch.bfloat16)},
               "padding_share_multi30k": padding_share(), "runs": []}
    print(json.dumps({k: results[k] for k in ("cpu", "ceiling_gflops", "padding_share_multi30k")}), flush=True)
    for shape in args.shapes:
        flops = train_flops(SHAPES[shape], 4096, 4096, 32, 32)
        for precision in args.precisions:
            ours = nmt_step(shape, precision, args.repeats)
            peer = None
            if Path(args.fairseq_python).exists():
                done = subprocess.run([args.fairseq_python, str(ROOT / "benchmarks" / "peers" / "fairseq_train.py"),
                                       "--shape", shape, "--precision", precision,
                                       "--repeats", str(args.repeats)], capture_output=True, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "2"})
                lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
                peer = json.loads(lines[-1]) if lines else {"error": done.stderr[-500:]}
            row = {"shape": shape, "precision": precision, "nmt": ours, "fairseq": peer,
                   "nmt_gflops": flops / ours["seconds"] / 1e9,
                   "nmt_share_of_ceiling": flops / ours["seconds"] / 1e9 / results["ceiling_gflops"][precision]}
            if peer and "seconds" in peer:
                row["ratio"] = peer["seconds"] / ours["seconds"]
                row["fairseq_gflops"] = flops / peer["seconds"] / 1e9
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
