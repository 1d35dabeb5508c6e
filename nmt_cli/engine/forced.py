"""Teacher-forced passes over given targets: how likely the model finds them (`nmt score-pairs`)
and which source token each of their tokens attends to most (--alignments)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from nmt_cli.engine.batches import pad_targets
from nmt_cli.engine.model import Transformer
from nmt_cli.vocab import PAD


@torch.no_grad()
def log_probs(
    model: Transformer | Sequence[Transformer], src: Tensor, tgt: Sequence[Sequence[int]]
) -> list[float]:
    """The log-probability of each given target (ids without BOS and EOS, its EOS counted) after
    its source in the padded (B, S) batch `src`: the sum of the log-probs the search adds up
    for it, token by token (an ensemble's mean log-probs), so that a search's own output scores
    what the search scored it."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    tgt_in, tgt_out = pad_targets(tgt)
    tgt_in_t, tgt_out_t = torch.from_numpy(tgt_in).to(src.device), torch.from_numpy(tgt_out).to(src.device)
    for m in models:
        m.eval()
    lprobs = torch.stack([F.log_softmax(m.logits(m(src, tgt_in_t)).float(), dim=-1) for m in models]).mean(0)
    picked = lprobs.gather(2, tgt_out_t[..., None]).squeeze(2).masked_fill(tgt_out_t == PAD, 0.0)
    return picked.sum(1).tolist()


@torch.no_grad()
def aligned(
    model: Transformer | Sequence[Transformer], src: Tensor, tgt: Sequence[Sequence[int]]
) -> list[list[tuple[int, int]]]:
    """Each target token's source token: (source position, target position) pairs, the source
    position the last decoder layer's encoder-decoder attention (heads and models averaged)
    weighs most when the token is predicted (teacher-forced on `tgt`, ids without EOS); the
    source's EOS is never chosen."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    tgt_in, _ = pad_targets(tgt)
    tgt_in_t = torch.from_numpy(tgt_in).to(src.device)
    weights = torch.stack([m.cross_attention(src, tgt_in_t).float() for m in models]).mean(0)
    lengths = (src != PAD).sum(1) - 1  # without the EOS
    # each row's best source position among its own, all rows at once: one read of the whole
    # batch from the device (the rows' lengths first), not one per sentence
    beyond = torch.arange(weights.shape[-1], device=src.device) >= lengths[:, None, None]
    best = weights.masked_fill(beyond, -math.inf).argmax(-1)
    read = torch.cat([lengths[:, None], best], 1).tolist()
    out = []
    for y, (n, *found) in zip(tgt, read):
        out.append([(i, j) for j, i in enumerate(found[: len(y)])] if n and y else [])
    return out
