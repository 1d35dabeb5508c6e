"""One frozen dataclass per command, built once at the CLI boundary and saved in the run directory.

`to_json`/`from_json` round-trip a config; unknown keys are rejected so a typo in a saved or
hand-edited config is an error, not a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, TypeVar

from nmt_cli.errors import NmtError


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_model: int = 512
    ffn: int = 2048
    heads: int = 8
    dropout: float = 0.1  # on residual branches and embeddings
    attention_dropout: float = 0.1  # on attention probabilities
    relu_dropout: float = 0.1  # after the FFN ReLU
    post_norm: bool = False
    max_positions: int = 1024

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by heads {self.heads}")


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
class PrepConfig:
    recipe: str  # one of recipes.RECIPES, which checks the rest against it (recipes.resolved)
    src: str = "en"
    tgt: str = "de"
    mirror: str | None = None  # a local folder holding the recipe's files by name
    max_words: int = 250  # training pairs with a longer side are dropped
    # ... and pairs whose length ratio is larger; None: the recipe's
    max_ratio: float | None = None
    # custom recipe: the user's files (plain or .gz); several training corpora, one pair each
    train_src: tuple[str, ...] = ()
    train_tgt: tuple[str, ...] = ()
    # custom, per training corpus (none, or one each): a token put before each source line
    # ("" for none), and how many times an epoch takes each pair on average (1: once)
    tags: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    valid_src: str | None = None
    valid_tgt: str | None = None
    test_src: str | None = None
    test_tgt: str | None = None

    def __post_init__(self) -> None:
        for name in ("train_src", "train_tgt", "tags", "weights"):  # a list from JSON, one path before
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value or ()))
        if self.src == self.tgt:
            raise NmtError(f"--src and --tgt are both {self.src!r}: give two languages")
        if self.max_words < 1 or (self.max_ratio is not None and self.max_ratio < 1):
            raise NmtError("--max-words must be at least 1 and --max-ratio at least 1.0")
        if self.recipe == "custom" and not (self.train_src and self.train_tgt):
            raise NmtError("`nmt prep custom` needs --train-src and --train-tgt")
        if self.recipe != "custom" and (self.train_src or self.train_tgt or self.tags or self.weights):
            raise NmtError("--train-src, --train-tgt, --tag and --weight are for `nmt prep custom`")
        self._check_corpora()
        for side in ("valid", "test"):
            a, b = getattr(self, f"{side}_src"), getattr(self, f"{side}_tgt")
            if bool(a) != bool(b):
                raise NmtError(f"give both --{side}-src and --{side}-tgt, or neither")

    def _check_corpora(self) -> None:
        n = len(self.train_src)
        if len(self.train_tgt) != n:
            raise NmtError(
                f"{n} --train-src but {len(self.train_tgt)} --train-tgt: give one of each per corpus"
            )
        for name, values in (("--tag", self.tags), ("--weight", self.weights)):
            if values and len(values) != n:
                raise NmtError(f"{len(values)} {name} for {n} training corpora: give none, or one per corpus")
        for tag in self.tags:
            if tag and (len(tag.split()) != 1 or tag != tag.strip()):
                raise NmtError(
                    f"--tag {tag!r} must be one token without spaces (e.g. '<bt>'), or '' for none"
                )
        if any(not 0 < w < 1000 for w in self.weights):
            raise NmtError(
                "--weight must be above 0 (1: each pair once an epoch; 0.5: half of them; 2: twice)"
            )

    def corpus_tag(self, i: int) -> str:
        return self.tags[i] if self.tags else ""

    def corpus_weight(self, i: int) -> float:
        return float(self.weights[i]) if self.weights else 1.0


@dataclass(frozen=True)
class BpeConfig:
    vocab_size: int = 0  # 0: chosen from the training set's size (see bpe.py)
    # Encode with this model's sentencepiece model (a run, a package or an .model file)
    # instead of learning one.
    from_model: str | None = None
    sample_lines: int = 500_000  # sentences (of both sides) the BPE model is learned from
    seed: int = 1
    # Fold case inside the sentencepiece model: every side, at training and translation time, is
    # lowercased, and so are the translations (for setups scored lowercased, as Multi30k's).
    lowercase: bool = False
    threads: int = max(1, os.cpu_count() or 1)

    def __post_init__(self) -> None:
        if self.vocab_size < 0 or (0 < self.vocab_size < 300):
            raise NmtError(
                f"--vocab-size {self.vocab_size} is too small: the byte fallback "
                "alone takes 256 pieces; use at least 300 (8000-40000 is usual)"
            )
        if self.from_model and self.vocab_size:
            raise NmtError("--from takes the vocabulary of that model: drop --vocab-size")
        if self.from_model and self.lowercase:
            raise NmtError("--from takes that model's normalisation, its casing included: drop --lowercase")
        if self.sample_lines < 1000:
            raise NmtError("--sample-lines must be at least 1000")
        if self.threads < 1:
            raise NmtError("--threads must be at least 1")


PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def resolve_device_name(name: str, gpu: bool) -> str:
    """--device where `gpu` says whether a CUDA GPU is visible: auto is the GPU if there is one.
    Torch-free, so that CTranslate2 (which counts GPUs itself) shares it with nmt's engine."""
    if name == "auto":
        return "cuda" if gpu else "cpu"
    if name.startswith("cuda") and not gpu:
        raise NmtError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
    return name


