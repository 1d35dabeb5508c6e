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
    # sentence 1's second beam first, then sentence 0's first
    rules.keep(np.array([3, 0]), None, torch.tensor([A, A]))
    got = rules(lprobs(2))
    assert int(torch.isfinite(got[0]).sum()) == V - 2  # sentence 1's row: free
    assert torch.isfinite(got[1]).tolist() == [i == B for i in range(V)]  # the prefix's 2nd token
    rules.keep(None, None, torch.tensor([B, B]))
    got = rules(lprobs(2))
    assert (torch.isfinite(got).sum(1) == V - 2).all()  # past the prefix: free


def test_limits_follow_the_rows_kept():
    rules = NextToken(DecodeOptions(beam=1), max_lens=[2, 5], rows=1)
    rules.keep(np.array([1, 0]), None, torch.tensor([A, A]))  # step 1 done, the rows swapped
    assert rules.at_limit().tolist() == [False, True] == rules.ending().tolist()


def test_the_end_waits_for_min_len_but_not_past_the_limit():
    rules = NextToken(DecodeOptions(beam=1, min_len=2), max_lens=[10, 1], rows=1)
    got = rules(lprobs(2))
    assert torch.isinf(got[0, EOS]) and torch.isfinite(got[1, EOS])  # row 1 is at its limit
    rules.keep(np.array([0]), None, torch.tensor([A]))
    assert torch.isinf(rules(lprobs(1))[0, EOS])  # one token so far
    rules.keep(None, None, torch.tensor([B]))
    assert torch.isfinite(rules(lprobs(1))[0, EOS])  # two: it may end


def test_no_token_completes_an_ngram_the_row_already_holds():
    rules = NextToken(DecodeOptions(beam=2, no_repeat_ngram=2), max_lens=[20], rows=2)
    for tokens in ([A, A], [B, 7], [A, B], [B, A]):  # rows so far: A B A B / A 7 B A
        rules(lprobs(2))
        rules.keep(None, None, torch.tensor(tokens))
    got = rules(lprobs(2))
    # row 0 ends "B", after which A came; row 1 ends "A", after which 7 came
    assert torch.isinf(got[0]).tolist() == [i in (PAD, BOS, A) for i in range(V)]
    assert torch.isinf(got[1]).tolist() == [i in (PAD, BOS, 7) for i in range(V)]
    rules.keep(np.array([1]), None, torch.tensor([A]))  # row 1 goes on alone: A 7 B A A
    got = rules(lprobs(1))
    assert torch.isinf(got[0]).tolist() == [i in (PAD, BOS, 7, A) for i in range(V)]


def test_the_ngram_ban_never_waits_for_the_device():
    """Banning repeats asks the device nothing (no nonzero: its size is read on the host)."""
    from conftest import host_reads

    rules = NextToken(DecodeOptions(beam=2, no_repeat_ngram=2), max_lens=[20], rows=2)
    for tokens in ([A, A], [B, 7], [A, B], [B, A]):
        rules(lprobs(2))
        rules.keep(None, None, torch.tensor(tokens))
    with host_reads() as reads:
        got = rules(lprobs(2))
    assert reads["n"] == 0
    assert torch.isinf(got[0]).tolist() == [i in (PAD, BOS, A) for i in range(V)]


def test_a_forced_prefix_token_is_taken_whatever_the_bans_say():
    forced = torch.tensor([[A, A]])
    rules = NextToken(DecodeOptions(beam=1, no_repeat_ngram=1, min_len=5), [10], 1, forced=forced)
    rules(lprobs(1))
    rules.keep(None, None, torch.tensor([A]))
    got = rules(lprobs(1))  # A again: banned by no-repeat, forced by the prefix
    assert got[0, A] == math.log(1.0 / V) and int(torch.isfinite(got[0]).sum()) == 1


def test_the_repetition_penalty_scales_the_logits_of_the_tokens_a_row_holds():
    rules = NextToken(DecodeOptions(beam=2, repetition_penalty=2.0), max_lens=[20], rows=2)
    logits = torch.tensor([[1.0, -1.0, 4.0, -4.0, 0.5, 2.0, -2.0, 3.0]]).repeat(2, 1)
    assert torch.equal(rules.logits(logits.clone()), logits)  # nothing held yet
    rules.keep(None, None, torch.tensor([A, 7]))
    rules.keep(np.array([1, 1]), None, torch.tensor([B, 2]))  # row 1 goes on twice: 7 B / 7 2
    got = rules.logits(logits.clone())
    want = logits.clone()
    want[:, 7] = 1.5  # both rows hold 7: a positive logit halved
    want[0, B] = -4.0  # a negative one doubled
    want[1, 2] = 2.0
    assert torch.equal(got, want)
    assert torch.equal(NextToken(DecodeOptions(), [20], 1).logits(logits[:1].clone()), logits[:1])
