"""Beam search over a batch of sentences at once, built from small pure functions.

`search` knows nothing of the Transformer: it asks `step(tokens)` for next-token log-probs of
every live row and tells `reorder(indices)` which rows survive. `translate` wires it to the
model and its DecoderCache. Rows are sentences x beams, each sentence's beams together.

A sentence stops once it has `beam` finished hypotheses, or when no live hypothesis can beat
its best finished one even with the most favourable length penalty it could still reach.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from nmt_cli.config import DecodeOptions
from nmt_cli.engine.cache import DecoderCache
from nmt_cli.engine.hypothesis import Hypothesis, length_penalty, max_lengths
from nmt_cli.engine.model import Transformer
from nmt_cli.vocab import BOS, EOS, PAD


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
    max_lens: list[int],
    beam: int,
    alpha: float,
    nbest: int = 1,
    device: torch.device | str = "cpu",
    forced: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Beam search for len(max_lens) sentences; the `nbest` best hypotheses of each, best first.
    `forced` (n, P): each sentence's first tokens, -1 after its own (a target prefix).

    step(tokens (R, 1)) -> log-probs (R, V) of the next token of each live row.
    reorder(indices (R',)) keeps those rows (of the last step's R) for the next step.

    The device ranks the candidates; the host reads them once per step (2*beam per sentence)
    and keeps the bookkeeping: the hypotheses' tokens, who finished, who lives on.
    """
    n = len(max_lens)
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    active = np.arange(n)  # sentence of each live group of `beam` rows
    history = np.zeros((n * beam, 0), dtype=np.int64)  # each live row's tokens so far
    scores = torch.full((n, beam), -math.inf, device=device)
    scores[:, 0] = 0.0  # at first every beam is the same: keep one
    tokens = torch.full((n * beam, 1), BOS, dtype=torch.long, device=device)
    limits = torch.tensor(max_lens, device=device)  # per live sentence
    t = 0
    while True:
        lprobs = _allowed(step(tokens).float(), (limits <= t + 1).repeat_interleave(beam))  # (R, V)
        if forced is not None and t < forced.shape[1]:
            lprobs = _force(lprobs, forced[:, t].repeat_interleave(beam))
        b = len(active)
        cand = beam_step(scores, lprobs.view(b, beam, -1), beam)
        cand_scores, cand_beams, cand_tokens = (
            torch.stack([c.double() for c in cand]).cpu().numpy()
        )  # the step's one read
        cand_beams, cand_tokens = cand_beams.astype(np.int64), cand_tokens.astype(np.int64)
        done, live = choose(cand_scores, cand_tokens, beam)
        penalty = length_penalty(t + 1, alpha)
        for row, col in zip(*np.nonzero(done)):
            tokens_so_far = history[row * beam + cand_beams[row, col]].tolist()
            finished[active[row]].append(Hypothesis(tokens_so_far, float(cand_scores[row, col]) / penalty))
        live_scores = np.take_along_axis(cand_scores, live, 1)
        keep = _going_on(finished, active, live_scores, beam, nbest, max_lens, alpha, t + 1)
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
        limits = limits.index_select(0, keep_t)
        if forced is not None:
            forced = forced.index_select(0, keep_t)
        reorder(rows_t)
        t += 1
    return [sorted(f, key=lambda h: -h.score)[:nbest] for f in finished]


def _allowed(lprobs: Tensor, at_limit: Tensor) -> Tensor:
    """`lprobs` (R, V) with what may never come next banned, in place: PAD and BOS anywhere,
    and anything but EOS in a row at its length limit (`at_limit`, (R,))."""
    eos = lprobs[:, EOS].clone()
    lprobs[:, PAD] = -math.inf
    lprobs[:, BOS] = -math.inf
    lprobs.masked_fill_(at_limit[:, None], -math.inf)
    lprobs[:, EOS] = eos
    return lprobs


def _force(lprobs: Tensor, tokens: Tensor) -> Tensor:
    """`lprobs` (R, V) where each row with a token in `tokens` (R,) may take only that one (a
    prefix's); rows with -1 are left as they are."""
    at = tokens.clamp(min=0)[:, None]
    only = torch.full_like(lprobs, -math.inf).scatter_(1, at, lprobs.gather(1, at))
    return torch.where((tokens >= 0)[:, None], only, lprobs)


def _going_on(
    finished: list[list[Hypothesis]],
    active: np.ndarray,
    live_scores: np.ndarray,
    beam: int,
    nbest: int,
    max_lens: list[int],
    alpha: float,
    length: int,
) -> np.ndarray:
    """Which live sentences (indices into `active`) go on after a step to `length` tokens."""
    going = [
        i
        for i, sentence in enumerate(active)
        if not _is_done(
            finished[sentence], live_scores[i], beam, nbest, max(max_lens[sentence], length), alpha, length
        )
    ]
    return np.array(going, dtype=np.int64)


