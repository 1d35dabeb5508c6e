"""Beam search over a batch of sentences at once, built from small pure functions.

`search` knows nothing of the Transformer: it asks `step(tokens)` for next-token log-probs of
every live row and tells `reorder(indices)` which rows survive. `translate` wires it to the
model and its DecoderCache. Rows are sentences x beams, each sentence's beams together.

A sentence stops once it has `beam` finished hypotheses, or when no live hypothesis can beat
its best finished one even with the most favourable length penalty it could still reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from nmt_cli.engine.model import DecoderCache, Transformer
from nmt_cli.shards import BOS, EOS, PAD


@dataclass
class Hypothesis:
    tokens: list[int]      # without BOS and EOS
    score: float           # log-probability divided by the length penalty


def length_penalty(length: int | Tensor, alpha: float):
    """GNMT's ((5 + |Y|) / 6) ** alpha, |Y| counting the EOS."""
    return ((5.0 + length) / 6.0) ** alpha


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


def choose(cand_scores: Tensor, cand_beams: Tensor, cand_tokens: Tensor,
           beam: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Split the candidates: EOS among the best `beam` finish; the best `beam` others live on.

    Returns (finished mask (B, 2*beam), and the live scores, beams and tokens, (B, beam) each).
    There are at most `beam` EOS candidates (one per beam), so `beam` others always exist.
    """
    is_eos = cand_tokens == EOS
    rank = torch.arange(cand_scores.shape[1], device=cand_scores.device)
    finished = is_eos & (rank < beam)[None, :] & torch.isfinite(cand_scores)
    live_scores, pick = cand_scores.masked_fill(is_eos, -math.inf).topk(beam, dim=1)
    return finished, live_scores, cand_beams.gather(1, pick), cand_tokens.gather(1, pick)


def search(step: Callable[[Tensor], Tensor], reorder: Callable[[Tensor], None],
           max_lens: list[int], beam: int, alpha: float, nbest: int = 1,
           device: torch.device | str = "cpu") -> list[list[Hypothesis]]:
    """Beam search for len(max_lens) sentences; the `nbest` best hypotheses of each, best first.

    step(tokens (R, 1)) -> log-probs (R, V) of the next token of each live row.
    reorder(indices (R',)) keeps those rows (of the last step's R) for the next step.
    """
    n = len(max_lens)
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    active = list(range(n))                      # sentence ids of the live rows' groups
    scores = torch.full((n, beam), -math.inf, device=device)
    scores[:, 0] = 0.0                           # at first every beam is the same: keep one
    history = torch.full((n * beam, 1), BOS, dtype=torch.long, device=device)
    limits = torch.tensor(max_lens, device=device)
    t = 0
    while active:
        lprobs = step(history[:, -1:]).float()                  # (R, V)
        lprobs[:, PAD] = -math.inf
        lprobs[:, BOS] = -math.inf
        at_limit = (limits[active] <= t + 1).repeat_interleave(beam)
        if at_limit.any():                                      # only EOS may follow
            eos = lprobs[at_limit, EOS].clone()
            lprobs[at_limit] = -math.inf
            lprobs[at_limit, EOS] = eos
        b = len(active)
        cand = beam_step(scores, lprobs.view(b, beam, -1), beam)
        done, live_scores, live_beams, live_tokens = choose(*cand, beam)
        for row, col in done.nonzero().tolist():
            src_row = row * beam + int(cand[1][row, col])
            finished[active[row]].append(Hypothesis(
                history[src_row, 1:].tolist(),
                float(cand[0][row, col]) / length_penalty(t + 1, alpha)))
        keep = [i for i in range(b)
                if not _is_done(finished[active[i]], live_scores[i], beam, nbest,
                                max(int(limits[active[i]]), t + 1), alpha, t + 1)]
        if not keep:
            break
        keep_t = torch.tensor(keep, device=device)
        rows = (keep_t[:, None] * beam + live_beams[keep_t]).view(-1)
        history = torch.cat([history[rows], live_tokens[keep_t].view(-1, 1)], dim=1)
        scores = live_scores[keep_t]
        active = [active[i] for i in keep]
        reorder(rows)
        t += 1
    return [sorted(f, key=lambda h: -h.score)[:nbest] for f in finished]


def _is_done(finished: list[Hypothesis], live: Tensor, beam: int, nbest: int, limit: int,
             alpha: float, length: int) -> bool:
    if len(finished) >= beam or length >= limit:
        return True
    if len(finished) < nbest:
        return False
    # Log-probs only fall as a hypothesis grows; the kindest penalty is that of the longest
    # length still allowed, so this bounds what any live hypothesis can reach.
    best_live = float(live.max()) / length_penalty(limit, alpha)
    worst_kept = sorted((h.score for h in finished), reverse=True)[nbest - 1]
    return worst_kept >= best_live


def greedy(step: Callable[[Tensor], Tensor], reorder: Callable[[Tensor], None],
           max_lens: list[int], alpha: float,
           device: torch.device | str = "cpu") -> list[list[Hypothesis]]:
    """The best next token at every step: beam 1 without the bookkeeping."""
    n = len(max_lens)
    out: list[list[Hypothesis]] = [[] for _ in range(n)]
    generated: list[list[int]] = [[] for _ in range(n)]
    active = torch.arange(n, device=device)
    tokens = torch.full((n, 1), BOS, dtype=torch.long, device=device)
    score = torch.zeros(n, device=device)
    limits = torch.tensor(max_lens, device=device)
    t = 0
    while len(active):
        lprobs = step(tokens).float()
        lprobs[:, PAD] = -math.inf
        lprobs[:, BOS] = -math.inf
        forced = limits[active] <= t + 1
        best = torch.where(forced, torch.full_like(active, EOS), lprobs.argmax(-1))
        score = score + lprobs.gather(1, best[:, None]).squeeze(1)
        ended = best == EOS
        for i, (s, token, end) in enumerate(zip(active.tolist(), best.tolist(), ended.tolist())):
            if end:
                out[s] = [Hypothesis(generated[s], float(score[i]) / length_penalty(t + 1, alpha))]
            else:
                generated[s].append(token)
        keep = (~ended).nonzero().flatten()
        if len(keep) == 0:
            break
        if len(keep) < len(active):
            reorder(keep)
        active, score, tokens = active[keep], score[keep], best[keep][:, None]
        t += 1
    return out


@torch.no_grad()
def translate(model: Transformer, src: Tensor, beam: int = 4, alpha: float = 0.6,
              max_len_a: float = 1.0, max_len_b: int = 50, nbest: int = 1,
              use_cache: bool = True) -> list[list[Hypothesis]]:
    """Translate a padded (B, S) batch of source ids (with EOS); `nbest` hypotheses each."""
    model.eval()
    src_lengths = (src != PAD).sum(1).tolist()
    ceiling = model.config.max_positions - 1
    max_lens = [max(1, min(int(max_len_a * (n - 1) + max_len_b), ceiling)) for n in src_lengths]
    memory, src_mask = model.encode(src)
    k = 1 if beam == 1 else beam
    if use_cache:
        cache = DecoderCache(model.memory_keys_values(memory), src_mask, k, max(max_lens) + 1)

        def step(tokens: Tensor) -> Tensor:
            h = model.decode(tokens, cache.memory_kv, cache.src_mask, cache)
            return F.log_softmax(model.logits(h[:, -1]).float(), dim=-1)

        reorder = cache.reorder
    else:  # the reference: rerun the whole decoder on the prefix at every step
        state = {"memory": memory.repeat_interleave(k, 0), "mask": src_mask.repeat_interleave(k, 0),
                 "prefix": torch.full((len(src_lengths) * k, 0), BOS, dtype=torch.long,
                                      device=src.device)}

        def step(tokens: Tensor) -> Tensor:
            state["prefix"] = torch.cat([state["prefix"], tokens], dim=1)
            kv = model.memory_keys_values(state["memory"])
            h = model.decode(state["prefix"], kv, state["mask"])
            return F.log_softmax(model.logits(h[:, -1]).float(), dim=-1)

        def reorder(indices: Tensor) -> None:
            for key in state:
                state[key] = state[key].index_select(0, indices)

    if beam == 1 and nbest == 1:
        return greedy(step, reorder, max_lens, alpha, src.device)
    return search(step, reorder, max_lens, k, alpha, nbest, src.device)
