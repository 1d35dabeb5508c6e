"""Beam search on hand-written probability tables (exact hypotheses and scores), and the
invariants on a real (random) model: cached = uncached, beam 1 = greedy, batched = alone."""

import dataclasses
import math

import pytest
import torch
from conftest import count_decoding_steps, host_reads

from nmt_cli.config import DecodeOptions, ModelConfig
from nmt_cli.engine.beam import beam_step, choose, length_penalty, search
from nmt_cli.engine.decoding import _decoder, translate
from nmt_cli.engine.hypothesis import max_lengths
from nmt_cli.engine.model import Transformer
from nmt_cli.engine.rules import NextToken
from nmt_cli.engine.sampling import greedy
from nmt_cli.vocab import BOS, EOS, PAD

A, B = 4, 5
V = 6


class Table:
    """A 'model' whose next-token distribution depends on the row's prefix, for one sentence
    per entry of `tables`; it keeps each row's prefix through reorder() as a decoder would."""

    def __init__(self, tables: list[dict[tuple, dict[int, float]]], beam: int):
        self.tables = tables
        self.rows = [(s, ()) for s in range(len(tables)) for _ in range(beam)]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        out = torch.full((len(self.rows), V), -math.inf)
        for r, (s, prefix) in enumerate(self.rows):
            for token, p in self.tables[s].get(prefix, {EOS: 1.0}).items():
                out[r, token] = math.log(p)
        self.last = tokens
        return out

    def reorder(self, indices: torch.Tensor) -> None:
        # The tokens chosen this step are only known to the search; the test's rows learn them
        # at the next step() through `tokens`, so record the reorder and extend lazily.
        self.rows = [self.rows[i] for i in indices.tolist()]
        self._pending = True

    def run(self, beam, alpha, max_lens, nbest=1):
        table = self

        def step(tokens):
            if getattr(table, "_pending", False):
                table.rows = [
                    (s, prefix + (int(tok),)) for (s, prefix), tok in zip(table.rows, tokens[:, 0].tolist())
                ]
                table._pending = False
            return table.step(tokens)

        options = DecodeOptions(beam=beam, alpha=alpha, nbest=nbest)
        return search(step, self.reorder, NextToken(options, max_lens, beam))


TABLE = {(): {A: 0.6, B: 0.4}, (A,): {EOS: 0.4, A: 0.3, B: 0.3}, (B,): {EOS: 0.9, A: 0.05, B: 0.05}}


def test_length_penalty():
    assert length_penalty(1, 0.6) == 1.0
    assert length_penalty(7, 0.6) == pytest.approx(2**0.6)
    assert length_penalty(10, 0.0) == 1.0


def test_beam_step_and_choose_by_hand():
    scores = torch.tensor([[math.log(0.6), math.log(0.4)]])
    lprobs = torch.full((1, 2, V), -math.inf)
    for beam, prefix in enumerate([(A,), (B,)]):
        for token, p in TABLE[prefix].items():
            lprobs[0, beam, token] = math.log(p)
    top, beams, tokens = beam_step(scores, lprobs, 2)
    assert torch.allclose(top.exp(), torch.tensor([[0.36, 0.24, 0.18, 0.18]]))
    assert beams.tolist() == [[1, 0, 0, 0]] and tokens.tolist()[0][:2] == [EOS, EOS]
    done, live = choose(top.numpy(), tokens.numpy(), 2)
    assert done.tolist() == [[True, True, False, False]]
    assert live.tolist() == [[2, 3]]  # the two best that do not end: A or B after A


def test_beam_finds_what_greedy_misses():
    hyps = Table([TABLE], beam=2).run(beam=2, alpha=0.0, max_lens=[10], nbest=2)[0]
    assert [h.tokens for h in hyps] == [[B], [A]]
    assert [h.score for h in hyps] == pytest.approx([math.log(0.36), math.log(0.24)])
    greedy_hyp = Table([TABLE], beam=1).run(beam=1, alpha=0.0, max_lens=[10])[0][0]
    assert greedy_hyp.tokens == [A] and greedy_hyp.score == pytest.approx(math.log(0.24))


