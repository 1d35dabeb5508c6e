"""One update: forward, label-smoothed loss, backward, the gradient as a per-token mean over all
ranks, clipping and Adam, queued on the device without waiting for it."""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch

from nmt_cli.engine import distributed
from nmt_cli.engine.batches import Batch
from nmt_cli.engine.loss import label_smoothed_loss
from nmt_cli.engine.model import Transformer
from nmt_cli.vocab import PAD


class Objective(torch.nn.Module):
    """The model and its loss as one module: the forward pass, the output layer over the target
    positions and the label-smoothed loss. It is what DDP wraps and what `--compile` traces, so
    that the whole update is one graph (the logits and the loss included, where the compiler
    fuses the passes over the (N, V) scores)."""

    def __init__(self, model: Transformer, label_smoothing: float):
        super().__init__()
        self.model, self.label_smoothing = model, label_smoothing

    def forward(
        self, src: torch.Tensor, tgt_in: torch.Tensor, positions: torch.Tensor | None, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed smoothed loss and summed NLL of the target tokens at `positions` (flat indices
        into tgt_in, found on the host: padding never reaches the output layer). Without
        `positions`, of every position's target, PAD weighted 0: every tensor's shape is then
        the batch's (batches of fixed shapes)."""
        hidden = self.model(src, tgt_in).flatten(0, 1)
        weights = None
        if positions is not None:
            hidden = hidden.index_select(0, positions)
        else:
            weights = (targets != PAD).float()
        logits = self.model.logits(hidden)
        with torch.autocast(logits.device.type, enabled=False):  # the loss keeps its own float32
            return label_smoothed_loss(logits, targets, self.label_smoothing, weights)


def batch_loss(objective: torch.nn.Module, batch: Batch, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed smoothed loss and summed NLL of one batch's target tokens."""
    with autocast():
        return objective(batch.src, batch.tgt_in, batch.positions, batch.targets)


# What train_step returns about an update, one number each, in this order.
STEP_FIGURES = ("loss_sum", "nll_sum", "tokens", "grad_norm", "skipped")


def train_step(
    model: Transformer,
    forward: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches: list[Batch],
    *,
    clip_norm: float,
    lr: float,
    autocast,
    group: distributed.Group,
    fold: bool = False,
) -> torch.Tensor:
    """One update from a group of batches: forward, label-smoothed loss, backward, the gradient
    as a per-token mean over all ranks, clipping, Adam; an update whose loss or gradient is not
    finite changes nothing (and counts as skipped).

    Nothing here waits for the device: the figures come back as one float64 tensor on it,
    laid out as STEP_FIGURES, for the caller to read when it wants them. `forward` is the
    model's Objective as called for training (DDP and/or compiled); gradients are all-reduced
    after the last batch only. The optimizer must be fused: it is told on the device whether to
    skip. With `fold`, the gradient's per-token scaling and its clipping are not passes over the
    gradients of their own: the fused step divides them by one number as it reads them.
    """
    model.train()
    sums = None
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else group.no_sync(forward):
            loss, nll = batch_loss(forward, batch, autocast)
            scaler.scale(loss).backward()
        figures = torch.stack([loss.detach(), nll.detach()]).double()
        sums = figures if sums is None else sums + figures
    assert sums is not None
    tokens = sums.new_full((1,), float(sum(b.tokens for b in batches)))
    totals = group.all_reduce(torch.cat([sums, tokens]))  # loss, NLL, tokens of every rank
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [g for p in params if (g := p.grad) is not None]
    # The loss is a sum over this rank's tokens and DDP averaged over ranks: make the gradient
    # the mean over every token of the update.
    per_token = (group.world / totals[2]).float()
    divide = None  # what the fused step divides the gradients by as it reads them
    if fold:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) * per_token
        clip = (clip_norm / (norm + 1e-6)).clamp(max=1.0) if clip_norm else 1.0  # clip_grad_norm_'s
        divide = 1.0 / (per_token * clip)
    else:
        torch._foreach_mul_(grads, per_token)
        if clip_norm:
            norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
        else:  # the norm for the figures and the skip: clip_grad_norm_ would multiply all by 1
            norm = torch.nn.utils.get_total_norm(grads)
    skipped = (~(torch.isfinite(norm) & torch.isfinite(totals[0]))).float()
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    # GradScaler's protocol with fused optimizers: the step is skipped on the device.
    told = cast(Any, optimizer)  # the attributes torch's fused step reads, if set
    told.found_inf, told.grad_scale = skipped, divide
    try:
        optimizer.step()
    finally:
        del told.found_inf, told.grad_scale
    scaler.update()  # with fp16, backs the loss scale off after a non-finite update
    optimizer.zero_grad(set_to_none=True)
    return torch.cat([totals, norm.double()[None], skipped.double()[None]])
