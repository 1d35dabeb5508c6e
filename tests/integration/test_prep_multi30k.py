"""The real Multi30k copy through --mirror, then BPE, with the round trip on every split."""

import gzip
import json

import pytest
from conftest import one_error_line, prepared_multi30k

from nmt_cli import bpe, vocab
from nmt_cli.files import file_stats
from nmt_cli.rundir import RunDir
from nmt_cli.shards import Shard

SPLITS = {"train": 29000, "valid": 1014, "test": 1000, "test2017": 1000}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, multi30k_dir):
    return RunDir(prepared_multi30k(tmp_path_factory.mktemp("m30k"), 2000))


def test_every_split_is_prepared_with_its_counts(prepared, multi30k_dir):
    manifest = prepared.load_manifest()
    splits = manifest["prep"]["splits"]
    assert {s: v["read"] for s, v in splits.items()} == SPLITS
    # People translated Multi30k: only its 3 exact duplicate pairs go (a 1.5 word-count ratio,
    # right for WMT, would drop 888 pairs), and evaluation sets stay whole.
    assert splits["train"]["dropped"] == {"duplicate": 3}
    assert json.loads(prepared.config_path("prep").read_text())["max_ratio"] == 9.0
    assert sum(splits["train"]["dropped"].values()) == 29000 - splits["train"]["kept"]
    for split in SPLITS:
        for lang in ("en", "de"):
            path = prepared.text(split, lang)
            expected = splits[split]["kept"]
            assert file_stats(path)["lines"] == expected
            assert manifest["prep"]["files"][prepared.relative(path)] == file_stats(path)
    # The raw evaluation files are the released text, line for line: the scoring references.
    released = gzip.open(multi30k_dir / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read()
    assert prepared.text("test", "de", raw=True).read_text(encoding="utf-8") == released


def test_configs_are_saved(prepared):
    assert json.loads(prepared.config_path("prep").read_text())["recipe"] == "multi30k-en-de"
    assert json.loads(prepared.config_path("bpe").read_text())["vocab_size"] == 2000


def test_round_trip_every_split(prepared):
    sp = bpe.load(prepared)
    assert sp.get_piece_size() == 2000
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    for split in SPLITS:
        for lang in ("en", "de"):
            shard = Shard(prepared.tokens(split, lang))
            assert shard.dtype.name == "uint16"
            lines = prepared.text(split, lang).read_text(encoding="utf-8").splitlines()
            assert len(shard) == len(lines)
            decoded = sp.decode([shard[i].tolist() for i in range(len(shard))])
            assert decoded == lines


def test_bpe_stats_are_recorded(prepared):
    entry = prepared.load_manifest()["bpe"]
    stats = entry["stats"]["train.en"]
    assert stats["sentences"] == prepared.load_manifest()["prep"]["splits"]["train"]["kept"]
    assert stats["tokens"] == int(Shard(prepared.tokens("train", "en")).lengths.sum())
    assert stats["unk_rate"] == 0.0  # byte fallback: nothing is unknown
    assert entry["vocab_size"] == 2000


def test_rerun_is_idempotent(prepared, multi30k_dir, nmt):
    before = prepared.load_manifest()["prep"]["files"]
    result = nmt("prep", "multi30k-en-de", "--run-dir", prepared.root, "--mirror", multi30k_dir)
    assert result.code == 0, result.err
    assert prepared.load_manifest()["prep"]["files"] == before


def test_lowercase_bpe_folds_case_in_training_translation_and_scoring(run_copy, tmp_path, nmt):
    """`nmt bpe --lowercase`: the sentencepiece model itself lowercases, so the shards, the
    translations and the scores of its model are lowercase, and German's ß stays ß (Unicode case
    folding would make it ss, unlike the references)."""
    from conftest import TINY, run_ok

    from nmt_cli.metrics import bleu_of_ids

    run = RunDir(run_copy)
    run_ok(["bpe", "--run-dir", run_copy, "--vocab-size", 1000, "--lowercase"])
    assert json.loads(run.config_path("bpe").read_text())["lowercase"] is True
    sp = bpe.load(run)
    assert vocab.folds_case(run.vocabularies().target)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_byte(i)]
    assert not [p for p in pieces if p != p.lower() and not p.startswith("<")]
    assert sp.decode(sp.encode("Die STRASSE, die Straße.")) == "die strasse, die straße."
    for split, lang in (("train", "de"), ("valid", "en")):
        shard = Shard(run.tokens(split, lang))
        lines = run.text(split, lang).read_text(encoding="utf-8").splitlines()
        assert sp.decode([shard[i].tolist() for i in range(len(shard))]) == [s.lower() for s in lines]
    # --eval-bleu scores lowercase translations case-insensitively against the released text.
    valid = Shard(run.tokens("valid", "de"))
    assert bleu_of_ids(run, "de")([valid[i].tolist() for i in range(len(valid))])["valid_bleu"] > 99

    run_ok(
        ["train", "--run-dir", run_copy, *TINY, "--max-steps", "20", "--save-every", "20", "--warmup", "5"]
    )
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("A Man in a RED shirt.\nTwo dogs play.\n", encoding="utf-8")
    ref.write_text("Ein Mann in einem roten Hemd.\nZwei Hunde spielen.\n", encoding="utf-8")
    out = nmt("translate", "--run-dir", run_copy, "--beam", "1", stdin=src.read_bytes())
    assert out.code == 0, out.err
    assert out.out.strip() and out.out == out.out.lower()
    scored = nmt(
        "score",
        "--run-dir",
        run_copy,
        "--src",
        src,
        "--ref",
        ref,
        "--metrics",
        "bleu",
        "--json",
        "--beam",
        "1",
    )
    assert scored.code == 0, scored.err
    assert "case:lc" in json.loads(scored.out)["scores"][0]["signature"]
    assert "case-insensitive" in scored.err
    # Scoring another system's file says nothing of casing.
    plain = nmt("score", "--hyp", ref, "--ref", ref, "--metrics", "bleu", "--json")
    assert "case:mixed" in json.loads(plain.out)["scores"][0]["signature"]
    assert "--lowercase" in one_error_line(
        nmt("bpe", "--run-dir", run_copy, "--from", run_copy, "--lowercase")
    )
