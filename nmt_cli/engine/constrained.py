"""Beam search whose translations must contain given target phrases (terminology): dynamic beam
allocation (Post and Vilar 2018) in the form of Hu et al. 2019, as fairseq's --constraints.

A hypothesis's bank is how many constraint tokens it has met. At each step a sentence's candidates
are beam.py's best continuations, each hypothesis's own best next token, and every token that
takes a hypothesis on through a constraint; the beam is then shared out among the banks round
robin (the best of the most advanced bank, the best of the next, ..., then the second best of
each), so that hypotheses that met more constraints are not crowded out by likelier ones that
met fewer. A hypothesis may end only once it has met all its constraints; the search gives each
sentence room for them, and the most advanced bank's best goes on every step, so one that has
met them all is found whenever they fit within the model's positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from nmt_cli.engine.beam import beam_step, is_done
from nmt_cli.engine.hypothesis import Hypothesis, length_penalty
from nmt_cli.engine.rules import NextToken
from nmt_cli.vocab import BOS, EOS


@dataclass(frozen=True)
class Progress:
    """How far a hypothesis has come through its sentence's constraints (token id sequences):
    those it has met, and the one it is inside (`at` of its tokens matched)."""

    met: frozenset[int] = frozenset()
    inside: int = -1
    at: int = 0

    def after(self, token: int, constraints: Sequence[Sequence[int]]) -> Progress:
        if self.inside >= 0:
            phrase = constraints[self.inside]
            if phrase[self.at] == token:
                if self.at + 1 == len(phrase):
                    return Progress(self.met | {self.inside})
                return Progress(self.met, self.inside, self.at + 1)
        # a phrase broken off is begun again from nothing: a token may start another one
        for j, phrase in enumerate(constraints):
            if j not in self.met and phrase[0] == token:
                return Progress(self.met | {j}) if len(phrase) == 1 else Progress(self.met, j, 1)
        return Progress(self.met) if self.inside >= 0 else self

    def bank(self, constraints: Sequence[Sequence[int]]) -> int:
        return sum(len(constraints[j]) for j in self.met) + self.at

    def wanted(self, constraints: Sequence[Sequence[int]]) -> list[int]:
        """The tokens that take it on: the next of the phrase it is inside, the first of each
        phrase it has not met."""
        out = [constraints[self.inside][self.at]] if self.inside >= 0 else []
        return out + [p[0] for j, p in enumerate(constraints) if j not in self.met and j != self.inside]

    def done(self, constraints: Sequence[Sequence[int]]) -> bool:
        return len(self.met) == len(constraints)


Candidate = tuple[float, int, int, Progress]  # score, the beam it extends, its token, its progress


def allocate(candidates: list[Candidate], banks: list[int], width: int) -> list[int]:
    """The `width` candidates (indices) that go on, in the order beam.choose reads them: round
    robin over the banks, the most advanced first, each bank's own best first."""
    order = sorted(range(len(candidates)), key=lambda i: (-banks[i], -candidates[i][0]))
    top = max(banks) if banks else 0
    stripes, seen, last = {}, 0, None
    for i in order:
        seen = seen + 1 if banks[i] == last else 0
        last = banks[i]
        stripes[i] = seen * (top + 1) + (top - banks[i])
    return sorted(order, key=lambda i: stripes[i])[:width]


