"""`nmt prep`'s cleaning rules on hand-made pairs: which pair is dropped, and why."""

import pytest

from nmt_cli.config import PrepConfig
from nmt_cli.data.filters import drop_reason, length
from nmt_cli.data.recipes import resolved


@pytest.fixture
def wmt():  # max_words 250, ratio 1.5
    return resolved(PrepConfig("wmt14-en-de"))


def test_empty_long_and_unbalanced_pairs_are_dropped(wmt):
    assert drop_reason("", "Hallo", wmt) == "empty"
    assert drop_reason("Hello", "", wmt) == "empty"
    assert drop_reason("w " * 251, "w " * 251, wmt) == "too long"
    assert drop_reason("a b c d", "a b", wmt) == "length ratio"  # 4 > 1.5 x 2
    assert drop_reason("a b c", "a b", wmt) is None  # 3 = 1.5 x 2 is kept
    assert drop_reason("Hello there", "Hallo", resolved(PrepConfig("multi30k-en-de"))) is None  # ratio 9


def test_length_counts_words_and_weighs_unspaced_scripts():
    assert length("A dog runs .") == 4
    assert length("我爱你") == pytest.approx(2.1)  # three Han characters, 0.7 each
    assert length("・") == 0  # punctuation of an unspaced script (kana's middle dot) weighs nothing
    assert length("Tokyo 東京") == pytest.approx(2.4)  # one word, two Han characters
