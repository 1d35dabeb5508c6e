"""The configs of the data commands: `nmt prep` and `nmt bpe`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from nmt_cli.config.common import knob, language
from nmt_cli.errors import NmtError

# The sides of a run of several directions, named by role: text/train.src, text/train.tgt
MANY = ("src", "tgt")


def target_token(lang: str) -> str:
    """The token that asks a many-to-many model for `lang`: the first piece of each source line."""
    return f"<2{lang}>"


@dataclass(frozen=True)
class PrepConfig:
    recipe: str  # one of recipes.RECIPES, which checks the rest against it (recipes.resolved)
    # None: the recipe's own (the other one of its pair, if one side is given); custom: en, de
    src: str | None = knob(None, "Source language (default: the recipe's; custom: en).")
    tgt: str | None = knob(None, "Target language (default: the recipe's; custom: de).")
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
    # several directions in one run (many-to-many): multi30k's languages, each pair a corpus
    pairs: tuple[str, ...] = knob(
        (),
        "A direction of the run, e.g. en-de; again for each further one (multi30k's default: en-de, "
        "de-en, en-fr, fr-en, en-cs, cs-en; custom: one per training corpus). With several, each "
        "source line begins with its target language's token, <2de>, which `nmt translate --tag` "
        "gives.",
    )
    valid_src: str | None = knob(
        None, "custom: validation source (default: every 100th training pair, up to 2000)."
    )
    valid_tgt: str | None = knob(None, "custom: validation target.")
    test_src: str | None = knob(None, "custom: test source.")
    test_tgt: str | None = knob(None, "custom: test target.")

    def __post_init__(self) -> None:
        for name in ("train_src", "train_tgt", "tags", "weights", "pairs"):  # a list from JSON, one before
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value or ()))
        for side in ("src", "tgt"):
            if getattr(self, side) is not None:
                language(getattr(self, side), f"--{side}")
        if self.src == self.tgt and self.src is not None:
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
        self._check_pairs()

    def _check_pairs(self) -> None:
        if self.pairs and self.recipe not in ("multi30k", "custom"):
            raise NmtError("--pair is for `nmt prep multi30k` and `nmt prep custom`")
        if self.recipe == "custom" and len(self.pairs) > 1:
            if len(self.pairs) != len(self.train_src):
                n = len(self.train_src)
                raise NmtError(f"{len(self.pairs)} --pair for {n} training corpora: give one per corpus")
            if self.valid_src or self.test_src or self.tags:
                raise NmtError(
                    "a custom run of several directions holds out its validation pairs from each "
                    "corpus and tags each source with its target's token: drop --valid-src, "
                    "--test-src and --tag (translate a test set with `nmt translate --tag`)"
                )
        for pair in self.pairs:
            sides = pair.split("-")
            if len(sides) != 2 or sides[0] == sides[1]:
                raise NmtError(f"--pair {pair!r} is not two languages joined by '-', e.g. en-de")
            for side in sides:
                language(side, f"--pair {pair}")
        if len(set(self.pairs)) != len(self.pairs):
            raise NmtError("--pair names a direction twice")

    def directions(self) -> list[tuple[str, str]]:
        """The (source, target) languages of each pair the run holds, in order: `pairs`, or the
        one pair of --src and --tgt."""
        if self.pairs:
            return [(a, b) for a, b in (p.split("-") for p in self.pairs)]
        return [(self.src or "en", self.tgt or "de")]

    @property
    def many(self) -> bool:
        """Several directions in one run: its sides are named by role (MANY) and each source line
        begins with its target language's token."""
        return len(self.pairs) > 1

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
        0,
        "Vocabulary size, joint or of each side with --separate (0: 8000 under 100k training "
        "pairs, 16000 under 1M, else 32000).",
    )
    # Separate vocabularies untie the source embedding from the target's (config/training.py).
    separate: bool = knob(
        False, "A BPE model for each side, learned from that side alone, instead of one joint model."
    )
    src_vocab_size: int = knob(0, "With --separate: the source's vocabulary size (0: --vocab-size's).")
    tgt_vocab_size: int = knob(0, "With --separate: the target's vocabulary size (0: --vocab-size's).")
    from_model: str | None = knob(
        None,
        "Encode with this model's sentencepiece models (a run directory, a package, or a .model "
        "file) instead of learning one.",
    )
    src_lang: str = knob(
        "",
        "With --from a multilingual model (M2M100, NLLB): its code of the source's language, whose "
        "token begins every source line (default: prep's --src, where the model has it).",
    )
    tgt_lang: str = knob(
        "",
        "With --from a multilingual model: its code of the target's language, whose token begins "
        "every target line (default: prep's --tgt, where the model has it).",
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
        for name in ("vocab_size", "src_vocab_size", "tgt_vocab_size"):
            value = getattr(self, name)
            if value < 0 or (0 < value < 300):
                raise NmtError(
                    f"--{name.replace('_', '-')} {value} is too small: the byte fallback "
                    "alone takes 256 pieces; use at least 300 (8000-40000 is usual)"
                )
        if (self.src_vocab_size or self.tgt_vocab_size) and not self.separate:
            raise NmtError("--src-vocab-size and --tgt-vocab-size size separate vocabularies: add --separate")
        sized = self.vocab_size or self.src_vocab_size or self.tgt_vocab_size
        if self.from_model and (sized or self.separate):
            raise NmtError(
                "--from takes the vocabularies of that model (joint or separate): drop --vocab-size "
                "and --separate"
            )
        if self.from_model and self.lowercase:
            raise NmtError("--from takes that model's normalisation, its casing included: drop --lowercase")
        if self.sample_lines < 1000:
            raise NmtError("--sample-lines must be at least 1000")
        if self.threads < 1:
            raise NmtError("--threads must be at least 1")

    def side_sizes(self, auto: int) -> tuple[int, int]:
        """The source's and the target's vocabulary sizes with --separate (`auto`: the corpus's)."""
        each = self.vocab_size or auto
        return self.src_vocab_size or each, self.tgt_vocab_size or each
