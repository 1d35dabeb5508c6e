"""The configs of using a model: how a search decodes (`DecodeOptions`), `nmt translate`'s
settings and `nmt score`'s (`nmt serve`'s own are in serving.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nmt_cli.config.common import COMET_PRECISION_HELP, COMET_PRECISIONS, PRECISIONS, knob
from nmt_cli.errors import NmtError

ENGINES = ("auto", "nmt", "ctranslate2")

# Each numeric decoding option's range, checked here once for the command line, the server and
# the Python API alike (and shown in --help). The upper bounds keep a request's work and its
# arithmetic finite: an alpha past ~140 overflows the length penalty, a temperature below float32's
# reach divides by zero, CTranslate2 takes a seed of 32 bits. Written `lo <= x <= hi`, so that NaN
# is refused too.
RANGES: dict[str, tuple[float, float]] = {
    "beam": (1, 1000),
    "alpha": (0.0, 10.0),
    "max_len_a": (0.0, 100.0),
    "max_len_b": (0, 100_000),
    "max_len": (0, 100_000),
    "min_len": (0, 100_000),
    "no_repeat_ngram": (0, 100),
    "repetition_penalty": (0.01, 100.0),
    "coverage_penalty": (0.0, 10.0),
    "nbest": (1, 1000),
    "topk": (0, 100_000),
    "temperature": (1e-6, 100.0),
    "seed": (0, 2**32 - 1),
    "candidates": (0, 1000),
    "epsilon": (0.0, 0.5),
}

# What --mbr compares candidates with: sacreBLEU's sentence-level chrF or BLEU (mbr.py), or a
# COMET model (comet.py, TranslateConfig.comet).
MBR_METRICS = ("chrf", "bleu", "comet")
# What --rerank chooses among candidates by, with no reference: CometKiwi (TranslateConfig.kiwi).
RERANKERS = ("kiwi",)
# The COMET models' options, alike wherever they are taken (score, translate)
COMET_HELP = "A COMET model folder (e.g. wmt22-comet-da, its encoder inside; pip install 'nmt-cli[comet]')."
KIWI_HELP = (
    "A CometKiwi model folder (e.g. wmt22-cometkiwi-da, its encoder inside): scores without references."
)
# --mbr's candidates when --candidates is 0: chosen on Multi30k validation (docs/benchmarks.md).
MBR_CANDIDATES = 16


@dataclass(frozen=True)
class DecodeOptions:
    """How a search decodes: one object carried from the CLI, the server and the Python entry
    points through either backend to the search. A new decoding option is a field here (with its
    range in RANGES), its use (a rule on the next token in engine/rules.py, which every search
    applies; engine/decoding.py picks the search) and its mapping (or refusal) in
    backend_ct2.py."""

    beam: int = knob(4, "Beam size (1: greedy).")
    alpha: float = knob(0.6, "Length penalty ((5+|Y|)/6)^alpha (GNMT).")
    max_len_a: float = knob(1.0, "Output length <= a * source length + b: a.")
    max_len_b: int = knob(50, "Output length <= a * source length + b: b.")
    max_len: int = knob(
        0,
        "Output length at most this many tokens, counting the EOS, whatever a and b allow "
        "(0: the model's limit).",
    )
    min_len: int = knob(
        0, "At least this many tokens before the end of sentence (0: none); the length limit wins."
    )
    no_repeat_ngram: int = knob(
        0, "No N-gram of tokens twice in one translation, as fairseq's --no-repeat-ngram-size (0: off)."
    )
    repetition_penalty: float = knob(
        1.0,
        "Each token the translation already holds scores lower: its logit divided by P if positive, "
        "multiplied by P if negative (CTRL's, as CTranslate2's repetition_penalty; 1: off).",
    )
    coverage_penalty: float = knob(
        0.0,
        "GNMT's coverage penalty B: the beam's finished translations ranked with B x the sum over "
        "source tokens of log(min(attention each received, 1)) added to their scores (the last "
        "decoder layer's attention; as CTranslate2's coverage_penalty; 0: off).",
    )
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
    epsilon: float = knob(
        0.0,
        "With --sample: never draw a token whose probability is below E (epsilon sampling, "
        "Hewitt et al. 2022; the likeliest token stays; 0: off).",
    )
    seed: int = knob(
        1,
        "With --sample: the same seed and input draw the same translations (batched otherwise, "
        "a draw on a float's edge may differ).",
    )
    # Minimum-Bayes-risk decoding (Freitag et al. 2022): the candidate that agrees most with the
    # others, rather than the likeliest.
    mbr: str = knob(
        "",
        "Minimum-Bayes-risk decoding with this utility, chrf or bleu (sacreBLEU's sentence "
        "scores) or comet (the model of --comet DIR): of each line's candidates (--candidates: the "
        "beam's n-best, or --sample's draws), the one whose mean score against them all is "
        "highest; --scores gives that mean (off: the search's best).",
    )
    rerank: str = knob(
        "",
        "kiwi: of each line's candidates (as --mbr takes them), the one CometKiwi (--kiwi DIR) "
        "scores highest with its source; --scores gives that score (off: the search's best).",
    )
    candidates: int = knob(
        0,
        f"With --mbr: candidates per line, the n-best of a beam at least this wide or, with "
        f"--sample, this many draws; the same ones counted once (0: {MBR_CANDIDATES}).",
    )
    alignments: bool = knob(
        False,
        "Each translation's word alignment after it: Pharaoh 'i-j' pairs (source word i, target "
        "word j, from 0), from the last decoder layer's attention to the source.",
    )
    tag: str = knob(
        "", "Put this corpus tag before every source line, as training did (`nmt prep custom --tag`)."
    )
    src_lang: str = knob(
        "",
        "A multilingual model's source language, its code (M2M100: de; NLLB: deu_Latn; default: "
        "the one `nmt import` was given).",
    )
    tgt_lang: str = knob(
        "",
        "A multilingual model's target language: its token is forced first and left out of the "
        "translation (default: the one `nmt import` was given); a model of several directions "
        "(`nmt prep multi30k --pair ...`): its token <2xx> before the source.",
    )

    @property
    def chooses(self) -> bool:
        """Whether the translation is chosen among candidates (--mbr, --rerank)."""
        return bool(self.mbr or self.rerank)

    @property
    def rows(self) -> int:
        """Hypotheses a sentence keeps alive at once: the work it asks for."""
        if self.chooses:
            return self.for_candidates().rows
        return self.nbest if self.sample else self.beam

    @property
    def pool(self) -> int:
        """--mbr's candidates per line."""
        return self.candidates or MBR_CANDIDATES

    def for_candidates(self) -> DecodeOptions:
        """The search that gives --mbr its candidates: `pool` draws, or the `pool`-best of a
        beam at least that wide; their own scores, no alignments (the chosen one's come after)."""
        return dataclasses.replace(
            self,
            mbr="",
            rerank="",
            candidates=0,
            nbest=self.pool,
            beam=self.beam if self.sample else max(self.beam, self.pool),
            scores=False,
            alignments=False,
        )

    def shared(self) -> DecodeOptions:
        """What the sentences of one decoding batch must have alike: all but the seed and alpha,
        which each sentence keeps for itself (its random stream, its ranking)."""
        return dataclasses.replace(self, seed=0, alpha=0.0)

    def joint(self) -> DecodeOptions:
        """What the sentences of one running batch (`nmt serve`) must have alike: `shared`'s, but
        for the length limits too (max_len_a, max_len_b, max_len), which each sentence keeps."""
        return dataclasses.replace(self.shared(), max_len_a=0.0, max_len_b=0, max_len=0)

    def __post_init__(self) -> None:
        for name, (lo, hi) in RANGES.items():
            value = getattr(self, name)
            if not lo <= value <= hi:
                flag = name.replace("_", "-")
                raise NmtError(f"--{flag} must be from {shown(lo)} to {shown(hi)}, not {shown(value)}")
        if not 0 < self.topp <= 1:
            raise NmtError(f"--topp must be in (0, 1], not {self.topp!r}")
        if self.mbr not in ("", *MBR_METRICS):
            raise NmtError(f"unknown --mbr {self.mbr!r}: choose one of {', '.join(MBR_METRICS)}")
        if self.rerank not in ("", *RERANKERS):
            raise NmtError(f"unknown --rerank {self.rerank!r}: choose one of {', '.join(RERANKERS)}")
        if self.mbr and self.rerank:
            raise NmtError("--mbr and --rerank each choose among the candidates: give one")
        if self.candidates and not self.chooses:
            raise NmtError("--candidates are --mbr's and --rerank's: add --mbr chrf (or bleu, comet)")
        if self.chooses and self.nbest > self.pool:
            raise NmtError(f"--nbest {self.nbest} exceeds --candidates {self.pool}: raise --candidates")
        if self.nbest > self.beam and not self.sample and not self.chooses:
            raise NmtError(f"--nbest {self.nbest} exceeds --beam {self.beam}: raise --beam")
        if self.sample and self.coverage_penalty:
            raise NmtError("--coverage-penalty ranks a search's translations: drop it with --sample")
        if not self.sample and (self.topk, self.topp, self.temperature, self.epsilon) != (0, 1.0, 1.0, 0.0):
            raise NmtError("--topk, --topp, --temperature and --epsilon shape --sample's draws: add --sample")
        if self.tag and self.tag.split() != [self.tag]:
            raise NmtError(
                f"--tag {self.tag!r} must be one token without spaces, as `nmt prep --tag` took it"
            )


