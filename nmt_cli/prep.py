"""`nmt prep`: a recipe's corpora (recipes.py), fetched, verified, extracted and cleaned into text/.

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
import itertools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nmt_cli import ui
from nmt_cli.config import PrepConfig
from nmt_cli.config.corpus import target_token
from nmt_cli.data import fetch
from nmt_cli.data.filters import SeenPairs, drop_reason
from nmt_cli.data.recipes import TRAIN, Corpus, Part, Recipe, recipe_for, resolved
from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_open
from nmt_cli.normalize import normalize
from nmt_cli.rundir import RunDir
from nmt_cli.textio import Damage, chunks, open_binary, read_lines

# -- cleaning ----------------------------------------------------------------------------------


def _normalize_chunk(langs: tuple[str, str], pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    a, b = langs
    return [(normalize(x, a), normalize(y, b)) for x, y in pairs]


@dataclass
class SplitStats:
    read: int = 0
    kept: int = 0
    dropped: dict = field(default_factory=lambda: collections.Counter())
    not_utf8: int = 0
    corpora: list = field(default_factory=list)  # training: each corpus's file, pairs, tag, weight
    pairs: list = field(default_factory=list)  # several directions: each one's languages and lines


def _read_part(part: Part, path: Path, damage: Damage) -> Iterator[str]:
    if part.tmx:
        yield from _read_tmx(path, part.tmx)
        return
    if not part.sgm:
        yield from read_lines(path, damage)
        return
    seg = re.compile(r"<seg[^>]*>(.*?)</seg>", re.IGNORECASE)
    for line in read_lines(path, damage):
        for text in seg.findall(line):
            yield " ".join(text.split())  # as sacrebleu reads WMT's SGML


def _read_tmx(path: Path, lang: str) -> Iterator[str]:
    """Each translation unit's segment in `lang` of a TMX file (plain or gzip), its whitespace
    collapsed; '' for a unit without one, so that the two sides' readers stay aligned unit for
    unit (cleaning drops the empty pair)."""
    from xml.etree import ElementTree

    xml_lang = "{http://www.w3.org/XML/1998/namespace}lang"
    try:
        with open_binary(path) as f:
            for _, unit in ElementTree.iterparse(f):
                if unit.tag != "tu":
                    continue
                text = ""
                for variant in unit.iter("tuv"):
                    if (variant.get(xml_lang) or variant.get("lang") or "").lower().split("-")[0] == lang:
                        seg = variant.find("seg")
                        text = " ".join("".join(seg.itertext()).split()) if seg is not None else ""
                yield text
                unit.clear()
    except (ElementTree.ParseError, OSError, EOFError) as e:
        raise NmtError(f"{path.name} is not a readable TMX file: {e}") from None


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
    src, tgt = config.src, config.tgt  # the run's sides: its languages, or MANY's roles
    train = split == TRAIN
    stats = {split: SplitStats()}
    if holdout:
        stats["valid"] = SplitStats()
    seen = SeenPairs()
    damage = {src: Damage(), tgt: Damage()}
    directions = config.directions()
    with contextlib.ExitStack() as stack, ui.progress() as bar:
        out = _Outputs(stack, run, list(stats), (src, tgt))
        task = bar.add_task(f"clean {split}", total=None)
        most = 2000 // len(corpora) if config.many else 2000  # held out for validation
        for i, (corpus, corpus_paths) in enumerate(zip(corpora, paths)):
            accepted = held = 0
            # a run of several directions: each corpus its own languages, and every source line
            # of every split begins with its target's token
            a_lang, b_lang = directions[i] if config.many else (src, tgt)
            pairs = _pairs(corpus, corpus_paths, a_lang, b_lang, {a_lang: damage[src], b_lang: damage[tgt]})
            if config.many:
                tag = target_token(b_lang) + " "
            else:
                tag = f"{config.corpus_tag(i)} " if train and config.corpus_tag(i) else ""
            kept_before = stats[split].kept
            for raw_chunk, chunk in _normalized(chunks(pairs, 2000), (a_lang, b_lang), workers):
                stats[split].read += len(chunk)
                bar.advance(task, len(chunk))
                for raw, (a, b) in zip(raw_chunk, chunk):
                    # the released text of an evaluation pair: tagged where the model reads a tag
                    released = (tag + raw[0], raw[1]) if config.many else raw
                    if not train:
                        out.write(split, (tag + a, b), released, stats[split])
                        continue
                    # A pair is remembered for dedup only once it passed the other filters.
                    reason = drop_reason(a, b, config) or (None if seen.add(tag + a, b) else "duplicate")
                    if reason is not None:
                        stats[split].dropped[reason] += 1
                        continue
                    accepted += 1
                    # The validation pairs held out come from the first (the main) corpus; in a
                    # run of several directions, from each, as many from each
                    if holdout and (i == 0 or config.many) and accepted % 100 == 0 and held < most:
                        held += 1
                        stats["valid"].read += 1
                        out.write("valid", (tag + a, b) if config.many else (a, b), released, stats["valid"])
                    else:
                        out.write(split, (tag + a, b), raw, stats[split])
            if train:  # what each corpus gave text/train, in order
                stats[split].corpora.append(_record(corpus, i, stats[split].kept - kept_before, config))
            if config.many:  # the lines of each direction, in order: per-pair scores read them
                pair = {"src": a_lang, "tgt": b_lang, "tag": tag.strip()}
                stats[split].pairs.append({**pair, "lines": stats[split].kept - kept_before})
                if holdout:
                    stats["valid"].pairs.append({**pair, "lines": held})
        _check_kept(split, stats[split])
    stats[split].not_utf8 += _warn_damage(split, damage)
    return stats


class _Outputs:
    """The text/ files of some splits, each pair normalised and, in evaluation splits, also as
    released (the reference for scoring)."""

    def __init__(self, stack: contextlib.ExitStack, run: RunDir, splits: list[str], langs: tuple[str, str]):
        self.langs = langs
        self.files = {
            (s, lang, raw): stack.enter_context(atomic_open(run.text(s, lang, raw=raw)))
            for s in splits
            for lang in langs
            for raw in ((False,) if s == TRAIN else (False, True))
        }

    def write(self, split: str, pair: tuple[str, str], raw: tuple[str, str], stats: SplitStats) -> None:
        for lang, text, released in zip(self.langs, pair, raw):
            self.files[(split, lang, False)].write(text + "\n")
            if split != TRAIN:
                self.files[(split, lang, True)].write(released + "\n")
        stats.kept += 1


def _check_kept(split: str, stats: SplitStats) -> None:
    if stats.kept == 0:
        what = ", ".join(f"{n} {r}" for r, n in stats.dropped.items()) or "none read"
        raise NmtError(
            f"no pairs left in {split} after cleaning ({stats.read} read; "
            f"dropped: {what}); check the input files and --max-words/--max-ratio"
        )


def _record(corpus: Corpus, i: int, pairs: int, config: PrepConfig) -> dict:
    a, b = config.directions()[i] if config.many else (config.src, config.tgt)
    return {
        "source": corpus[a].describe(),
        "target": corpus[b].describe(),
        "pairs": pairs,
        "tag": target_token(b) if config.many else config.corpus_tag(i),
        "weight": config.corpus_weight(i),
        **({"pair": f"{a}-{b}"} if config.many else {}),
    }


def _warn_damage(split: str, damage: dict[str, Damage]) -> int:
    """Say which sides had lines that are not UTF-8; how many there were."""
    for lang, d in damage.items():
        if d.not_utf8:
            ui.warn(
                f"{split}.{lang}: {d.not_utf8} lines had bytes that are not UTF-8 (first at "
                f"line {d.first_bad_line}); they were replaced with U+FFFD"
            )
    return sum(d.not_utf8 for d in damage.values())


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
    config = resolved(config)
    if config.mirror and not Path(config.mirror).is_dir():
        raise NmtError(f"mirror folder {config.mirror} not found")
    for split, corpora in recipe_for(config).items():
        for corpus in corpora:
            for side, part in zip(("src", "tgt"), corpus.values()):  # each corpus: source first
                if part.source is None and not Path(part.path).is_file():  # type: ignore[arg-type]
                    raise NmtError(f"--{split}-{side} {part.path}: file not found")


def prepare(config: PrepConfig, run: RunDir, workers: int | None = None) -> dict:
    """Run the recipe into the run directory; returns the per-split statistics."""
    config = resolved(config)
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
        s: {
            "read": st.read,
            "kept": st.kept,
            "dropped": dict(st.dropped),
            "not_utf8": st.not_utf8,
            **({"corpora": st.corpora} if st.corpora else {}),
            **({"pairs": st.pairs} if st.pairs else {}),
        }
        for s, st in all_stats.items()
    }
    many = {"pairs": [f"{a}-{b}" for a, b in config.directions()]} if config.many else {}
    run.record("prep", produced, splits=summary, src=config.src, tgt=config.tgt, **many)
    return summary


def show(summary: dict) -> None:
    """The table of what `prepare` kept and dropped; with several training corpora, a row each."""
    corpora = summary.get(TRAIN, {}).get("corpora", [])
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
        ]
        + [
            [
                f"  {c.get('pair') or c['source']}",
                "",
                f"{c['pairs']:,}",
                f"tag {c['tag'] or '-'}, weight {c['weight']:g}",
                "",
            ]
            for c in (corpora if len(corpora) > 1 else [])
        ],
    )
