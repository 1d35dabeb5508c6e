"""What may come next: the rules every search applies to its rows' next-token log-probs, in one
place. Beam search, constrained beam search, greedy search and sampling each build one
`NextToken` from the options and the sentences, ask it to shape every step's log-probs before
they choose, and tell it which rows go on.

The rules: PAD and BOS never come next; a row at its length limit (counting the EOS) may take
only the EOS; before `min_len` tokens it may not take the EOS (unless at its limit); with
`no_repeat_ngram` N no token may complete an N-gram the row already holds; a row with a forced
prefix takes the prefix's token while it lasts, whatever the other rules say. The bans are
applied to the log-probs as they are, not renormalised (as fairseq's --min-len and
--no-repeat-ngram-size do). One rule changes the logits before their softmax instead, as
CTRL and CTranslate2 define it: `repetition_penalty` P scales down the logit of every token the
row already holds (`logits`, which each model's step calls). A new rule on the next token is one
more here, with its option in config.translation.DecodeOptions and its mapping in backend_ct2.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from nmt_cli.config import DecodeOptions
from nmt_cli.vocab import BOS, EOS, PAD


class NextToken:
    """The rules for one search over len(max_lens) sentences of `rows` rows each (the beam, or 1),
    rows of a sentence together. `forced` (sentences, P): each sentence's first tokens, -1 after
    its own. Row state (limits, forced tokens) follows the rows the search keeps (`keep`).
    Sentences may also `join` a search between its steps (nmt serve's running batch): their
    rows begin at that step, so a row's length is the steps since its sentence began; the
    limits are kept as the step at which each row must end."""

    def __init__(
        self,
        options: DecodeOptions,
        max_lens: Sequence[int],
        rows: int,
        device: torch.device | str = "cpu",
        forced: Tensor | None = None,
        alphas: Sequence[float] | None = None,
    ):
        self.options, self.max_lens = options, list(max_lens)
        # each sentence's length penalty: what ranks its finished hypotheses and ends its search
        self.alphas = list(alphas) if alphas is not None else [options.alpha] * len(self.max_lens)
        self.t = 0  # steps taken: the tokens of each row of a sentence that began at 0
        self.rows = rows
        self.begun = [0] * len(self.max_lens)  # the step at which each sentence began
        self.limits_host = np.repeat(np.asarray(max_lens, dtype=np.int64), rows)
        self.sentence = np.repeat(np.arange(len(self.max_lens)), rows)  # each live row's
        self.limits = torch.from_numpy(self.limits_host).to(device)
        self.row_begun: np.ndarray | None = None  # (R,) the step each row began at, once one joined
        self.forced = forced.repeat_interleave(rows, 0) if forced is not None else None
        # each row's tokens so far, kept only for a rule that reads them
        self.history = (
            torch.zeros((len(self.limits_host), 0), dtype=torch.long, device=device)
            if options.no_repeat_ngram
            else None
        )
        self.seen: Tensor | None = None  # (R, V) which tokens each row holds, for the penalty

    def logits(self, logits: Tensor) -> Tensor:
        """This step's `logits` (R, V) of the live rows with the repetition penalty applied."""
        p = self.options.repetition_penalty
        if p == 1.0:
            return logits
        if self.seen is None:
            self.seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        return torch.where(self.seen, torch.where(logits < 0, logits * p, logits / p), logits)

    def __call__(self, lprobs: Tensor) -> Tensor:
        """This step's `lprobs` (R, V) of the live rows, in place, with what may not come next at
        -inf."""
        kept = None  # a prefix's tokens and their own log-probs, whatever the bans below say
        if self.forced is not None and self.t < self.forced.shape[1]:
            tokens = self.forced[:, self.t]
            kept = tokens, lprobs.gather(1, tokens.clamp(min=0)[:, None])
        # The host knows whether any row is at its limit: most steps skip the kernels that end one.
        at_limit = self.ending() if self.at_limit().any() else None
        lprobs = allowed(lprobs, at_limit)
        early = self._early()
        if early is True:  # no EOS yet, but in a row that must end here
            eos = lprobs[:, EOS]
            lprobs[:, EOS] = -math.inf if at_limit is None else torch.where(at_limit, eos, -math.inf)
        elif early is not None:  # ... in the rows that began less than min_len steps ago
            ban = torch.from_numpy(early).to(lprobs.device)
            if at_limit is not None:
                ban &= ~at_limit
            lprobs[:, EOS] = lprobs[:, EOS].masked_fill(ban, -math.inf)
        if self.history is not None and self.t >= self.options.no_repeat_ngram - 1:
            ban_repeats(lprobs, self.history, self.options.no_repeat_ngram)
        if kept is not None:
            lprobs = force(lprobs, *kept)
        return lprobs

    def _early(self) -> bool | np.ndarray | None:
        """Which rows may not take the EOS yet (below min_len): True for all, None for none."""
        if self.row_begun is None:
            return True if self.t < self.options.min_len else None
        early = self.t - self.row_begun < self.options.min_len
        return True if early.all() else early if early.any() else None

    def join(self, max_lens: Sequence[int], alphas: Sequence[float]) -> list[int]:
        """Sentences begin at this step (their limits `max_lens`, length penalties `alphas`), their
        rows after the live ones; their numbers. Not with a prefix or a rule that reads a row's
        tokens (no_repeat_ngram): those need every row to have begun together."""
        if self.forced is not None or self.history is not None:
            raise ValueError("sentences join a search without prefixes or no_repeat_ngram")
        first, n = len(self.max_lens), len(max_lens)
        self.max_lens += list(max_lens)
        self.alphas += list(alphas)
        self.begun += [self.t] * n
        begun = np.full(n * self.rows, self.t, dtype=np.int64)
        self.row_begun = begun if self.row_begun is None else np.concatenate([self.row_begun, begun])
        limits = np.repeat(np.asarray(max_lens, dtype=np.int64) + self.t, self.rows)
        self.limits_host = np.concatenate([self.limits_host, limits])
        self.sentence = np.concatenate([self.sentence, np.repeat(np.arange(first, first + n), self.rows)])
        self.limits = torch.from_numpy(self.limits_host).to(self.limits.device)
        if self.seen is not None:
            self.seen = torch.cat([self.seen, self.seen.new_zeros((n * self.rows, self.seen.shape[1]))])
        return list(range(first, first + n))

    def end(self, sentences: Sequence[int]) -> None:
        """`sentences` end at this step, their limit now (nobody waits for them any more): their
        rows may take only the EOS, a prefix no longer forced, and the search ends them there."""
        for s in sentences:
            self.max_lens[s] = min(self.max_lens[s], self.t - self.begun[s] + 1)
        rows = np.isin(self.sentence, sentences)
        if not rows.any():  # all finished already
            return
        self.limits_host = np.where(rows, np.minimum(self.limits_host, self.t + 1), self.limits_host)
        self.limits = torch.from_numpy(self.limits_host).to(self.limits.device)
        if self.forced is not None:
            self.forced = self.forced.masked_fill(torch.from_numpy(rows).to(self.forced.device)[:, None], -1)

    def at_limit(self) -> np.ndarray:
        """(R,) which live rows must end at this step, on the host."""
        return self.limits_host <= self.t + 1

    def ending(self) -> Tensor:
        """(R,) which live rows must end at this step, on the device: a search that picks one
        token per row takes the EOS there whatever the model makes of it."""
        return self.limits <= self.t + 1

    def keep(self, rows: np.ndarray | None, on_device: Tensor | None, chosen: Tensor) -> None:
        """The step is over: the rows of this step that go on, in their new order (None: all,
        as they are; `on_device` the same indices on the device, if the search has them there),
        and the token each of them took (R',)."""
        if rows is not None:
            self.select(rows, on_device)
        if self.history is not None:
            self.history = torch.cat([self.history, chosen.reshape(-1, 1)], 1)
        if self.seen is not None:
            self.seen.scatter_(1, chosen.reshape(-1, 1), True)
        self.t += 1

    def select(self, rows: np.ndarray, on_device: Tensor | None = None) -> None:
        """Keep the live rows `rows` (indices, in their new order; `on_device` the same there)."""
        self.limits_host, self.sentence = self.limits_host[rows], self.sentence[rows]
        if self.row_begun is not None:
            self.row_begun = self.row_begun[rows]
        index = on_device if on_device is not None else torch.from_numpy(rows).to(self.limits.device)
        self.limits = self.limits.index_select(0, index)
        if self.forced is not None:
            self.forced = self.forced.index_select(0, index)
        if self.history is not None:
            self.history = self.history.index_select(0, index)
        if self.seen is not None:
            self.seen = self.seen.index_select(0, index)


def allowed(lprobs: Tensor, at_limit: Tensor | None) -> Tensor:
    """`lprobs` (R, V) with what may never come next banned, in place: PAD and BOS anywhere,
    and anything but EOS in a row at its length limit (`at_limit`, (R,); None: no row is)."""
    lprobs[:, PAD] = -math.inf
    lprobs[:, BOS] = -math.inf
    if at_limit is not None:
        eos = lprobs[:, EOS].clone()
        lprobs.masked_fill_(at_limit[:, None], -math.inf)
        lprobs[:, EOS] = eos
    return lprobs


def force(lprobs: Tensor, tokens: Tensor, given: Tensor | None = None) -> Tensor:
    """`lprobs` (R, V) where each row with a token in `tokens` (R,) may take only that one (a
    prefix's), at its log-prob in `given` (R, 1) if given, else in `lprobs`; rows with -1 are
    left as they are."""
    at = tokens.clamp(min=0)[:, None]
    value = given if given is not None else lprobs.gather(1, at)
    only = torch.full_like(lprobs, -math.inf).scatter_(1, at, value)
    return torch.where((tokens >= 0)[:, None], only, lprobs)


def ban_repeats(lprobs: Tensor, history: Tensor, n: int) -> None:
    """Ban in `lprobs` (R, V), in place, each token that would complete an `n`-gram its row's
    `history` (R, t) already holds: the token after each earlier occurrence of the row's last
    n - 1 tokens."""
    t = history.shape[1]
    if t < n:
        return
    windows = history.unfold(1, n, 1)  # (R, t - n + 1, n)
    last = history[:, t - (n - 1) :]  # (R, n - 1)
    repeats = (windows[:, :, :-1] == last[:, None, :]).all(-1)  # (R, W)
    # Each window's last token where it repeats, else PAD (banned anyway): no nonzero(), whose
    # count of hits the host would have to wait for at every step.
    banned = torch.where(repeats, windows[:, :, -1], PAD)  # (R, W)
    lprobs.scatter_(1, banned, -math.inf)
