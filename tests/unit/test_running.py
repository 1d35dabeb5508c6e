"""nmt serve's running batch (decoding.Running): sentences that join a beam search between its
steps, end at different steps and drop out are each searched as `translate` searches them alone."""

import dataclasses

import pytest
import torch

from nmt_cli.config import DecodeOptions, ModelConfig
from nmt_cli.engine.decoding import Running, translate
from nmt_cli.engine.model import Transformer
from nmt_cli.vocab import EOS

OPTIONS = [
    DecodeOptions(beam=4, max_len_a=1.5, max_len_b=3),
    DecodeOptions(beam=1, max_len_a=1.0, max_len_b=8),
    DecodeOptions(beam=4, nbest=3, max_len_a=0.0, max_len_b=15),
    DecodeOptions(beam=3, repetition_penalty=1.5, min_len=4, max_len_b=12),
    DecodeOptions(beam=2, alpha=1.0, max_len_a=0.5, max_len_b=2, max_len=7),
]


def model(eos: float = 0.0) -> Transformer:
    """A random model; `eos` added to the EOS's logit (so that min_len has something to hold)."""
    torch.manual_seed(0)
    m = Transformer(
        ModelConfig(
            vocab_size=40,
            num_encoder_layers=2,
            num_decoder_layers=2,
            d_model=32,
            ffn=64,
            heads=4,
            output_bias=True,
        )
    ).eval()
    assert m.output_bias is not None
    m.output_bias[EOS] = eos
    return m


def sources(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 14, (n,), generator=g).tolist()
    return [torch.randint(4, 40, (k,), generator=g).tolist() for k in lengths]


def alone(m: Transformer, ids: list[int], options: DecodeOptions, alpha: float):
    return translate(m, torch.tensor([ids + [EOS]]), options, alphas=[alpha])[0]


@pytest.mark.parametrize("options", OPTIONS)
def test_sentences_that_join_at_any_step_are_searched_as_alone(options):
    """Sentences join in threes and fours while others decode, each with its own alpha and
    length limit; every
    one's n-best (tokens and scores) is what it finds alone, though it shared its steps with
    sentences of other lengths begun at other steps."""
    m, xs = model(eos=2.0 if options.min_len else 0.0), sources(14)
    each = [  # a length penalty and limits of each sentence's own
        dataclasses.replace(options, alpha=0.6 + 0.1 * (i % 3), max_len_b=options.max_len_b + i % 2)
        for i in range(len(xs))
    ]
    run = Running(m, options, "cpu")
    arrivals = {0: [0, 1, 2], 2: [3, 4, 5, 6], 3: [7], 7: [8, 9, 10], 12: [11, 12, 13]}
    number, found, step = {}, {}, 0
    while run.live or any(s >= step for s in arrivals):
        for i in arrivals.get(step, []):
            (number[run.join([xs[i]], [each[i]])[0]],) = [i]
        if run.live:
            for s, hyps in run.step():
                found[number[s]] = hyps
        step += 1
    assert sorted(found) == list(range(len(xs)))
    ended_at = {len(h[0].tokens) for h in found.values()}
    assert len(ended_at) > 2  # sentences ended at different steps
    for i, x in enumerate(xs):
        expected = alone(m, x, each[i], each[i].alpha)
        assert [h.tokens for h in found[i]] == [h.tokens for h in expected], i
        assert [h.score for h in found[i]] == pytest.approx([h.score for h in expected], abs=1e-4)


def test_a_sentence_that_drops_out_leaves_the_others_as_they_were():
    """Nobody waits for one sentence any more: it leaves at once, with no hypotheses, and the
    ones it decoded beside go on as alone; one that joins later too."""
    m, xs, options = model(), sources(4, seed=7), DecodeOptions(beam=4, max_len_a=0.0, max_len_b=20)
    run = Running(m, options, "cpu")
    numbers = run.join(xs[:3], [options] * 3)
    found = {}
    for step in range(60):
        if step == 2:
            run.drop([numbers[1]])
            assert run.live == 2
        if step == 4:
            numbers.append(run.join([xs[3]], [options])[0])
        if not run.live:
            break
        found.update(run.step())
    assert numbers[1] not in found and set(found) == {numbers[0], numbers[2], numbers[3]}
    for k in (0, 2, 3):
        expected = alone(m, xs[k], options, 0.6)
        assert [h.tokens for h in found[numbers[k]]] == [h.tokens for h in expected]


def test_an_empty_running_batch_takes_sentences_again():
    m, xs, options = model(), sources(2), DecodeOptions(beam=4, max_len_b=10)
    run = Running(m, options, "cpu")
    for x in xs:
        (n,) = run.join([x], [options])
        got = {}
        while run.live:
            got.update(run.step())
        assert [h.tokens for h in got[n]] == [h.tokens for h in alone(m, x, options, 0.6)]


@pytest.mark.parametrize(
    "options",
    [DecodeOptions(sample=True), DecodeOptions(no_repeat_ngram=2), DecodeOptions(coverage_penalty=0.2)],
)
def test_searches_that_need_their_sentences_to_begin_together_are_not_run_so(options):
    assert not Running.takes(options)
    with pytest.raises(ValueError):
        Running(model(), options, "cpu")


def test_sentences_join_a_running_batch_of_their_options_alone():
    run = Running(model(), DecodeOptions(beam=4), "cpu")
    run.join([[5, 6]], [DecodeOptions(beam=4, seed=3, alpha=1.0, max_len_b=7, max_len=9)])
    for other in (DecodeOptions(beam=5), DecodeOptions(beam=4, min_len=2), DecodeOptions(beam=4, nbest=2)):
        with pytest.raises(ValueError):
            run.join([[5, 6]], [other])
