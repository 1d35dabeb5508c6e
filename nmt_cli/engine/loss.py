"""Label-smoothed cross-entropy (section 5.4), with a backward written out by hand.

The loss of a row of scores x against target t, with the smoothing mass epsilon spread over the
V words, is (1 - epsilon) * (lse(x) - x_t) + epsilon * (lse(x) - mean(x)), lse the log-sum-exp.
So the forward needs three numbers a row and the backward only the scores and lse: neither ever
holds the (N, V) log-probabilities. On a GPU each pass over the scores is one compiled kernel
that computes in float32 as it reads (it would otherwise read and write them five times from
memory); on a CPU the eager passes run over slices of rows that fit the cache, in float32
within a slice, so that no float32 (N, V) copy of bf16 scores exists either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements of one slice on a CPU: a few MB, its caches. A GPU takes all rows at once: its
# compiled kernels hold no float32 copy of the scores, and each slice would cost the host a
# launch of every kernel.
CPU_SLICE = 2**19


def _row_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lse(x) and lse(x) - mean(x) of each row, in float32: what the compiler fuses into one pass."""
    x = x.float()
    lse = torch.logsumexp(x, -1)
    return lse, lse - x.mean(-1)


def _row_grad(x, lse, target, g, hit, out) -> None:
    """Writes into `out` the gradient of rows x: g[0] * softmax(x) - g[1] everywhere, `hit`
    less at each row's target (as the compiler fuses it: one read of x, one write). g[i] and
    `hit` are one number, or one a row."""
    p = torch.exp(x.float() - lse[:, None]) * g[0].reshape(-1, 1) - g[1].reshape(-1, 1)
    at_target = torch.arange(x.shape[-1], device=x.device) == target[:, None]
    out.copy_(torch.where(at_target, p - hit.reshape(-1, 1), p))


def _row_sums_eager(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_row_sums in passes that torch runs as single kernels: one log_softmax, one mean."""
    lp = F.log_softmax(x.float(), -1)
    return x[:, 0].float() - lp[:, 0], -lp.mean(-1)


def _row_grad_eager(x, lse, target, g, hit, out) -> None:
    """_row_grad in place: into `out` itself where it is float32, else into one float32 slice."""
    p = out if out.dtype == torch.float32 else torch.empty(x.shape, device=x.device)
    torch.sub(x, lse[:, None], out=p)
    p.exp_().mul_(g[0].reshape(-1, 1)).sub_(g[1].reshape(-1, 1))
    p[torch.arange(len(target), device=x.device), target] -= hit
    if p is not out:
        out.copy_(p)


_compiled: dict[str, object] = {}


def _kernels(device: torch.device):
    """The two slice functions: compiled once per process on a GPU, eager elsewhere."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return _row_sums_eager, _row_grad_eager
    if not _compiled:
        _compiled["sums"] = torch.compile(_row_sums, dynamic=True)
        _compiled["grad"] = torch.compile(_row_grad, dynamic=True)
    return _compiled["sums"], _compiled["grad"]


def _slices(rows: int, width: int, device: torch.device):
    if device.type == "cuda":
        return [slice(0, rows)]
    step = max(1, CPU_SLICE // max(width, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


class _SmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, epsilon: float, weights: torch.Tensor | None
    ):
        sums, _ = _kernels(logits.device)
        n = logits.shape[0]
        lse = logits.new_empty(n, dtype=torch.float32)
        uniform = logits.new_empty(n, dtype=torch.float32)  # -mean log-probability
        for rows in _slices(n, logits.shape[-1], logits.device):
            lse[rows], uniform[rows] = sums(logits[rows])
        nll = lse - logits.gather(-1, target[:, None]).squeeze(-1).float()  # (N,)
        ctx.save_for_backward(logits, target, lse, weights)
        ctx.epsilon = epsilon
        loss = (1.0 - epsilon) * nll + epsilon * uniform
        if weights is not None:
            loss, nll = loss * weights, nll * weights
        return loss.sum(), nll.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, grad_nll: torch.Tensor | None):
        logits, target, lse, weights = ctx.saved_tensors
        _, grad_of = _kernels(logits.device)
        eps, v = ctx.epsilon, logits.shape[-1]
        g_loss = grad_loss.float()
        g_nll = grad_nll.float() if grad_nll is not None else torch.zeros_like(g_loss)
        # d/dx of (1-eps)*nll + eps*uniform, scaled by g_loss, plus nll's, scaled by g_nll.
        g = torch.stack([g_loss + g_nll, g_loss * eps / v])
        hit = g_loss * (1.0 - eps) + g_nll
        if weights is not None:  # each row's own
            g, hit = g[:, None] * weights, hit * weights
        grad = torch.empty_like(logits)
        for rows in _slices(logits.shape[0], v, logits.device):
            row_g, row_hit = (g[:, rows], hit[rows]) if weights is not None else (g, hit)
            grad_of(logits[rows], lse[rows], target[rows], row_g, row_hit, grad[rows])
        return grad, None, None, None


def _as_formula(logits: torch.Tensor, target: torch.Tensor, epsilon: float, weights: torch.Tensor | None):
    """The same loss in plain operations, for an update traced by torch.compile: the compiler
    fuses the passes over the scores, forward and backward, into a kernel each, and keeps no
    float32 copy of them; the slices above would cut its graph at every one."""
    x = logits.float()
    lse = torch.logsumexp(x, -1)
    nll = lse - x.gather(-1, target[:, None]).squeeze(-1)
    loss = (1.0 - epsilon) * nll + epsilon * (lse - x.mean(-1))
    if weights is not None:
        loss, nll = loss * weights, nll * weights
    return loss.sum(), nll.sum()


def label_smoothed_loss(
    logits: torch.Tensor, target: torch.Tensor, epsilon: float, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed smoothed loss and summed NLL of (N, V) scores against (N,) targets, each row
    counted `weights` times (N,) if given (0: a padding position, which adds nothing).

    The smoothing mass epsilon is spread uniformly over the vocabulary (section 5.4).
    """
    if torch.compiler.is_compiling():
        return _as_formula(logits, target, epsilon, weights)
    return _SmoothedCrossEntropy.apply(logits, target, epsilon, weights)
