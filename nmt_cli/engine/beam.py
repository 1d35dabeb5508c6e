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
    """
    beams = Beams(rules, device)
    while True:
        rows = beams.advance(step(beams.tokens))
        if rows is None:
            break
        reorder(rows)
    return [beams.found(s) for s in range(len(rules.max_lens))]


class Beams:
    """Beam search between its steps: each live sentence's `beam` hypotheses (its rows), what
    has finished, and the tokens the next step takes.

    The device ranks the candidates; the host reads them once per step (2*beam per sentence)
    and keeps the bookkeeping: the hypotheses' tokens, who finished, who lives on.

    With `open`, sentences may `join` between steps and `drop` out (nmt serve's running batch:
    rules.NextToken.join); a step that ends every sentence leaves an empty search, not None."""

    def __init__(self, rules: NextToken, device: torch.device | str = "cpu", open: bool = False):
        o = rules.options
        self.rules, self.device, self.open = rules, device, open
        self.beam, self.nbest = o.beam, o.nbest
        n = len(rules.max_lens)
        self.finished: dict[int, list[Hypothesis]] = {s: [] for s in range(n)}
        self.active = np.arange(n)  # sentence of each live group of `beam` rows
        # each live row's tokens so far, right-aligned: a sentence that began later has fewer
        self.history = np.zeros((n * self.beam, 0), dtype=np.int64)
        self.scores = torch.full((n, self.beam), -math.inf, device=device)
        self.scores[:, 0] = 0.0  # at first every beam is the same: keep one
        self.tokens = torch.full((n * self.beam, 1), BOS, dtype=torch.long, device=device)
        self.ended: np.ndarray = np.zeros(0, dtype=np.int64)  # the sentences the last step ended

    def advance(self, lprobs: Tensor) -> Tensor | None:
        """One step on the live rows' next-token `lprobs` (R, V): the rows (indices into R, on
        the device) that go on, for the decoder's reorder; None once none does (unless open)."""
        rules, beam, t = self.rules, self.beam, self.rules.t
        lprobs = rules(lprobs.float())
        active, b = self.active, len(self.active)
        cand = beam_step(self.scores, lprobs.view(b, beam, -1), beam)
        cand_scores, cand_beams, cand_tokens = (
            torch.stack([c.double() for c in cand]).cpu().numpy()
        )  # the step's one read
        cand_beams, cand_tokens = cand_beams.astype(np.int64), cand_tokens.astype(np.int64)
        done, live = choose(cand_scores, cand_tokens, beam)
        begun = np.fromiter((rules.begun[s] for s in active), dtype=np.int64, count=b)
        lengths = t + 1 - begun  # each sentence's, with this step's token
        for row, col in zip(*np.nonzero(done)):
            s = active[row]
            tokens_so_far = self.history[row * beam + cand_beams[row, col]]
            tokens_so_far = tokens_so_far[len(tokens_so_far) - (lengths[row] - 1) :].tolist()
            penalty = length_penalty(int(lengths[row]), rules.alphas[s])
            self.finished[s].append(Hypothesis(tokens_so_far, float(cand_scores[row, col]) / penalty))
        live_scores = np.take_along_axis(cand_scores, live, 1)
        keep = _going_on(
            self.finished, active, live_scores, beam, self.nbest, rules.max_lens, rules.alphas, lengths
        )
        self.ended = np.setdiff1d(active, active[keep], assume_unique=True)
        if not len(keep) and not self.open:
            return None
        live_beams = np.take_along_axis(cand_beams, live, 1)[keep]
        rows = (keep[:, None] * beam + live_beams).reshape(-1)
        history = np.concatenate(
            [self.history[rows], np.take_along_axis(cand_tokens, live, 1)[keep].reshape(-1, 1)], 1
        )
        self.active = active[keep]
        if self.open and len(self.active):  # no longer than the longest live row's
            history = history[:, history.shape[1] - int(lengths[keep].max()) :]
        self.history = history
        index = torch.from_numpy(np.concatenate([keep, live[keep].reshape(-1), rows])).to(self.device)
        keep_t, live_t, rows_t = index.split([len(keep), len(rows), len(rows)])
        live_t = live_t.view(-1, beam)
        self.scores = cand[0].index_select(0, keep_t).gather(1, live_t)
        self.tokens = cand[2].index_select(0, keep_t).gather(1, live_t).view(-1, 1)
        rules.keep(rows, rows_t, self.tokens)
        return rows_t

    def found(self, sentence: int) -> list[Hypothesis]:
        """The `nbest` best finished hypotheses of an ended sentence, best first (forgotten here)."""
        return sorted(self.finished.pop(sentence), key=lambda h: -h.score)[: self.nbest]

    def join(self, max_lens: list[int], alphas: list[float]) -> list[int]:
        """Sentences begin at the next step (their limits and length penalties); their numbers."""
        added = self.rules.join(max_lens, alphas)
        n, beam = len(added), self.beam
        self.finished.update({s: [] for s in added})
        self.active = np.concatenate([self.active, np.asarray(added, dtype=np.int64)])
        self.history = np.concatenate([self.history, np.zeros((n * beam, self.history.shape[1]), np.int64)])
        scores = torch.full((n, beam), -math.inf, device=self.device)
        scores[:, 0] = 0.0
        self.scores = torch.cat([self.scores, scores])
        self.tokens = torch.cat(
            [self.tokens, torch.full((n * beam, 1), BOS, dtype=torch.long, device=self.device)]
        )
        return added

    def drop(self, sentences: list[int]) -> Tensor:
        """`sentences` leave now, unfinished (nobody waits for them): the rows that stay (indices,
        on the device), for the decoder's reorder."""
        keep = np.flatnonzero(~np.isin(self.active, sentences))
        for s in np.setdiff1d(self.active, self.active[keep]):
            del self.finished[int(s)]
        rows = (keep[:, None] * self.beam + np.arange(self.beam)).reshape(-1)
        self.active, self.history = self.active[keep], self.history[rows]
        rows_t = torch.from_numpy(rows).to(self.device)
        self.scores = self.scores.index_select(0, torch.from_numpy(keep).to(self.device))
        self.tokens = self.tokens.index_select(0, rows_t)
        self.rules.select(rows, rows_t)
        return rows_t


def _going_on(
    finished: dict[int, list[Hypothesis]],
    active: np.ndarray,
    live_scores: np.ndarray,
    beam: int,
    nbest: int,
    max_lens: list[int],
    alphas: list[float],
    lengths: np.ndarray,
) -> np.ndarray:
    """Which live sentences (indices into `active`) go on after a step to `lengths` tokens."""
    # Most sentences have fewer than `nbest` finished hypotheses and room to grow: they go on
    # without is_done's look at their scores (the per-sentence loop was a large part of the
    # host's work per step, which a GPU waits for).
    counts = np.fromiter((len(finished[s]) for s in active), dtype=np.int64, count=len(active))
    limits = np.maximum(
        np.fromiter((max_lens[s] for s in active), dtype=np.int64, count=len(active)), lengths
    )
    going = (counts < min(nbest, beam)) & (lengths < limits)
    for i in np.flatnonzero(~going):
        sentence = active[i]
        going[i] = not is_done(
            finished[sentence], live_scores[i], beam, nbest, int(limits[i]), alphas[sentence], int(lengths[i])
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
