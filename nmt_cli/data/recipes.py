"""What each `nmt prep` recipe is made of: per split, the corpora, and per language the file
(a download with its checksum and size, a member of a downloaded archive, or a local file)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nmt_cli.config import PrepConfig
from nmt_cli.config.corpus import MANY
from nmt_cli.data.fetch import Source
from nmt_cli.errors import NmtError

TRAIN = "train"


@dataclass(frozen=True)
class Part:
    """One language side of one corpus: a downloaded file, or a member of a downloaded archive."""

    source: Source | None  # None: a local file of the user's (`path`)
    member: str | None = None  # inside the archive; None: the file itself (plain or .gz)
    sgm: bool = False  # WMT's SGML test-set format
    path: str | None = None
    tmx: str | None = None  # a TMX file (plain or .gz) holding both sides: this side's language

    def describe(self) -> str:
        if self.source is None:
            return str(self.path)
        where = f"{self.source.name}:{self.member}" if self.member else self.source.name
        return f"{where} ({self.tmx})" if self.tmx else where


Corpus = dict[str, Part]  # lang -> part
Recipe = dict[str, list[Corpus]]  # split -> corpora, concatenated in order

# -- WMT14 English-German, the paper's data -----------------------------------------------------
# Checksums as recorded by Hugging Face `datasets` (dataset_infos.json of wmt14, revision
# 22d3b80586cab756b70d6c939ceace94bb356a8c); statmt.org publishes none (docs/data.md).
EUROPARL = Source(
    "http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
    "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7",
    657632379,
)
COMMONCRAWL = Source(
    "http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
    "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5",
    918311367,
)
NEWS_COMMENTARY = Source(
    "http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz",
    "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485",
    80418416,
)
# WMT19's dev archive holds newstest2013 as plain text and the full (3003-line) newstest2014.
WMT_DEV = Source(
    "http://data.statmt.org/wmt19/translation-task/dev.tgz",
    "7a7deccf82ebb05ba508dba5eb21356492224e8f630ec4f992132b029b4b25e7",
    38654961,
)


def _pair(source: Source, stem: str, langs: tuple[str, str], suffix: str = "") -> Corpus:
    """A corpus whose two members differ only in their language: STEM.LANG[SUFFIX] each."""
    return {lang: Part(source, f"{stem}.{lang}{suffix}") for lang in langs}


def _sgm(source: Source, **members: str) -> Corpus:
    """A WMT dev or test set in SGML: each language's member."""
    return {lang: Part(source, member, sgm=True) for lang, member in members.items()}


EN_DE = ("en", "de")
WMT14_EN_DE: Recipe = {
    TRAIN: [
        _pair(EUROPARL, "training/europarl-v7.de-en", EN_DE),
        _pair(COMMONCRAWL, "commoncrawl.de-en", EN_DE),
        _pair(NEWS_COMMENTARY, "training/news-commentary-v9.de-en", EN_DE),
    ],
    "valid": [_pair(WMT_DEV, "dev/newstest2013", EN_DE)],
    "test": [_sgm(WMT_DEV, en="dev/newstest2014-deen-src.en.sgm", de="dev/newstest2014-deen-ref.de.sgm")],
}


# -- WMT14 English-French, the paper's second result (36M pairs there) ------------------------------
# The archives as Hugging Face `datasets` reads WMT14 fr-en (datasets/wmt14: its zip copies of
# statmt.org's archives), with the checksums it records for them (dataset_infos.json, fr-en).
def _hf_zip(path: str, sha256: str, size: int) -> Source:
    return Source(f"https://huggingface.co/datasets/wmt/{path}", sha256, size)


