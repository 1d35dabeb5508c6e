import pytest

from nmt_cli.errors import NmtError
from nmt_cli.shards import Shard, ShardWriter


@pytest.mark.parametrize("vocab,dtype", [(8000, "uint16"), (65536, "uint16"), (70000, "uint32")])
def test_round_trip_and_dtype(tmp_path, vocab, dtype):
    sentences = [[1, 2, 3], [], [vocab - 1], list(range(40))]
    with ShardWriter(tmp_path / "x", vocab) as w:
        w.add(sentences[:2])
        w.add(sentences[2:])
    shard = Shard(tmp_path / "x")
    assert shard.dtype.name == dtype
    assert [s.tolist() for s in shard] == sentences
    assert shard.lengths.tolist() == [3, 0, 1, 40]


def test_empty_shard(tmp_path):
    with ShardWriter(tmp_path / "e", 100):
        pass
    assert len(Shard(tmp_path / "e")) == 0


def test_truncated_data_is_detected(tmp_path):
    with ShardWriter(tmp_path / "t", 100) as w:
        w.add([[1, 2, 3, 4]])
    (tmp_path / "t.bin").write_bytes((tmp_path / "t.bin").read_bytes()[:-2])
    with pytest.raises(NmtError, match="rerun `nmt bpe`"):
        Shard(tmp_path / "t")


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "f", 100) as w:
            w.add([[1]])
            raise RuntimeError
    assert not list(tmp_path.iterdir())
