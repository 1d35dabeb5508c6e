"""The training batches: every sentence once with little padding, the next epoch made ahead
the same, one shape per update, filler rows that change nothing, fixed shapes one per length."""

import threading

import numpy as np
import pytest
import torch
from conftest import (
    tiny_trainer,
)

from nmt_cli.engine import step
from nmt_cli.engine.batches import (
    Epochs,
    Planned,
    Split,
    grid_length,
    make_batches,
    on_device,
    padding_share,
)
from nmt_cli.engine.distributed import Group
from nmt_cli.rundir import RunDir
from nmt_cli.shards import Shard


def test_batches_cover_every_sentence_once_with_little_padding(multi30k_bpe):
    run = RunDir(multi30k_bpe)
    split = Split.of(Shard(run.tokens("train", "en")), Shard(run.tokens("train", "de")), 256)
    s, t = split.src_lengths, split.tgt_lengths
    a, b = split.batches(4096, seed=1, epoch=0), split.batches(4096, seed=1, epoch=1)
    assert np.array_equal(np.sort(np.concatenate([x.sentences for x in a])), split.keep)
    for x in a:
        assert x.shape == (len(x.sentences), *(grid_length(int(y[x.sentences].max())) for y in (s, t)))
    assert all(x.shape[0] * max(x.shape[1:]) <= 4096 for x in a)
    assert not all(np.array_equal(x.sentences, y.sentences) for x, y in zip(a, b))  # reshuffled each epoch
    assert [x.shape for x in a] == [x.shape for x in split.batches(4096, 1, 0)]
    # Lengths on the grid: far fewer shapes over a few epochs than batches as long as their
    # longest sentence, for a little more padding.
    as_long = [make_batches(s, t, 4096, 1, e) for e in range(4)]
    exact = [[Planned(g, (len(g), s[g].max(), t[g].max())) for g in epoch] for epoch in as_long]
    grid = [split.batches(4096, 1, e) for e in range(4)]
    assert len({x.shape for x in sum(grid, [])}) < 0.75 * len({x.shape for x in sum(exact, [])})
    as_before = padding_share(exact[0], s, t)
    assert as_before < padding_share(a, s, t) <= as_before + 0.02


@pytest.mark.parametrize("rank, world", [(0, 1), (1, 2)])
def test_the_next_epoch_made_ahead_by_a_thread_is_the_same_epoch(multi30k_bpe, rank, world):
    """What a GPU run does (Epochs' `ahead`), forced on the CPU: each next epoch's pairs
    (re-encoded, as BPE-dropout does) and batches are made by a thread while this one trains,
    the same as made when asked for, alone and as the second of 2 ranks; an error there is
    raised when that epoch is asked for."""
    run = RunDir(multi30k_bpe)
    split = Split.of(Shard(run.tokens("train", "en")), Shard(run.tokens("train", "de")), 256)
    made_by: dict[int, str] = {}

    def resample(epoch: int) -> tuple[Shard, Shard]:
        made_by[epoch] = threading.current_thread().name
        if epoch == 3:
            raise OSError("the text went away")
        # Each epoch's own encoding: the sources one word longer every other epoch.
        src = [list(split.src[i]) + [7] * (epoch % 2) for i in range(len(split.src_lengths))]
        return Shard.in_memory(src, 8000), split.tgt

    def epochs(ahead: bool) -> list:
        e = Epochs(split, 2048, 2, 3, Group(rank, world), resample, ahead)
        made = [(e.data(n).src_lengths, [(x.sentences, x.shape) for x in e.batches(n)]) for n in range(3)]
        with pytest.raises(OSError, match="went away"):
            e.batches(3)
        return made

    asked = epochs(False)
    assert set(made_by.values()) == {threading.current_thread().name}
    ahead = epochs(True)
    assert made_by[0] == threading.current_thread().name
    assert made_by[1] == made_by[2] == made_by[3] == "nmt-next-epoch"
    assert not np.array_equal(asked[0][0], asked[1][0])  # the epochs differ
    for (lengths, batches), (lengths2, batches2) in zip(asked, ahead, strict=True):
        assert np.array_equal(lengths, lengths2) and len(batches) == len(batches2)
        assert all(np.array_equal(a, b) and s == t for (a, s), (b, t) in zip(batches, batches2))


