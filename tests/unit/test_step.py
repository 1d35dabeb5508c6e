"""One update of train_step against plain autograd: the per-token mean over accumulated
batches, label smoothing, clipping."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from updates import BATCHES, small_model

from nmt_cli.engine import distributed
from nmt_cli.engine.step import Objective, train_step
from nmt_cli.vocab import PAD


def _step_seeing_gradients(model, batches, clip_norm):
    """Run train_step; return its figures and the gradients Adam was given."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, fused=True)
    seen = {}
    real = optimizer.step

    def step(*args, **kwargs):
        seen["grads"] = [p.grad.clone() for p in model.parameters()]
        return real(*args, **kwargs)

    optimizer.step = step
    figures = train_step(
        model,
        Objective(model, 0.1),
        optimizer,
        torch.amp.GradScaler("cuda", enabled=False),
        batches,
        clip_norm=clip_norm,
        lr=1e-3,
        autocast=contextlib.nullcontext,
        group=distributed.Group(),
    )
    return figures.tolist(), seen["grads"]


def _reference_gradients(model, batches):
    """Label-smoothed cross-entropy (torch's own) summed over every real target token of all
    the batches, divided by their number."""
    total, tokens = 0.0, 0
    for b in batches:
        tgt_out = torch.full(b.tgt_in.shape, PAD).flatten()
        tgt_out[b.positions] = b.targets
        logits = model.logits(model(b.src, b.tgt_in)).flatten(0, 1)
        total = total + F.cross_entropy(
            logits, tgt_out, ignore_index=PAD, reduction="sum", label_smoothing=0.1
        )
        tokens += int((tgt_out != PAD).sum())
    return torch.autograd.grad(total / tokens, list(model.parameters())), total.item(), tokens


def test_accumulated_batches_give_the_mean_gradient_over_all_their_tokens():
    reference, loss, tokens = _reference_gradients(small_model(), BATCHES)
    figures, grads = _step_seeing_gradients(small_model(), BATCHES, clip_norm=0.0)
    assert figures[2] == tokens == 3 + 5 + 2
    assert figures[0] == pytest.approx(loss, rel=1e-5)
    for got, want in zip(grads, reference):
        assert torch.allclose(got, want, atol=1e-6)


def test_clipping_scales_the_gradient_to_the_bound():
    reference, _, _ = _reference_gradients(small_model(), BATCHES)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in reference])).item()
    bound = norm / 4
    figures, grads = _step_seeing_gradients(small_model(), BATCHES, clip_norm=bound)
    assert figures[3] == pytest.approx(norm, rel=1e-4)  # the norm before clipping is logged
    for got, want in zip(grads, reference):
        assert torch.allclose(got, want / 4, atol=1e-6)
    _, unclipped = _step_seeing_gradients(small_model(), BATCHES, clip_norm=norm * 2)
    assert all(torch.allclose(got, want, atol=1e-6) for got, want in zip(unclipped, reference))


@pytest.mark.parametrize("clip", [0.0, 0.05, 100.0])
def test_the_folded_scaling_and_clipping_step_as_the_passes_do(clip):
    """--fold-clipping: the per-token scaling and the clipping divided out inside the fused
    Adam step give the weights and figures of the passes over the gradients, Adam and AdamW;
    a non-finite update is skipped alike."""
    for make in (torch.optim.Adam, torch.optim.AdamW):
        results = []
        for fold in (False, True):
            model = small_model()
            optimizer = make(model.parameters(), lr=0.0, fused=True)
            figures = [
                train_step(
                    model,
                    Objective(model, 0.1),
                    optimizer,
                    torch.amp.GradScaler("cpu", enabled=False),
                    BATCHES,
                    clip_norm=clip,
                    lr=1e-2,
                    autocast=contextlib.nullcontext,
                    group=distributed.Group(),
                    fold=fold,
                )
                for _ in range(3)
            ]
            results.append((torch.stack(figures), dict(model.named_parameters())))
        (figures, weights), (folded_figures, folded) = results
        assert torch.allclose(figures, folded_figures, rtol=1e-5)
        assert sum((a - b).abs().sum() for a, b in zip(weights.values(), small_model().parameters())) > 0.1
        for name, a in weights.items():
            b = folded[name]
            if name.endswith("attn.kv.bias"):  # the key bias's gradient is rounding noise, which
                a, b = a[len(a) // 2 :], b[len(b) // 2 :]  # Adam scales up to steps of lr
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("clip", [0.0, 1e-3])
def test_no_clipping_makes_no_pass_over_the_gradients(clip):
    """--clip-norm 0: the norm is taken (for the figures and the skip), and the gradients are
    multiplied once, by the per-token scale; clipping multiplies them a second time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.muls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.muls += func.overloadpacket in (torch.ops.aten._foreach_mul_,)
            return func(*args, **(kwargs or {}))

    counted = Count()
    with counted:  # Adam's step is fused: one op of its own, none of these
        figures, _ = _step_seeing_gradients(small_model(), BATCHES, clip_norm=clip)
    assert counted.muls == (2 if clip else 1) and figures[3] > 0
