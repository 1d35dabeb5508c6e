"""--bpe-dropout: each epoch encoded anew, deterministically, tags kept whole. (Resumed exactly
after a kill: tests/system/test_resumes.)"""

import shutil
import subprocess
import sys

import numpy as np
from conftest import train_command

from nmt_cli import train as train_mod
from nmt_cli.config import TrainConfig
from nmt_cli.engine import state
from nmt_cli.rundir import RunDir
from nmt_cli.shards import Shard


def test_bpe_dropout_encodes_each_epoch_anew_and_deterministically(tagged_bpe):
    """On the tagged run's 5,000 Multi30k pairs (the first 2,000 untagged)."""
    import sentencepiece as spm

    from nmt_cli.bpe import dropout_encoding

    run = RunDir(tagged_bpe)
    kept = run.load_manifest()["prep"]["splits"]["train"]["kept"]
    fixed = Shard(run.tokens("train", "en"))
    e0 = dropout_encoding(run, "en", 0.1, seed=1, epoch=0)
    assert len(e0) == len(fixed) == kept
    same = subprocess.run(  # another process, as a resumed run or another rank is
        [
            sys.executable,
            "-c",
            "import sys, hashlib; from nmt_cli.bpe import dropout_encoding;"
            "from nmt_cli.rundir import RunDir;"
            "s = dropout_encoding(RunDir(sys.argv[1]), 'en', 0.1, 1, 0);"
            "print(hashlib.sha256(s.tokens.tobytes() + s.offsets.tobytes()).hexdigest())",
            str(tagged_bpe),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    import hashlib

    assert same == hashlib.sha256(e0.tokens.tobytes() + e0.offsets.tobytes()).hexdigest()
    e1 = dropout_encoding(run, "en", 0.1, seed=1, epoch=1)
    other_seed = dropout_encoding(run, "en", 0.1, seed=2, epoch=0)
    differ = lambda a, b: sum(not np.array_equal(a[i], b[i]) for i in range(2000))  # noqa: E731
    # Dropping 10% of merges re-segments most captions, into more and shorter pieces...
    assert differ(e0, fixed) > 1500 and differ(e1, e0) > 1000 and differ(other_seed, e0) > 1000
    assert 1.1 < e0.lengths.sum() / fixed.lengths.sum() < 1.4
    # ... of the same text.
    sp = spm.SentencePieceProcessor(model_file=str(run.vocabularies().source))
    assert all(sp.decode(e0[i].tolist()) == sp.decode(fixed[i].tolist()) for i in range(kept))
    assert differ(dropout_encoding(run, "en", 0.0, seed=1, epoch=0), fixed) == 0


def test_bpe_dropout_keeps_corpus_tags_whole(tagged_bpe):
    """A tag is a piece of its own that no merge builds: BPE-dropout leaves it as it is (it
    raised KeyError: '<' on every tagged corpus), and at rate 0 gives the binarized data."""
    from nmt_cli.bpe import dropout_encoding

    run = RunDir(tagged_bpe)
    fixed = Shard(run.tokens("train", "en"))
    kept = dropout_encoding(run, "en", 0.0, 1, 0)
    assert all(np.array_equal(kept[i], fixed[i]) for i in range(len(fixed)))
    clean = run.load_manifest()["prep"]["splits"]["train"]["corpora"][0]["pairs"]  # then the tagged
    tag = int(fixed[clean][1])  # a tagged line begins with U+2581, then the tag
    dropped = dropout_encoding(run, "en", 0.3, 1, 0)
    assert all(int(dropped[i][1]) == tag for i in range(clean, len(fixed)))
    assert not any(tag in dropped[i].tolist() for i in range(clean))
    assert sum(not np.array_equal(dropped[i], fixed[i]) for i in range(clean, len(fixed))) > 1000


def test_bpe_dropout_trains_on_its_own_epochs(tagged_bpe, tmp_path):
    """On the tagged run (5,000 pairs): each epoch is encoded anew, once. (After a kill alike:
    tests/system/test_resumes.)"""
    from nmt_cli.train import _resample

    run_copy = tmp_path / "run"
    shutil.copytree(tagged_bpe, run_copy)

    config = TrainConfig(size="tiny", d_model=16, ffn=32, heads=2, max_tokens=256, bpe_dropout=0.1, seed=3)
    t = train_mod.build_trainer(
        config, RunDir(run_copy), state.Quiet(), resample=_resample(RunDir(run_copy), config)
    )
    fixed, e0, e1 = t.epochs.fixed, t.epochs.data(0), t.epochs.data(1)
    assert t.epochs.data(1) is e1  # an epoch is encoded once
    assert fixed.src_lengths.sum() < e0.src_lengths.sum() and fixed.tgt_lengths.sum() < e0.tgt_lengths.sum()
    assert not np.array_equal(e0.src.tokens, e1.src.tokens)
    valid = Shard(RunDir(run_copy).tokens("valid", "en"))
    assert t.valid_data.src_lengths.sum() == valid.lengths.sum() + len(valid)  # each with its EOS
    t.dist.close()
    subprocess.run([*train_command(run_copy, 12), "--bpe-dropout", "0.1"], check=True, capture_output=True)
    # `nmt train` trains on the epoch's own encoding, not the fixed one: its first epoch was cut
    # into batches as the dropped-out lengths make them (train_command's seed is 3).
    epoch = next(r for r in RunDir(run_copy).metric_records() if r["kind"] == "epoch")
    assert epoch["batches"] == len(e0.batches(256, 3, 0)) != len(fixed.batches(256, 3, 0))
