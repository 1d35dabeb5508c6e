"""`nmt prep`: a recipe's corpora, fetched, verified, extracted and cleaned into text/.

Cleaning follows the standard Moses recipe: punctuation normalisation, non-printing characters
to spaces, whitespace collapsed; training pairs that are empty, longer than `max_words` words,
more unbalanced than `max_ratio` (lengths measured in words, or their equivalent in scripts
written without spaces: `length`), or exact duplicates of an earlier pair are dropped. Evaluation
splits keep every line (and a copy as released, the reference for scoring). Everything streams:
memory does not grow with the corpus, except 8 bytes per distinct training pair for dedup.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import hashlib
import itertools
import os
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nmt_cli import fetch, ui
from nmt_cli.config import PrepConfig
from nmt_cli.errors import NmtError
from nmt_cli.fetch import Source
from nmt_cli.normalize import normalize
from nmt_cli.rundir import RunDir, atomic_open
from nmt_cli.textio import Damage, chunks, read_lines

TRAIN = "train"


@dataclass(frozen=True)
class Part:
    """One language side of one corpus: a downloaded file, or a member of a downloaded archive."""

    source: Source | None  # None: a local file of the user's (`path`)
    member: str | None = None  # inside the archive; None: the file itself (plain or .gz)
    sgm: bool = False  # WMT's SGML test-set format
    path: str | None = None

    def describe(self) -> str:
        if self.source is None:
            return str(self.path)
        return f"{self.source.name}:{self.member}" if self.member else self.source.name


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


def _pair(source: Source, en: str, de: str, sgm: bool = False) -> Corpus:
    return {"en": Part(source, en, sgm), "de": Part(source, de, sgm)}


WMT14_EN_DE: Recipe = {
    TRAIN: [
        _pair(EUROPARL, "training/europarl-v7.de-en.en", "training/europarl-v7.de-en.de"),
        _pair(COMMONCRAWL, "commoncrawl.de-en.en", "commoncrawl.de-en.de"),
        _pair(
            NEWS_COMMENTARY, "training/news-commentary-v9.de-en.en", "training/news-commentary-v9.de-en.de"
        ),
    ],
    "valid": [_pair(WMT_DEV, "dev/newstest2013.en", "dev/newstest2013.de")],
    "test": [
        _pair(WMT_DEV, "dev/newstest2014-deen-src.en.sgm", "dev/newstest2014-deen-ref.de.sgm", sgm=True)
    ],
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
MULTI30K_EN_DE: Recipe = {
    split: [
        {
            lang: Part(Source(f"{MULTI30K_BASE}{name}.{lang}.gz", sha, size))
            for lang, (sha, size) in sides.items()
        }
    ]
    for (split, name), sides in MULTI30K_FILES.items()
}


def custom_recipe(config: PrepConfig) -> Recipe:
    recipe: Recipe = {}
    for split in (TRAIN, "valid", "test"):
        src, tgt = getattr(config, f"{split}_src"), getattr(config, f"{split}_tgt")
        if src:
            recipe[split] = [{config.src: Part(None, path=src), config.tgt: Part(None, path=tgt)}]
    return recipe


def recipe_for(config: PrepConfig) -> Recipe:
    if config.recipe == "wmt14-en-de":
        return WMT14_EN_DE
    if config.recipe == "multi30k-en-de":
        return MULTI30K_EN_DE
    return custom_recipe(config)


# -- cleaning ----------------------------------------------------------------------------------


def _normalize_chunk(langs: tuple[str, str], pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    a, b = langs
    return [(normalize(x, a), normalize(y, b)) for x, y in pairs]


class SeenPairs:
    """Exact-duplicate detection in 8 bytes per distinct pair (a 64-bit hash in a sorted array)."""

    def __init__(self, flush_every: int = 65536):
        self.old = np.zeros(0, dtype=np.uint64)
        self.recent: set[int] = set()
        self.flush_every = flush_every

    def add(self, a: str, b: str) -> bool:
        """Record the pair; False if it was seen before."""
        h = int.from_bytes(hashlib.blake2b(f"{a}\t{b}".encode(), digest_size=8).digest(), "little")
        if h in self.recent:
            return False
        i = int(np.searchsorted(self.old, np.uint64(h)))  # a Python int would cast the array
        if i < len(self.old) and int(self.old[i]) == h:
            return False
        self.recent.add(h)
        if len(self.recent) >= self.flush_every:
            new = np.sort(np.fromiter(self.recent, dtype=np.uint64, count=len(self.recent)))
            self.old = np.insert(self.old, np.searchsorted(self.old, new), new)
            self.recent.clear()
        return True


@dataclass
class SplitStats:
    read: int = 0
    kept: int = 0
    dropped: dict = field(default_factory=lambda: collections.Counter())
    not_utf8: int = 0


def _read_part(part: Part, path: Path, damage: Damage) -> Iterator[str]:
    if not part.sgm:
        yield from read_lines(path, damage)
        return
    seg = re.compile(r"<seg[^>]*>(.*?)</seg>", re.IGNORECASE)
    for line in read_lines(path, damage):
        for text in seg.findall(line):
            yield " ".join(text.split())  # as sacrebleu reads WMT's SGML


def _pairs(
    corpus: Corpus, paths: dict[str, Path], src: str, tgt: str, damage: dict[str, Damage]
) -> Iterator[tuple[str, str]]:
    """The pairs of one corpus; different line counts are an error naming both files."""
    a = _read_part(corpus[src], paths[src], damage[src])
    b = _read_part(corpus[tgt], paths[tgt], damage[tgt])
    n = 0
    for n, (x, y) in enumerate(itertools.zip_longest(a, b), 1):
        if x is None or y is None:
            na = n - 1 + (x is not None) + sum(1 for _ in a)
            nb = n - 1 + (y is not None) + sum(1 for _ in b)
            raise NmtError(
                f"{corpus[src].describe()} has {na} lines but "
                f"{corpus[tgt].describe()} has {nb}: a parallel corpus needs "
                "the same number of lines on both sides"
            )
        yield x, y


def _normalized(chunks: Iterator[list], langs: tuple[str, str], workers: int) -> Iterator[list]:
    """Normalise chunks in worker processes, in order, with a bounded number in flight."""
    if workers <= 1:
        for chunk in chunks:
            yield chunk, _normalize_chunk(langs, chunk)
        return
    with cf.ProcessPoolExecutor(workers) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append((chunk, pool.submit(_normalize_chunk, langs, chunk)))
            if len(pending) >= 2 * workers:
                raw, future = pending.popleft()
                yield raw, future.result()
        while pending:
            raw, future = pending.popleft()
            yield raw, future.result()


def clean_split(
    split: str,
    corpora: list[Corpus],
    paths: list[dict[str, Path]],
    config: PrepConfig,
    run: RunDir,
    holdout: bool = False,
    workers: int = 1,
) -> dict[str, SplitStats]:
    """Clean one split into text/; with `holdout`, every 100th kept training pair (up to 2000)
    goes to a validation split instead. All outputs appear together or not at all."""
    src, tgt = config.src, config.tgt
    train = split == TRAIN
    stats = {split: SplitStats()}
    if holdout:
        stats["valid"] = SplitStats()
    seen = SeenPairs()
    damage = {src: Damage(), tgt: Damage()}
    outputs = [
        (s, lang, raw)
        for s in stats
        for lang in (src, tgt)
        for raw in ((False,) if s == TRAIN else (False, True))
    ]
    with contextlib.ExitStack() as stack, ui.progress() as bar:
        files = {
            key: stack.enter_context(atomic_open(run.text(key[0], key[1], raw=key[2]))) for key in outputs
        }
        task = bar.add_task(f"clean {split}", total=None)
        accepted = 0

        def write(s: str, pair: tuple[str, str], raw: tuple[str, str]) -> None:
            files[(s, src, False)].write(pair[0] + "\n")
            files[(s, tgt, False)].write(pair[1] + "\n")
            if s != TRAIN:
                files[(s, src, True)].write(raw[0] + "\n")
                files[(s, tgt, True)].write(raw[1] + "\n")
            stats[s].kept += 1

        for corpus, corpus_paths in zip(corpora, paths):
            pairs = _pairs(corpus, corpus_paths, src, tgt, damage)
            for raw_chunk, chunk in _normalized(chunks(pairs, 2000), (src, tgt), workers):
                stats[split].read += len(chunk)
                bar.advance(task, len(chunk))
                for raw, (a, b) in zip(raw_chunk, chunk):
                    if not train:
                        write(split, (a, b), raw)
                        continue
                    reason = _drop_reason(a, b, config)
                    if reason is None and not seen.add(a, b):
                        reason = "duplicate"
                    if reason is not None:
                        stats[split].dropped[reason] += 1
                        continue
                    accepted += 1
                    if holdout and accepted % 100 == 0 and stats["valid"].kept < 2000:
                        stats["valid"].read += 1
                        write("valid", (a, b), raw)
                    else:
                        write(split, (a, b), raw)
        if stats[split].kept == 0:
            what = ", ".join(f"{n} {r}" for r, n in stats[split].dropped.items()) or "none read"
            raise NmtError(
                f"no pairs left in {split} after cleaning ({stats[split].read} read; "
                f"dropped: {what}); check the input files and --max-words/--max-ratio"
            )
    for lang, d in damage.items():
        stats[split].not_utf8 += d.not_utf8
        if d.not_utf8:
            ui.warn(
                f"{split}.{lang}: {d.not_utf8} lines had bytes that are not UTF-8 (first at "
                f"line {d.first_bad_line}); they were replaced with U+FFFD"
            )
    return stats


# Scripts written without spaces between words, and how much of an English word one of their
# letters carries, from translations of the Universal Declaration of Human Rights, article 1
# (English 30 words; Chinese 40 Han characters; Japanese about 30 kanji and 50 kana; Thai
# about 95 letters besides its combining vowel and tone marks): about 0.7, 0.3 and 0.3.
UNSPACED = [
    (0x3400, 0x4DBF, 0.7),
    (0x4E00, 0x9FFF, 0.7),
    (0xF900, 0xFAFF, 0.7),
    (0x20000, 0x2FA1F, 0.7),  # Han
    (0x3040, 0x30FF, 0.3),
    (0x31F0, 0x31FF, 0.3),
    (0xFF66, 0xFF9F, 0.3),  # kana
    (0x0E00, 0x0EFF, 0.3),
    (0x1000, 0x109F, 0.3),
    (0x1780, 0x17FF, 0.3),
]  # Thai, Lao,
#                                                                  Myanmar, Khmer


# Lines without such letters (nearly all, in most corpora) are counted by their spaces alone.
_ANY_UNSPACED = re.compile("[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi, _ in UNSPACED) + "]")


def _weight(c: str) -> float:
    o = ord(c)
    for lo, hi, w in UNSPACED:
        if lo <= o <= hi:
            return 0.0 if unicodedata.category(c)[0] in "MP" else w
    return -1.0


def length(text: str) -> float:
    """Length in English-word equivalents, for any script: a space-separated token counts 1; in
    one with letters of a script written without spaces, those letters count their weight and
    the rest of the token 1 if it holds a letter or digit."""
    if not _ANY_UNSPACED.search(text):
        return len(text.split())
    n = 0.0
    for token in text.split():
        if token.isascii():
            n += 1
            continue
        weights = [_weight(c) for c in token]
        if max(weights) < 0:
            n += 1
            continue
        n += sum(w for w in weights if w > 0)
        n += any(w < 0 and c.isalnum() for w, c in zip(weights, token))
    return n


def _drop_reason(a: str, b: str, config: PrepConfig) -> str | None:
    if not a or not b:
        return "empty"
    na, nb = length(a), length(b)
    if na > config.max_words or nb > config.max_words:
        return "too long"
    if na > config.max_ratio * nb or nb > config.max_ratio * na:
        return "length ratio"
    return None


# -- the step ----------------------------------------------------------------------------------


def local_paths(recipe: Recipe, config: PrepConfig, run: RunDir) -> dict[str, list[dict[str, Path]]]:
    """Fetch, verify and extract what the recipe needs; the local path of every part."""
    mirror = Path(config.mirror) if config.mirror else None
    fetched: dict[str, Path] = {}
    members: dict[str, list[str]] = collections.defaultdict(list)
    for corpora in recipe.values():
        for corpus in corpora:
            for part in corpus.values():
                if part.source is None:
                    continue
                if part.source.name not in fetched:
                    fetched[part.source.name] = fetch.fetch(part.source, run.downloads, mirror)
                if part.member:
                    members[part.source.name].append(part.member)
    extracted = {
        name: fetch.extract(fetched[name], wanted, run.extracted / name) for name, wanted in members.items()
    }

    def where(part: Part) -> Path:
        if part.source is None:
            return Path(part.path)  # type: ignore[arg-type]
        if part.member:
            return extracted[part.source.name][part.member]
        return fetched[part.source.name]

    return {
        split: [{lang: where(p) for lang, p in corpus.items()} for corpus in corpora]
        for split, corpora in recipe.items()
    }


def check_inputs(config: PrepConfig) -> None:
    """The cheap checks, made before anything in the run directory changes."""
    if config.mirror and not Path(config.mirror).is_dir():
        raise NmtError(f"mirror folder {config.mirror} not found")
    for split, corpora in recipe_for(config).items():
        for corpus in corpora:
            for lang in (config.src, config.tgt):
                part = corpus[lang]
                if part.source is None and not Path(part.path).is_file():  # type: ignore[arg-type]
                    raise NmtError(
                        f"--{split}-{'src' if lang == config.src else 'tgt'} {part.path}: file not found"
                    )


def prepare(config: PrepConfig, run: RunDir, workers: int | None = None) -> dict:
    """Run the recipe into the run directory; returns the per-split statistics."""
    check_inputs(config)
    recipe = recipe_for(config)
    paths = local_paths(recipe, config, run)
    if workers is None:
        big = sum(os.path.getsize(p) for c in paths[TRAIN] for p in c.values()) > 20_000_000
        workers = min(os.cpu_count() or 1, 4) if big else 1
    holdout = "valid" not in recipe
    all_stats: dict[str, SplitStats] = {}
    for split, corpora in recipe.items():
        all_stats.update(
            clean_split(
                split, corpora, paths[split], config, run, holdout=holdout and split == TRAIN, workers=workers
            )
        )
    produced = [
        run.text(s, lang, raw)
        for s in all_stats
        for lang in (config.src, config.tgt)
        for raw in ((False,) if s == TRAIN else (False, True))
    ]
    summary = {
        s: {"read": st.read, "kept": st.kept, "dropped": dict(st.dropped), "not_utf8": st.not_utf8}
        for s, st in all_stats.items()
    }
    run.record("prep", produced, splits=summary, src=config.src, tgt=config.tgt)
    return summary


def show(summary: dict) -> None:
    """The table of what `prepare` kept and dropped."""
    ui.table(
        "nmt prep",
        ["split", "read", "kept", "dropped", "not UTF-8"],
        [
            [
                s,
                f"{v['read']:,}",
                f"{v['kept']:,}",
                ", ".join(f"{n:,} {r}" for r, n in v["dropped"].items()) or "-",
                f"{v['not_utf8']:,}",
            ]
            for s, v in summary.items()
        ],
    )
