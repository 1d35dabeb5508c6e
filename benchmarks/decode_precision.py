"""Decoding in fp32, bf16 and fp16: BLEU, agreement with fp32 and speed, on one trained model.

    python benchmarks/decode_precision.py RUN_DIR [--split valid] [--device auto]

The model `nmt translate` would load from RUN_DIR translates the split (beam 4, the defaults)
once per precision; each output is scored with sacreBLEU against the split's references as
released and compared line by line with the fp32 output. On a GPU this is what chose the
default decoding precision (docs/benchmarks.md); on a CPU, where bf16 and fp16 arithmetic is
emulated or slow, it shows the numerical effect only, not the speed a GPU would reach.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_name  # noqa: E402

from nmt_cli.backend_nmt import load_model  # noqa: E402
from nmt_cli.config import TranslateConfig  # noqa: E402
from nmt_cli.engine.device import resolve_device  # noqa: E402
from nmt_cli.metrics import score  # noqa: E402
from nmt_cli.models import from_run  # noqa: E402
from nmt_cli.rundir import RunDir  # noqa: E402
from nmt_cli.translate import Translator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--split", default="valid", help="choices are made on the validation set")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precisions", nargs="*", default=["fp32", "bf16", "fp16"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--profile", type=int, default=0, metavar="N", help="then profile N sentences per precision"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run = RunDir(args.run)
    prep = run.load_manifest()["prep"]
    sources = run.text(args.split, prep["src"], raw=True).read_text(encoding="utf-8").splitlines()
    refs = run.text(args.split, prep["tgt"], raw=True).read_text(encoding="utf-8").splitlines()
    device = resolve_device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    model = from_run(run, None)
    translator = Translator(model, TranslateConfig(device=str(device), precision="fp32"))
    rows, reference = [], None
    for precision in args.precisions:
        # Loaded directly: `nmt translate` refuses fp16 on a CPU, where it is only measured.
        translator.decoder.models = [load_model(model, device, precision)]
        translator.translate(sources[:64])  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        hyps = translator.translate(sources)
        seconds = time.perf_counter() - start
        reference = reference or hyps
        bleu, chrf = score(hyps, refs, ["bleu", "chrf"])
        rows.append(
            {
                "precision": precision,
                "device": where,
                "split": args.split,
                "sentences": len(sources),
                "bleu": round(bleu.score, 2),
                "chrf": round(chrf.score, 2),
                "bleu_signature": bleu.signature,
                "same_as_fp32": sum(a == b for a, b in zip(hyps, reference)),
                "sentences_per_s": round(len(sources) / seconds, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        if args.profile:
            _profile(translator, sources[: args.profile], precision)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


def _profile(translator: Translator, sources: list[str], precision: str) -> None:
    """The operators that take the time of decoding `sources`, on the host and on the device:
    where a precision loses its speed."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        translator.translate(sources)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    order = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"== {precision}: {len(sources)} sentences, by {order}", flush=True)
    print(prof.key_averages().table(sort_by=order, row_limit=12), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)


if __name__ == "__main__":
    main()
