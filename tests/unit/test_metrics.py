"""The measures of `nmt score` on hand-made lines: what each gives and refuses."""

import pytest

from nmt_cli import metrics
from nmt_cli.errors import NmtError

REFS = ["The cat sits on the mat .", "A dog runs in the park ."]


def test_identical_lines_score_the_top_and_carry_their_signature():
    bleu, chrf, ter = metrics.score(REFS, REFS, ["bleu", "chrf", "ter"])
    assert (bleu.score, chrf.score, ter.score) == (pytest.approx(100.0), pytest.approx(100.0), 0.0)
    assert bleu.signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert "nc:6" in chrf.signature and bleu.text.startswith("BLEU = 100.00")


def test_lowercase_and_tokenize_reach_sacrebleu():
    upper = [r.upper() for r in REFS]
    assert metrics.score(upper, REFS, ["bleu"])[0].score < 10
    lowered = metrics.score(upper, REFS, ["bleu"], lowercase=True)[0]
    assert lowered.score == pytest.approx(100.0) and "case:lc" in lowered.signature
    assert "tok:none" in metrics.score(REFS, REFS, ["bleu"], tokenize="none")[0].signature


def test_moses_lc_lowercases_normalises_and_escapes():
    assert metrics.moses_lc(['Ein "Zitat" & mehr.'], "de") == ["ein &quot; zitat &quot; &amp; mehr ."]


def test_refusals_are_nmt_errors():
    with pytest.raises(NmtError, match="has 1 lines but refs has 2"):
        metrics.check_lengths(REFS[:1], REFS, "hyp", "refs")
    with pytest.raises(NmtError, match="unknown metric 'meteor'"):
        metrics.score(REFS, REFS, ["meteor"])


def test_the_paired_bootstrap_tells_a_better_system_from_a_worse_one():
    refs = [f"sentence number {i} is about a small red house ." for i in range(60)]
    good = list(refs)
    bad = [f"number {i} house" for i in range(60)]
    result = metrics.compare(good, bad, refs, ["bleu"], samples=200)["bleu"]
    assert result["system"] > result["baseline"] and result["p_value"] < 0.05
