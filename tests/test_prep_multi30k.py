"""The real Multi30k copy through --mirror, then BPE, with the round trip on every split."""

import gzip
import json

import pytest
from conftest import prepared_multi30k

from nmt_cli import bpe
from nmt_cli.rundir import RunDir, file_stats
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
