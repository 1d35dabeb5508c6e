"""What limits training and decoding on a GPU, measured in one call: run by benchmarks/gpu_perf.sh.

    python benchmarks/gpu_perf.py --out DIR [--budget 480] [--data RUN_DIR]
    python benchmarks/gpu_perf.py --dry-run --out DIR   # every section on the CPU, tiny sizes

Sections, the most valuable first (a section that would not fit the time left is recorded as
skipped): the machine (versions, the bf16 matmul and copy ceilings, which kernel each attention
call of the model picks, as torch chooses and as nmt does); decoding (beam 4 and greedy) in
fp32, bf16 and fp16, with and without CUDA graphs; a trained model translating newstest2014
and test2016 as users run it (`--model`, `--shared`); the training step of `base` and `big` (bf16,
512 x 32 tokens a side) with the landed loss and the fused one, with torch's attention kernels
or nmt's; a cold pass over many batch shapes against a warm one; the trainer's loop against the
bare step on real batches (`--data`: a prepared and binarized Multi30k run); the step compiled;
each attention call's time under each SDPA backend. One JSON line per figure in DIR/gpu_perf.jsonl.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, model_config, train_flops  # noqa: E402

from nmt_cli.config import DecodeOptions  # noqa: E402
from nmt_cli.engine import decoding, distributed, step  # noqa: E402
from nmt_cli.engine.batches import Batch, to_device  # noqa: E402
from nmt_cli.engine.device import prefer_attention_kernels  # noqa: E402
from nmt_cli.engine.model import Transformer  # noqa: E402
from nmt_cli.vocab import EOS, PAD  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DRY = {"tiny": dict(layers=2, d=64, ffn=128, heads=4, vocab=1000)}


class _LandedLoss(torch.autograd.Function):
    """The loss as it was before the fused one (commit 53268c1), for the A/B: full float32
    (N, V) log-probabilities, kept for a backward that rewrites them in place."""

    @staticmethod
    def forward(ctx, logits, target, epsilon):
        lprobs = F.log_softmax(logits.float(), dim=-1)
        nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)
        uniform = -lprobs.sum(dim=-1) / lprobs.shape[-1]
        ctx.save_for_backward(lprobs, target)
        ctx.epsilon, ctx.dtype = epsilon, logits.dtype
        return ((1.0 - epsilon) * nll + epsilon * uniform).sum(), nll.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_nll):
        lprobs, target = ctx.saved_tensors
        eps, v = ctx.epsilon, lprobs.shape[-1]
        g_loss = grad_loss.float()
        g_nll = grad_nll.float() if grad_nll is not None else torch.zeros_like(g_loss)
        grad = lprobs.exp_().mul_(g_loss + g_nll).sub_(g_loss * eps / v)
        hit = (-(g_loss * (1.0 - eps) + g_nll)).expand(len(target), 1).contiguous()
        grad.scatter_add_(-1, target[:, None], hit)
        return grad.to(ctx.dtype), None, None


def _landed(logits, target, epsilon, weights=None):
    assert weights is None, "the landed loss takes the real target positions only"
    return _LandedLoss.apply(logits, target, epsilon)


LOSSES = {"landed": _landed, "fused": step.label_smoothed_loss}


class Bench:
    FIGURES = "gpu_perf.jsonl"  # in `out`

    def __init__(self, args):
        self.dry, self.out, self.budget = args.dry_run, args.out, args.budget
        self.device = torch.device("cpu" if self.dry else "cuda:0")
        self.start = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = (self.out / self.FIGURES).open("a")
        self.ceiling: float | None = None
        self.rounds = args.rounds
        self.loop_tokens = args.loop_tokens

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def emit(self, section: str, **figures) -> None:
        row = {"section": section, "t": round(time.perf_counter() - self.start, 1), **figures}
        line = json.dumps(row, default=str)
        print(line, flush=True)
        self.jsonl.write(line + "\n")
        self.jsonl.flush()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn, warmup: int = 3, repeats: int = 10) -> float:
        """Median seconds of fn() after warm-up (each call synchronised)."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def shape(self, name: str) -> dict:
        return DRY["tiny"] if self.dry else SHAPES[name]

    def model(self, name: str) -> Transformer:
        torch.manual_seed(0)
        return Transformer(model_config(self.shape(name))).to(self.device)


