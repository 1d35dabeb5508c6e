"""What training measures on the validation set: the NLL, and greedy translations for BLEU.
Each rank computes its share of the batches; the results are combined across ranks."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from nmt_cli.config import DecodeOptions
from nmt_cli.engine import decoding
from nmt_cli.engine.batches import Split, on_device, pad_sources
from nmt_cli.engine.distributed import Group
from nmt_cli.engine.model import Transformer
from nmt_cli.engine.step import Objective, batch_loss

GREEDY = DecodeOptions(beam=1)  # validation BLEU: greedy, the default length limits


def figures(
    model: Transformer,
    data: Split,
    max_tokens: int,
    group: Group,
    device: torch.device,
    autocast,
    scores_of: Callable[[list[list[int]]], dict] | None,
) -> dict:
    """The validation figures every rank gets: the NLL and perplexity, and with `scores_of` what
    it makes of the greedy translations (BLEU, COMET), which rank 0 scores."""
    model.eval()
    loss = nll(model, data, max_tokens, group, device, autocast)
    out = {"valid_nll": loss, "valid_ppl": math.exp(min(loss, 50.0))}
    if scores_of is not None:
        ids = greedy_ids(model, data, group, device, autocast)
        out |= group.from_main(scores_of(ids) if ids is not None else None)
    return out


@torch.no_grad()
def nll(
    model: Transformer, data: Split, max_tokens: int, group: Group, device: torch.device, autocast
) -> float:
    """Validation NLL per target token (every rank gets it)."""
    # The plain model, not DDP: ranks run different numbers of batches here.
    batches = data.batches(max_tokens, 0, 0)
    mine = batches[group.rank :: group.world]
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    objective = Objective(model, 0.0)
    for (batch,) in on_device(data, ([b] for b in mine), device):
        _, nll_sum = batch_loss(objective, batch, autocast)
        sums += torch.stack([nll_sum.double(), sums.new_full((), float(batch.tokens))])
    nll_sum, tokens = group.all_reduce(sums).tolist()
    return nll_sum / max(tokens, 1)


@torch.no_grad()
def greedy_ids(
    model: Transformer, data: Split, group: Group, device: torch.device, autocast, batch_size: int = 64
) -> list[list[int]] | None:
    """Greedy translations of every validation sentence as token ids, in corpus order (a cheap
    stand-in for the test score while training). Rank 0 gets them; the others get None."""
    order = data.keep[np.argsort(-data.src_lengths[data.keep], kind="stable")]
    starts = list(range(0, len(order), batch_size))[group.rank :: group.world]
    mine: dict[int, list[int]] = {}
    for start in starts:
        rows = order[start : start + batch_size]
        src = torch.from_numpy(pad_sources([data.src[int(i)] for i in rows])).to(device)
        with autocast():
            hyps = decoding.translate(model, src, GREEDY)
        mine.update({int(i): h[0].tokens for i, h in zip(rows, hyps)})
    shares = group.gather_objects(mine)
    if not group.is_main:
        return None
    ids: list[list[int]] = [[] for _ in range(len(data.src))]
    for share in shares:
        for i, tokens in share.items():
            ids[i] = tokens
    return ids