def shown(x: float) -> str:
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x) if abs(x) < 10**12 else f"a number of {len(str(abs(x)))} digits"
    return f"{x:g}"


def help_of(config: type, field: dataclasses.Field) -> str:
    """A config field's --help text: its knob's, and a decoding option's range."""
    text = field.metadata["help"]
    if config is DecodeOptions and field.name in RANGES:
        text += " [{} to {}]".format(*map(shown, RANGES[field.name]))
    return text


@dataclass(frozen=True)
class TranslateConfig:
    checkpoint: str | None = knob(
        None, "Model file (default: the averaged model, else the latest checkpoint)."
    )
    decode: DecodeOptions = DecodeOptions()
    max_tokens: int = knob(4096, "Padded source tokens per batch.")
    batch_size: int = knob(
        0,
        "Sentences per batch (0: 32; nmt's engine on a CPU with a model of d_model 256 or less: 64, "
        "or as many as give each thread a batch, 32 at least).",
    )
    chunk: int = 10_000  # lines read (and held) at a time
    device: str = knob("auto", "auto, cpu, cuda or cuda:N.")
    precision: str = knob(
        "auto", "auto (fp32), fp32, tf32 (GPU: fp32 with TensorFloat-32 matrix products), bf16, fp16 (GPU)."
    )
    int8: bool = knob(False, "int8 weights, decoded by CTranslate2 (pip install 'nmt-cli[ct2]').")
    comet: str | None = knob(None, COMET_HELP)  # --mbr comet's
    kiwi: str | None = knob(None, KIWI_HELP)  # --rerank kiwi's
    comet_precision: str = knob("fp32", COMET_PRECISION_HELP)  # the COMET models' above
    engine: str = knob(
        "auto",
        "auto (CTranslate2 where it does all that is asked, on a CPU; nmt's engine otherwise; "
        "--verbose says which and why), nmt or ctranslate2.",
    )
    threads: int = knob(0, "CPU threads (0: torch's default; CTranslate2: one per CPU this process may use).")
    shortlist: bool = knob(
        False,
        "Score each step over the model's lexical shortlist only: its batch's source pieces' "
        "likely target pieces and the most frequent ones, not the whole vocabulary (faster; "
        "`nmt bpe` builds it, the package and CTranslate2 export carry it).",
    )
    cuda_graphs: bool = knob(
        True,
        "nmt's engine on a GPU: each decoding step replayed as a CUDA graph, one launch a step "
        "(--no-cuda-graphs: its kernels launched one by one).",
    )

    def __post_init__(self) -> None:
        for name in ("max_tokens", "chunk"):
            if getattr(self, name) < 1:
                raise NmtError(f"--{name.replace('_', '-')} must be at least 1")
        if self.batch_size < 0:
            raise NmtError("--batch-size must not be negative (0: the engine's own)")
        if self.precision not in PRECISIONS:
            raise NmtError(f"unknown --precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.comet_precision not in COMET_PRECISIONS:
            raise NmtError(f"unknown --comet-precision {self.comet_precision!r}: choose fp32 or bf16")
        if self.int8 and self.precision not in ("auto", "fp32"):
            raise NmtError("--int8 quantises an fp32 model: drop --precision or use fp32")
        if self.engine not in ENGINES:
            raise NmtError(f"unknown --engine {self.engine!r}: choose one of {', '.join(ENGINES)}")
        if self.int8 and self.engine == "nmt":
            raise NmtError("--int8 runs on CTranslate2: drop --engine nmt")


@dataclass(frozen=True)
class ScoreConfig:
    """What `nmt score` measures and how: the translations (given, or the model's of a file or of
    the run's split) against their references. A model it translates with: a TranslateConfig."""

    hyp: str | None = knob(None, "Translations (default: stdin, or with no --ref, the run's test set).")
    ref: str | None = knob(None, "References, line-aligned with --hyp.")
    src: str | None = knob(None, "Translate this file (with --ref, instead of --hyp) with the model.")
    split: str = knob("test", "Without --ref: the run's split to translate and score.")
    metrics: tuple[str, ...] = knob(
        (), "bleu, chrf, ter: comma-separated, or the option given again (default: all three)."
    )
    tokenize: str = knob("13a", "sacreBLEU tokenizer for BLEU.")
    lowercase: bool = knob(False, "Case-insensitive scores.")
    moses_lc: bool = knob(
        False,
        "Lowercase + Moses normalise + Moses tokenise both sides, BLEU with --tokenize none (how "
        "Multi30k papers report).",
    )
    compound_split: bool = knob(
        False,
        "Cased Moses tokenisation of both sides, hyphenated compounds split as ##AT##-##AT##, BLEU "
        "with --tokenize none (how the Transformer paper scored WMT14 en-de).",
    )
    lang: str | None = knob(None, "Target language for --moses-lc or --compound-split (default: the run's).")
    compare: str | None = knob(None, "Another system's translations: paired bootstrap test against it.")
    comet: str | None = knob(None, COMET_HELP)
    kiwi: str | None = knob(None, KIWI_HELP)
    source: str | None = knob(None, "The source lines of --hyp, for --comet and --kiwi.")
    json: bool = knob(False, "Print JSON.")

    def __post_init__(self) -> None:
        if self.moses_lc and self.compound_split:
            raise NmtError("--moses-lc and --compound-split are two ways of scoring: give one")
