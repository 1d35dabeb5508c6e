"""The rules on the next token (engine/rules.py), on hand-written log-probabilities: what every
search applies before it chooses."""

import math

import numpy as np
import torch

from nmt_cli.config import DecodeOptions
from nmt_cli.engine.rules import NextToken
from nmt_cli.vocab import BOS, EOS, PAD

V = 8
A, B = 5, 6


def lprobs(rows: int) -> torch.Tensor:
    return torch.log(torch.full((rows, V), 1.0 / V))


def test_pad_and_bos_never_come_next_and_a_row_at_its_limit_may_only_end():
    rules = NextToken(DecodeOptions(beam=2), max_lens=[3, 1], rows=2)
    got = rules(lprobs(4))
    assert torch.isinf(got[:, [PAD, BOS]]).all()
    assert torch.isfinite(got[:2, [EOS, A, B]]).all()  # sentence 0: limit 3, at its first token
    assert torch.isfinite(got[2:, EOS]).all() and (torch.isinf(got[2:]).sum(1) == V - 1).all()
    assert rules.at_limit().tolist() == [False, False, True, True] == rules.ending().tolist()
    assert got[0, EOS] == math.log(1.0 / V)  # what is allowed keeps its value


def test_a_forced_prefix_is_the_only_choice_while_it_lasts_and_follows_its_rows():
    forced = torch.tensor([[A, B], [-1, -1]])  # sentence 0's prefix; sentence 1 has none
    rules = NextToken(DecodeOptions(beam=2), max_lens=[10, 10], rows=2, forced=forced)
    got = rules(lprobs(4))
    assert [int(torch.isfinite(row).sum()) for row in got] == [1, 1, V - 2, V - 2]
    assert got[0].argmax() == A and got[1].argmax() == A
    rules.keep(np.array([3, 0]))  # sentence 1's second beam first, then sentence 0's first
    got = rules(lprobs(2))
    assert int(torch.isfinite(got[0]).sum()) == V - 2  # sentence 1's row: free
    assert torch.isfinite(got[1]).tolist() == [i == B for i in range(V)]  # the prefix's 2nd token
    rules.keep(None)
    got = rules(lprobs(2))
    assert (torch.isfinite(got).sum(1) == V - 2).all()  # past the prefix: free


def test_limits_follow_the_rows_kept():
    rules = NextToken(DecodeOptions(beam=1), max_lens=[2, 5], rows=1)
    rules.keep(np.array([1, 0]))  # step 1 done, the rows swapped
    assert rules.at_limit().tolist() == [False, True] == rules.ending().tolist()
