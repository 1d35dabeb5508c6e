"""--pair-temperature: the corpora of a run (a many-to-many run's directions) reweighted so that
an epoch takes each in proportion to its size to the power 1/T, the epoch's size unchanged."""

import numpy as np
import pytest

from nmt_cli.engine.batches import Split


def taken(corpora) -> list[float]:
    return [c["pairs"] * c["weight"] for c in corpora]


def test_temperature_one_changes_nothing():
    corpora = [{"pairs": 100, "weight": 1.0}, {"pairs": 10_000, "weight": 2.5}]
    assert Split.tempered(corpora, 1.0) == tuple(corpora)


@pytest.mark.parametrize("temperature", [2.0, 5.0, 100.0])
def test_a_higher_temperature_evens_the_corpora_out_keeping_the_epoch(temperature):
    corpora = [
        {"pairs": 100, "weight": 1.0, "tag": "<2de>"},
        {"pairs": 10_000, "weight": 1.0, "tag": "<2fr>"},
    ]
    tempered = Split.tempered(corpora, temperature)
    before, after = taken(corpora), taken(tempered)
    assert sum(after) == pytest.approx(sum(before))
    assert after[1] / after[0] == pytest.approx(100 ** (1 / temperature))
    assert [c["tag"] for c in tempered] == ["<2de>", "<2fr>"]


def test_it_tempers_what_the_weights_take():
    """A corpus given --weight 2 counts as twice its pairs."""
    corpora = [{"pairs": 100, "weight": 2.0}, {"pairs": 200, "weight": 1.0}]
    after = taken(Split.tempered(corpora, 3.0))
    assert after[0] == pytest.approx(after[1])


def test_an_epoch_takes_the_tempered_shares():
    """Split.chosen draws the tempered weights: each corpus's share of an epoch as computed."""
    from nmt_cli.shards import Shard

    n = [50, 450]
    side = Shard.in_memory([[5, 6, 7]] * sum(n), 8000)
    corpora = Split.tempered([{"pairs": n[0], "weight": 1.0}, {"pairs": n[1], "weight": 1.0}], 4.0)
    chosen = Split.of(side, side, 100, corpora).chosen(seed=1, epoch=1)
    first = int(np.sum(chosen < n[0]))
    expected = taken(corpora)
    assert first == pytest.approx(expected[0], abs=1)
    assert len(chosen) - first == pytest.approx(expected[1], abs=1)