def resolve_precision(
    precision: str, device_type: str, cpu_bf16: bool = False, decoding: bool = False
) -> str:
    """--precision on a device of `device_type` ("cpu", "cuda"). auto: on a GPU bf16 for training
    and fp32 for decoding, where bf16 scored level with fp32 on the validation set but decoded
    several times slower (benchmarks/decode_precision.py); on a CPU bf16 when `cpu_bf16` (it
    has bf16 arithmetic and the caller gains from it), else fp32."""
    if precision == "auto":
        if device_type == "cuda":
            return "fp32" if decoding else "bf16"
        return "bf16" if cpu_bf16 else "fp32"
    if precision == "fp16" and device_type != "cuda":
        raise NmtError("--precision fp16 needs a GPU; on the CPU use bf16 or fp32")
    return precision


@dataclass(frozen=True)
class TrainConfig:
    size: str = "base"  # one of PRESETS
    num_encoder_layers: int | None = None  # None: the preset's value
    num_decoder_layers: int | None = None
    d_model: int | None = None
    ffn: int | None = None
    heads: int | None = None
    dropout: float | None = None
    attention_dropout: float | None = None
    relu_dropout: float | None = None
    post_norm: bool = False
    max_tokens: int = 4096  # per batch (and per rank), source or target side
    update_freq: int = 1  # batches whose gradients make one update
    lr_scale: float = 1.0
    warmup: int = 4000
    beta1: float = 0.9
    beta2: float = 0.98
    adam_eps: float = 1e-9
    label_smoothing: float = 0.1
    # BPE-dropout (Provilkov et al. 2020): each epoch the training side is encoded anew with
    # each merge dropped with this probability; 0: the fixed encoding of `nmt bpe`.
    bpe_dropout: float = 0.0
    clip_norm: float = 0.0  # 0: no clipping
    max_steps: int = 100_000  # 0: no limit
    max_epochs: int = 0  # 0: no limit
    max_time: float = 0.0  # minutes; 0: no limit
    precision: str = "auto"  # auto: resolve_precision
    eval_every: int = 1000
    eval_bleu: bool = False  # also log greedy BLEU of the validation set
    patience: int = 0  # evaluations without improvement; 0: off
    save_every: int = 1000
    keep_last: int = 20  # enough to average the last 20 (big)
    # Start from this model's weights (a run, a checkpoint or a package); fresh optimizer.
    init_from: str | None = None
    # ... keeping, from its training checkpoint, the Adam moments and / or the step (and so the
    # point of the learning-rate schedule)
    init_optimizer: bool = False
    init_schedule: bool = False
    keep_best: int = 0  # also keep the N best models by best_metric
    best_metric: str = "nll"  # nll, or bleu (with eval_bleu); for patience too
    seed: int = 1
    tensorboard: bool = False  # also write metrics.jsonl's figures as TensorBoard events
    device: str = "auto"
    compile: bool = False
    threads: int = 0  # 0: torch's default
    max_bad_steps: int = 20  # non-finite steps in a row before stopping

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
        if self.lr_scale <= 0:
            raise NmtError("--lr-scale must be positive")
        if self.keep_best < 0:
            raise NmtError("--keep-best must not be negative")
        if (self.init_optimizer or self.init_schedule) and not self.init_from:
            raise NmtError(
                "--init-optimizer and --init-schedule keep what --init-from's checkpoint had: "
                "give --init-from"
            )
        if self.best_metric not in ("nll", "bleu"):
            raise NmtError(f"unknown --best-metric {self.best_metric!r}: choose nll or bleu")
        if self.best_metric == "bleu" and not self.eval_bleu:
            raise NmtError("--best-metric bleu needs --eval-bleu (validation BLEU)")
        if not self.device == "auto" and not self.device.startswith(("cpu", "cuda")):
            raise NmtError(f"unknown --device {self.device!r}: use auto, cpu, cuda or cuda:N")
        self.model_config(vocab_size=1)  # the shape, checked before any work starts

    def model_config(self, vocab_size: int, max_positions: int = 1024):
        shape = dict(PRESETS[self.size])
        for name in shape:
            if getattr(self, name, None) is not None:
                shape[name] = getattr(self, name)
        try:
            return ModelConfig(
                vocab_size=vocab_size, post_norm=self.post_norm, max_positions=max_positions, **shape
            )
        except ValueError as e:
            raise NmtError(f"bad model shape: {e}") from None


