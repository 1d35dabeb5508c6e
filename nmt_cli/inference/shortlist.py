"""Lexical shortlists (Marian's `--shortlist`, CTranslate2's vocabulary map): for each source
piece, the target pieces likely in a translation of a sentence that holds it. A batch decoded
with one scores at each step only the union of its source pieces' candidates, the target's most
frequent pieces and what its prefixes and constraints need, instead of the whole vocabulary.

`nmt bpe` builds it from the training data: a source piece's candidates are the target pieces
that share the most training sentence pairs with it (co-occurrence; no word alignment to run),
besides the `frequent` pieces kept for every batch; a piece that the target vocabulary also has
(a name, a number, with a joint vocabulary) is its own first candidate. It is saved in
CTranslate2's vocabulary-map format, one line per source piece, `piece<TAB>candidates`, best
first, after a line with an empty source listing the pieces always kept: the package carries
it and the CTranslate2 export carries it as its vmap.txt, so that both engines read one file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_write_text, read_regular
from nmt_cli.inference.models import SHORTLIST, SHORTLIST_MAX_BYTES, SHORTLIST_SHA
from nmt_cli.vocab import BOS, EOS, PAD, UNK, pieces

if TYPE_CHECKING:
    from nmt_cli.inference.models import Model
    from nmt_cli.rundir import RunDir
    from nmt_cli.shards import Shard

NAME, SHA_KEY = SHORTLIST, SHORTLIST_SHA  # its file, and the setting that holds its sha256
# Chosen on Multi30k validation (benchmarks/shortlist.py, docs/benchmarks.md).
FREQUENT = 256
PER_SOURCE = 32
# Sentence pairs counted at most, evenly spaced through the training data: counting takes time
# in proportion to the pairs, and a piece that a batch meets often is in a million pairs often.
PAIRS = 1_000_000
MAX_BYTES = SHORTLIST_MAX_BYTES
# candidates of one source piece at most: every source piece holds a row as wide as the widest
MAX_ROW = 256
SPECIALS = (PAD, UNK, BOS, EOS)


@dataclass(frozen=True)
class Shortlist:
    """`always`: target ids kept for every batch; `candidates`: (source vocabulary, K) target
    ids of each source id, -1 past its own."""

    always: np.ndarray
    candidates: np.ndarray

    def among(self, sources: Iterable[Sequence[int]], needed: Iterable[int] = ()) -> np.ndarray:
        """The sorted target ids a batch of `sources` (ids) may output: the pieces always kept,
        PAD, UNK, BOS and EOS, each source piece's candidates, and `needed` (its prefixes' and
        constraints' pieces)."""
        ids = np.unique(
            np.concatenate([np.asarray(s, dtype=np.int64) for s in sources] or [np.zeros(0, int)])
        )
        found = self.candidates[ids[ids < len(self.candidates)]].ravel()
        parts = [self.always, np.asarray(SPECIALS), found[found >= 0], np.fromiter(needed, dtype=np.int64)]
        return np.unique(np.concatenate([p.astype(np.int64) for p in parts]))


def path_of(model: Model) -> Path:
    """The file of the shortlist `model` carries, for `--shortlist`; an error line if it has none."""
    if model.shortlist is None:
        unrecorded = model.where.is_dir() and any(
            os.path.lexists(model.where / name) for name in (NAME, "vmap.txt")
        )
        raise NmtError(
            f"{model.where} has no lexical shortlist for --shortlist: "
            + (
                "its shortlist file is not recorded in its nmt.json (an older export): export it again"
                if unrecorded
                else "`nmt bpe` builds one in a run directory, `nmt export` from a run directory into "
                "its package"
            )
        )
    return model.shortlist


def of(model: Model) -> Shortlist:
    """The shortlist `model` carries, loaded for nmt's engine (path_of)."""
    return load(path_of(model), pieces(model.vocabs.source), pieces(model.vocabs.target))


def copy(model: Model, dest: Path) -> None:
    """`model`'s shortlist written anew at `dest` from what was parsed of it: an export ships
    lines of the model's own pieces, never the bytes of whatever the run's file was."""
    source, target = pieces(model.vocabs.source), pieces(model.vocabs.target)
    save(load(path_of(model), source, target), dest, source, target)


def for_run(run: RunDir) -> Path:
    """The run's shortlist file (in its bpe folder), built from its binarized training data
    first if it has none."""
    path = run.spm_folder / NAME
    if path.exists():
        return path
    from nmt_cli.shards import Shard

    prep = run.load_manifest()["prep"]
    vocabs = run.vocabularies()
    source, target = pieces(vocabs.source), pieces(vocabs.target)
    ids = {p: i for i, p in enumerate(target)}
    same = np.array([ids.get(p, -1) for p in source], dtype=np.int64)
    pairs = Shard(run.tokens("train", prep["src"])), Shard(run.tokens("train", prep["tgt"]))
    save(build(*pairs, len(source), len(target), same), path, source, target)
    return path


