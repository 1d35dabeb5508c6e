"""Minimum-Bayes-risk decoding (`--mbr chrf|bleu`) and epsilon sampling, in nmt's engine,
CTranslate2's, the Python API and the server, on a small trained Multi30k model; the utilities
against sacreBLEU's own sentence scores."""

import dataclasses
import gzip
import random

import numpy as np
import pytest
import sacrebleu
import torch
from conftest import Server, multi30k_folder, one_error_line

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.engine.sampling import draw
from nmt_cli.inference import mbr
from nmt_cli.inference.models import from_dir, locate
from nmt_cli.inference.translator import Translator
from nmt_cli.rundir import RunDir

SENTENCE = {"chrf": lambda h, r: sacrebleu.sentence_chrf(h, [r]).score,
            "bleu": lambda h, r: sacrebleu.sentence_bleu(h, [r]).score}  # fmt: skip


@pytest.fixture(scope="module")
def sources(trained_longer) -> list[str]:
    return RunDir(trained_longer).text("valid", "en", raw=True).read_text().splitlines()[:20]


def translator(run, engine="nmt", **options) -> Translator:
    return Translator(locate(run), TranslateConfig(engine=engine, decode=DecodeOptions(**options)))


def expected_by_hand(candidates: list[str], metric: str) -> dict[str, float]:
    """Each different candidate's mean sacreBLEU score against every candidate drawn (a text
    drawn twice counts twice), pair by pair."""
    score = SENTENCE[metric]
    return {h: float(np.mean([score(h, r) for r in candidates])) for h in dict.fromkeys(candidates)}


def test_the_utilities_are_sacrebleus_sentence_scores():
    german = [line.strip() for line in gzip.open(multi30k_folder() / "val.de.gz", "rt")][:300]
    rng = random.Random(0)
    odd = ["", " ", "a", "!!", "Ein Hund.", "Ein Hund.", "ein hund", "Straße – ”ja“ …", "x " * 40]
    for _ in range(25):
        texts = rng.sample(german, 10) + rng.sample(odd, 4)
        # shuffled words: candidates that share n-grams without being equal
        texts = [t if rng.random() < 0.5 else " ".join(rng.sample(t.split(), len(t.split()))) for t in texts]
        for metric in ("chrf", "bleu"):
            found = mbr.utilities(texts, metric)
            by_hand = np.array([[SENTENCE[metric](h, r) for r in texts] for h in texts])
            # chrF's arithmetic is sacreBLEU's step for step; BLEU's logarithms are numpy's
            assert np.abs(found - by_hand).max() <= (0 if metric == "chrf" else 1e-9), metric
    assert mbr.deduplicated(["a", "b", "a", "c", "b", "a"]) == ([0, 1, 3], [3, 2, 1])


def test_epsilon_never_draws_a_token_below_it():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0, -1.0, -2.0], [0.1, 0.0, 0.0, 0.0, 0.0, 0.0]])
    lprobs = torch.log_softmax(logits, -1)
    probs = lprobs.exp()
    uniform = torch.linspace(0, 0.9999, 2000)
    for epsilon in (0.01, 0.05, 0.3):
        drawn = torch.stack([draw(lprobs, u.repeat(2), 0, 1.0, 1.0, epsilon) for u in uniform])
        for row in range(2):
            seen = set(drawn[:, row].tolist())
            allowed = {i for i, p in enumerate(probs[row].tolist()) if p >= epsilon}
            likeliest = int(probs[row].argmax())
            assert seen == (allowed or {likeliest}), (epsilon, row, seen)
    # without a cut, every token is drawn
    plain = {int(draw(lprobs, u.repeat(2), 0, 1.0, 1.0)[0]) for u in uniform}
    assert plain == set(range(6))


def test_epsilon_half_is_greedy_and_smaller_ones_draw(trained_longer, sources):
    greedy = [t[0] for t in _texts(translator(trained_longer, beam=1), sources)]
    assert [t[0] for t in _texts(translator(trained_longer, sample=True, epsilon=0.5), sources)] == greedy
    plain = _texts(translator(trained_longer, sample=True, nbest=4, seed=3), sources)
    cut = _texts(translator(trained_longer, sample=True, nbest=4, seed=3, epsilon=0.02), sources)
    assert cut != plain and any(len(set(t)) > 1 for t in cut)


def _texts(t: Translator, lines: list[str]) -> list[list[str]]:
    return t.texts(t.hypotheses(lines))


@pytest.mark.parametrize(
    "options",
    [
        {"mbr": "chrf", "candidates": 8, "nbest": 3},
        {"mbr": "bleu", "candidates": 6, "nbest": 2},
        {"mbr": "chrf", "sample": True, "epsilon": 0.2, "candidates": 12, "nbest": 3, "seed": 4},
    ],
)
def test_mbr_ranks_the_candidates_by_their_expected_utility(trained_longer, sources, options):
    """The candidates are the plain search's (the n-best of the beam, or the draws), each text
    once; the chosen ones rank first by their mean sacreBLEU score against all candidates drawn,
    which is their score."""
    chosen = translator(trained_longer, **options)
    hyps = chosen.hypotheses(sources)
    texts = chosen.texts(hyps)
    searched = translator(trained_longer, **dataclasses.asdict(chosen.config.decode.for_candidates()))
    candidates = _texts(searched, sources)
    assert all(len(c) == chosen.config.decode.pool for c in candidates)
    repeats = 0
    for got, scored, pool in zip(texts, hyps, candidates):
        by_hand = expected_by_hand(pool, options["mbr"])
        repeats += len(by_hand) < len(pool)
        best = sorted(by_hand, key=lambda h: -by_hand[h])
        n = min(options["nbest"], len(by_hand))  # fewer texts than asked: the last again
        assert len(got) == options["nbest"] and got[n:] == got[n - 1 : n] * (len(got) - n)
        assert [by_hand[t] for t in got[:n]] == pytest.approx([by_hand[t] for t in best[:n]], abs=1e-9)
        assert [h.score for h in scored] == pytest.approx([by_hand[t] for t in got], abs=1e-9)
        assert len(set(got)) == n
    if options.get("sample"):
        assert repeats > 0  # the weighting by draws was tried
    # not the search's own best on every line
    assert sum(g[0] != c[0] for g, c in zip(texts, candidates)) > 0