def _is_done(
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


def greedy(
    step: Callable[[Tensor], Tensor],
    reorder: Callable[[Tensor], None],
    max_lens: list[int],
    alpha: float,
    device: torch.device | str = "cpu",
    forced: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """The best next token at every step: beam 1 without the bookkeeping. `forced` as in
    `search`."""

    def best(lprobs: Tensor, rows: Tensor, t: int) -> Tensor:
        return lprobs.argmax(-1)

    return [[h] for h in _row_by_row(step, reorder, max_lens, alpha, best, device, forced)]


def sample(
    step: Callable[[Tensor], Tensor],
    reorder: Callable[[Tensor], None],
    max_lens: list[int],
    options: DecodeOptions,
    seeds: Sequence[int],
    device: torch.device | str = "cpu",
    forced: Tensor | None = None,
) -> list[Hypothesis]:
    """One translation per row, each token drawn from the model's distribution (shaped by
    top-k, top-p and temperature), scored by the model's own log-probabilities.

    Each row draws from a random stream of its own (`seeds`), so a row gets the same draws
    whatever else is in its batch."""
    # every row's uniforms for all its steps, drawn at once from its own stream
    steps = max(max_lens) + 1
    uniforms = torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(x)) for x in seeds])
    uniforms = uniforms.to(device)

    def drawn(lprobs: Tensor, rows: Tensor, t: int) -> Tensor:
        return draw(lprobs, uniforms[rows, t], options.topk, options.topp, options.temperature)

    return _row_by_row(step, reorder, max_lens, options.alpha, drawn, device, forced)


def _row_by_row(
    step: Callable[[Tensor], Tensor],
    reorder: Callable[[Tensor], None],
    max_lens: list[int],
    alpha: float,
    choose_next: Callable[[Tensor, Tensor, int], Tensor],
    device: torch.device | str,
    forced: Tensor | None,
) -> list[Hypothesis]:
    """One hypothesis per row, each step's token chosen by `choose_next(lprobs, rows, t)` (rows:
    the live rows' first indices); a row stops alone. The host reads each step's tokens (and
    running scores) once."""
    n = len(max_lens)
    out: list[Hypothesis] = [Hypothesis([], 0.0)] * n
    generated: list[list[int]] = [[] for _ in range(n)]
    active = np.arange(n)
    rows = torch.arange(n, device=device)
    tokens = torch.full((n, 1), BOS, dtype=torch.long, device=device)
    score = torch.zeros(n, device=device)
    limits = torch.tensor(max_lens, device=device)
    t = 0
    while True:
        lprobs = step(tokens).float()
        lprobs[:, PAD] = -math.inf
        lprobs[:, BOS] = -math.inf
        if forced is not None and t < forced.shape[1]:
            lprobs = _force(lprobs, forced[:, t])
        # at its limit a row ends, whatever its model makes of the EOS: no need to mask the rest
        chosen = torch.where(limits <= t + 1, EOS, choose_next(lprobs, rows, t))
        score = score + lprobs.gather(1, chosen[:, None]).squeeze(1)
        chosen_h, score_h = torch.stack([chosen.double(), score.double()]).cpu().numpy()
        ended = chosen_h == EOS
        for i in np.flatnonzero(ended):
            out[active[i]] = Hypothesis(
                generated[active[i]], float(score_h[i]) / length_penalty(t + 1, alpha)
            )
        keep = np.flatnonzero(~ended)
        if not len(keep):
            break
        for i in keep:
            generated[active[i]].append(int(chosen_h[i]))
        if len(keep) < len(active):
            keep_t = torch.from_numpy(keep).to(device)
            reorder(keep_t)
            chosen, score, limits, rows = chosen[keep_t], score[keep_t], limits[keep_t], rows[keep_t]
            forced = forced[keep_t] if forced is not None else None
        active, tokens = active[keep], chosen[:, None]
        t += 1
    return out


def draw(lprobs: Tensor, uniform: Tensor, topk: int, topp: float, temperature: float) -> Tensor:
    """One token per row of `lprobs` (R, V): the inverse of the cumulative distribution, at
    `uniform` (R,), of the log-probabilities divided by `temperature`, cut to the `topk` most
    likely tokens (0: all) and then to the fewest most likely whose probabilities reach `topp`.
    Any fixed order of the tokens draws alike: they are sorted only where a cut needs it."""
    probs = F.softmax(lprobs / temperature, dim=-1)
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


def _seed(seed: int, key: int, draw: int) -> int:
    """A random stream's seed from --seed, a sentence's key (its line number) and the draw."""
    return ((seed * 1_000_003 + key) * 1_009 + draw) & (2**63 - 1)


