"""One hypothesis per row, a token at a time: greedy search (beam 1 without the bookkeeping) and
sampling (Edunov et al. 2018's back-translation, diverse outputs), sharing one loop. `step`,
`reorder` and the rules (rules.NextToken) as in beam.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from nmt_cli.engine.hypothesis import Hypothesis, length_penalty
from nmt_cli.engine.rules import NextToken
from nmt_cli.vocab import BOS, EOS


def greedy(
    step: Callable[[Tensor], Tensor],
    reorder: Callable[[Tensor], None],
    rules: NextToken,
    device: torch.device | str = "cpu",
) -> list[list[Hypothesis]]:
    """The best next token at every step: beam 1 without the bookkeeping."""

    def best(lprobs: Tensor, rows: Tensor, t: int) -> Tensor:
        return lprobs.argmax(-1)

    return [[h] for h in _row_by_row(step, reorder, rules, best, device)]


def sample(
    step: Callable[[Tensor], Tensor],
    reorder: Callable[[Tensor], None],
    rules: NextToken,
    seeds: Sequence[int],
    device: torch.device | str = "cpu",
) -> list[Hypothesis]:
    """One translation per row (`rules` made with one row per draw), each token drawn from the
    model's distribution (shaped by the options' top-k, top-p and temperature), scored by the
    model's own log-probabilities.

    Each row draws from a random stream of its own (`seeds`), so a row gets the same draws
    whatever else is in its batch."""
    o = rules.options
    # every row's uniforms for all its steps, drawn at once from its own stream
    steps = max(rules.max_lens) + 1
    uniforms = torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(x)) for x in seeds])
    uniforms = uniforms.to(device)

    def drawn(lprobs: Tensor, rows: Tensor, t: int) -> Tensor:
        return draw(lprobs, uniforms[rows, t], o.topk, o.topp, o.temperature, o.epsilon)

    return _row_by_row(step, reorder, rules, drawn, device)


def _row_by_row(
    step: Callable[[Tensor], Tensor],
    reorder: Callable[[Tensor], None],
    rules: NextToken,
    choose_next: Callable[[Tensor, Tensor, int], Tensor],
    device: torch.device | str,
) -> list[Hypothesis]:
    """One hypothesis per row, each step's token chosen by `choose_next(lprobs, rows, t)` (rows:
    the live rows' first indices) among what `rules` allows (at its limit, a row's only choice
    is the EOS); a row stops alone. The host reads each step's tokens (and running scores)
    once."""
    n, alphas = len(rules.max_lens), rules.alphas
    out: list[Hypothesis] = [Hypothesis([], 0.0)] * n
    generated: list[list[int]] = [[] for _ in range(n)]
    active = np.arange(n)
    rows = torch.arange(n, device=device)
    tokens = torch.full((n, 1), BOS, dtype=torch.long, device=device)
    score = torch.zeros(n, device=device)
    t = 0
    while True:
        lprobs = rules(step(tokens).float())
        chosen = torch.where(rules.ending(), EOS, choose_next(lprobs, rows, t))
        score = score + lprobs.gather(1, chosen[:, None]).squeeze(1)
        chosen_h, score_h = torch.stack([chosen.double(), score.double()]).cpu().numpy()
        ended = chosen_h == EOS
        for i in np.flatnonzero(ended):
            out[active[i]] = Hypothesis(
                generated[active[i]], float(score_h[i]) / length_penalty(t + 1, alphas[active[i]])
            )
        keep = np.flatnonzero(~ended)
        if not len(keep):
            break
        for i in keep:
            generated[active[i]].append(int(chosen_h[i]))
        if len(keep) < len(active):
            keep_t = torch.from_numpy(keep).to(device)
            reorder(keep_t)
            chosen, score, rows = chosen[keep_t], score[keep_t], rows[keep_t]
            rules.keep(keep, keep_t, chosen)
        else:
            rules.keep(None, None, chosen)
        active, tokens = active[keep], chosen[:, None]
        t += 1
    return out


def draw(
    lprobs: Tensor, uniform: Tensor, topk: int, topp: float, temperature: float, epsilon: float = 0.0
) -> Tensor:
    """One token per row of `lprobs` (R, V): the inverse of the cumulative distribution, at
    `uniform` (R,), of the log-probabilities divided by `temperature`, without the tokens whose
    probability is below `epsilon` (but the likeliest), cut to the `topk` most likely tokens (0:
    all) and then to the fewest most likely whose probabilities reach `topp`. Any fixed order of
    the tokens draws alike: they are sorted only where a cut needs it."""
    probs = F.softmax(lprobs / temperature, dim=-1)
    if epsilon:
        likeliest = probs.amax(-1, keepdim=True)
        probs = probs.masked_fill((probs < epsilon) & (probs < likeliest), 0.0)
    order = None
    if topk:
        probs, order = probs.topk(min(topk, probs.shape[1]), dim=-1)
    elif topp < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
    if topp < 1.0:
        before = probs.cumsum(-1) - probs  # what the more likely tokens hold
        probs = probs.masked_fill(before >= topp * probs.sum(-1, keepdim=True), 0.0)
    total = probs.cumsum(-1)
    at = torch.searchsorted(total, (uniform * total[:, -1])[:, None], right=True).clamp_(
        max=probs.shape[1] - 1
    )
    return (order.gather(1, at) if order is not None else at).squeeze(1)


def seed_of(stream: int, draw: int) -> int:
    """The seed of a sentence's draw from its stream (hypothesis.stream_of)."""
    return (stream * 1_009 + draw) & (2**63 - 1)
