"""What a Trainer is handed: the data a run trains on, and the parts it trains (the process
group and device, the model with its loss as an update calls it, the optimizer, the loss scaler,
the moving average), built from a TrainConfig by `build` (OpenNMT's build_trainer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nmt_cli.config import ModelConfig, TrainConfig, resolve_precision
from nmt_cli.engine import adapters, checkpoint, distributed
from nmt_cli.engine.device import cpu_has_bf16, keep_large_blocks_in_heap, resolve_device, widen_onednn_cache
from nmt_cli.engine.ema import Average
from nmt_cli.engine.model import Transformer
from nmt_cli.engine.state import Reporter
from nmt_cli.engine.step import Objective
from nmt_cli.errors import NmtError
from nmt_cli.shards import Shard


@dataclass(frozen=True)
class Data:
    """What a run trains on: token ids of the training pairs and of the validation pairs (or
    none), their languages and vocabulary sizes, and the training corpora as `nmt prep` records
    them (the number of pairs and the sampling weight of each)."""

    train: tuple[Shard, Shard]
    valid: tuple[Shard, Shard] | None
    src: str
    tgt: str
    vocab_size: int  # the target's
    corpora: tuple[dict, ...] = ()
    src_vocab_size: int | None = None  # None: the vocabulary is joint


@dataclass(frozen=True)
class Setup:
    """What a Trainer is handed besides its data: where it runs (the process group, the device),
    how it computes, and the parts it trains. `build` makes one from a TrainConfig."""

    dist: distributed.Group
    device: torch.device
    precision: str  # resolved: fp32, bf16 or fp16
    model_config: ModelConfig
    model: Transformer
    forward: torch.nn.Module  # the model with its loss as an update calls it (DDP and/or compiled)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: Average | None


def build(config: TrainConfig, data: Data, reporter: Reporter, like: ModelConfig | None = None) -> Setup:
    """The process group, device, precision, model (seeded alike on every rank, sized for
    `data`'s vocabularies; shaped `like` the model --init-from starts from), its DDP and
    compiled wrapping, optimizer, loss scaler and moving average of `config`."""
    if config.threads:
        torch.set_num_threads(config.threads)
    dist, device = distributed.setup(resolve_device(config.device), config.dist_timeout)
    if device.type == "cpu":
        keep_large_blocks_in_heap()
        widen_onednn_cache()
    # bf16 training on a CPU with bf16 arithmetic makes more updates at the same loss per
    # update (docs/benchmarks.md); decoding stays fp32, faster there.
    precision = resolve_precision(config.precision, device.type, cpu_has_bf16())
    if config.precision == "auto" and device.type == "cpu" and precision == "bf16" and dist.is_main:
        reporter.say("training in bf16 autocast: this CPU has bf16 arithmetic (or --precision fp32)")
    if precision == "tf32":  # the process trains in one precision: its switch stays on
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    model_config = config.model_config(data.vocab_size, data.src_vocab_size, like=like)
    torch.manual_seed(config.seed)
    model = Transformer(model_config).to(device)
    model.set_kernels(config.fused_qkv, config.narrow_residual)
    if config.adapters:
        added = adapters.attach(model, config.adapters)
        if dist.is_main:
            reporter.say(f"--adapters {config.adapters}: {added:,} weights train, the model's own stay")
    if config.freeze:
        frozen = freeze(model, config.freeze)
        if dist.is_main:
            total = sum(p.numel() for p in model.parameters())
            reporter.say(f"--freeze {config.freeze}: {frozen:,} of {total:,} weights stay as they are")
    if dist.world > 1:  # same initial weights everywhere, different dropout per rank
        torch.manual_seed(config.seed + 7919 * dist.rank)
    dist.allow_writes(checkpoint.write_seconds(model, 4 if config.ema else 3))  # weights, Adam, EMA
    objective = Objective(model, config.label_smoothing)
    forward = dist.wrap(
        objective,
        device,
        config.compile,
        dynamic=not config.fixed_shapes,
        batched_grad_copy=config.batched_grad_copy,
    )
    return Setup(
        dist,
        device,
        precision,
        model_config,
        model,
        forward,
        make_optimizer(model, config),
        torch.amp.GradScaler("cuda", init_scale=2.0**7, enabled=precision == "fp16"),
        Average(model, config.ema) if config.ema else None,
    )


def freeze(model: Transformer, parts: str) -> int:
    """Leave the named parts of `model` (TrainConfig.freeze) out of training: no gradient, so
    neither Adam nor DDP touches them. Returns how many weights that is."""
    c, prefixes = model.config, []
    for part in (p.strip() for p in parts.split(",") if p.strip()):
        if part == "embeddings":
            prefixes += ["embed.", "src_embed."]
        elif part in ("encoder", "decoder"):
            prefixes += [f"{part}.", f"{part}_norm."]
        else:
            side, index = part.split(".")
            layers = c.num_encoder_layers if side == "encoder" else c.num_decoder_layers
            if int(index) >= layers:
                raise NmtError(f"--freeze {part}: the {side} has layers 0 to {layers - 1}")
            prefixes.append(f"{side}.{int(index)}.")
    frozen = 0
    for name, p in model.named_parameters():
        if name.startswith(tuple(prefixes)):
            p.requires_grad_(False)
            frozen += p.numel()
    if not any(p.requires_grad for p in model.parameters()):
        raise NmtError(f"--freeze {parts} leaves nothing to train")
    return frozen


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The paper's Adam, or AdamW whose decoupled weight decay leaves biases and LayerNorms alone
    (the weight matrices and the embedding decay). Fused (CPU and CUDA): it can skip a
    non-finite update on the device (train_step)."""
    settings: dict[str, Any] = {"lr": 0.0, "betas": (config.beta1, config.beta2), "eps": config.adam_eps}
    settings["fused"] = True
    trained = [p for p in model.parameters() if p.requires_grad]  # all but what --freeze keeps
    if config.optimizer == "adam":
        return torch.optim.Adam(trained, **settings)
    matrices = [p for p in trained if p.dim() >= 2]
    others = [p for p in trained if p.dim() < 2]
    groups = [
        {"params": matrices, "weight_decay": config.weight_decay},
        {"params": others, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, **settings)