def attention_kernels(policy: str) -> None:
    """ "torch": every SDPA backend allowed, torch choosing; "nmt": nmt's choice (the engine's
    prefer_attention_kernels)."""
    if policy == "nmt":
        return prefer_attention_kernels(torch.device("cuda", 0))
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(True)


def sdpa_ops(fn) -> list[str]:
    """The aten attention ops fn() ran: they name the SDPA backend that was picked."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events()}
    keep = ("attention", "flash", "cudnn")
    return sorted(n for n in names if n.startswith("aten::_") and any(k in n for k in keep))


def attention_calls(b: Bench, dtype) -> dict:
    """The model's attention calls, as the base model makes them in training and decoding."""
    dry = b.dry
    B, H, K, S = (8, 2, 16, 12) if dry else (512, 8, 64, 32)
    dev = b.device

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    q, k, v = rand(B, H, S, K), rand(B, H, S, K), rand(B, H, S, K)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=dev)
    mask[: B // 2, ..., -3:] = False
    beams, m = 4, 24
    q1 = torch.randn(B // 4 * beams, H, 1, K, device=dev, dtype=dtype)
    k1 = torch.randn(B // 4 * beams, H, m, K, device=dev, dtype=dtype)
    qc = torch.randn(B // 4, H, beams, K, device=dev, dtype=dtype)
    kc = torch.randn(B // 4, H, S, K, device=dev, dtype=dtype)
    mc = mask[: B // 4]
    # graphed decoding (cache.FixedCache): every position of a fixed length, additive masks
    seen = torch.zeros(1, 1, 1, 2 * m, device=dev, dtype=dtype)
    seen[..., m:] = -math.inf
    kf = torch.randn(B // 4 * beams, H, 2 * m, K, device=dev, dtype=dtype)
    mcf = torch.zeros(mc.shape, device=dev, dtype=dtype).masked_fill(~mc, -math.inf)
    sdpa = F.scaled_dot_product_attention
    return {
        "train_self_masked": lambda: sdpa(q, k, v, attn_mask=mask).sum().backward(),
        "train_self_unmasked": lambda: sdpa(q, k, v).sum().backward(),
        "train_causal": lambda: sdpa(q, k, v, is_causal=True).sum().backward(),
        "decode_self_step": lambda: sdpa(q1, k1, k1),
        "decode_cross_beams": lambda: sdpa(qc, kc, kc, attn_mask=mc),
        "decode_self_fixed": lambda: sdpa(q1, kf, kf, attn_mask=seen),
        "decode_cross_fixed": lambda: sdpa(qc, kc, kc, attn_mask=mcf),
    }


def section_machine(b: Bench) -> None:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if b.device.type == "cuda":
        info |= {
            "gpu": torch.cuda.get_device_name(b.device),
            "cudnn": torch.backends.cudnn.version(),
            "sdpa_enabled": {
                "flash": torch.backends.cuda.flash_sdp_enabled(),
                "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                "cudnn": getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)(),
                "math": torch.backends.cuda.math_sdp_enabled(),
            },
        }
    n = 512 if b.dry else 8192
    x = torch.randn(n, n, device=b.device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=b.device, dtype=torch.bfloat16)
    b.ceiling = 2 * n**3 / b.timed(lambda: x @ y) / 1e12
    big = torch.empty(2**28 if not b.dry else 2**20, dtype=torch.uint8, device=b.device)
    other = torch.empty_like(big)
    copy_tbs = 2 * big.numel() / b.timed(lambda: other.copy_(big)) / 1e12
    b.emit("machine", **info, bf16_matmul_tflops=round(b.ceiling, 1), copy_tb_s=round(copy_tbs, 2))
    for kernels in ("torch", "nmt"):
        attention_kernels(kernels)
        for dtype in (torch.bfloat16, torch.float32):
            for name, call in attention_calls(b, dtype).items():
                b.emit("sdpa_pick", attention=kernels, dtype=str(dtype)[6:], call=name, ops=sdpa_ops(call))


def section_attention(b: Bench) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    for name, call in attention_calls(b, torch.bfloat16).items():
        row = {}
        for label, backend in backends.items():
            try:
                with sdpa_kernel([backend]):
                    row[label] = round(b.timed(call, 2, 10) * 1e3, 3)
            except RuntimeError:
                row[label] = None  # this backend takes no such call
        attention_kernels("torch")
        row["torch_default"] = round(b.timed(call, 2, 10) * 1e3, 3)
        attention_kernels("nmt")
        row["nmt"] = round(b.timed(call, 2, 10) * 1e3, 3)
        b.emit("attention_ms", call=name, **row)


def make_step(b: Bench, model: Transformer, compiled: bool, padded: bool, sentences: int, length: int = 32):
    s_vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, s_vocab, (sentences, length), generator=g)
    tgt = torch.randint(4, s_vocab, (sentences, length + 1), generator=g)
    if padded:  # a quarter of the sentences a few tokens shorter, as real batches are
        src[: sentences // 4, -3:] = PAD
    batch = to_device((src.numpy(), tgt[:, :-1].numpy(), tgt[:, 1:].numpy()), b.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    scaler = torch.amp.GradScaler(b.device.type, enabled=False)
    group = distributed.Group()
    forward = step.Objective(model, 0.1)
    if compiled:  # as the trainer's --compile does
        forward = group.wrap(forward, b.device, compile=True)

    def autocast():
        return torch.autocast(b.device.type, dtype=torch.bfloat16)

    def one():
        step.train_step(
            model,
            forward,
            optimizer,
            scaler,
            [batch],
            clip_norm=0.0,
            lr=1e-4,
            autocast=autocast,
            group=group,
        )

    return one, batch


def step_row(b: Bench, name: str, seconds: float, batch: Batch, **labels) -> dict:
    s = b.shape(name)
    tokens = batch.src.numel()
    flops = train_flops(s, tokens, batch.tokens, batch.src.shape[1], batch.tgt_in.shape[1])
    tflops = flops / seconds / 1e12
    row = {"shape": name, **labels, "ms": round(seconds * 1e3, 2), "tgt_tok_s": round(batch.tokens / seconds)}
    share = round(tflops / b.ceiling, 3) if b.ceiling else None  # the machine section measures it
    row |= {"model_tflops": round(tflops, 1), "share_of_ceiling": share}
    if b.device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated(b.device) / 2**30, 2)
        torch.cuda.reset_peak_memory_stats(b.device)
    return row


def top_kernels(b: Bench, fn, label: str, n: int = 12) -> None:
    """Where fn()'s device time goes: its n costliest ops by self time on the device (on the
    CPU in a dry run), with the host's time beside the device's."""
    from torch.profiler import ProfilerActivity, profile

    cuda = b.device.type == "cuda"
    fn()
    b.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts):  # the profiler's own start-up, outside the figures
        torch.ones(1, device=b.device).add_(1)
        b.sync()
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        b.sync()
    wall = time.perf_counter() - t
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events)
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    ops = [[e.key[:60], round(getattr(e, key) / 1e3, 2), e.count] for e in top]
    idle = {"gpu_idle_share": round(max(0.0, 1 - total / 1e6 / wall), 3)} if cuda else {}
    b.emit(
        "profile", of=label, wall_ms=round(wall * 1e3, 1), device_ms=round(total / 1e3, 1), **idle, top=ops
    )


def section_step(b: Bench) -> None:
    """The step's levers against the landed path, in alternate rounds: the loss (landed, fused)
    and the attention kernels (torch's choice, or nmt's)."""
    sentences = 16 if b.dry else 512
    variants = [  # (loss, attention kernels chosen by)
        ("landed", "torch"),
        ("landed", "nmt"),
        ("fused", "nmt"),
    ]
    for name in ("base", "big"):
        model = b.model(name)
        runs: dict[tuple, list[float]] = {v: [] for v in variants}
        peaks: dict[tuple, float] = {}  # GiB at the peak of each variant's (last) round
        for _ in range(b.rounds):
            for loss, kernels in variants:
                if b.left() < 20:
                    return b.emit("step", skipped="budget")
                step.label_smoothed_loss = LOSSES[loss]
                attention_kernels(kernels)
                one, batch = make_step(b, model, False, False, sentences)
                if b.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(b.device)
                runs[(loss, kernels)].append(b.timed(one, 3, 10))
                if b.device.type == "cuda":
                    peaks[(loss, kernels)] = torch.cuda.max_memory_allocated(b.device) / 2**30
        for (loss, kernels), times in runs.items():
            if times:
                row = step_row(b, name, statistics.median(times), batch, loss=loss, attention=kernels)
                if (loss, kernels) in peaks:
                    row["peak_gib"] = round(peaks[(loss, kernels)], 2)
                b.emit("step", **row, rounds_ms=[round(t * 1e3, 2) for t in times])
        if name == "base":
            top_kernels(b, one, "base step, fused loss, nmt's attention kernels")
        del model
    step.label_smoothed_loss = LOSSES["fused"]


def section_decode(b: Bench) -> None:
    """Sentences/s of beam 4 and greedy on a random `base` model, 256 sources of 20-40 tokens,
    in fp32, bf16 and fp16, each with its steps run one kernel at a time (graphs off) and
    replayed as CUDA graphs (graphed.py, the default), in alternate rounds; each variant's
    translations beside those of fp32 without graphs; the host's and the device's time of one
    batch, both ways."""
    import numpy as np

    rng = np.random.default_rng(0)
    n, batch = (8, 4) if b.dry else (256, 64)
    vocab = b.shape("base")["vocab"]
    lengths = rng.integers(20, 41, n)
    sources = [rng.integers(4, vocab, k).tolist() for k in lengths]
    base = b.model("base").eval()
    attention_kernels("nmt")

    def src_of(chunk: list[list[int]]) -> torch.Tensor:
        src = torch.full((len(chunk), max(map(len, chunk)) + 1), PAD)
        for r, s in enumerate(chunk):
            src[r, : len(s)], src[r, len(s)] = torch.tensor(s), EOS
        return src.to(b.device)

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    models = {p: copy.deepcopy(base).to(d) for p, d in dtypes.items()}
    variants = [(p, g) for p in dtypes for g in (False, True)]
    for beam in (4, 1):
        options = DecodeOptions(beam=beam, max_len_a=0.0, max_len_b=33)

        def run(precision, graphs, count=n, options=options):
            out = []
            for i in range(0, count, batch):
                src = src_of(sources[i : i + batch])
                out += decoding.translate(models[precision], src, options, graphs=graphs)
            return out

        outputs = {v: run(*v) for v in variants}  # also the warm-up
        reference = [h[0].tokens for h in outputs[("fp32", False)]]
        times: dict[tuple, list[float]] = {v: [] for v in variants}
        for _ in range(min(b.rounds, 2)):
            for v in variants:
                if b.left() < 20:
                    return b.emit("decode", skipped="budget")
                b.sync()
                t = time.perf_counter()
                run(*v)
                b.sync()
                times[v].append(time.perf_counter() - t)
        for (precision, graphs), seconds in times.items():
            hyps = outputs[(precision, graphs)]
            words = sum(len(h[0].tokens) for h in hyps)
            best = min(seconds)
            b.emit(
                "decode",
                beam=beam,
                precision=precision,
                graphs=graphs,
                sentences_s=round(n / best, 1),
                tokens_s=round(words / best),
                rounds_s=[round(x, 3) for x in seconds],
                same_as_fp32_eager=sum(h[0].tokens == r for h, r in zip(hyps, reference)),
                of=n,
            )
        if beam == 4:  # the steps of one batch: the profiles' times over them are per step
            model, steps = models["bf16"], {"n": 0}

            def counted(*args, _decode=model.decode, _steps=steps, **kwargs):
                _steps["n"] += 1
                return _decode(*args, **kwargs)

            model.decode = counted
            run("bf16", False, count=batch)
            del model.decode
            b.emit("decode", beam=beam, steps_of_one_batch=steps["n"])
            for graphs in (False, True):
                top_kernels(
                    b,
                    lambda g=graphs: run("bf16", g, count=batch),
                    f"beam 4 bf16, graphs {graphs}, one batch",
                )
    from decode_speed import search_host_work

    from nmt_cli.engine import graphed

    b.emit("decode", graphs_failed=graphed._failed)
    for beam in (4, 1):  # what a replayed step still waits for: the search's own kernels and bookkeeping
        b.emit("decode", beam=beam, search_host_ms_per_step=round(search_host_work(str(b.device), beam), 3))


def section_translate(b: Bench, package: Path | None, data: Path | None) -> None:
    """A trained model as users run it (`--model`: a package from `nmt export`, which
    gpu_carry.sh puts in .gpu/model): nmt's engine through the Translator on the GPU, fp32 and
    bf16, CUDA graphs on and off, beam 4 and greedy, batches of 64 sentences, on newstest2014's
    first 300 lines (sentences/s) and Multi30k test2016's (sentences/s, and BLEU against its
    references: bf16's beside fp32's), in alternate rounds. CTranslate2 is not beside it: its
    wheel loads CUDA 12's cuBLAS, and the GPU image holds CUDA 13's."""
    import gzip

    import sacrebleu

    from nmt_cli.inference.translator import Translator

    if package is None or not (package / "nmt.json").exists():
        return b.emit("translate", skipped=f"no model package at {package} (gpu_carry.sh RUN puts one)")
    if data is None or not (data / "wmt14" / "newstest2014.en.gz").exists():
        return b.emit("translate", skipped=f"no newstest2014 under {data}")
    n, batch = (40, 16) if b.dry else (300, 64)

    def read(path: str) -> list[str]:
        with gzip.open(data / path, "rt", encoding="utf-8") as f:
            return f.read().splitlines()[:n]

    sets = {
        "newstest2014": (read("wmt14/newstest2014.en.gz"), None),
        "test2016": (read("multi30k/test_2016_flickr.en.gz"), read("multi30k/test_2016_flickr.de.gz")),
    }
    device = str(b.device)
    variants = [(p, g) for p in ("fp32", "bf16") for g in (False, True)]
    translators = {
        (p, g): Translator.load(package, device=device, precision=p, cuda_graphs=g, batch_size=batch)
        for p, g in variants
    }
    for beam in (4, 1):
        for name, (lines, refs) in sets.items():
            seconds: dict[tuple, list[float]] = {v: [] for v in variants}
            outputs = {v: translators[v].translate(lines, beam=beam) for v in variants}  # warm-up
            for r in range(min(b.rounds, 2)):
                for v in variants if r % 2 == 0 else variants[::-1]:
                    if b.left() < 20:
                        return b.emit("translate", skipped="budget")
                    b.sync()
                    t = time.perf_counter()
                    translators[v].translate(lines, beam=beam)
                    b.sync()
                    seconds[v].append(time.perf_counter() - t)
            first = outputs[variants[0]]
            for (precision, graphs), times in seconds.items():
                out = outputs[(precision, graphs)]
                row = {
                    "set": name,
                    "beam": beam,
                    "precision": precision,
                    "graphs": graphs,
                    "sentences_s": round(len(lines) / min(times), 1),
                    "rounds_s": [round(x, 3) for x in times],
                    "lines_as_fp32_eager": sum(a == c for a, c in zip(out, first)),
                    "of": len(lines),
                }
                if refs is not None:
                    row["bleu"] = round(sacrebleu.corpus_bleu(out, [refs]).score, 2)
                b.emit("translate", **row)


def section_cold(b: Bench) -> None:
    """A pass over 24 batch shapes never seen, then the same pass again, with nmt's attention
    kernels, then torch's (cuDNN's cold to their per-shape plans): the first epoch of a real run
    meets every shape."""
    import numpy as np

    rng = np.random.default_rng(1)
    model = b.model("base")
    tokens = 256 if b.dry else 8192
    shapes = [(int(s), int(s + rng.integers(-4, 5))) for s in rng.choice(range(10, 60), 24, replace=False)]
    for kernels in ("nmt", "torch"):
        attention_kernels(kernels)
        steps = []
        for s_len, t_len in shapes:
            one, _ = make_step(b, model, False, True, max(1, tokens // max(s_len, t_len)), s_len)
            steps.append(one)
        passes = []
        for _ in range(2):
            b.sync()
            t = time.perf_counter()
            for one in steps:
                one()
            b.sync()
            passes.append(time.perf_counter() - t)
        b.emit(
            "cold_shapes",
            attention=kernels,
            cold_s=round(passes[0], 3),
            warm_s=round(passes[1], 3),
            cold_over_warm=round(passes[0] / passes[1], 2),
        )
    attention_kernels("nmt")


def section_compile(b: Bench) -> None:
    """--compile (the whole update: forward, logits, loss) on big, its compile time and step."""
    sentences = 16 if b.dry else 512
    for name in ("big",):
        model = b.model(name)
        one, batch = make_step(b, model, True, False, sentences)
        t = time.perf_counter()
        one()
        b.sync()
        compile_s = time.perf_counter() - t
        seconds = b.timed(one, 3, 10)
        b.emit("compiled_step", compile_s=round(compile_s, 1), **step_row(b, name, seconds, batch))


def section_loop(b: Bench, data: Path | None) -> None:
    """The trainer's loop against the bare step on the same real batches (train_throughput's
    measurement), at each of --loop-tokens."""
    while data is not None and not (data / ".ready").exists() and b.left() > 90:
        time.sleep(2)  # gpu_perf.sh prepares it in the background
    if data is None or not (data / "data").exists():
        return b.emit("loop", skipped="no prepared data")
    from train_throughput import loop_against_bare

    for max_tokens in [1024] if b.dry else b.loop_tokens:
        if b.left() < 60:
            return b.emit("loop", skipped="budget")
        size, steps = ("tiny", 30) if b.dry else ("base", 200)
        row = loop_against_bare(data, size, max_tokens, str(b.device), "bf16", steps)
        b.emit("loop", **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})


SECTIONS = ["machine", "decode", "translate", "step", "cold", "loop", "compile", "attention"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="every section on the CPU, tiny sizes")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "gpu_perf")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all sections")
    ap.add_argument("--data", type=Path, default=None, help="a binarized Multi30k run for the loop")
    ap.add_argument("--model", type=Path, default=ROOT / ".gpu" / "model", help="a package to translate with")
    ap.add_argument("--shared", type=Path, default=None, help="the shared data (multi30k/, wmt14/)")
    ap.add_argument("--sections", nargs="*", default=SECTIONS, choices=SECTIONS)
    ap.add_argument("--rounds", type=int, default=3, help="alternate rounds of the step's variants")
    ap.add_argument("--loop-tokens", type=int, nargs="*", default=[8192, 16384], help="loop batch sizes")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_perf.py: no CUDA GPU visible (--dry-run runs it on the CPU)")
    b = Bench(args)
    for name in args.sections:
        if b.left() < 15:
            b.emit(name, skipped="budget")
            continue
        start = time.perf_counter()
        try:
            if name == "loop":
                section_loop(b, args.data)
            elif name == "translate":
                section_translate(b, args.model, args.shared)
            else:
                globals()[f"section_{name}"](b)
        except Exception as e:  # one section's failure must not cost the others their figures
            import traceback

            traceback.print_exc()
            b.emit(name, error=f"{type(e).__name__}: {str(e)[:300]}")
        b.emit(name, seconds=round(time.perf_counter() - start, 1))
        if b.device.type == "cuda":
            with torch.cuda.device(b.device):
                torch.cuda.empty_cache()
    if b.ceiling is not None:
        b.emit("done", left_s=round(b.left()), ceiling_tflops=round(b.ceiling, 1))


if __name__ == "__main__":
    main()