def search(
    step: Callable[[Tensor], Tensor],
    reorder: Callable[[Tensor], None],
    rules: NextToken,
    constraints: Sequence[Sequence[Sequence[int]]],
    device: torch.device | str = "cpu",
) -> list[list[Hypothesis]]:
    """beam.search for sentences with `constraints` (per sentence, its phrases as ids; [] for
    none): the `nbest` best hypotheses that contain all of a sentence's phrases. The host keeps
    each row's progress and tokens, as beam.search keeps its tokens. Besides `rules`, a row may
    end only once it has met its phrases (or at its limit)."""
    o, max_lens = rules.options, rules.max_lens
    beam, alphas, nbest = o.beam, rules.alphas, o.nbest
    n, k = len(max_lens), beam
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    short: list[list[Hypothesis]] = [[] for _ in range(n)]  # cut at the limit with phrases unmet
    active = np.arange(n)
    history: list[list[int]] = [[] for _ in range(n * k)]
    progress = [Progress()] * (n * k)
    scores = np.full((n, k), -math.inf)
    scores[:, 0] = 0.0  # at first every beam is the same: keep one
    tokens = torch.full((n * k, 1), BOS, dtype=torch.long, device=device)
    t = 0
    while True:
        phrases = [constraints[int(s)] for s in active]
        lprobs = rules(step(tokens).float())
        found = _candidates(lprobs, scores, progress, phrases, rules.at_limit())
        keep, rows, going = [], [], []
        for i, s in enumerate(active):
            mine = slice(i * k, i * k + k)
            ended, live = _choose(found[i], progress[mine], phrases[i], k)
            for score, j, p in ended:
                h = Hypothesis(history[i * k + j], score / length_penalty(t + 1, alphas[s]))
                (finished if p.done(phrases[i]) else short)[s].append(h)
            best = np.array([c[0] for c in live] or [-math.inf])
            if not live or is_done(finished[s], best, k, nbest, max(max_lens[s], t + 1), alphas[s], t + 1):
                continue
            keep.append(i)
            # a sentence with fewer candidates than beams keeps dead rows
            live += [(-math.inf, 0, EOS, Progress())] * (k - len(live))
            rows += [i * k + j for _, j, _, _ in live]
            going += live
        if not keep:
            break
        active = active[keep]
        scores = np.array([c[0] for c in going]).reshape(-1, k)
        progress = [c[3] for c in going]
        history = [history[r] + [c[2]] for r, c in zip(rows, going)]
        tokens = torch.tensor([c[2] for c in going], device=device)[:, None]
        rows_t = torch.tensor(rows, device=device)
        rules.keep(np.array(rows, dtype=np.int64), rows_t, tokens)
        reorder(rows_t)
        t += 1
    return [
        (sorted(f, key=lambda h: -h.score) + sorted(c, key=lambda h: -h.score))[:nbest]
        for f, c in zip(finished, short)
    ]


def _candidates(
    lprobs: Tensor,
    scores: np.ndarray,
    progress: list[Progress],
    phrases: list[Sequence[Sequence[int]]],
    at_limit: np.ndarray,
) -> list[dict[tuple[int, int], float]]:
    """Each live sentence's candidates, (beam, token) -> score: beam.py's best 2*beam, each
    hypothesis's own best token, and each token that takes a hypothesis on through a phrase.
    `lprobs` (R, V) of the rows (sentences x beams), `scores` (sentences, beams) theirs so far.
    A row that has not met all its phrases may end only at its limit. The host reads once."""
    b, k = scores.shape
    unmet = [not p.done(phrases[r // k]) and not at_limit[r] for r, p in enumerate(progress)]
    lprobs[torch.tensor(unmet, device=lprobs.device), EOS] = -math.inf
    wanted = [(r, w) for r, p in enumerate(progress) for w in p.wanted(phrases[r // k])]
    top = beam_step(torch.from_numpy(scores).float().to(lprobs.device), lprobs.view(b, k, -1), k)
    best_lp, best_tok = lprobs.max(-1)
    at = torch.tensor(wanted or [(0, 0)], device=lprobs.device)
    read = torch.cat([x.double().reshape(-1) for x in (*top, best_lp, best_tok, lprobs[at[:, 0], at[:, 1]])])
    top_scores, top_beams, top_tokens, best_lp_h, best_tok_h, wanted_lp = np.split(
        read.cpu().numpy(), np.cumsum([b * 2 * k] * 3 + [b * k] * 2)
    )
    found: list[dict[tuple[int, int], float]] = [{} for _ in range(b)]
    for i, (score, j, token) in enumerate(zip(top_scores, top_beams, top_tokens)):
        found[i // (2 * k)][(int(j), int(token))] = float(score)
    extra = [(r, int(best_tok_h[r]), best_lp_h[r]) for r in range(b * k)]
    for r, token, lp in extra + [(r, w, lp) for (r, w), lp in zip(wanted, wanted_lp)]:
        found[r // k].setdefault((r % k, token), scores[r // k, r % k] + lp)
    return found


def _choose(
    found: dict[tuple[int, int], float], progress: list[Progress], phrases: Sequence[Sequence[int]], k: int
) -> tuple[list[tuple[float, int, Progress]], list[Candidate]]:
    """One sentence's step, as beam.choose: of its candidates in the banks' round-robin order,
    the EOS among the first `k` end (score, beam, progress); the first `k` others live on."""
    candidates = [
        (score, j, token, progress[j] if token == EOS else progress[j].after(token, phrases))
        for (j, token), score in found.items()
        if score > -math.inf
    ]
    ended: list[tuple] = []
    live: list[tuple] = []
    for rank, c in enumerate(allocate(candidates, [c[3].bank(phrases) for c in candidates], 2 * k)):
        score, j, token, p = candidates[c]
        if token == EOS:
            if rank < k:
                ended.append((score, j, p))
        elif len(live) < k:
            live.append(candidates[c])
    return ended, live
