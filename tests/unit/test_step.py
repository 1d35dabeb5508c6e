"""One update of train_step against plain autograd: the per-token mean over accumulated
batches, label smoothing, clipping."""

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nmt_cli.config import ModelConfig
from nmt_cli.engine import distributed
from nmt_cli.engine.batches import to_device
from nmt_cli.engine.model import Transformer
from nmt_cli.engine.step import Objective, batch_loss, train_step
from nmt_cli.vocab import BOS, EOS, PAD


def _batch(rows: list[tuple[list[int], list[int]]]):
    """A collated batch of (source ids, target ids), padded as engine.batches.collate pads."""
    s_len = max(len(s) for s, _ in rows) + 1
    t_len = max(len(t) for _, t in rows) + 1
    src = np.full((len(rows), s_len), PAD)
    tgt_in = np.full((len(rows), t_len), PAD)
    tgt_out = np.full((len(rows), t_len), PAD)
    for i, (s, t) in enumerate(rows):
        src[i, : len(s) + 1] = s + [EOS]
        tgt_in[i, : len(t) + 1] = [BOS] + t
        tgt_out[i, : len(t) + 1] = t + [EOS]
    return to_device((src, tgt_in, tgt_out), torch.device("cpu"))


BATCHES = [_batch([([5, 6, 7], [8, 9]), ([10, 11], [12, 13, 14, 15])]), _batch([([16, 17, 18, 19], [20])])]


def _model():
    torch.manual_seed(0)
    return Transformer(
        ModelConfig(
            vocab_size=30,
            num_encoder_layers=1,
            num_decoder_layers=1,
            d_model=16,
            ffn=32,
            heads=2,
            dropout=0.0,
            attention_dropout=0.0,
            relu_dropout=0.0,
        )
    )


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
    reference, loss, tokens = _reference_gradients(_model(), BATCHES)
    figures, grads = _step_seeing_gradients(_model(), BATCHES, clip_norm=0.0)
    assert figures[2] == tokens == 3 + 5 + 2
    assert figures[0] == pytest.approx(loss, rel=1e-5)
    for got, want in zip(grads, reference):
        assert torch.allclose(got, want, atol=1e-6)


def test_clipping_scales_the_gradient_to_the_bound():
    reference, _, _ = _reference_gradients(_model(), BATCHES)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in reference])).item()
    bound = norm / 4
    figures, grads = _step_seeing_gradients(_model(), BATCHES, clip_norm=bound)
    assert figures[3] == pytest.approx(norm, rel=1e-4)  # the norm before clipping is logged
    for got, want in zip(grads, reference):
        assert torch.allclose(got, want / 4, atol=1e-6)
    _, unclipped = _step_seeing_gradients(_model(), BATCHES, clip_norm=norm * 2)
    assert all(torch.allclose(got, want, atol=1e-6) for got, want in zip(unclipped, reference))


def test_the_compiled_update_gives_the_eager_loss_and_gradients():
    """--compile traces the model, its output layer and the loss as one graph, where the loss
    is the plain formula the compiler fuses: the same loss, NLL and gradients as the eager
    update's hand-written loss, under bf16 autocast, on batches of two shapes."""
    import torch._dynamo

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    results = []
    for compile in (False, True):
        torch._dynamo.reset()
        model = _model()
        objective = distributed.Group().wrap(Objective(model, 0.1), torch.device("cpu"), compile)
        figures = []
        for batch in BATCHES:
            loss, nll = batch_loss(objective, batch, autocast)
            (2 * loss + nll).backward()
            figures.append(torch.stack([loss.detach(), nll.detach()]))
        results.append((torch.stack(figures), [p.grad for p in model.parameters()]))
    torch._dynamo.reset()
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert torch.allclose(compiled.float(), eager.float(), rtol=1e-3, atol=1e-3)
    for got, want in zip(compiled_grads, eager_grads):
        assert torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("clip", [0.0, 0.05, 100.0])
def test_the_folded_scaling_and_clipping_step_as_the_passes_do(clip):
    """--fold-clipping: the per-token scaling and the clipping divided out inside the fused
    Adam step give the weights and figures of the passes over the gradients, Adam and AdamW;
    a non-finite update is skipped alike."""
    for make in (torch.optim.Adam, torch.optim.AdamW):
        results = []
        for fold in (False, True):
            model = _model()
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
        assert sum((a - b).abs().sum() for a, b in zip(weights.values(), _model().parameters())) > 0.1
        for name, a in weights.items():
            b = folded[name]
            if name.endswith("attn.kv.bias"):  # the key bias's gradient is rounding noise, which
                a, b = a[len(a) // 2 :], b[len(b) // 2 :]  # Adam scales up to steps of lr
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name
