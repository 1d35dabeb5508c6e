"""The configs of training a model: the size presets, `nmt train`'s settings, and how `nmt
train` launches its workers (the model's shape itself: model.py)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from nmt_cli.config.common import COMET_PRECISION_HELP, COMET_PRECISIONS, PRECISIONS, knob
from nmt_cli.config.model import ModelConfig
from nmt_cli.errors import NmtError

SCHEDULES = ("inverse-sqrt", "linear", "cosine", "constant")  # engine/schedule.py

# fmt: off
PRESETS: dict[str, dict] = {
    # CPU-sized. `tiny` is the shape of the speed benchmarks. `small` is the Multi30k model of
    # `nmt quickstart`: Wu et al. 2021's Transformer-Tiny shape, narrower but deeper than `tiny`.
    # A small corpus wants few parameters; Wu et al.'s dropout 0.3 is for training to
    # convergence, while in a 2-core CPU hour 0.2 led 0.3 on validation at equal time.
    "tiny": dict(num_encoder_layers=3, num_decoder_layers=3, d_model=256, ffn=1024, heads=4,
                 dropout=0.1, attention_dropout=0.1, relu_dropout=0.1),
    "small": dict(num_encoder_layers=4, num_decoder_layers=4, d_model=128, ffn=256, heads=4,
                  dropout=0.2, attention_dropout=0.1, relu_dropout=0.1),
    "base": dict(num_encoder_layers=6, num_decoder_layers=6, d_model=512, ffn=2048, heads=8,
                 dropout=0.1, attention_dropout=0.1, relu_dropout=0.1),
    "big": dict(num_encoder_layers=6, num_decoder_layers=6, d_model=1024, ffn=4096, heads=16,
                dropout=0.3, attention_dropout=0.1, relu_dropout=0.1),
}
# fmt: on


@dataclass(frozen=True)
class CpuRecipe:
    """A whole Multi30k run on a CPU: the BPE vocabulary, the training settings (a run trains for
    a fixed time), the checkpoints averaged."""

    vocab_size: int
    train: dict  # TrainConfig's fields
    average: int


# `nmt quickstart`'s recipe, measured in docs/benchmarks.md (Multi30k quality). Small batches:
# on Multi30k in a fixed CPU time, more updates beat bigger ones.
MULTI30K_CPU = CpuRecipe(
    vocab_size=8000,
    train=dict(
        size="small",
        max_tokens=1024,
        warmup=1000,
        eval_bleu=True,
        eval_every=500,
        save_every=250,
        keep_last=10,
    ),
    average=5,
)


@dataclass(frozen=True)
class TrainConfig:
    size: str = knob("base", f"Model preset: {', '.join(PRESETS)} (config/training.py's PRESETS).")
    # None: the preset's value
    num_encoder_layers: int | None = knob(None, "Override the preset.")
    num_decoder_layers: int | None = knob(None, "Override the preset.")
    d_model: int | None = knob(None, "Override the preset.")
    ffn: int | None = knob(None, "Override the preset.")
    heads: int | None = knob(None, "Override the preset.")
    dropout: float | None = knob(None, "Residual/embedding dropout.")
    attention_dropout: float | None = knob(None, "On attention weights.")
    relu_dropout: float | None = knob(None, "After the FFN ReLU.")
    post_norm: bool = knob(False, "The paper's post-norm sub-layers.")
    share_embeddings: bool | None = knob(
        None,
        "Embed the source with the target's embedding (default: with a joint vocabulary; "
        "separate vocabularies have their own).",
    )
    max_tokens: int = knob(4096, "Tokens per batch (either side, per rank).")
    update_freq: int = knob(1, "Batches accumulated into one update.")
    lr_scale: float = knob(1.0, "Multiplies the paper's schedule.")
    lr: float = knob(
        0.0, "The peak learning rate, absolute (0: the paper's d^-0.5 x warmup^-0.5, x --lr-scale)."
    )
    schedule: str = knob(
        "inverse-sqrt",
        "After the warm-up: inverse-sqrt (the paper's), linear or cosine (decay to --min-lr at "
        "--max-steps), constant.",
    )
    min_lr: float = knob(0.0, "A floor under the learning rate after the warm-up.")
    warmup: int = knob(4000, "Warm-up steps of the schedule.")
    optimizer: str = knob("adam", "adam (the paper's), or adamw (decoupled --weight-decay).")
    weight_decay: float = knob(
        0.0, "With --optimizer adamw: decay of the weight matrices and embeddings (not biases, norms)."
    )
    beta1: float = 0.9  # the paper's, not an option
    beta2: float = knob(0.98, "Adam beta2 (t2t later used 0.997).")
    adam_eps: float = 1e-9  # the paper's, not an option
    label_smoothing: float = knob(0.1, "Label smoothing.")
    ema: float = knob(
        0.0,
        "Keep a moving average of the weights with this decay (e.g. 0.9999), validated, kept as "
        "the best and translated with instead of them (0: off).",
    )
    # Provilkov et al. 2020; 0: the fixed encoding of `nmt bpe`
    bpe_dropout: float = knob(
        0.0, "BPE-dropout: re-encode the training side every epoch, each merge dropped with P."
    )
    clip_norm: float = knob(0.0, "Gradient norm clipping (0: off).")
    max_steps: int = knob(100_000, "Stop after this many updates (0: no limit).")
    max_epochs: int = knob(0, "Stop after this many epochs (0: no limit).")
    max_time: float = knob(0.0, "Stop after this many minutes (0: no limit).")
    precision: str = knob(
        "auto",
        "auto (bf16 on a GPU and on a CPU with bf16 arithmetic, else fp32), fp32, tf32 (GPU: fp32 "
        "with TensorFloat-32 matrix products), bf16, fp16 (GPU).",
    )
    eval_every: int = knob(1000, "Validate every N updates.")
    eval_bleu: bool = knob(
        False, "Also log greedy BLEU on the validation set (a run of several directions: each's too)."
    )
    pair_temperature: float = knob(
        1.0,
        "Sample the training corpora (a many-to-many run's directions) with this temperature: 1 "
        "as their sizes say, higher evens them out (5: a corpus 100x larger is taken 2.5x as often).",
    )
    patience: int = knob(0, "Stop after N validations without improvement (0: off).")
    save_every: int = knob(1000, "Checkpoint every N updates.")
    keep_last: int = knob(20, "Checkpoints kept.")  # enough to average the last 20 (big)
    init_from: str | None = knob(
        None,
        "Start from this model's weights (a run directory, a checkpoint, or a package from `nmt "
        "export` or `nmt import`) with a fresh optimizer; its BPE must be this run's (`nmt bpe "
        "--from`), and its shape is kept (no --size needed). Without schedule options: --schedule "
        "linear --lr 1e-4 --warmup 500 (a tenth of --max-steps at most).",
    )
    init_optimizer: bool = knob(False, "With --init-from: keep its Adam moments (a training checkpoint's).")
    init_schedule: bool = knob(
        False,
        "With --init-from: go on from its step, and so its learning-rate schedule (--max-steps "
        "counts its steps too).",
    )
    freeze: str = knob(
        "",
        "Parts of the model left as they are, comma-separated: embeddings (the tied output "
        "projection too), encoder, decoder, or one layer as encoder.N / decoder.N (from 0).",
    )
    adapters: int = knob(
        0,
        "Low-rank adapters (LoRA) of this rank on every attention and FFN projection of the "
        "--init-from model, whose own weights stay as they are; checkpoints hold the adapters "
        "only, merged into the weights by `nmt average`, `translate` and `export` (0: off).",
    )
    keep_best: int = knob(0, "Also keep the N best models by --best-metric, in checkpoints/best (0: none).")
    best_metric: str = knob(
        "nll", "nll, bleu (with --eval-bleu) or comet (with --comet): what --keep-best and --patience watch."
    )
    comet: str | None = knob(
        None,
        "A COMET model folder (e.g. wmt22-comet-da, its encoder inside): also log the validation "
        "COMET of greedy translations, on rank 0 ('.[comet]').",
    )
    comet_lines: int = knob(500, "Validation COMET scores the first N lines of the validation set.")
    comet_precision: str = knob("fp32", COMET_PRECISION_HELP)
    seed: int = knob(1, "Seed of initialisation, dropout and batch order.")
    tensorboard: bool = knob(
        False, "Also write the figures as TensorBoard events in RUN/tensorboard ('.[tensorboard]')."
    )
    device: str = knob("auto", "auto, cpu, cuda or cuda:N.")
    compile: bool = knob(False, "torch.compile the model.")
    # The speed levers below are off until a GPU has measured them (docs/benchmarks.md).
    fixed_shapes: bool = knob(
        False,
        "Batches of one shape per length (both sides padded to the longer, on multiples of 8; "
        "--max-tokens // length rows; the loss over every position, PAD weighted 0): --compile "
        "compiles the update once per length, without dynamic shapes.",
    )
    fold_scaling: bool = knob(
        False,
        "Divide the gradient by its token count and clipping factor inside the fused Adam step "
        "instead of in passes of their own (the same update).",
    )
    fused_qkv: bool = knob(
        False, "Self-attention's query, key and value projections in one matrix product (the same model)."
    )
    narrow_residual: bool = knob(
        False,
        "Under bf16/fp16 the residual stream between sub-layers in that dtype, not float32: half "
        "its memory traffic, each sum rounded.",
    )
    batched_grad_copy: bool = knob(
        False,
        "Across ranks, DDP copies a bucket's gradients into it in one operation, not one per "
        "weight (torch 2.13; the same update).",
    )
    threads: int = knob(0, "CPU threads (0: torch's default).")
    dist_timeout: float = knob(
        300.0,
        "Seconds a rank waits for the others in a collective before the run stops with an error "
        "(a rank that died or hangs; rank 0's checkpoint writes have a wait of their own).",
    )
    max_bad_steps: int = knob(20, "Stop after this many non-finite updates in a row.")

    def __post_init__(self) -> None:
        if self.size not in PRESETS:
            raise NmtError(f"unknown --size {self.size!r}: choose one of {', '.join(PRESETS)}")
        if self.precision not in PRECISIONS:
            raise NmtError(f"unknown --precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        for name in (
            "max_tokens",
            "update_freq",
            "warmup",
            "eval_every",
            "save_every",
            "keep_last",
            "max_bad_steps",
        ):
            if getattr(self, name) < 1:
                raise NmtError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("max_steps", "max_epochs", "max_time", "patience", "clip_norm", "threads"):
            if getattr(self, name) < 0:
                raise NmtError(f"--{name.replace('_', '-')} must not be negative")
        for name in ("dropout", "attention_dropout", "relu_dropout", "label_smoothing", "bpe_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise NmtError(f"--{name.replace('_', '-')} must be in [0, 1)")
        if not self.lr_scale > 0 or not 0 <= self.lr < 1 or not 0 <= self.min_lr < 1:
            raise NmtError("--lr-scale must be positive, --lr and --min-lr in [0, 1)")
        if not self.dist_timeout > 0:
            raise NmtError("--dist-timeout must be positive (seconds)")
        if self.schedule not in SCHEDULES:
            raise NmtError(f"unknown --schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.schedule in ("linear", "cosine") and not self.max_steps > self.warmup:
            raise NmtError(f"--schedule {self.schedule} decays until --max-steps: give one above --warmup")
        if self.optimizer not in ("adam", "adamw"):
            raise NmtError(f"unknown --optimizer {self.optimizer!r}: choose adam or adamw")
        if not 0 <= self.ema < 1:
            raise NmtError("--ema must be in [0, 1) (0: off; e.g. 0.9999)")
        if not 0 <= self.weight_decay < 1:
            raise NmtError("--weight-decay must be in [0, 1)")
        if self.weight_decay and self.optimizer != "adamw":
            raise NmtError("--weight-decay is decoupled weight decay: add --optimizer adamw")
        if self.keep_best < 0:
            raise NmtError("--keep-best must not be negative")
        if (self.init_optimizer or self.init_schedule) and not self.init_from:
            raise NmtError(
                "--init-optimizer and --init-schedule keep what --init-from's checkpoint had: "
                "give --init-from"
            )
        for part in filter(None, self.freeze.split(",")):
            if not re.fullmatch(r"embeddings|encoder|decoder|(encoder|decoder)\.\d+", part.strip()):
                raise NmtError(
                    f"--freeze {part!r:.40} names no part: give embeddings, encoder, decoder, "
                    "encoder.N or decoder.N, comma-separated"
                )
        if self.adapters < 0:
            raise NmtError("--adapters is a rank: 0 (off) or more")
        if self.adapters and not self.init_from:
            raise NmtError("--adapters adapt a trained model: give it with --init-from")
        for name in ("ema", "fused_qkv", "init_optimizer"):
            if self.adapters and getattr(self, name):
                raise NmtError(f"--adapters cannot be combined with --{name.replace('_', '-')}")
        if not 0 < self.pair_temperature <= 100:
            raise NmtError("--pair-temperature must be above 0 (1: as the corpora's sizes say), at most 100")
        if self.best_metric not in ("nll", "bleu", "comet"):
            raise NmtError(f"unknown --best-metric {self.best_metric!r}: choose nll, bleu or comet")
        if self.best_metric == "bleu" and not self.eval_bleu:
            raise NmtError("--best-metric bleu needs --eval-bleu (validation BLEU)")
        if self.best_metric == "comet" and not self.comet:
            raise NmtError("--best-metric comet needs --comet DIR (a COMET model folder)")
        if self.comet_precision not in COMET_PRECISIONS:
            raise NmtError(f"unknown --comet-precision {self.comet_precision!r}: choose fp32 or bf16")
        if self.comet_lines < 1:
            raise NmtError("--comet-lines must be at least 1")
        if not self.device == "auto" and not self.device.startswith(("cpu", "cuda")):
            raise NmtError(f"unknown --device {self.device!r}: use auto, cpu, cuda or cuda:N")
        self.model_config(vocab_size=1)  # the shape, checked before any work starts

    def model_config(
        self,
        vocab_size: int,
        src_vocab_size: int | None = None,
        max_positions: int = 1024,
        like: ModelConfig | None = None,
    ):
        """The model's shape for the target's `vocab_size` and the source's (None: one joint
        vocabulary). `like`: the model --init-from starts from, whose shape and settings are
        kept but for the options given (a model that `nmt import` made has settings no option
        sets: its activation, positions, ...)."""
        if src_vocab_size is not None and self.share_embeddings:
            raise NmtError(
                "--share-embeddings needs one joint vocabulary, and this run's are separate "
                "(`nmt bpe --separate`): drop it, or run `nmt bpe` without --separate"
            )
        if src_vocab_size is None:
            src_vocab_size = 0 if self.share_embeddings in (None, True) else vocab_size
        if like is not None:
            given = {k: getattr(self, k) for k in PRESETS["base"] if getattr(self, k, None) is not None}
            return dataclasses.replace(like, vocab_size=vocab_size, src_vocab_size=src_vocab_size, **given)
        shape = dict(PRESETS[self.size])
        for name in shape:
            if getattr(self, name, None) is not None:
                shape[name] = getattr(self, name)
        try:
            return ModelConfig(
                vocab_size=vocab_size,
                src_vocab_size=src_vocab_size,
                post_norm=self.post_norm,
                max_positions=max_positions,
                **shape,
            )
        except ValueError as e:
            raise NmtError(f"bad model shape: {e}") from None


@dataclass(frozen=True)
class LaunchConfig:
    """How `nmt train` starts its workers (not saved: the run is the same however it is launched)."""

    gpus: int = knob(0, "GPUs on this node: one NCCL worker each, through torch's elastic launcher.")
    procs: int = knob(1, "CPU worker processes (gloo), e.g. --procs 2 --device cpu.")
    nnodes: int = knob(1, "Nodes taking part (run the same command on each).")
    node_rank: int = knob(0, "This node's rank among --nnodes.")
    rdzv_endpoint: str = knob("", "HOST:PORT of node 0, for --nnodes > 1.")
    max_restarts: int = knob(0, "Restart failed workers up to N times; they resume from the last checkpoint.")
    # A `big` checkpoint on a network file system, or a validation in progress, takes a while.
    stop_grace: int = knob(
        120,
        "Seconds the workers get to save a checkpoint and exit after the launcher is signalled "
        "(SIGTERM, Ctrl-C) before they are killed.",
    )

    def __post_init__(self) -> None:
        if self.gpus < 0 or self.procs < 1 or self.nnodes < 1 or self.max_restarts < 0 or self.stop_grace < 0:
            raise NmtError(
                "--gpus, --max-restarts, --stop-grace must not be negative; --procs and --nnodes "
                "must be at least 1"
            )
        if self.gpus and self.procs > 1:
            raise NmtError("give --gpus N (one worker per GPU) or --procs N (CPU workers), not both")

    @property
    def needed(self) -> bool:
        return bool(self.gpus) or self.procs > 1 or self.nnodes > 1
