"""What torch.compile makes of the engine, against the eager code on the CPU: the whole update
(model, output layer, loss) and the loss's slice kernels a GPU runs compiled. Each compiles for
seconds to a minute, which is why they are not in tests/unit."""

import pytest
import torch
from updates import BATCHES, small_model

from nmt_cli.engine import distributed
from nmt_cli.engine.step import Objective, batch_loss


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.soak)])
def test_the_compiled_update_gives_the_eager_loss_and_gradients(backend, monkeypatch):
    """--compile traces the model, its output layer and the loss as one graph, where the loss
    is the plain formula the compiler fuses: the same loss, NLL and gradients as the eager
    update's hand-written loss, under bf16 autocast, on batches of two shapes. In the suite the
    graph, forward and backward, runs as traced (AOTAutograd, its decompositions); the kernels
    Inductor builds from it (a minute under AVX2) are the soak set's."""
    import functools

    import torch._dynamo

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    results = []
    for compile in (False, True):
        torch._dynamo.reset()
        model = small_model()
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


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.soak)])
def test_the_compiled_slice_kernels_equal_the_eager_ones(backend):
    """What a GPU runs (the slice functions compiled) against what the CPU runs, on the CPU: as
    traced in the suite, with Inductor's CPU kernels in the soak set."""
    import functools

    from nmt_cli.engine import loss as module

    compile_ = functools.partial(torch.compile, backend=backend, dynamic=True)
    torch.manual_seed(2)
    x = (3 * torch.randn(23, 40)).bfloat16()
    target = torch.randint(0, 40, (23,))
    sums, grad_of = compile_(module._row_sums), compile_(module._row_grad)
    lse, uniform = sums(x)
    lse_eager, uniform_eager = module._row_sums_eager(x)
    assert torch.allclose(lse, lse_eager, atol=1e-5) and torch.allclose(uniform, uniform_eager, atol=1e-5)
    g, hit = torch.tensor([1.5, 0.01]), torch.tensor(0.9)
    out = torch.full((30, 40), float("nan"), dtype=torch.bfloat16)
    expected = out.clone()
    grad_of(x, lse, target, g, hit, out[:23])
    module._row_grad_eager(x, lse, target, g, hit, expected[:23])
    assert torch.allclose(out[:23].float(), expected[:23].float(), atol=1e-2)
    assert out[23:].isnan().all()  # only the rows given were written