def test_length_penalty_divides_scores():
    hyps = Table([TABLE], beam=2).run(beam=2, alpha=0.6, max_lens=[10], nbest=2)[0]
    lp = length_penalty(2, 0.6)
    assert [h.score for h in hyps] == pytest.approx([math.log(0.36) / lp, math.log(0.24) / lp])


def test_max_length_forces_eos_per_sentence():
    import itertools

    dist = {A: 0.5, B: 0.49, EOS: 0.01}  # EOS never ranks among the best two by itself
    forever = {prefix: dist for n in range(3) for prefix in itertools.product([A, B], repeat=n)}
    hyps = Table([forever, TABLE], beam=2).run(beam=2, alpha=0.0, max_lens=[3, 10])
    assert hyps[0][0].tokens == [A, A]  # 2 tokens + the forced EOS = the limit of 3
    assert hyps[0][0].score == pytest.approx(math.log(0.5 * 0.5 * 0.01))
    assert hyps[1][0].tokens == [B]  # the other sentence is not cut short


def test_a_sentence_ends_at_its_limit_with_fewer_hypotheses_than_nbest():
    """A limit of one token leaves one finished hypothesis (the first step has one live beam),
    fewer than --nbest 2: the search ends that sentence there all the same."""
    calls = {"n": 0}

    def step(tokens):
        calls["n"] += 1
        assert calls["n"] <= 4, "the search went on past every limit"
        lprobs = torch.log_softmax(torch.arange(V, dtype=torch.float).expand(len(tokens), V), -1)
        return lprobs.index_fill(1, torch.tensor([EOS]), -30.0)  # EOS only where forced

    found = search(step, lambda rows: None, NextToken(DecodeOptions(beam=2, nbest=2, alpha=0.0), [1, 3], 2))
    assert [[h.tokens for h in hs] for hs in found] == [[[]], [[5, 5], [5, 4]]]
    assert calls["n"] == 3


def test_stops_when_no_live_hypothesis_can_win():
    # After "A EOS" (0.5) finishes, the live "B A" and "B B" have 0.1 at most: they cannot win.
    # Without that bound the search would go on to the length limit (EOS then ranks low).
    import itertools

    later = {A: 0.5, B: 0.49, EOS: 0.01}
    table = {prefix: later for n in range(2, 12) for prefix in itertools.product([A, B], repeat=n)}
    table.update({(): {A: 0.5, B: 0.5}, (A,): {EOS: 1.0}, (B,): {A: 0.2, B: 0.2, EOS: 0.6}})
    calls = {"n": 0}
    t = Table([table], beam=3)
    real = t.step

    def counting(tokens):
        calls["n"] += 1
        return real(tokens)

    t.step = counting
    hyps = t.run(beam=3, alpha=0.0, max_lens=[12])[0]
    assert hyps[0].tokens == [A] and hyps[0].score == pytest.approx(math.log(0.5))
    assert calls["n"] == 2


@pytest.mark.parametrize("beam", [1, 2])
def test_pad_and_bos_are_never_chosen(beam):
    table = {
        (): {PAD: 0.5, BOS: 0.3, A: 0.15, B: 0.05},
        (A,): {BOS: 0.9, EOS: 0.1},
        (B,): {PAD: 0.9, EOS: 0.1},
    }
    hyps = Table([table], beam=beam).run(beam=beam, alpha=0.0, max_lens=[10], nbest=beam)[0]
    assert [h.tokens for h in hyps] == [[A], [B]][:beam]
    assert hyps[0].score == pytest.approx(math.log(0.15 * 0.1))


def model():
    torch.manual_seed(0)
    return Transformer(
        ModelConfig(vocab_size=40, num_encoder_layers=2, num_decoder_layers=2, d_model=32, ffn=64, heads=4)
    ).eval()


SRC = torch.tensor(
    [[5, 6, 7, 8, 9, 10, EOS], [11, 12, EOS, PAD, PAD, PAD, PAD], [13, 14, 15, 16, EOS, PAD, PAD]]
)


@pytest.mark.parametrize("beam", [1, 4])
def test_cached_equals_uncached(beam):
    m = model()
    a = translate(m, SRC, DecodeOptions(beam=beam, max_len_b=12, nbest=1))
    b = translate(m, SRC, DecodeOptions(beam=beam, max_len_b=12, nbest=1), use_cache=False)
    for x, y in zip(a, b):
        assert x[0].tokens == y[0].tokens
        assert x[0].score == pytest.approx(y[0].score, abs=1e-5)


