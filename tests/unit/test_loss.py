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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_in_slices_equals_it_whole(monkeypatch, dtype):
    """Rows in many slices (and the last one short) give the loss and gradient of one slice,
    and bf16 scores get a bf16 gradient computed in float32."""
    from nmt_cli.engine import loss as module

    torch.manual_seed(1)
    logits = (3 * torch.randn(37, 50)).to(dtype).requires_grad_()
    target = torch.randint(0, 50, (37,))
    results = []
    for rows_per_slice in (1000, 8):
        monkeypatch.setattr(module, "CPU_SLICE", rows_per_slice * 50)
        loss, nll = label_smoothed_loss(logits, target, 0.1)
        (grad,) = torch.autograd.grad(2 * loss + nll, logits)
        results.append((loss, nll, grad))
    (whole, whole_nll, whole_grad), (sliced, sliced_nll, sliced_grad) = results
    assert sliced_grad.dtype == dtype
    assert torch.allclose(whole, sliced, atol=1e-4) and torch.allclose(whole_nll, sliced_nll, atol=1e-4)
    assert torch.equal(whole_grad, sliced_grad)
    lprobs = torch.log_softmax(logits.detach().float(), -1)
    reference = -(lprobs.gather(-1, target[:, None]).sum())
    assert torch.allclose(whole_nll, reference, rtol=1e-5)
    # a GPU's compiled kernels take every row at once: no slice costs the host its launches
    assert module._slices(10**6, 32000, torch.device("cuda", 0)) == [slice(0, 10**6)]


@pytest.mark.parametrize("kind", ["inverse-sqrt", "linear", "cosine", "constant"])
def test_every_schedule_warms_up_to_its_peak_and_keeps_its_floor(kind):
    w, peak, floor, end = 100, 1e-3, 1e-5, 1000
    rate = lambda step: learning_rate(step, 512, w, kind=kind, peak=peak, max_steps=end, floor=floor)  # noqa: E731
    assert rate(w // 2) == pytest.approx(peak / 2) and rate(w) == pytest.approx(peak)  # linear warm-up
    after = [rate(s) for s in range(w, 3 * end, 37)]
    assert all(a >= b for a, b in zip(after, after[1:])) and min(after) >= floor  # falls, never below
    if kind in ("linear", "cosine"):
        assert rate(end) == pytest.approx(floor) and rate((w + end) // 2) == pytest.approx((peak + floor) / 2)
    if kind == "constant":
        assert rate(end) == peak
    if kind == "inverse-sqrt":
        assert rate(4 * w) == pytest.approx(peak / 2)


def test_an_absolute_peak_of_the_papers_value_is_the_papers_schedule():
    d, w = 512, 4000
    paper = d**-0.5 * w**-0.5
    for step in (1, 10, w, 2 * w, 50_000):
        assert learning_rate(step, d, w, peak=paper) == pytest.approx(learning_rate(step, d, w))


def test_the_moving_average_moves_by_its_warmed_up_decay():
    from nmt_cli.engine.ema import Average

    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = Average(model, decay=0.99)
    with torch.no_grad():
        model.weight.fill_(12.0)
    ema.update(step=1)  # the decay is min(0.99, 2 / 11) early on
    assert ema.weights["weight"][0].tolist() == pytest.approx([2 / 11 * 1 + 9 / 11 * 12] * 2)  # 10
    ema.update(step=10_000)  # then 0.99
    assert ema.weights["weight"][0, 0].item() == pytest.approx(0.99 * 10 + 0.01 * 12)
    with ema.swapped_into(model):
        assert torch.equal(model.weight, ema.weights["weight"])
    assert (model.weight == 12.0).all()  # its own weights back