ENGINES = ("auto", "nmt", "ctranslate2")


@dataclass(frozen=True)
class DecodeOptions:
    """How a search decodes: one object carried from the CLI, the server and the Python entry
    points through either backend to the search. A new decoding option is a field here, its use
    in engine/beam.py and its mapping (or refusal) in ct2.py."""

    beam: int = 4
    alpha: float = 0.6  # length penalty ((5 + |Y|) / 6) ** alpha (GNMT)
    max_len_a: float = 1.0  # output length <= a * source length + b
    max_len_b: int = 50
    nbest: int = 1

    def __post_init__(self) -> None:
        for name in ("beam", "nbest"):
            if getattr(self, name) < 1:
                raise NmtError(f"--{name} must be at least 1")
        if self.nbest > self.beam:
            raise NmtError(f"--nbest {self.nbest} exceeds --beam {self.beam}: raise --beam")
        if self.alpha < 0 or self.max_len_a < 0 or self.max_len_b < 0:
            raise NmtError("--alpha, --max-len-a and --max-len-b must not be negative")


@dataclass(frozen=True)
class TranslateConfig:
    checkpoint: str | None = None  # default: the averaged model, else the latest checkpoint
    decode: DecodeOptions = DecodeOptions()
    max_tokens: int = 4096  # padded source tokens per batch
    batch_size: int = 32  # sentences per batch
    chunk: int = 10_000  # lines read (and held) at a time
    device: str = "auto"
    precision: str = "auto"  # auto: fp32 (resolve_precision)
    int8: bool = False  # int8 weights, through CTranslate2
    engine: str = "auto"  # nmt or ctranslate2; auto: nmt, but ctranslate2 for an export or --int8
    threads: int = 0

    def __post_init__(self) -> None:
        for name in ("max_tokens", "batch_size", "chunk"):
            if getattr(self, name) < 1:
                raise NmtError(f"--{name.replace('_', '-')} must be at least 1")
        if self.precision not in PRECISIONS:
            raise NmtError(f"unknown --precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.int8 and self.precision not in ("auto", "fp32"):
            raise NmtError("--int8 quantises an fp32 model: drop --precision or use fp32")
        if self.engine not in ENGINES:
            raise NmtError(f"unknown --engine {self.engine!r}: choose one of {', '.join(ENGINES)}")
        if self.int8 and self.engine == "nmt":
            raise NmtError("--int8 runs on CTranslate2: drop --engine nmt")


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_wait_ms: float = 5.0  # a request waits this long for others to batch with
    max_batch: int = 64  # sentences decoded together at most
    batching: bool = True  # False: one request per decoding batch
    max_queue: int = 1024  # sentences waiting or in flight; beyond, 503
    max_sentences: int = 256  # per request; beyond, 413
    max_hypotheses: int = 2048  # sentences x beam per request; beyond, 413
    max_chars: int = 2000  # per sentence; beyond, 400
    max_body: int = 1 << 20  # bytes per request; beyond, 413
    shutdown_timeout: float = 60.0  # seconds SIGTERM waits for requests in flight
    request_timeout: float = 60.0  # seconds a request may take; then 504 and it leaves the queue
    read_timeout: float = 30.0  # seconds to receive a request's body; then 408
    header_timeout: float = 10.0  # seconds a connection may be without a request; then closed
    max_connections: int = 1000  # open at once; beyond, a new one gets 503

    def __post_init__(self) -> None:
        for name in (
            "max_batch",
            "max_queue",
            "max_sentences",
            "max_hypotheses",
            "max_chars",
            "max_body",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise NmtError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_wait_ms < 0 or not 0 <= self.port < 65536:
            raise NmtError("--max-wait-ms must not be negative, and --port within 0-65535")
        if min(self.request_timeout, self.read_timeout, self.header_timeout) <= 0:
            raise NmtError("--request-timeout, --read-timeout and --header-timeout must be positive")


C = TypeVar("C")


def to_json(config: Any) -> str:
    return json.dumps(dataclasses.asdict(config), indent=2) + "\n"


def from_json(cls: type[C], text: str, source: str = "config") -> C:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise NmtError(f"{source} is not valid JSON: {e}") from None
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise NmtError(f"{source} has unknown keys {unknown} for {cls.__name__}")
    return cls(**data)