def test_beam_one_equals_greedy():
    m = model()
    fast = translate(m, SRC, DecodeOptions(beam=1, max_len_b=12))
    slow = translate(
        m, SRC, DecodeOptions(beam=1, max_len_b=12), use_cache=False
    )  # the prefix rerun each step
    # The beam search itself with one beam (translate takes the greedy path at beam 1).
    lens = max_lengths([int((r != PAD).sum()) - 1 for r in SRC], 1.0, 12, m.config.max_positions - 1)
    with torch.no_grad():
        step, reorder = _decoder(m, SRC, 1, max(lens) + 1, True)
        beam1 = search(step, reorder, NextToken(DecodeOptions(beam=1), lens, 1))
    for f, s, b in zip(fast, slow, beam1):
        assert f[0].tokens == s[0].tokens == b[0].tokens
        assert f[0].score == pytest.approx(s[0].score, abs=1e-5)
        assert f[0].score == pytest.approx(b[0].score, abs=1e-5)


def test_batched_equals_alone():
    m = model()
    batched = translate(m, SRC, DecodeOptions(beam=4, max_len_b=12))
    for i in range(len(SRC)):
        row = SRC[i : i + 1, : int((SRC[i] != PAD).sum())]
        alone = translate(m, row, DecodeOptions(beam=4, max_len_b=12))
        assert alone[0][0].tokens == batched[i][0].tokens
        assert alone[0][0].score == pytest.approx(batched[i][0].score, abs=1e-5)


def test_greedy_respects_limits():
    m = model()
    out = greedy(
        lambda tokens: torch.log_softmax(torch.zeros(len(tokens), V), -1).index_fill(
            1, torch.tensor([EOS]), -math.inf
        ),
        lambda idx: None,
        NextToken(DecodeOptions(beam=1, alpha=0.0), [3, 5], 1),
    )
    assert [len(h[0].tokens) for h in out] == [2, 4]
    del m


@pytest.mark.parametrize("beam", [1, 4])
def test_search_reads_the_device_once_per_step(beam):
    """On a GPU every read of a tensor's values waits for the device: one per step, not one
    per sentence or per check."""
    from conftest import count_decoding_steps, host_reads

    m = model()
    steps = count_decoding_steps(m)
    with host_reads() as reads:
        translate(m, SRC, DecodeOptions(beam=beam, max_len_b=12))
    assert steps["n"] >= 5
    assert reads["n"] <= steps["n"] + 1, (reads, steps)  # + the source lengths


FIXED_SRC = torch.randint(4, 40, (9, 12), generator=torch.Generator().manual_seed(5))
FIXED_SRC[:, -1] = EOS
FIXED_SRC[3, 5], FIXED_SRC[3, 6:] = EOS, PAD
FIXED_SRC[7, 8], FIXED_SRC[7, 9:] = EOS, PAD


@pytest.mark.parametrize(
    "options, extra",
    [
        (dict(beam=4, max_len_a=1.5, max_len_b=3), {}),
        (dict(beam=1, max_len_a=1.5, max_len_b=3), {}),
        (dict(beam=4, nbest=3, max_len_a=0.0, max_len_b=15), {}),
        (dict(sample=True, nbest=3, max_len_a=1.0, max_len_b=4, seed=3), {}),
        (dict(beam=3, repetition_penalty=1.5, no_repeat_ngram=2, min_len=3), {}),
        (dict(beam=4), {"prefixes": [[7, 8]] * 3 + [[]] * 6}),
        (dict(beam=4), {"constraints": [[[9, 10]]] * 2 + [[]] * 7}),
        (dict(beam=4, max_len_a=1.2), {"ensemble": True}),
    ],
)
def test_the_fixed_shape_steps_of_a_gpu_decode_as_the_cpus_cache_does(options, extra):
    """What a GPU replays as a CUDA graph (cache.FixedCache: every row kept, every position
    masked until written) finds what the CPU's cache finds, in every search, with sentences
    ending at different steps."""
    m = model()
    models = [m, _random_model(3, 32)] if extra.pop("ensemble", False) else m
    options = DecodeOptions(**options)
    mine = translate(models, FIXED_SRC, options, **extra)
    steps = count_decoding_steps(m)
    with host_reads() as reads:
        fixed = translate(models, FIXED_SRC, options, graphs=True, **extra)
    assert [[h.tokens for h in hs] for hs in fixed] == [[h.tokens for h in hs] for hs in mine]
    assert [h.score for hs in fixed for h in hs] == pytest.approx(
        [h.score for hs in mine for h in hs], abs=1e-5
    )
    assert len({len(hs[0].tokens) for hs in mine}) > 2  # sentences end at different steps
    # as many reads of the device as the CPU's cache needs: one a step
    reads_fixed, steps_fixed = reads["n"], steps["n"]
    steps["n"] = 0
    with host_reads() as reads:
        translate(models, FIXED_SRC, options, **extra)
    assert (reads_fixed, steps_fixed) == (reads["n"], steps["n"])