EUROPARL_V7_ZIP = _hf_zip(
    "wmt13/resolve/main-zip/training-parallel-europarl-v7.zip",
    "5b2d8b32c2396da739b4e731871c597fcc6e75729becd74619d0712eecf7770e",
    658092427,
)
COMMONCRAWL_ZIP = _hf_zip(
    "wmt13/resolve/main-zip/training-parallel-commoncrawl.zip",
    "5ffe980072ea29adfd84568d099bea366d9f72772b988e670794ae851b4e5627",
    918734483,
)
UN_ZIP = _hf_zip(
    "wmt13/resolve/main-zip/training-parallel-un.zip",
    "74f07002e053c81bc7f73b4fdab58e7987e831338748f264cbda82a8b062d2e2",
    2366237633,
)
NEWS_COMMENTARY_V9_ZIP = _hf_zip(
    "wmt14/resolve/main-zip/training-parallel-nc-v9.zip",
    "ce199f93ec56ff480137ba29f0819f9a22e70d88be6d7458f112303d67d623d5",
    80462375,
)
GIGA_FREN_ZIP = _hf_zip(
    "wmt10/resolve/main-zip/training-giga-fren.zip",
    "9439f86523e5dff3f923526dbf6c6929da1786c18dbf64436d2b7564b83aaba3",
    2595877717,
)
WMT_DEV_ZIP = _hf_zip(
    "wmt19/resolve/main-zip/translation-task/dev.zip",
    "d796e363740fdc4261aa6f5a3d2f8223e3adaee7d737b7724863325b8956dfd1",
    38714274,
)


EN_FR = ("en", "fr")
WMT14_EN_FR: Recipe = {
    TRAIN: [
        _pair(EUROPARL_V7_ZIP, "training/europarl-v7.fr-en", EN_FR),
        _pair(COMMONCRAWL_ZIP, "commoncrawl.fr-en", EN_FR),
        _pair(UN_ZIP, "un/undoc.2000.fr-en", EN_FR),
        _pair(NEWS_COMMENTARY_V9_ZIP, "training/news-commentary-v9.fr-en", EN_FR),
        _pair(GIGA_FREN_ZIP, "giga-fren.release2.fixed", EN_FR, ".gz"),
    ],
    "valid": [_pair(WMT_DEV_ZIP, "dev/newstest2013", EN_FR)],
    # the full newstest2014 (3003 segments, both directions' halves), as its fr-en files hold it
    "test": [_sgm(WMT_DEV_ZIP, en="dev/newstest2014-fren-ref.en.sgm", fr="dev/newstest2014-fren-src.fr.sgm")],
}

# -- WMT16 English-Romanian (Europarl v8 + SETIMES2; newsdev2016, newstest2016) -----------------
# The archives as Hugging Face `datasets` reads them (datasets/wmt16/wmt_utils.py, config ro-en:
# its copies of statmt.org's archives, OPUS's SETIMES2 TMX), with the checksums it records for
# them (datasets/wmt16/dataset_infos.json); statmt.org publishes none (docs/data.md).
EUROPARL_V8 = _hf_zip(
    "wmt16/resolve/main-zip/translation-task/training-parallel-ep-v8.zip",
    "387e570a6812948e30c64885e64a1d3735a66b7c0bc424fcff1208ef11110149",
    225190342,
)
SETIMES2_EN_RO = Source(
    "https://opus.nlpl.eu/download.php?f=SETIMES/v2/tmx/en-ro.tmx.gz",
    "56bfaa2a8c8bdfccb7b50cc926067e2291347d807004e81faab8762ddbf26302",
    23458958,
)


def _ro_en_sgm(name: str) -> Corpus:
    """A WMT dev/test set of the ro-en direction: its Romanian source and English reference."""
    return _sgm(WMT_DEV_ZIP, en=f"dev/{name}-roen-ref.en.sgm", ro=f"dev/{name}-roen-src.ro.sgm")


WMT16_EN_RO: Recipe = {
    TRAIN: [
        _pair(EUROPARL_V8, "training-parallel-ep-v8/europarl-v8.ro-en", ("en", "ro")),
        {"en": Part(SETIMES2_EN_RO, tmx="en"), "ro": Part(SETIMES2_EN_RO, tmx="ro")},
    ],
    "valid": [_ro_en_sgm("newsdev2016")],
    "test": [_ro_en_sgm("newstest2016")],
}

