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


def knob(default: Any, help: str) -> Any:
    """A config field that is also a command-line option: `help` is its --help text, written
    only here (the CLI reads it: cli/options.about)."""
    return dataclasses.field(default=default, metadata={"help": help})


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
    src: str = knob("en", "Source language.")
    tgt: str = knob("de", "Target language.")
    mirror: str | None = knob(
        None,
        "Take the recipe's files from this local folder instead of the network (same names, same checksums).",
    )
    max_words: int = knob(250, "Drop training pairs with a side longer than this many words.")
    max_ratio: float | None = knob(
        None, "Drop training pairs whose word-count ratio exceeds this (default: the recipe's)."
    )
    # custom recipe: the user's files (plain or .gz); several training corpora, one pair each
    train_src: tuple[str, ...] = knob(
        (), "custom: training source (plain or .gz); again for each further corpus."
    )
    train_tgt: tuple[str, ...] = knob((), "custom: training target, one per --train-src.")
    tags: tuple[str, ...] = knob(
        (),
        "custom: per training corpus, a token put before its source lines, e.g. '<bt>' for "
        "back-translations ('' for none).",
    )
    weights: tuple[float, ...] = knob(
        (), "custom: per training corpus, times an epoch takes each pair on average (1)."
    )
    valid_src: str | None = knob(
        None, "custom: validation source (default: every 100th training pair, up to 2000)."
    )
    valid_tgt: str | None = knob(None, "custom: validation target.")
    test_src: str | None = knob(None, "custom: test source.")
    test_tgt: str | None = knob(None, "custom: test target.")

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
    vocab_size: int = knob(
        0, "Joint vocabulary size (0: 8000 under 100k training pairs, 16000 under 1M, else 32000)."
    )
    from_model: str | None = knob(
        None,
        "Encode with this model's sentencepiece model (a run directory, a package, or a .model "
        "file) instead of learning one.",
    )
    sample_lines: int = knob(500_000, "Sentences (both sides) sampled to learn BPE from.")
    seed: int = knob(1, "Seed of the sample.")
    # Casing is folded inside the sentencepiece model, so translation time folds it too.
    lowercase: bool = knob(
        False,
        "Lowercase everything the model encodes, so its translations are lowercase too (for "
        "setups scored lowercased, as Multi30k papers).",
    )
    threads: int = knob(max(1, os.cpu_count() or 1), "Threads for learning and encoding.")

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
    size: str = knob("base", "Model preset: tiny, small (CPU), base, big.")
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
    max_tokens: int = knob(4096, "Tokens per batch (either side, per rank).")
    update_freq: int = knob(1, "Batches accumulated into one update.")
    lr_scale: float = knob(1.0, "Multiplies the paper's schedule.")
    warmup: int = knob(4000, "Warm-up steps of the schedule.")
    beta1: float = 0.9  # the paper's, not an option
    beta2: float = knob(0.98, "Adam beta2 (t2t later used 0.997).")
    adam_eps: float = 1e-9  # the paper's, not an option
    label_smoothing: float = knob(0.1, "Label smoothing.")
    # Provilkov et al. 2020; 0: the fixed encoding of `nmt bpe`
    bpe_dropout: float = knob(
        0.0, "BPE-dropout: re-encode the training side every epoch, each merge dropped with P."
    )
    clip_norm: float = knob(0.0, "Gradient norm clipping (0: off).")
    max_steps: int = knob(100_000, "Stop after this many updates (0: no limit).")
    max_epochs: int = knob(0, "Stop after this many epochs (0: no limit).")
    max_time: float = knob(0.0, "Stop after this many minutes (0: no limit).")
    precision: str = knob(
        "auto", "auto (bf16 on a GPU and on a CPU with bf16 arithmetic, else fp32), fp32, bf16, fp16 (GPU)."
    )
    eval_every: int = knob(1000, "Validate every N updates.")
    eval_bleu: bool = knob(False, "Also log greedy BLEU on the validation set.")
    patience: int = knob(0, "Stop after N validations without improvement (0: off).")
    save_every: int = knob(1000, "Checkpoint every N updates.")
    keep_last: int = knob(20, "Checkpoints kept.")  # enough to average the last 20 (big)
    init_from: str | None = knob(
        None,
        "Start from this model's weights (a run directory, a checkpoint or a package from `nmt "
        "export`) with a fresh optimizer and schedule; its BPE must be this run's (`nmt bpe --from`).",
    )
    init_optimizer: bool = knob(False, "With --init-from: keep its Adam moments (a training checkpoint's).")
    init_schedule: bool = knob(
        False,
        "With --init-from: go on from its step, and so its learning-rate schedule (--max-steps "
        "counts its steps too).",
    )
    keep_best: int = knob(0, "Also keep the N best models by --best-metric, in checkpoints/best (0: none).")
    best_metric: str = knob("nll", "nll, or bleu (with --eval-bleu): what --keep-best and --patience watch.")
    seed: int = knob(1, "Seed of initialisation, dropout and batch order.")
    tensorboard: bool = knob(
        False, "Also write the figures as TensorBoard events in RUN/tensorboard ('.[tensorboard]')."
    )
    device: str = knob("auto", "auto, cpu, cuda or cuda:N.")
    compile: bool = knob(False, "torch.compile the model.")
    threads: int = knob(0, "CPU threads (0: torch's default).")
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


ENGINES = ("auto", "nmt", "ctranslate2")


