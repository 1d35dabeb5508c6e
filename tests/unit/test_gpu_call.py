"""The GPU call's checks (benchmarks/gpu_all.py) can fail: each passes its good row and refuses
every broken one, so that a call on a GPU reports no figure its checks could not have refused."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_all  # noqa: E402


@pytest.mark.parametrize("name", sorted(gpu_all.CHECKS))
def test_each_check_passes_its_good_row_and_refuses_each_broken_one(name):
    check = gpu_all.CHECKS[name]
    assert check(gpu_all.GOOD[name]) == []
    assert gpu_all.BROKEN[name], f"{name} has no broken rows"
    for change in gpu_all.BROKEN[name]:
        assert check({**gpu_all.GOOD[name], **change}), f"{name} lets {change} through"


def test_every_section_of_the_first_call_has_a_check():
    assert set(gpu_all.FIRST) == set(gpu_all.CHECKS)
    assert gpu_all.checks_that_cannot_fail() == []
