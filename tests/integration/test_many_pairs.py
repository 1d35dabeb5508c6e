"""Several directions in one run (`nmt prep multi30k --pair ...`): each a corpus of the shared
Multi30k copy, every source line beginning with its target language's token, and the lines of
each direction recorded for per-pair scores."""

import gzip

import pytest
from conftest import MULTI30K, one_error_line, prepared_pairs, run_ok

from nmt_cli import bpe
from nmt_cli.normalize import normalize
from nmt_cli.rundir import RunDir

PAIRS = ("en-de", "de-en", "en-fr", "fr-en")  # two into English: one token, two corpora
FILES = {"train": "train", "valid": "val", "test": "test_2016_flickr", "test2017": "test_2017_flickr"}


def released(split: str, lang: str) -> list[str]:
    with gzip.open(MULTI30K / f"{FILES[split]}.{lang}.gz", "rt", encoding="utf-8") as f:
        return f.read().splitlines()


@pytest.fixture(scope="module")
def many(tmp_path_factory, multi30k_dir):
    run_dir = prepared_pairs(tmp_path_factory.mktemp("many"), PAIRS, 2000)
    return RunDir(run_dir)


def test_each_direction_is_a_corpus_whose_sources_begin_with_its_targets_token(many):
    prep = many.load_manifest()["prep"]
    assert prep["pairs"] == list(PAIRS) and (prep["src"], prep["tgt"]) == ("src", "tgt")
    assert set(prep["splits"]) == set(FILES)  # test2017 has English, German and French
    for split in ("valid", "test", "test2017"):
        src = many.text(split, "src", raw=True).read_text(encoding="utf-8").splitlines()
        tgt = many.text(split, "tgt", raw=True).read_text(encoding="utf-8").splitlines()
        recorded = prep["splits"][split]["pairs"]
        assert [f"{p['src']}-{p['tgt']}" for p in recorded] == list(PAIRS)
        start = 0
        for p in recorded:  # every line of an evaluation split, in the order of the pairs
            a, b = released(split, p["src"]), released(split, p["tgt"])
            assert p["lines"] == len(a) and p["tag"] == f"<2{p['tgt']}>"
            assert src[start : start + len(a)] == [f"<2{p['tgt']}> {line}" for line in a]
            assert tgt[start : start + len(a)] == b
            start += len(a)
        assert start == len(src) == len(tgt)
    train = prep["splits"]["train"]
    assert [c["tag"] for c in train["corpora"]] == ["<2de>", "<2en>", "<2fr>", "<2en>"]
    assert [p["lines"] for p in train["pairs"]] == [c["pairs"] for c in train["corpora"]]
    # en-de and de-en are the same captions read both ways: neither is a duplicate of the other
    assert train["pairs"][0]["lines"] == train["pairs"][1]["lines"] > 28_900
    lines = many.text("train", "src").read_text(encoding="utf-8").splitlines()
    first_fr = train["pairs"][0]["lines"] + train["pairs"][1]["lines"]
    assert lines[first_fr] == "<2fr> " + normalize(released("train", "en")[0], "en")


def test_the_target_tokens_are_pieces_of_the_joint_vocabulary(many):
    sp = bpe.load(many)
    for token in ("<2de>", "<2en>", "<2fr>"):
        assert sp.piece_to_id(token) != sp.unk_id()
        assert token in sp.encode(f"{token} A dog runs.", out_type=str)  # one piece, never cut


def test_one_pair_is_a_run_of_that_pair_without_tokens(tmp_path, multi30k_dir):
    run_ok(["prep", "multi30k", "--run-dir", tmp_path, "--mirror", MULTI30K, "--pair", "en-cs"])
    prep = RunDir(tmp_path).load_manifest()["prep"]
    assert (prep["src"], prep["tgt"]) == ("en", "cs") and "pairs" not in prep
    assert set(prep["splits"]) == {"train", "valid", "test"}  # no Czech test2017
    assert RunDir(tmp_path).text("test", "cs", raw=True).read_text(encoding="utf-8").splitlines() == released(
        "test", "cs"
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--pair", "en-xx"], "multi30k has English, German, French and Czech"),
        (["--pair", "en-en"], "is not two languages"),
        (["--pair", "en-de", "--pair", "en-de"], "names a direction twice"),
        (["--pair", "de-en", "--src", "en", "--tgt", "de"], "not both"),
    ],
)
def test_a_pair_that_cannot_be_is_one_line(tmp_path, nmt, args, says):
    result = nmt("prep", "multi30k", "--run-dir", tmp_path, "--mirror", MULTI30K, *args)
    assert says in one_error_line(result)
    assert not (tmp_path / "text").exists()


def test_pairs_are_for_multi30k_and_custom(tmp_path, nmt):
    result = nmt("prep", "multi30k-en-de", "--run-dir", tmp_path, "--pair", "en-de")
    assert "--pair is for `nmt prep multi30k` and `nmt prep custom`" in one_error_line(result)


def test_custom_corpora_each_a_direction_hold_out_validation_from_each(tmp_path, nmt):
    """`nmt prep custom --pair` once per corpus: each corpus cleaned in its own languages, its
    sources tagged with its target's token, every 100th pair of each held out for validation."""

    def corpus(name: str, lang: str, lines: int) -> object:
        path = tmp_path / f"{name}.{lang}"
        path.write_text("\n".join(released("train", lang)[:lines]) + "\n", encoding="utf-8")
        return path

    run = RunDir(tmp_path / "run")
    first = ["--train-src", corpus("a", "en", 400), "--train-tgt", corpus("a", "de", 400), "--pair", "en-de"]
    second = ["--train-src", corpus("b", "fr", 300), "--train-tgt", corpus("b", "en", 300), "--pair", "fr-en"]
    result = nmt("prep", "custom", "--run-dir", run.root, *first, *second)
    assert result.code == 0, result.err
    prep = run.load_manifest()["prep"]
    assert prep["pairs"] == ["en-de", "fr-en"] and (prep["src"], prep["tgt"]) == ("src", "tgt")
    valid = prep["splits"]["valid"]["pairs"]
    trained = [c["pairs"] for c in prep["splits"]["train"]["corpora"]]
    assert [(p["src"], p["tgt"]) for p in valid] == [("en", "de"), ("fr", "en")]
    for p, kept in zip(valid, trained):  # every 100th pair each corpus kept
        assert p["lines"] == (kept + p["lines"]) // 100 >= 2, (valid, trained)
    sources = run.text("valid", "src").read_text(encoding="utf-8").splitlines()
    n = valid[0]["lines"]
    assert [s.split()[0] for s in sources] == ["<2de>"] * n + ["<2en>"] * valid[1]["lines"]
    french = {normalize(line, "fr") for line in released("train", "fr")[:300]}
    assert all(s.removeprefix("<2en> ") in french for s in sources[n:])
    assert not set(sources) & set(run.text("train", "src").read_text(encoding="utf-8").splitlines())
    assert [c["tag"] for c in prep["splits"]["train"]["corpora"]] == ["<2de>", "<2en>"]
    # a validation set of its own, or a count of pairs that is not one per corpus: one line each
    own = ["--valid-src", first[1], "--valid-tgt", first[3]]
    wrong = nmt("prep", "custom", "--run-dir", tmp_path / "r2", *first, *second, *own)
    assert "holds out its validation pairs from each corpus" in one_error_line(wrong)
    wrong = nmt(
        "prep",
        "custom",
        "--run-dir",
        tmp_path / "r3",
        *first,
        *second[:4],
        "--pair",
        "fr-en",
        "--pair",
        "de-en",
    )
    assert "give one per corpus" in one_error_line(wrong)
