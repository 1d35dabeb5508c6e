"""Lexical constraints (engine/constrained.py) on a real (random) model: every hypothesis holds its
phrases, a sentence without any is searched as beam.py searches it, and the beam is shared out
among banks round robin."""

import pytest
import torch
from test_beam import SRC, model  # the random model and sources of beam search's own tests

from nmt_cli.config import DecodeOptions
from nmt_cli.engine import constrained
from nmt_cli.engine.constrained import Progress, allocate
from nmt_cli.engine.decoding import _decoder, translate
from nmt_cli.engine.hypothesis import limits, max_lengths
from nmt_cli.engine.rules import NextToken
from nmt_cli.vocab import PAD


def holds(tokens: list[int], phrase: list[int]) -> bool:
    return any(tokens[i : i + len(phrase)] == phrase for i in range(len(tokens)))


PHRASES = [[[20, 21], [30]], [[15]], [[33, 34, 35], [22, 23]]]


@pytest.mark.parametrize("beam_size,nbest,models", [(1, 1, 1), (4, 1, 1), (4, 2, 1), (4, 1, 2)])
def test_every_hypothesis_holds_its_phrases(beam_size, nbest, models):
    m = model() if models == 1 else [model(), model()]  # an ensemble searches as one
    found = translate(m, SRC, DecodeOptions(beam=beam_size, max_len_b=12, nbest=nbest), constraints=PHRASES)
    for phrases, hyps in zip(PHRASES, found):
        assert len(hyps) == nbest
        held = [all(holds(h.tokens, p) for p in phrases) for h in hyps]
        # those the search finished within the limit come first: the best always holds them
        assert held[0] and held == sorted(held, reverse=True), (phrases, [h.tokens for h in hyps])


def test_a_sentence_without_phrases_is_searched_as_beam_search_does():
    m = model()
    options = DecodeOptions(beam=4, max_len_b=12, nbest=3)
    plain = translate(m, SRC, options)
    lens = max_lengths([int((r != PAD).sum()) - 1 for r in SRC], 1.0, 12, m.config.max_positions - 1)
    with torch.no_grad():  # every sentence through the constrained search, none with a phrase
        step, reorder = _decoder(m, SRC, 4, max(lens) + 1, True)
        free = constrained.search(step, reorder, NextToken(options, lens, 4), [[], [], []])
    mixed = translate(m, SRC, options, constraints=[[], [[15]], []])
    for i, (p, f) in enumerate(zip(plain, free)):
        assert [h.tokens for h in p] == [h.tokens for h in f]
        assert [h.score for h in p] == pytest.approx([h.score for h in f], abs=1e-5)
        if i != 1:
            assert [h.tokens for h in mixed[i]] == [h.tokens for h in p]


def test_a_prefix_and_phrases_together():
    found = translate(
        model(), SRC, DecodeOptions(beam=4, max_len_b=12), prefixes=[[7, 8], [], [9]], constraints=PHRASES
    )
    for start, phrases, hyps in zip([[7, 8], [], [9]], PHRASES, found):
        assert hyps[0].tokens[: len(start)] == start
        assert all(holds(hyps[0].tokens, p) for p in phrases)


def test_progress_through_phrases():
    phrases = [[5, 6, 7], [9]]
    p = Progress()
    assert sorted(p.wanted(phrases)) == [5, 9]
    p = p.after(5, phrases).after(6, phrases)
    assert (p.bank(phrases), p.wanted(phrases)) == (2, [7, 9])
    broken = p.after(9, phrases)  # the phrase broken off, the other met
    assert (broken.met, broken.bank(phrases), broken.done(phrases)) == ({1}, 1, False)
    whole = p.after(7, phrases).after(9, phrases)
    assert whole.done(phrases) and whole.bank(phrases) == 4
    assert whole.after(3, phrases) == whole  # a met phrase stays met


def test_the_beam_is_shared_round_robin_among_banks():
    # (score, beam, token, progress): two likely candidates in bank 0, unlikely ones in banks 1 and 2
    scores = [-1.0, -2.0, -9.0, -8.0, -7.0]
    banks = [0, 0, 1, 1, 2]
    chosen = allocate([(s, 0, 0, Progress()) for s in scores], banks, 4)
    assert chosen == [4, 3, 0, 2]  # the best of banks 2, 1, 0, then bank 1's second


def test_constraints_need_room():
    # room for the prefix, then the phrases, then the EOS, within the ceiling
    assert limits([3, 3], 1.0, 2, 100, [[7], []], [[[1, 2], [3]], []]) == [5, 5]
    assert limits([3, 3], 0.0, 1, 100, [[7], []], [[[1, 2], [3]], []]) == [5, 1]
    assert limits([3], 0.0, 1, 4, [[7]], [[[1, 2], [3]]]) == [4]
    # a sentence allowed fewer tokens than its phrases need is given room for them
    out = translate(
        model(), SRC[:1], DecodeOptions(beam=2, max_len_a=0.0, max_len_b=1), constraints=[[[20, 21, 22]]]
    )
    assert holds(out[0][0].tokens, [20, 21, 22])
