"""The pure functions of training: the learning-rate schedule and the label-smoothed loss."""

import math

import pytest
import torch

from nmt_cli.engine.loss import label_smoothed_loss
from nmt_cli.engine.schedule import learning_rate


def test_learning_rate_schedule():
    d, w = 512, 4000
    assert learning_rate(w, d, w) == pytest.approx(d**-0.5 * w**-0.5)  # the peak
    assert learning_rate(w // 2, d, w) == pytest.approx(learning_rate(w, d, w) / 2)  # linear
    assert learning_rate(4 * w, d, w) == pytest.approx(learning_rate(w, d, w) / 2)  # 1/sqrt
    assert learning_rate(w, d, w, scale=2.0) == pytest.approx(2 * learning_rate(w, d, w))


def test_label_smoothed_loss_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])  # p = (1/4, 3/4)
    target = torch.tensor([1, 1])
    loss, nll = label_smoothed_loss(logits, target, 0.0)
    assert nll.item() == pytest.approx(-math.log(0.75) - math.log(0.25))
    assert loss.item() == pytest.approx(nll.item())
    loss, nll = label_smoothed_loss(logits, target, 0.1)
    uniform = 2 * -(math.log(0.25) + math.log(0.75)) / 2
    assert loss.item() == pytest.approx(0.9 * nll.item() + 0.1 * uniform)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_label_smoothed_loss_gradient_matches_autograd(epsilon):
    import torch.nn.functional as F

    torch.manual_seed(0)
    logits = torch.randn(40, 30, requires_grad=True)
    target = torch.randint(0, 30, (40,))
    lprobs = F.log_softmax(logits, -1)
    nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)
    reference = ((1 - epsilon) * nll - epsilon * lprobs.mean(-1)).sum()
    (expected,) = torch.autograd.grad(3 * reference + 2 * nll.sum(), logits)
    loss, nll_sum = label_smoothed_loss(logits, target, epsilon)
    (got,) = torch.autograd.grad(3 * loss + 2 * nll_sum, logits)
    assert torch.allclose(loss, reference.detach(), atol=1e-4)
    assert torch.allclose(got, expected, atol=1e-6)
