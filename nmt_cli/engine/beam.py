"""Beam search over a batch of sentences at once, built from small pure functions.

`search` knows nothing of the Transformer: it asks `step(tokens)` for next-token log-probs of
every live row, has rules.py's `NextToken` shape them, and tells `reorder(indices)` which rows
survive (decoding.py wires it to the model and its DecoderCache). Rows are sentences x beams,
each sentence's beams together.

A sentence stops once it has `beam` finished hypotheses, or when no live hypothesis can beat
its best finished one even with the most favourable length penalty it could still reach.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from nmt_cli.engine.hypothesis import Hypothesis, length_penalty
from nmt_cli.engine.rules import NextToken
from nmt_cli.vocab import BOS, EOS


def beam_step(scores: Tensor, lprobs: Tensor, beam: int) -> tuple[Tensor, Tensor, Tensor]:
    """The 2*beam best continuations of each sentence.

    scores (B, beam) cumulative log-probs of the live hypotheses; lprobs (B, beam, V) of their
    next token. Returns candidate scores, the beam each extends and its token, (B, 2*beam) each.
    """
    b, k, v = lprobs.shape
    n = min(2 * beam, v)
    # A beam's score is one number added to all its tokens, so the sentence's best 2*beam are
    # among each beam's own best 2*beam: rank (B, k*n) candidates, not all (B, k*V).
    own, tokens = lprobs.topk(n, dim=2)
    total = (scores[:, :, None] + own).view(b, k * n)
    top, index = total.topk(min(2 * beam, k * n), dim=1)
    return top, index // n, tokens.view(b, k * n).gather(1, index)


def choose(cand_scores: np.ndarray, cand_tokens: np.ndarray, beam: int) -> tuple[np.ndarray, np.ndarray]:
    """Split the candidates (each sentence's, best first): EOS among the best `beam` finish; the
    best `beam` others live on.

    Returns the finished mask (B, 2*beam) and the columns of the live candidates (B, beam).
    There are at most `beam` EOS candidates (one per beam), so `beam` others always exist.
    """
    is_eos = cand_tokens == EOS
    finished = is_eos & (np.arange(cand_scores.shape[1]) < beam) & np.isfinite(cand_scores)
    live = np.argsort(is_eos, axis=1, kind="stable")[:, :beam]  # non-EOS first, in rank order
    return finished, live


def search(
    step: Callable[[Tensor], Tensor],
    reorder: Callable[[Tensor], None],
    rules: NextToken,
    device: torch.device | str = "cpu",
) -> list[list[Hypothesis]]:
    """Beam search for len(rules.max_lens) sentences at `rules.options`' beam and nbest, each
    sentence ranked by its own length penalty (`rules.alphas`);
    the `nbest` best hypotheses of each, best first. `rules` shapes every step's log-probs.

    step(tokens (R, 1)) -> log-probs (R, V) of the next token of each live row.
    reorder(indices (R',)) keeps those rows (of the last step's R) for the next step.

    The device ranks the candidates; the host reads them once per step (2*beam per sentence)
    and keeps the bookkeeping: the hypotheses' tokens, who finished, who lives on.
    """
    o, max_lens = rules.options, rules.max_lens
    beam, alphas, nbest = o.beam, rules.alphas, o.nbest
    n = len(max_lens)
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    active = np.arange(n)  # sentence of each live group of `beam` rows
    history = np.zeros((n * beam, 0), dtype=np.int64)  # each live row's tokens so far
    scores = torch.full((n, beam), -math.inf, device=device)
    scores[:, 0] = 0.0  # at first every beam is the same: keep one
    tokens = torch.full((n * beam, 1), BOS, dtype=torch.long, device=device)
    t = 0
    while True:
        lprobs = rules(step(tokens).float())  # (R, V)
        b = len(active)
        cand = beam_step(scores, lprobs.view(b, beam, -1), beam)
        cand_scores, cand_beams, cand_tokens = (
            torch.stack([c.double() for c in cand]).cpu().numpy()
        )  # the step's one read
        cand_beams, cand_tokens = cand_beams.astype(np.int64), cand_tokens.astype(np.int64)
        done, live = choose(cand_scores, cand_tokens, beam)
        for row, col in zip(*np.nonzero(done)):
            tokens_so_far = history[row * beam + cand_beams[row, col]].tolist()
            penalty = length_penalty(t + 1, alphas[active[row]])
            finished[active[row]].append(Hypothesis(tokens_so_far, float(cand_scores[row, col]) / penalty))
        live_scores = np.take_along_axis(cand_scores, live, 1)
        keep = _going_on(finished, active, live_scores, beam, nbest, max_lens, alphas, t + 1)
        if not len(keep):
            break
        live_beams = np.take_along_axis(cand_beams, live, 1)[keep]
        rows = (keep[:, None] * beam + live_beams).reshape(-1)
        history = np.concatenate(
            [history[rows], np.take_along_axis(cand_tokens, live, 1)[keep].reshape(-1, 1)], 1
        )
        active = active[keep]
        index = torch.from_numpy(np.concatenate([keep, live[keep].reshape(-1), rows])).to(device)
        keep_t, live_t, rows_t = index.split([len(keep), len(rows), len(rows)])
        live_t = live_t.view(-1, beam)
        scores = cand[0].index_select(0, keep_t).gather(1, live_t)
        tokens = cand[2].index_select(0, keep_t).gather(1, live_t).view(-1, 1)
        rules.keep(rows, rows_t, tokens)
        reorder(rows_t)
        t += 1
    return [sorted(f, key=lambda h: -h.score)[:nbest] for f in finished]


def _going_on(
    finished: list[list[Hypothesis]],
    active: np.ndarray,
    live_scores: np.ndarray,
    beam: int,
    nbest: int,
    max_lens: list[int],
    alphas: list[float],
    length: int,
) -> np.ndarray:
    """Which live sentences (indices into `active`) go on after a step to `length` tokens."""
    # Most sentences have fewer than `nbest` finished hypotheses and room to grow: they go on
    # without is_done's look at their scores (the per-sentence loop was a large part of the
    # host's work per step, which a GPU waits for).
    counts = np.fromiter((len(finished[s]) for s in active), dtype=np.int64, count=len(active))
    limits = np.maximum(np.asarray(max_lens, dtype=np.int64)[active], length)
    going = (counts < min(nbest, beam)) & (length < limits)
    for i in np.flatnonzero(~going):
        sentence = active[i]
        going[i] = not is_done(
            finished[sentence], live_scores[i], beam, nbest, int(limits[i]), alphas[sentence], length
        )
    return np.flatnonzero(going)


def is_done(
    finished: list[Hypothesis], live: np.ndarray, beam: int, nbest: int, limit: int, alpha: float, length: int
) -> bool:
    if len(finished) >= beam or length >= limit:
        return True
    if len(finished) < nbest:
        return False
    # Log-probs only fall as a hypothesis grows; the kindest penalty is that of the longest
    # length still allowed, so this bounds what any live hypothesis can reach.
    best_live = float(live.max()) / length_penalty(limit, alpha)
    worst_kept = sorted((h.score for h in finished), reverse=True)[nbest - 1]
    return worst_kept >= best_live