def test_mbr_is_the_same_however_the_lines_are_batched(trained_longer, sources):
    options = dict(mbr="chrf", sample=True, epsilon=0.02, candidates=8, seed=11)
    together = _texts(translator(trained_longer, **options), sources)
    alone = Translator(locate(trained_longer), TranslateConfig(batch_size=1, decode=DecodeOptions(**options)))
    assert _texts(alone, sources) == together
    assert _texts(translator(trained_longer, **options), sources) == together
    assert _texts(translator(trained_longer, **{**options, "seed": 12}), sources) != together


def test_ctranslate2_mbr_ranks_its_own_candidates(package, exported, sources):
    for options in (
        {"mbr": "chrf", "candidates": 8},
        {"mbr": "bleu", "sample": True, "candidates": 8, "topp": 0.9},
    ):
        ct2 = Translator(from_dir(exported["float32"]), TranslateConfig(decode=DecodeOptions(**options)))
        hyps = ct2.hypotheses(sources)
        if options.get("sample"):  # CTranslate2's draws cannot be drawn again alike: scores alone
            assert all(h[0].score >= 0 for h in hyps)
            continue
        plain = dataclasses.asdict(ct2.config.decode.for_candidates())
        pools = _texts(
            Translator(from_dir(exported["float32"]), TranslateConfig(decode=DecodeOptions(**plain))), sources
        )
        for got, pool in zip(ct2.texts(hyps), pools):
            by_hand = expected_by_hand(pool, options["mbr"])
            assert by_hand[got[0]] == pytest.approx(max(by_hand.values()), abs=1e-9)
        # the same candidates as nmt's engine on most lines: the same choice there
        ours = _texts(
            Translator(from_dir(package), TranslateConfig(decode=DecodeOptions(**options))), sources
        )
        assert sum(a == b for a, b in zip(ours, ct2.texts(hyps))) >= len(sources) * 0.8


def test_mbr_on_the_command_line_and_its_errors(trained_longer, sources, nmt, exported):
    stdin = ("\n".join(sources[:6]) + "\n").encode()
    from nmt_cli import Translator as Api

    api = Api.load(trained_longer, threads=1).translations(sources[:6], mbr="chrf", candidates=8, nbest=2)
    out = nmt("translate", "--run-dir", trained_longer, "--mbr", "chrf", "--candidates", "8", "--nbest", "2",
              stdin=stdin).out.splitlines()  # fmt: skip
    assert out == [f"{i // 2}\t{t.score:.4f}\t{t.text}" for i, t in enumerate(x for ts in api for x in ts)]
    for flags, message in (
        (["--mbr", "ter"], "unknown --mbr 'ter': choose one of chrf, bleu, comet"),
        (["--candidates", "4"], "--candidates are --mbr's and --rerank's: add --mbr chrf"),
        (["--mbr", "chrf", "--nbest", "20"], "--nbest 20 exceeds --candidates 16"),
        (["--epsilon", "0.1"], "add --sample"),
        (["--sample", "--epsilon", "0.9"], "--epsilon must be from 0 to 0.5, not 0.9"),
    ):
        assert message in one_error_line(nmt("translate", "--run-dir", trained_longer, *flags, stdin=b"x\n"))
    refused = nmt("translate", "--model", exported["int8"], "--sample", "--epsilon", "0.1", stdin=b"x\n")
    assert "CTranslate2 has no --epsilon sampling" in one_error_line(refused)


def test_the_server_decodes_mbr_as_translate_does(package, exported, sources):
    options = {"mbr": "chrf", "candidates": 8, "sample": True, "epsilon": 0.02, "seed": 5, "scores": True}
    local = Translator(from_dir(package), TranslateConfig(decode=DecodeOptions(**options)))
    expected = [h[0] for h in local.hypotheses(sources[:6])]
    texts = local.texts([[h] for h in expected])
    server = Server(package, "--engine", "nmt")  # epsilon: nmt's engine's
    try:
        status, answer, _ = server.post({"text": sources[:6], **options})
        assert status == 200, answer
        assert [a["text"] for a in answer["translations"]] == [t[0] for t in texts]
        assert [a["score"] for a in answer["translations"]] == [round(h.score, 4) for h in expected]
        status, answer, _ = server.post({"text": ["a dog"], "mbr": "chrf", "candidates": 32})
        assert status == 400 and '"candidates" must be at most 16' in answer["error"], answer
        for choice in ({"mbr": "comet"}, {"rerank": "kiwi"}):  # a second model: translate's alone
            status, answer, _ = server.post({"text": ["a dog"], **choice})
            assert status == 400 and "which the server does not load" in answer["error"], answer
    finally:
        assert server.stop() == 0
    server = Server(exported["int8"])
    try:
        status, answer, _ = server.post({"text": ["a dog"], "sample": True, "epsilon": 0.1})
        assert status == 400 and "CTranslate2 has no --epsilon" in answer["error"], answer
        status, answer, _ = server.post({"text": sources[:2], "mbr": "bleu", "candidates": 4})
        assert status == 200 and len(answer["translations"]) == 2, answer
    finally:
        assert server.stop() == 0
