"""What may come next: the rules every search applies to its rows' next-token log-probs, in one
place. Beam search, constrained beam search, greedy search and sampling each build one
`NextToken` from the options and the sentences, ask it to shape every step's log-probs before
they choose, and tell it which rows go on.

The rules: PAD and BOS never come next; a row with a forced prefix takes the prefix's token
while it lasts; a row at its length limit (counting the EOS) may take only the EOS. A new rule
on the next token (a minimum length, a ban on repeated n-grams) is one more here, with its
option in config.use.DecodeOptions and its mapping in backend_ct2.py.
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
    its own. Row state (limits, forced tokens) follows the rows the search keeps (`keep`)."""

    def __init__(
        self,
        options: DecodeOptions,
        max_lens: Sequence[int],
        rows: int,
        device: torch.device | str = "cpu",
        forced: Tensor | None = None,
    ):
        self.options, self.max_lens = options, list(max_lens)
        self.t = 0  # tokens each live row has so far
        self.limits_host = np.repeat(np.asarray(max_lens, dtype=np.int64), rows)
        self.limits = torch.from_numpy(self.limits_host).to(device)
        self.forced = forced.repeat_interleave(rows, 0) if forced is not None else None

    def __call__(self, lprobs: Tensor) -> Tensor:
        """This step's `lprobs` (R, V) of the live rows, in place, with what may not come next at
        -inf."""
        lprobs = allowed(lprobs, self.limits <= self.t + 1)
        if self.forced is not None and self.t < self.forced.shape[1]:
            lprobs = force(lprobs, self.forced[:, self.t])
        return lprobs

    def at_limit(self) -> np.ndarray:
        """(R,) which live rows must end at this step, on the host."""
        return self.limits_host <= self.t + 1

    def ending(self) -> Tensor:
        """(R,) which live rows must end at this step, on the device: a search that picks one
        token per row takes the EOS there whatever the model makes of it."""
        return self.limits <= self.t + 1

    def keep(self, rows: np.ndarray | None, on_device: Tensor | None = None) -> None:
        """The step is over: the rows of this step that go on, in their new order (None: all,
        as they are); `on_device` the same indices on the device, if the search has them there."""
        if rows is not None:
            self.limits_host = self.limits_host[rows]
            index = on_device if on_device is not None else torch.from_numpy(rows).to(self.limits.device)
            self.limits = self.limits.index_select(0, index)
            if self.forced is not None:
                self.forced = self.forced.index_select(0, index)
        self.t += 1


def allowed(lprobs: Tensor, at_limit: Tensor) -> Tensor:
    """`lprobs` (R, V) with what may never come next banned, in place: PAD and BOS anywhere,
    and anything but EOS in a row at its length limit (`at_limit`, (R,))."""
    eos = lprobs[:, EOS].clone()
    lprobs[:, PAD] = -math.inf
    lprobs[:, BOS] = -math.inf
    lprobs.masked_fill_(at_limit[:, None], -math.inf)
    lprobs[:, EOS] = eos
    return lprobs


def force(lprobs: Tensor, tokens: Tensor) -> Tensor:
    """`lprobs` (R, V) where each row with a token in `tokens` (R,) may take only that one (a
    prefix's); rows with -1 are left as they are."""
    at = tokens.clamp(min=0)[:, None]
    only = torch.full_like(lprobs, -math.inf).scatter_(1, at, lprobs.gather(1, at))
    return torch.where((tokens >= 0)[:, None], only, lprobs)