@pytest.mark.parametrize("world, update_freq", [(2, 1), (4, 1), (2, 3)])
def test_the_batches_of_an_update_have_one_shape_and_every_sentence_is_trained_on(
    multi30k_bpe, world, update_freq
):
    run = RunDir(multi30k_bpe)
    split = Split.of(Shard(run.tokens("train", "en")), Shard(run.tokens("train", "de")), 256)
    ranks = [Epochs(split, 2048, update_freq, 3, Group(rank, world)).batches(0) for rank in range(world)]
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) % update_freq == 0
    for i in range(0, len(ranks[0]), update_freq):
        update = [x for r in ranks for x in r[i : i + update_freq]]
        assert len({x.shape for x in update}) == 1
        assert all(len(x.sentences) <= x.shape[0] and x.shape[0] * max(x.shape[1:]) <= 2048 for x in update)
    trained = np.concatenate([x.sentences for r in ranks for x in r])
    assert np.array_equal(np.sort(trained), split.keep)
    # N ranks train on the batches one process accumulates with --update-freq N.
    alone = Epochs(split, 2048, world * update_freq, 3, Group(0, 1)).batches(0)
    assert all(
        np.array_equal(x.sentences, alone[i * world + r].sentences)
        for r in range(world)
        for i, x in enumerate(ranks[r])
    )


def test_filler_rows_and_columns_change_no_loss_and_no_gradient(run_copy):
    from nmt_cli.engine.batches import collate, to_device

    t = tiny_trainer(run_copy)
    t.model.eval()  # no dropout: the same function of the sentences
    split, planned = t.epochs.fixed, t.epochs.batches(0)[0]
    rows, s, tl = planned.shape
    figures = []
    # as planned; with filler; with filler and the loss over every position (--fixed-shapes)
    for shape, every in (
        (planned.shape, False),
        ((rows + 3, s + 5, tl + 4), False),
        ((rows + 3, s + 5, tl + 4), True),
    ):
        arrays = collate(split.src, split.tgt, Planned(planned.sentences, shape))
        batch = to_device(arrays, t.device, every_position=every)
        assert (batch.positions is None) == every
        t.model.zero_grad()
        loss, nll = step.batch_loss(step.Objective(t.model, 0.1), batch, t.autocast)
        loss.backward()
        grads = [p.grad.clone() for p in t.model.parameters()]
        figures.append((batch.tokens, loss.item(), nll.item(), grads))
    tokens, loss, nll, grads = figures[0]
    for tokens2, loss2, nll2, grads2 in figures[1:]:
        assert tokens == tokens2 and loss == pytest.approx(loss2, rel=1e-5)
        assert nll == pytest.approx(nll2, rel=1e-5)
        assert all(torch.allclose(g, h, rtol=1e-4, atol=1e-6) for g, h in zip(grads, grads2))


def test_fixed_shapes_come_one_per_length_and_train_as_the_planned_shapes_do(run_copy, tmp_path):
    """--fixed-shapes: every batch is (max_tokens // L, L, L), L a multiple of 8, so a run meets
    as many shapes as lengths; the same sentences in the same updates as batches padded to
    their own lengths on multiples of 8, and the same updates of the weights."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(run_copy, other)
    quiet = dict(dropout=0.0, attention_dropout=0.0, relu_dropout=0.0)  # the same function of the sentences
    fixed, planned = (
        tiny_trainer(run_copy, fixed_shapes=True, **quiet),
        tiny_trainer(other, compile=True, **quiet),
    )
    planned.forward = planned.forward._orig_mod  # batches as --compile plans them, run eagerly
    a, b = fixed.epochs.batches(0), planned.epochs.batches(0)
    assert [x.sentences.tolist() for x in a] == [x.sentences.tolist() for x in b]
    lengths = {x.shape[1] for x in a}
    assert {x.shape for x in a} == {(256 // n, n, n) for n in lengths} and all(n % 8 == 0 for n in lengths)
    assert len({x.shape for x in b}) > len(lengths)
    for t in (fixed, planned):
        for group in on_device(
            t.epochs.fixed, [[x] for x in t.epochs.batches(0)[:6]], t.device, 0, t is fixed
        ):
            t.step(group)
    assert torch.allclose(torch.stack(fixed.figures.pending), torch.stack(planned.figures.pending), rtol=1e-5)
    for (name, x), y in zip(fixed.model.named_parameters(), planned.model.parameters()):
        if name.endswith("attn.kv.bias"):  # the key bias's gradient is rounding noise, which
            x, y = x[len(x) // 2 :], y[len(y) // 2 :]  # Adam scales up to steps of lr
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6), name


def test_fixed_shapes_compile_once_per_length(run_copy, monkeypatch):
    """Compiled without dynamic shapes, one graph per length met (torch's eager backend counts
    what the compiler would compile)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, **{**kw, "backend": counter}))
    t = tiny_trainer(run_copy, fixed_shapes=True, compile=True)
    first = t.epochs.batches(0)[:12]
    for group in on_device(t.epochs.fixed, [[x] for x in first], t.device, 0, True):
        t.step(group)
    torch._dynamo.reset()
    assert counter.frame_count == len({x.shape for x in first}) > 1