def _random_model(seed: int, d_model: int) -> Transformer:
    torch.manual_seed(seed)
    c = ModelConfig(
        vocab_size=40, num_encoder_layers=1, num_decoder_layers=2, d_model=d_model, ffn=32, heads=2
    )
    return Transformer(c).eval()


@torch.no_grad()
def _mean_lprobs(models, src: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """The ensemble's next-token log-probs after `prefix`, from whole teacher-forced passes."""
    outs = [torch.log_softmax(m.logits(m(src, prefix)[:, -1]), -1) for m in models]
    return sum(outs) / len(outs)


def test_an_ensemble_averages_the_log_probabilities_of_its_models():
    # Two models of different widths, their own encoders and caches, one search.
    models = [_random_model(1, 16), _random_model(2, 24)]
    src = torch.tensor([[5, 6, 7, 8, EOS], [9, 10, EOS, PAD, PAD]])
    # Greedy, against a reference that reruns both models on the whole prefix at every step.
    got = translate(models, src, DecodeOptions(beam=1, max_len_a=0.0, max_len_b=6))
    for i, hyps in enumerate(got):
        prefix = torch.tensor([[BOS]])
        total = 0.0
        for t in range(6):
            lp = _mean_lprobs(models, src[i : i + 1, : int((src[i] != PAD).sum())], prefix)[0]
            lp[PAD] = lp[BOS] = -math.inf
            best = EOS if t == 5 else int(lp.argmax())
            total += float(lp[best])
            if best == EOS:
                break
            prefix = torch.cat([prefix, torch.tensor([[best]])], 1)
        assert hyps[0].tokens == prefix[0, 1:].tolist()
        assert hyps[0].score == pytest.approx(total / length_penalty(len(prefix[0]), 0.6), abs=1e-4)
    # Beam 4: each hypothesis's score is the sum of its tokens' mean log-probs, penalised.
    for i, hyps in enumerate(
        translate(models, src, DecodeOptions(beam=4, alpha=0.6, max_len_a=0.0, max_len_b=6, nbest=4))
    ):
        one = src[i : i + 1, : int((src[i] != PAD).sum())]
        for h in hyps:
            tokens = torch.tensor([[BOS, *h.tokens]])
            steps = [
                float(_mean_lprobs(models, one, tokens[:, : j + 1])[0, tok])
                for j, tok in enumerate([*h.tokens, EOS])
            ]
            assert h.score == pytest.approx(sum(steps) / length_penalty(len(h.tokens) + 1, 0.6), abs=1e-4)
    # One model twice is that model.
    alone = translate(models[0], src, DecodeOptions(beam=4, max_len_b=6, nbest=2))
    twice = translate([models[0], models[0]], src, DecodeOptions(beam=4, max_len_b=6, nbest=2))
    assert [[h.tokens for h in hs] for hs in twice] == [[h.tokens for h in hs] for hs in alone]


def test_draws_follow_the_distribution_as_top_k_top_p_and_temperature_shape_it():
    from nmt_cli.engine.sampling import draw

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40_000
    lprobs = probs.log().expand(n, 4).clone()
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(0))

    def shares(topk=0, topp=1.0, temperature=1.0) -> list[float]:
        tokens = draw(lprobs, uniform, topk, topp, temperature)
        return (torch.bincount(tokens, minlength=4).float() / n).tolist()

    assert shares() == pytest.approx(probs.tolist(), abs=0.01)
    assert shares(topk=2) == pytest.approx([0.625, 0.375, 0, 0], abs=0.01)
    assert shares(topp=0.7) == pytest.approx([0.625, 0.375, 0, 0], abs=0.01)  # 0.5 falls short of 0.7
    assert shares(topp=0.45) == [1.0, 0.0, 0.0, 0.0]  # 0.5 alone reaches it
    assert shares(topp=0.55) == pytest.approx([0.625, 0.375, 0, 0], abs=0.01)  # 0.5 falls short
    # top-p within what top-k kept: 0.5 / 0.95 + 0.3 / 0.95 falls short of 0.9
    assert shares(topk=3, topp=0.9) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], abs=0.01)
    assert shares(topk=3, topp=0.8) == pytest.approx([0.625, 0.375, 0, 0], abs=0.01)
    squared = (probs**2 / (probs**2).sum()).tolist()
    assert shares(temperature=0.5) == pytest.approx(squared, abs=0.01)


