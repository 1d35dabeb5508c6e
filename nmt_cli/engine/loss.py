"""Label-smoothed cross-entropy (section 5.4), with a backward written out by hand."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Label-smoothed cross-entropy with a hand-written backward: the gradient is
    softmax - (1 - epsilon) * onehot - epsilon / V, computed in place from the saved
    log-probabilities. Autograd's version materialises three more (N, V) tensors."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, epsilon: float):
        lprobs = F.log_softmax(logits.float(), dim=-1)  # (N, V)
        nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)  # (N,)
        uniform = -lprobs.sum(dim=-1) / lprobs.shape[-1]  # (N,)
        ctx.save_for_backward(lprobs, target)
        ctx.epsilon, ctx.dtype = epsilon, logits.dtype
        return ((1.0 - epsilon) * nll + epsilon * uniform).sum(), nll.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, grad_nll: torch.Tensor | None):
        lprobs, target = ctx.saved_tensors
        eps, v = ctx.epsilon, lprobs.shape[-1]
        g_loss = grad_loss.float()
        g_nll = grad_nll.float() if grad_nll is not None else torch.zeros_like(g_loss)
        grad = lprobs.exp_().mul_(g_loss + g_nll).sub_(g_loss * eps / v)  # softmax, in place
        grad.scatter_add_(
            -1, target[:, None], (-(g_loss * (1.0 - eps) + g_nll)).expand(len(target), 1).contiguous()
        )
        return grad.to(ctx.dtype), None, None


def label_smoothed_loss(
    logits: torch.Tensor, target: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed smoothed loss and summed NLL of (N, V) scores against (N,) targets.

    The smoothing mass epsilon is spread uniformly over the vocabulary (section 5.4).
    """
    return _SmoothedCrossEntropy.apply(logits, target, epsilon)