# -- Multi30k task 1, raw files of the multi30k/dataset repository, pinned to one commit ----------
MULTI30K_BASE = (
    "https://raw.githubusercontent.com/multi30k/dataset/"
    "a3d2e0d26b56f3846f66a952536ffed4e401d05a/data/task1/raw/"
)
MULTI30K_FILES = {  # (split, name): (sha256, bytes)
    ("train", "train"): {
        "en": ("d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f", 568929),
        "de": ("726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6", 637044),
    },
    ("valid", "val"): {
        "en": ("14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28", 21650),
        "de": ("f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a", 24681),
    },
    ("test", "test_2016_flickr"): {
        "en": ("611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9", 21077),
        "de": ("9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8", 22890),
    },
    ("test2017", "test_2017_flickr"): {
        "en": ("76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074", 19138),
        "de": ("a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee", 21471),
    },
}
# The French and Czech sides, line-aligned with the English and German (test_2017_flickr has
# French only): for many-to-many work and multilingual models' tests
MULTI30K_MORE_FILES = {  # (split, name): {lang: (sha256, bytes)}
    ("train", "train"): {
        "fr": ("622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c", 604242),
        "cs": ("a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077", 593827),
    },
    ("valid", "val"): {
        "fr": ("ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9", 23001),
        "cs": ("b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc", 22096),
    },
    ("test", "test_2016_flickr"): {
        "fr": ("6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90", 22310),
        "cs": ("200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1", 22572),
    },
    ("test2017", "test_2017_flickr"): {
        "fr": ("3ba671ceb2299f3304ffafefea7a833d08632fbaf0ba18546f8a2ec2391af496", 20434),
    },
}
MULTI30K_EN_DE: Recipe = {
    split: [
        {
            lang: Part(Source(f"{MULTI30K_BASE}{name}.{lang}.gz", sha, size))
            for lang, (sha, size) in sides.items()
        }
    ]
    for (split, name), sides in MULTI30K_FILES.items()
}

# `nmt prep multi30k`: its directions among these four languages, English-centric by default
MULTI30K_LANGUAGES = ("en", "de", "fr", "cs")
MULTI30K_PAIRS = ("en-de", "de-en", "en-fr", "fr-en", "en-cs", "cs-en")


def multi30k_recipe(config: PrepConfig) -> Recipe:
    """One corpus per direction of `config` in each split, the four languages' files shared (the
    same captions: a direction and its reverse are one corpus read both ways); test2017 where
    every language of the run has it (Czech has none)."""
    files = {key: {**sides, **MULTI30K_MORE_FILES.get(key, {})} for key, sides in MULTI30K_FILES.items()}
    directions = config.directions()
    recipe: Recipe = {}
    for (split, name), sides in files.items():
        if all(lang in sides for pair in directions for lang in pair):
            recipe[split] = [
                {lang: Part(Source(f"{MULTI30K_BASE}{name}.{lang}.gz", *sides[lang])) for lang in pair}
                for pair in directions
            ]
    return recipe


def custom_recipe(config: PrepConfig) -> Recipe:
    if config.many:  # each corpus its direction
        return {
            TRAIN: [
                {a: Part(None, path=src), b: Part(None, path=tgt)}
                for src, tgt, (a, b) in zip(config.train_src, config.train_tgt, config.directions())
            ]
        }
    recipe: Recipe = {
        TRAIN: [
            {config.src: Part(None, path=src), config.tgt: Part(None, path=tgt)}
            for src, tgt in zip(config.train_src, config.train_tgt)
        ]
    }
    for split in ("valid", "test"):
        src, tgt = getattr(config, f"{split}_src"), getattr(config, f"{split}_tgt")
        if src:
            recipe[split] = [{config.src: Part(None, path=src), config.tgt: Part(None, path=tgt)}]
    return recipe


@dataclass(frozen=True)
class Known:
    """A recipe of `nmt prep`: the languages of its data (None: any), the word-count ratio above
    which its training pairs are dropped, and its corpora (None: the user's files)."""

    languages: tuple[str, str] | None
    max_ratio: float
    corpora: Recipe | None


# A new corpus recipe is one entry here (and its corpora above); the CLI's choice derives from it.
RECIPES: dict[str, Known] = {
    "wmt14-en-de": Known(("en", "de"), 1.5, WMT14_EN_DE),
    "wmt14-en-fr": Known(("en", "fr"), 1.5, WMT14_EN_FR),
    "wmt16-en-ro": Known(("en", "ro"), 1.5, WMT16_EN_RO),
    # Web-crawled corpora hold misaligned pairs that a 1.5 word-count ratio catches (fairseq's
    # WMT14 recipe); Multi30k is translated by people, and 1.5 would drop 888 of its 29,000
    # pairs, mostly short captions, so only Moses' own limit (9) applies there.
    "multi30k-en-de": Known(("en", "de"), 9.0, MULTI30K_EN_DE),
    # any directions among English, German, French and Czech, one run (--pair, MULTI30K_PAIRS)
    "multi30k": Known(None, 9.0, None),
    "custom": Known(None, 1.5, None),
}
LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "ro": "Romanian", "cs": "Czech"}


