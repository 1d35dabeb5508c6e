"""Minimum-Bayes-risk decoding (Kumar and Byrne 2004; Freitag et al. 2022, "High Quality Rather
than High Model Probability"): of a sentence's candidate translations, the one with the highest
expected utility, each candidate scored against all of them as pseudo-references.

The utilities are sacreBLEU's sentence-level chrF (`sentence_chrf`: character 6-grams, beta 2,
no whitespace) and BLEU (`sentence_bleu`: 13a, exp smoothing, effective order), computed for
every pair of a sentence's candidates at once: each candidate's n-grams are counted once, the
matches of all pairs are the minimum of their count matrices, and the scores follow sacreBLEU's
arithmetic step for step, so that each equals sacreBLEU's own (tests/integration/test_mbr.py). K candidates
cost K n-gram counts and a few array operations, where sacreBLEU would be K^2 calls that count
each pair's n-grams again.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from sacrebleu.metrics.helpers import extract_all_char_ngrams
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

from nmt_cli.config.translation import MBR_METRICS

if TYPE_CHECKING:
    from nmt_cli.config import DecodeOptions
    from nmt_cli.engine.hypothesis import Hypothesis

CHAR_ORDER, BETA = 6, 2  # sacreBLEU's chrF
BLEU_ORDER = 4
# matches of at most this many (hypothesis, reference, n-gram) counts at once
CELLS = 1 << 22
_tokenize = Tokenizer13a()


def ranked(
    texts: Sequence[str], metric: str, weights: Sequence[float] | None = None, table: np.ndarray | None = None
) -> list[tuple[int, float]]:
    """The candidates `texts` (each counted `weights` times as a pseudo-reference: how often it
    was drawn; default once) as (index, expected utility), best first; a tie keeps the earlier.
    `table`: the utilities, where the caller computed them (COMET's)."""
    if not texts:
        return []
    w = np.ones(len(texts)) if weights is None else np.asarray(weights, dtype=np.float64)
    table = utilities(texts, metric) if table is None else np.asarray(table, dtype=np.float64)
    return best_first(table @ w / w.sum())


def best_first(values: np.ndarray) -> list[tuple[int, float]]:
    """(index, value), the highest first; a tie keeps the earlier."""
    order = sorted(range(len(values)), key=lambda i: -values[i])
    return [(i, float(values[i])) for i in order]


def utilities(texts: Sequence[str], metric: str) -> np.ndarray:
    """(K, K): the `metric` of candidate i as the hypothesis against candidate j as the reference."""
    if metric == "chrf":
        return chrf(texts)
    if metric == "bleu":
        return bleu(texts)
    raise ValueError(f"unknown MBR utility {metric!r}: one of {MBR_METRICS}")


def chrf(texts: Sequence[str]) -> np.ndarray:
    """sacreBLEU's sentence_chrf of each pair (hypothesis i, reference j), in [0, 100]."""
    grams = [extract_all_char_ngrams(t, CHAR_ORDER) for t in texts]
    k, factor = len(texts), BETA**2
    eps = 1e-16
    avg_prec, avg_rec, orders = np.zeros((k, k)), np.zeros((k, k)), np.zeros((k, k))
    for n in range(CHAR_ORDER):
        counts = _count_matrix([g[n] for g in grams])
        totals = counts.sum(1)
        match = _matches(counts)
        n_hyp, n_ref = np.broadcast_to(totals[:, None], (k, k)), np.broadcast_to(totals[None, :], (k, k))
        prec = np.divide(match, n_hyp, out=np.full((k, k), eps), where=n_hyp > 0)
        rec = np.divide(match, n_ref, out=np.full((k, k), eps), where=n_ref > 0)
        both = (n_hyp > 0) & (n_ref > 0)
        avg_prec += np.where(both, prec, 0.0)
        avg_rec += np.where(both, rec, 0.0)
        orders += both
    avg_prec = np.divide(avg_prec, orders, out=np.zeros((k, k)), where=orders > 0)
    avg_rec = np.divide(avg_rec, orders, out=np.zeros((k, k)), where=orders > 0)
    top = (1 + factor) * avg_prec * avg_rec
    bottom = factor * avg_prec + avg_rec
    return 100 * np.divide(top, bottom, out=np.zeros((k, k)), where=avg_prec + avg_rec > 0)


def bleu(texts: Sequence[str]) -> np.ndarray:
    """sacreBLEU's sentence_bleu of each pair (hypothesis i, reference j), in [0, 100]."""
    tokens = [_tokenize(t.rstrip()).split() for t in texts]
    k = len(texts)
    lengths = np.array([len(x) for x in tokens], dtype=np.float64)
    sys_len, ref_len = lengths[:, None] * np.ones((1, k)), np.ones((k, 1)) * lengths[None, :]
    correct, total = [], []
    for n in range(1, BLEU_ORDER + 1):
        counts = _count_matrix([Counter(tuple(x[i : i + n]) for i in range(len(x) - n + 1)) for x in tokens])
        correct.append(_matches(counts).astype(np.float64))
        total.append(np.broadcast_to(counts.sum(1)[:, None].astype(np.float64), (k, k)))
    with np.errstate(divide="ignore", invalid="ignore"):
        bp = np.where(sys_len >= ref_len, 1.0, np.where(sys_len > 0, np.exp(1 - ref_len / sys_len), 0.0))
        going = np.ones((k, k), dtype=bool)  # orders until the first without n-grams
        smooth = np.ones((k, k))
        logs, order = np.zeros((k, k)), np.zeros((k, k))
        for n in range(BLEU_ORDER):
            going &= total[n] > 0
            order = np.where(going, n + 1, order)
            missed = correct[n] == 0
            smooth = np.where(going & missed, smooth * 2, smooth)
            precision = np.where(missed, 100.0 / (smooth * total[n]), 100.0 * correct[n] / total[n])
            logs += np.where(going, np.log(np.where(going, precision, 1.0)), 0.0)
        score = bp * np.exp(logs / np.maximum(order, 1))
    matched = sum(correct) > 0  # sacreBLEU's 0 when no n-gram matches at all
    return np.where(matched & (order > 0), score, 0.0)


def _count_matrix(counters: list[Counter]) -> np.ndarray:
    """(K, V): each candidate's count of each n-gram that any of them holds."""
    index: dict = {}
    for c in counters:
        for gram in c:
            index.setdefault(gram, len(index))
    counts = np.zeros((len(counters), max(1, len(index))), dtype=np.int32)
    for row, c in enumerate(counters):
        if c:
            counts[row, [index[g] for g in c]] = list(c.values())
    return counts


def _matches(counts: np.ndarray) -> np.ndarray:
    """(K, K): the n-grams each pair has in common (clipped counts), in row blocks of bounded size."""
    k, v = counts.shape
    out = np.empty((k, k), dtype=np.int64)
    step = max(1, CELLS // max(1, k * v))
    for start in range(0, k, step):
        block = counts[start : start + step]
        out[start : start + step] = np.minimum(block[:, None, :], counts[None, :, :]).sum(-1)
    return out


def deduplicated(texts: Sequence[str]) -> tuple[list[int], list[int]]:
    """Each different text's first index in `texts`, and how many times it is there."""
    slot: dict[str, int] = {}
    first: list[int] = []
    times: list[int] = []
    for i, t in enumerate(texts):
        if t not in slot:
            slot[t] = len(first)
            first.append(i)
            times.append(0)
        times[slot[t]] += 1
    return first, times


class Searches(Protocol):
    """What the choice asks of the translator (searcher.Searcher keeps it)."""

    def metric(self, kind: str) -> Any: ...

    def hypotheses(
        self,
        lines: list[str],
        options: list[DecodeOptions],
        keys: list[int] | None,
        prefixes: list[str] | None,
        constraints: list[list[str]] | None,
        gone: Callable[[], list[bool]] | None,
    ) -> list[list[Hypothesis]]: ...

    def texts(self, hyps: list[list[Hypothesis]]) -> list[list[str]]: ...

    def encode(self, lines: list[str], tag: str = "") -> list[list[int]]: ...

    def align(self, ids: list[list[int]], hyps: list[list[Hypothesis]], tag: str) -> None: ...


def chosen(
    translator: Searches,
    lines: list[str],
    each: list[DecodeOptions],
    keys: list[int] | None,
    prefixes: list[str] | None,
    constraints: list[list[str]] | None,
    gone: Callable[[], list[bool]] | None,
) -> list[list[Hypothesis]]:
    """Translator.hypotheses() under --mbr or --rerank: each line's candidates searched as
    DecodeOptions.for_candidates asks, told apart by their text, ranked by their expected
    utility (`ranked`, a drawn text weighing as often as it was drawn; COMET's utilities from
    one encoding of each candidate) or by CometKiwi's score with the source, the `nbest` best
    (the last repeated where fewer differ), each scored with that figure."""
    options = each[0]
    judge = (
        translator.metric("kiwi" if options.rerank else "comet")
        if options.rerank or options.mbr == "comet"
        else None
    )
    candidates = [o.for_candidates() for o in each]
    found = translator.hypotheses(lines, candidates, keys, prefixes, constraints, gone)
    texts = translator.texts(found)
    firsts = [deduplicated(t) for t in texts]
    unique = [[t[i] for i in first] for t, (first, _) in zip(texts, firsts)]
    if options.rerank:
        assert judge is not None
        qe = judge.score(
            [c for cs in unique for c in cs], [line for line, cs in zip(lines, unique) for _ in cs]
        )
        starts = np.cumsum([0, *map(len, unique)])
        rankings = [best_first(np.array(qe[a:b])) for a, b in zip(starts, starts[1:])]
    else:
        tables = judge.mbr_utilities(lines, unique) if judge is not None else None
        rankings = [
            ranked(u, options.mbr, times, tables[n].numpy() if tables is not None else None)
            for n, (u, (_, times)) in enumerate(zip(unique, firsts))
        ]
    out = []
    for hyps, (first, _), ranking in zip(found, firsts, rankings):
        best = [dataclasses.replace(hyps[first[k]], score=u) for k, u in ranking[: options.nbest]]
        out.append(best + best[-1:] * (options.nbest - len(best)))
    if options.alignments:
        translator.align(translator.encode(lines, options.tag), out, options.tag)
    return out