def build(
    sources: Shard | Sequence[np.ndarray],
    targets: Shard | Sequence[np.ndarray],
    source_size: int,
    target_size: int,
    same: np.ndarray | None = None,
    frequent: int = FREQUENT,
    per_source: int = PER_SOURCE,
    pairs: int = PAIRS,
) -> Shortlist:
    """The shortlist of the sentence pairs (`sources`[i], `targets`[i]) (ids), each source piece
    with its `per_source` best candidates besides the `frequent` most frequent target pieces.
    `same`: for each source id, the target id of the same piece (-1: none); a joint vocabulary's
    is the identity."""
    n = len(sources)
    picked = np.linspace(0, n - 1, pairs).round().astype(np.int64) if n > pairs else np.arange(n)
    # The pieces kept for every batch first (each target piece's occurrences): the pairs they
    # would make, most of all pairs, are then never counted.
    tokens = np.zeros(target_size, dtype=np.int64)
    for start in range(0, len(picked), 100_000):
        chunk = [np.asarray(targets[int(i)]) for i in picked[start : start + 100_000]]
        tokens += np.bincount(np.concatenate(chunk), minlength=target_size)
    always = np.argsort(-tokens, kind="stable")[:frequent]
    always = np.sort(always[tokens[always] > 0])
    kept = np.zeros(target_size, dtype=bool)
    kept[always] = True
    key = np.int32 if source_size * target_size < 2**31 else np.int64  # half the memory where it fits
    holding = [np.zeros(source_size, dtype=np.int64), np.zeros(target_size, dtype=np.int64)]  # sentences
    runs: list[tuple[np.ndarray, np.ndarray]] = []  # (pair keys, sentences), larger ones first
    keys: list[np.ndarray] = []

    def flush() -> None:
        """The pairs held so far counted into `runs`, which merge while the last is about as
        large as the one before it: each pair is sorted a logarithmic number of times."""
        nonlocal keys
        if keys:
            found, times = np.unique(np.concatenate(keys), return_counts=True)
            runs.append((found, times.astype(np.int32)))
            keys = []
        while len(runs) > 1 and 2 * len(runs[-1][0]) >= len(runs[-2][0]):
            runs.append(_merge(runs.pop(), runs.pop()))

    held = 0
    for i in map(int, picked):
        s, t = np.unique(sources[i]), np.unique(targets[i])
        holding[0][s] += 1
        holding[1][t] += 1
        t = t[~kept[t]]
        keys.append((s[:, None].astype(key) * target_size + t[None, :].astype(key)).ravel())
        held += keys[-1].size
        if held > 4_000_000:
            flush()
            held = 0
    flush()
    together, shared = np.zeros(0, key), np.zeros(0, np.int32)
    for run in runs:
        together, shared = _merge((together, shared), run)
    src, tgt = (together // target_size).astype(np.int64), (together % target_size).astype(np.int64)
    # Dice's coefficient: the share of the two pieces' sentences that hold both, so that a
    # frequent target piece does not lead every source piece's list (`always` has those)
    dice = 2 * shared / (holding[0][src] + holding[1][tgt])
    order = np.lexsort((tgt, -dice, src))
    src, tgt = src[order], tgt[order]
    candidates = np.full((source_size, per_source), -1, dtype=np.int64)
    first = 0
    if same is not None:  # the piece itself first, where the target has it, and once only
        own = np.where(same[:source_size] >= 0, same[:source_size], -1)
        candidates[:, 0] = own
        first = 1
        keep = tgt != own[src]
        src, tgt = src[keep], tgt[keep]
    rank = np.arange(len(src)) - np.searchsorted(src, np.arange(source_size))[src]
    take = rank < per_source - first
    candidates[src[take], rank[take] + first] = tgt[take]
    candidates[list(SPECIALS)] = -1  # no source word: the search keeps them all the same
    return Shortlist(always.astype(np.int64), candidates)


def _merge(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Two (keys, counts) as one, the counts of a key in both added."""
    every, where = np.unique(np.concatenate([a[0], b[0]]), return_inverse=True)
    return every, np.bincount(where, weights=np.concatenate([a[1], b[1]])).astype(np.int32)


def save(shortlist: Shortlist, path: Path, source_pieces: list[str], target_pieces: list[str]) -> None:
    """`shortlist` as CTranslate2's vocabulary map of these pieces."""
    lines = ["\t" + " ".join(target_pieces[i] for i in shortlist.always)]
    for s, row in enumerate(shortlist.candidates):
        row = row[row >= 0]
        if len(row) and s not in SPECIALS:
            lines.append(source_pieces[s] + "\t" + " ".join(target_pieces[i] for i in row))
    atomic_write_text(path, "\n".join(lines) + "\n")


def load(path: Path, source_pieces: list[str], target_pieces: list[str]) -> Shortlist:
    """The shortlist saved at `path` for these pieces; an error line naming the file if it is
    not one of them."""
    try:
        text = read_regular(path, MAX_BYTES, follow=False).decode("utf-8")
    except UnicodeDecodeError:
        raise NmtError(f"{path} is not UTF-8 text: not a shortlist nmt wrote") from None
    source_ids = {p: i for i, p in enumerate(source_pieces)}
    target_ids = {p: i for i, p in enumerate(target_pieces)}
    always: list[int] = []
    rows: dict[int, list[int]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        piece, tab, listed = line.partition("\t")
        wanted = listed.split(" ") if listed else []
        if not tab or any(p not in target_ids for p in wanted) or (piece and piece not in source_ids):
            raise NmtError(
                f"{path}:{number} is not a line of a shortlist of this model's pieces "
                "('source piece<TAB>target pieces'): rebuild it with `nmt bpe` or `nmt export`"
            )
        ids = [target_ids[p] for p in wanted]
        if piece and len(ids) > MAX_ROW:
            raise NmtError(
                f"{path}:{number} lists {len(ids)} candidates for one source piece, more than "
                f"{MAX_ROW}: rebuild it with `nmt bpe`"
            )
        if piece:
            rows[source_ids[piece]] = ids
        else:
            always = ids
    width = max((len(r) for r in rows.values()), default=0)
    candidates = np.full((len(source_pieces), max(width, 1)), -1, dtype=np.int64)
    for s, ids in rows.items():
        candidates[s, : len(ids)] = ids
    return Shortlist(np.asarray(always, dtype=np.int64), candidates)