def resolved(config: PrepConfig) -> PrepConfig:
    """`config` checked against its recipe, with the recipe's defaults filled in."""
    known = RECIPES.get(config.recipe)
    if known is None:
        raise NmtError(f"unknown recipe {config.recipe!r}: choose one of {', '.join(RECIPES)}")
    if config.recipe == "multi30k":
        return _multi30k(config)
    if config.pairs:  # custom, a direction each corpus
        return _directions(config)
    config = dataclasses.replace(config, **_languages(config.src, config.tgt, known.languages))
    if known.languages and {config.src, config.tgt} != set(known.languages):
        a, b = known.languages
        names = "-".join(LANGUAGE_NAMES.get(x, x) for x in known.languages)
        raise NmtError(f"recipe {config.recipe} is {names}: use --src {a} --tgt {b} or --src {b} --tgt {a}")
    if config.max_ratio is None:
        config = dataclasses.replace(config, max_ratio=known.max_ratio)
    return config


def _directions(config: PrepConfig) -> PrepConfig:
    """`config` with the sides of its --pair: the pair's languages, or MANY for several."""
    pairs = config.pairs
    given = MANY if len(pairs) > 1 else tuple(pairs[0].split("-"))
    if (config.src or config.tgt) and (config.src, config.tgt) != given:  # (resolved already: given)
        raise NmtError("give --pair for each direction, or --src and --tgt for one, not both")
    src, tgt = given
    return dataclasses.replace(config, src=src, tgt=tgt, max_ratio=config.max_ratio or 1.5)


def _multi30k(config: PrepConfig) -> PrepConfig:
    """multi30k's directions: --pair each, or the one of --src and --tgt, or MULTI30K_PAIRS; a run
    of several has the sides MANY."""
    pairs = config.pairs
    if pairs:
        _directions(config)  # its sides, checked against --src and --tgt
    else:
        if bool(config.src) != bool(config.tgt):
            raise NmtError("multi30k: give both --src and --tgt (or --pair for each direction)")
        pairs = (f"{config.src}-{config.tgt}",) if config.src else MULTI30K_PAIRS
    for pair in pairs:
        for lang in pair.split("-"):
            if lang not in MULTI30K_LANGUAGES:
                *first, last = (LANGUAGE_NAMES[x] for x in MULTI30K_LANGUAGES)
                raise NmtError(
                    f"multi30k has {', '.join(first)} and {last} ({', '.join(MULTI30K_LANGUAGES)}), "
                    f"not {lang!r}"
                )
    config = dataclasses.replace(config, pairs=tuple(pairs), src=None, tgt=None)
    src, tgt = MANY if config.many else config.directions()[0]
    return dataclasses.replace(config, src=src, tgt=tgt, max_ratio=config.max_ratio or 9.0)


def _languages(src: str | None, tgt: str | None, pair: tuple[str, str] | None) -> dict[str, str]:
    """The languages not given: the recipe's pair in its order, or the other one of it when one
    side is given (`--src de` of an en-de recipe is de-en); without a pair, en and de."""
    if pair is None:
        return {"src": src or "en", "tgt": tgt or "de"}
    if src is None and tgt is None:
        return {"src": pair[0], "tgt": pair[1]}
    if src is None:
        src = pair[0] if tgt == pair[1] else pair[1]
    if tgt is None:
        tgt = pair[1] if src == pair[0] else pair[0]
    return {"src": src, "tgt": tgt}


def recipe_for(config: PrepConfig) -> Recipe:
    config = resolved(config)
    if config.recipe == "multi30k":
        return multi30k_recipe(config)
    corpora = RECIPES[config.recipe].corpora
    return corpora if corpora is not None else custom_recipe(config)