@pytest.mark.parametrize(
    "options",
    [DecodeOptions(beam=4), DecodeOptions(beam=1), DecodeOptions(sample=True, nbest=2), "constrained"],
)
def test_every_search_gives_up_at_the_step_after_stop_says_so(options):
    """The server's `gone`: asked before every decoding step of every search; once nobody waits
    for any sentence, the search raises Stopped instead of running on for nobody."""
    from nmt_cli.errors import Stopped

    m, src = model(), torch.tensor([[5, 6, 7, EOS], [8, 9, EOS, PAD]])
    constraints = [[[10, 11]], [[12]]] if options == "constrained" else None
    options = DecodeOptions(beam=4, max_len_b=30) if options == "constrained" else options
    asked = []

    def gone() -> list[bool]:
        asked.append(True)
        return [len(asked) > 3] * 2

    with pytest.raises(Stopped):
        translate(m, src, dataclasses.replace(options, max_len_b=30), constraints=constraints, gone=gone)
    assert len(asked) == 4  # three steps taken, the fourth refused
    assert translate(m, src, options, constraints=constraints, gone=lambda: [False, False])  # no effect


@pytest.mark.parametrize(
    "options",
    [DecodeOptions(beam=4), DecodeOptions(beam=1), DecodeOptions(sample=True, nbest=2), "constrained"],
)
def test_every_search_ends_the_sentences_nobody_waits_for_and_goes_on_with_the_rest(options):
    """A sentence whose request has gone ends at the next step (its rows no longer decoded);
    the others of its batch are searched as if it had stayed."""
    m, src = model(), torch.tensor([[5, 6, 7, EOS], [8, 9, EOS, PAD], [10, 11, 12, EOS]])
    constraints = [[[10, 11]], [[12, 13]], [[14]]] if options == "constrained" else None
    options = DecodeOptions(beam=4) if options == "constrained" else options
    options = dataclasses.replace(options, max_len_a=0.0, max_len_b=30)
    asked = []

    def gone() -> list[bool]:  # the second sentence's client leaves before the third step
        asked.append(True)
        return [False, len(asked) >= 3, False]

    stayed = translate(m, src, options, constraints=constraints)
    left = translate(m, src, options, constraints=constraints, gone=gone)
    assert min(len(h.tokens) for h in stayed[1]) > 2  # it would have gone on
    assert all(len(h.tokens) <= 2 for h in left[1])  # two tokens, then the EOS at the third step
    for i in (0, 2):
        assert [h.tokens for h in left[i]] == [h.tokens for h in stayed[i]]
        assert [h.score for h in left[i]] == pytest.approx([h.score for h in stayed[i]], abs=1e-4)


def test_coverage_penalty_by_hand():
    """beta x the sum of log(min(attention received, 1)) over the source tokens; a token given
    more than its share counts 0, one never attended to (padding) nothing."""
    from nmt_cli.engine.hypothesis import coverage_penalty

    expected = 2.0 * (math.log(0.5) + math.log(0.25))
    assert coverage_penalty([0.5, 1.5, 0.0, 0.25], 2.0) == pytest.approx(expected)
    assert coverage_penalty([1.0, 3.0], 0.7) == 0.0