@dataclass(frozen=True)
class DecodeOptions:
    """How a search decodes: one object carried from the CLI, the server and the Python entry
    points through either backend to the search. A new decoding option is a field here, its use
    in engine/beam.py and its mapping (or refusal) in backend_ct2.py."""

    beam: int = knob(4, "Beam size (1: greedy).")
    alpha: float = knob(0.6, "Length penalty ((5+|Y|)/6)^alpha (GNMT).")
    max_len_a: float = knob(1.0, "Output length <= a * source length + b: a.")
    max_len_b: int = knob(50, "Output length <= a * source length + b: b.")
    nbest: int = knob(1, "Hypotheses per sentence, best first, each with its score.")
    scores: bool = knob(False, "Each translation with its score, also the 1-best (see --nbest).")
    # Sampling (Edunov et al. 2018's back-translation, diverse outputs): nbest draws per sentence.
    sample: bool = knob(
        False,
        "Draw each next token at random instead of searching (back-translation, diverse outputs); "
        "--nbest draws per line, --beam does not apply.",
    )
    topk: int = knob(0, "With --sample: draw among the K most likely tokens (0: all of them).")
    topp: float = knob(
        1.0, "With --sample: draw among the fewest most likely tokens whose probabilities reach P (nucleus)."
    )
    temperature: float = knob(
        1.0, "With --sample: divide the log-probabilities by T (below 1: nearer greedy)."
    )
    seed: int = knob(
        1, "With --sample: the same seed draws the same translations, however lines are batched."
    )
    alignments: bool = knob(
        False,
        "Each translation's word alignment after it: Pharaoh 'i-j' pairs (source word i, target "
        "word j, from 0), from the last decoder layer's attention to the source.",
    )
    tag: str = knob(
        "", "Put this corpus tag before every source line, as training did (`nmt prep custom --tag`)."
    )

    @property
    def rows(self) -> int:
        """Hypotheses a sentence keeps alive at once: the work it asks for."""
        return self.nbest if self.sample else self.beam

    def __post_init__(self) -> None:
        for name in ("beam", "nbest"):
            if getattr(self, name) < 1:
                raise NmtError(f"--{name} must be at least 1")
        if self.nbest > self.beam and not self.sample:
            raise NmtError(f"--nbest {self.nbest} exceeds --beam {self.beam}: raise --beam")
        if not self.sample and (self.topk, self.topp, self.temperature) != (0, 1.0, 1.0):
            raise NmtError("--topk, --topp and --temperature shape --sample's draws: add --sample")
        if self.topk < 0 or not 0 < self.topp <= 1 or not self.temperature > 0:
            raise NmtError("--topk must not be negative, --topp must be in (0, 1], --temperature above 0")
        for name in ("alpha", "max_len_a", "max_len_b"):
            if getattr(self, name) < 0:
                raise NmtError(f"--{name.replace('_', '-')} must not be negative")
        if self.tag and self.tag.split() != [self.tag]:
            raise NmtError(
                f"--tag {self.tag!r} must be one token without spaces, as `nmt prep --tag` took it"
            )


@dataclass(frozen=True)
class TranslateConfig:
    checkpoint: str | None = knob(
        None, "Model file (default: the averaged model, else the latest checkpoint)."
    )
    decode: DecodeOptions = DecodeOptions()
    max_tokens: int = knob(4096, "Padded source tokens per batch.")
    batch_size: int = knob(32, "Sentences per batch.")
    chunk: int = 10_000  # lines read (and held) at a time
    device: str = knob("auto", "auto, cpu, cuda or cuda:N.")
    precision: str = knob("auto", "auto (fp32), fp32, bf16, fp16 (GPU).")
    int8: bool = knob(False, "int8 weights, decoded by CTranslate2 (pip install 'nmt-cli[ct2]').")
    engine: str = knob(
        "auto", "nmt or ctranslate2 (auto: nmt; ctranslate2 for a CTranslate2 export or --int8)."
    )
    threads: int = knob(0, "CPU threads (0: torch's default; CTranslate2: one per CPU this process may use).")

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
    host: str = knob("127.0.0.1", "Address to listen on.")
    port: int = knob(8080, "TCP port (0: any free one, printed).")
    max_wait_ms: float = knob(5.0, "How long a request may wait for others to share its batch.")
    max_batch: int = knob(64, "Sentences decoded together at most.")
    batching: bool = knob(True, "Decode concurrent requests together.")
    max_queue: int = knob(1024, "Sentences waiting at most; beyond, 503.")
    max_sentences: int = knob(256, "Sentences per request; beyond, 413.")
    max_hypotheses: int = knob(2048, "Sentences x beam per request (the work it asks for); beyond, 413.")
    max_chars: int = 2000  # per sentence; beyond, 400
    max_body: int = 1 << 20  # bytes per request; beyond, 413
    shutdown_timeout: float = 60.0  # seconds SIGTERM waits for requests in flight
    request_timeout: float = knob(
        60.0, "Seconds a request may wait and decode; beyond, 504 and it leaves the queue."
    )
    read_timeout: float = knob(
        30.0, "Seconds to receive a request's body; beyond, 408 (a client that stalls)."
    )
    header_timeout: float = knob(
        10.0,
        "Seconds a connection may stay without a request (its head must arrive whole within "
        "them); beyond, it is closed.",
    )
    max_connections: int = knob(1000, "Connections open at once; beyond, a new one gets 503 and is closed.")

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
