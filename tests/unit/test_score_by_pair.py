"""`nmt score` on a split of several directions (score.by_pair): each direction scored apart, the
sources that a neural metric reads without the token that chose the direction, and the mean."""

from types import SimpleNamespace

import pytest

from nmt_cli.config import ScoreConfig
from nmt_cli.score import by_pair


class Seen:
    """A stand-in for a COMET model that records the sources it is given and scores each
    segment 1 where its hypothesis equals its reference."""

    hparams = SimpleNamespace(takes_reference=True)

    def __init__(self):
        self.sources: list[str] = []

    def score(self, hyps, sources, refs, progress=None):
        self.sources += sources
        return [float(h == r) for h, r in zip(hyps, refs)]

    def signature(self):
        return "stand-in"


def test_each_direction_is_scored_apart_with_its_sources_untagged():
    pairs = [
        {"src": "en", "tgt": "de", "tag": "<2de>", "lines": 2},
        {"src": "en", "tgt": "fr", "tag": "<2fr>", "lines": 1},
    ]
    hyps = ["Ein Hund läuft .", "Zwei Männer .", "Un chien ."]
    refs = ["Ein Hund läuft .", "Zwei Frauen .", "Un chien ."]
    sources = ["<2de> A dog runs .", "<2de> Two men .", "<2fr> A dog ."]
    seen = Seen()
    settings = {"tokenize": "13a", "lowercase": False, "neural": [("comet", seen)]}
    out = by_pair(hyps, refs, ("h", "r"), ["chrf"], pairs, sources, ScoreConfig(), settings)
    assert list(out["pairs"]) == ["en-de", "en-fr"]
    assert seen.sources == ["A dog runs .", "Two men .", "A dog ."]
    comet = {name: r["scores"][1]["score"] for name, r in out["pairs"].items()}
    assert comet == {"en-de": 0.5, "en-fr": 1.0}
    means = {s["metric"]: s["score"] for s in out["scores"]}
    assert means["comet"] == pytest.approx(0.75)
    chrf = [r["scores"][0]["score"] for r in out["pairs"].values()]
    assert means["chrf"] == pytest.approx(sum(chrf) / 2) and chrf[1] == pytest.approx(100.0)