@torch.no_grad()
def translate(
    model: Transformer | Sequence[Transformer],
    src: Tensor,
    options: DecodeOptions = DecodeOptions(),
    use_cache: bool = True,
    keys: Sequence[int] | None = None,
    prefixes: Sequence[Sequence[int]] | None = None,
) -> list[list[Hypothesis]]:
    """Translate a padded (B, S) batch of source ids (with EOS); `options.nbest` hypotheses each.
    `keys`: the sentences' line numbers, which seed --sample's draws (default: 0, 1, ...).
    `prefixes`: the ids each translation must begin with (none: []).

    Several models (an ensemble sharing one vocabulary) search together: each keeps its own
    encoder output and cache, and a step's log-probs are the mean of theirs."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    src_lengths = (src != PAD).sum(1).tolist()
    ceiling = min(m.config.max_positions for m in models) - 1
    o = options
    max_lens = max_lengths([n - 1 for n in src_lengths], o.max_len_a, o.max_len_b, ceiling)
    forced = None
    if prefixes is not None and any(prefixes):
        max_lens = [max(n, min(len(p) + 1, ceiling)) for n, p in zip(max_lens, prefixes)]
        forced = _prefix_tensor(prefixes, src.device)
    keys = range(len(max_lens)) if keys is None else keys
    if o.sample:  # each draw a row of its own, as a sentence of its own
        src = src.repeat_interleave(o.nbest, 0)
        max_lens = [n for n in max_lens for _ in range(o.nbest)]
        forced = forced.repeat_interleave(o.nbest, 0) if forced is not None else None
    k = 1 if o.sample else o.beam
    step, reorder = _together([_decoder(m, src, k, max(max_lens) + 1, use_cache) for m in models])
    if o.sample:
        seeds = [_seed(o.seed, key, j) for key in keys for j in range(o.nbest)]
        drawn = sample(step, reorder, max_lens, o, seeds, src.device, forced)
        groups = [drawn[i : i + o.nbest] for i in range(0, len(drawn), o.nbest)]
        return [sorted(g, key=lambda h: -h.score) for g in groups]
    if o.beam == 1 and o.nbest == 1:
        return greedy(step, reorder, max_lens, o.alpha, src.device, forced)
    return search(step, reorder, max_lens, k, o.alpha, o.nbest, src.device, forced)


def _prefix_tensor(prefixes: Sequence[Sequence[int]], device: torch.device | str) -> Tensor:
    """(n, P): each sentence's prefix ids, -1 after them."""
    out = np.full((len(prefixes), max(len(p) for p in prefixes)), -1, dtype=np.int64)
    for row, p in enumerate(prefixes):
        out[row, : len(p)] = p
    return torch.from_numpy(out).to(device)


def _together(
    parts: list[tuple[Callable[[Tensor], Tensor], Callable[[Tensor], None]]],
) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], None]]:
    """One `step` and `reorder` for several models' (an ensemble): the mean of their log-probs."""
    if len(parts) == 1:
        return parts[0]

    def step(tokens: Tensor) -> Tensor:
        return torch.stack([own(tokens) for own, _ in parts]).mean(0)

    def reorder(indices: Tensor) -> None:
        for _, own in parts:
            own(indices)

    return step, reorder


def _decoder(
    model: Transformer, src: Tensor, k: int, max_len: int, use_cache: bool
) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], None]]:
    """`step` and `reorder` of one model for `search`, over `k` rows per sentence of `src`."""
    model.eval()
    memory, src_mask = model.encode(src)
    if use_cache:
        cache = DecoderCache(model.memory_keys_values(memory), src_mask, k, max_len)

        def step(tokens: Tensor) -> Tensor:
            h = model.decode(tokens, cache.memory_kv, cache.src_mask, cache)
            return F.log_softmax(model.logits(h[:, -1]).float(), dim=-1)

        return step, cache.reorder
    # The reference: rerun the decoder's self-attention on the whole prefix every step (the
    # encoder side, memory and its keys/values, is computed once all the same).
    state = {
        "kv": model.memory_keys_values(memory.repeat_interleave(k, 0)),
        "mask": src_mask.repeat_interleave(k, 0),
        "prefix": torch.full((src.shape[0] * k, 0), BOS, dtype=torch.long, device=src.device),
    }

    def step_uncached(tokens: Tensor) -> Tensor:
        state["prefix"] = torch.cat([state["prefix"], tokens], dim=1)
        h = model.decode(state["prefix"], state["kv"], state["mask"])
        return F.log_softmax(model.logits(h[:, -1]).float(), dim=-1)

    def reorder(indices: Tensor) -> None:
        state["kv"] = [(a.index_select(0, indices), b.index_select(0, indices)) for a, b in state["kv"]]
        state["mask"] = state["mask"].index_select(0, indices)
        state["prefix"] = state["prefix"].index_select(0, indices)

    return step_uncached, reorder
