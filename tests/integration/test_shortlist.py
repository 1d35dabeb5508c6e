"""Lexical shortlists: built by `nmt bpe` (and `nmt export` for a run without one), carried by
packages and CTranslate2 exports (as its vmap.txt), and `--shortlist` in nmt's engine, in
CTranslate2 and in the server; on a small trained Multi30k model."""

import math
import shutil

import numpy as np
import pytest
import torch
from conftest import Server, one_error_line, run_ok, sources_of

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.engine import decoding
from nmt_cli.engine.batches import pad_sources
from nmt_cli.inference import shortlist
from nmt_cli.inference.backend_nmt import load_model
from nmt_cli.inference.models import from_dir, locate
from nmt_cli.inference.translator import Translator
from nmt_cli.rundir import RunDir
from nmt_cli.shards import Shard
from nmt_cli.vocab import EOS, pieces


@pytest.fixture(scope="module")
def sources(trained_longer) -> list[str]:
    return RunDir(trained_longer).text("valid", "en", raw=True).read_text().splitlines()[:48]


def small_shortlist(run, frequent: int, per_source: int) -> shortlist.Shortlist:
    """A shortlist of `run`'s training data far smaller than the vocabulary, as the tests need."""
    source = target = pieces(RunDir(run).spm_folder / "spm.model")
    pairs = Shard(RunDir(run).tokens("train", "en")), Shard(RunDir(run).tokens("train", "de"))
    return shortlist.build(*pairs, len(source), len(target), np.arange(len(source)), frequent, per_source)


@pytest.fixture(scope="module")
def narrow(trained_longer, tmp_path_factory):
    """The trained run with a shortlist of 64 frequent pieces and 16 per source piece in place
    of `nmt bpe`'s, its package and the package's CTranslate2 export."""
    run = tmp_path_factory.mktemp("narrow") / "run"
    shutil.copytree(trained_longer, run)
    spm = RunDir(run).spm_folder / "spm.model"
    shortlist.save(
        small_shortlist(run, 64, 16), RunDir(run).spm_folder / shortlist.NAME, pieces(spm), pieces(spm)
    )
    run_ok(["export", run.parent / "package", "--run-dir", run])
    run_ok(["export", run.parent / "ct2", "--format", "ctranslate2", "--model", run.parent / "package"])
    return run


def test_bpe_builds_the_shortlist_of_the_training_data(trained_longer):
    spm = RunDir(trained_longer).spm_folder / "spm.model"
    path = RunDir(trained_longer).spm_folder / shortlist.NAME
    found = shortlist.load(path, pieces(spm), pieces(spm))
    vocab = len(pieces(spm))
    assert len(found.always) == shortlist.FREQUENT and found.candidates.shape == (vocab, shortlist.PER_SOURCE)
    assert RunDir(trained_longer).relative(path) in RunDir(trained_longer).load_manifest()["bpe"]["files"]
    again = small_shortlist(trained_longer, shortlist.FREQUENT, shortlist.PER_SOURCE)
    assert (again.always == found.always).all() and (again.candidates == found.candidates).all()
    # the most frequent target pieces are the ones the training targets hold most
    counts = np.bincount(
        np.concatenate(list(Shard(RunDir(trained_longer).tokens("train", "de")))), minlength=vocab
    )
    assert counts[found.always].min() >= np.sort(counts)[-shortlist.FREQUENT]
    # a source piece the target also has is its own first candidate; none is listed twice
    listed = [row[row >= 0] for row in found.candidates[4:]]
    assert all(row[0] == i + 4 for i, row in enumerate(listed) if len(row))
    assert all(len(set(row)) == len(row) for row in listed)
    assert not np.isin(found.candidates[:, 1:], found.always).any()


def _masked(model, allowed: torch.Tensor):
    """`model` whose output layer scores only the ids `allowed`, the others -inf (what a
    shortlist means, computed over the whole vocabulary)."""
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[allowed] = False
    full = model.logits
    model.logits = lambda h: full(h).masked_fill(outside, -math.inf)
    return model


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"beam": 1},
        {"sample": True, "nbest": 3, "seed": 5},
        {"no_repeat_ngram": 2, "repetition_penalty": 1.3, "min_len": 4, "nbest": 2},
    ],
)
def test_a_shortlisted_search_is_the_whole_search_with_the_rest_banned(trained_longer, sources, options):
    model = load_model(locate(trained_longer), torch.device("cpu"), "fp32")
    t = Translator(locate(trained_longer), TranslateConfig())
    ids = t.encode(sources[:16])
    src = torch.from_numpy(pad_sources(ids))
    prefixes = [t.encode_targets(["Ein"])[0] if i % 3 == 0 else [] for i in range(16)]
    among = np.unique(
        np.r_[np.arange(EOS + 1), np.random.default_rng(0).choice(model.config.vocab_size, 300)]
    )
    among = np.union1d(among, [x for p in prefixes for x in p])
    among_t = torch.from_numpy(among)
    o = DecodeOptions(**options)
    narrowed = decoding.translate(model, src, o, prefixes=prefixes, among=among_t)
    banned = decoding.translate(_masked(model, among_t), src, o, prefixes=prefixes)
    for a, b in zip(narrowed, banned, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)
        assert all(set(h.tokens) <= set(among.tolist()) for h in a)
    # the constrained search too, its phrases' pieces in the list
    phrase = t.encode_targets(["Hund"])[0]
    bound, wider = [[phrase]] * 4, torch.from_numpy(np.union1d(among, phrase))
    fresh = load_model(locate(trained_longer), torch.device("cpu"), "fp32")
    narrowed = decoding.translate(fresh, src[:4], DecodeOptions(), constraints=bound, among=wider)
    banned = decoding.translate(_masked(fresh, wider), src[:4], DecodeOptions(), constraints=bound)
    assert [h[0].tokens for h in narrowed] == [h[0].tokens for h in banned]


def test_the_shortlist_keeps_most_translations_where_a_random_one_of_its_size_does_not(narrow, sources):
    """Measured here, on this model: the lines --shortlist leaves as they were outnumber by far
    those a random set of pieces of the same size per batch leaves."""
    full = Translator(locate(narrow), TranslateConfig(batch_size=8, engine="nmt")).translate(sources)
    listed = Translator(locate(narrow), TranslateConfig(batch_size=8, shortlist=True, engine="nmt"))
    kept = listed.translate(sources)
    same = sum(a == b for a, b in zip(full, kept))
    rng = np.random.default_rng(1)
    real = listed.backend.shortlist
    assert real is not None
    vocab = len(real.candidates)

    class Random(shortlist.Shortlist):
        def among(self, batch, needed=()):
            size = len(real.among(batch, needed))
            return np.union1d(
                np.arange(EOS + 1), rng.choice(np.arange(EOS + 1, vocab), size - EOS - 1, replace=False)
            )

    listed.backend.shortlist = Random(real.always, real.candidates)
    same_random = sum(a == b for a, b in zip(full, listed.translate(sources)))
    sizes = [len(real.among([x])) for x in listed.encode(sources[:8])]
    assert max(sizes) < 0.6 * vocab  # a shortlist, not the vocabulary
    assert same >= 2 * same_random + 3, (same, same_random)


def test_packages_and_ctranslate2_exports_carry_the_shortlist(narrow, sources, nmt):
    package, ct2 = narrow.parent / "package", narrow.parent / "ct2"
    listed = (RunDir(narrow).spm_folder / shortlist.NAME).read_bytes()
    assert (package / shortlist.NAME).read_bytes() == listed == (ct2 / "vmap.txt").read_bytes()
    stdin = ("\n".join(sources) + "\n").encode()
    ours = nmt("translate", "--run-dir", narrow, "--shortlist", stdin=stdin).out
    assert nmt("translate", "--model", package, "--shortlist", stdin=stdin).out == ours
    theirs = nmt("translate", "--model", ct2, "--shortlist", stdin=stdin).out
    whole = nmt("translate", "--model", ct2, stdin=stdin).out
    assert sum(a == b for a, b in zip(theirs.splitlines(), ours.splitlines())) >= len(sources) * 0.8
    # CTranslate2 reads its vmap.txt: its outputs hold only listed pieces
    t = Translator(from_dir(ct2), TranslateConfig(shortlist=True))
    found = t.hypotheses(sources[:8])
    allowed = shortlist.load(ct2 / "vmap.txt", pieces(ct2 / "spm.model"), pieces(ct2 / "spm.model"))
    batch = set(allowed.among(t.encode(sources[:8])).tolist())  # one batch: its union
    assert all(set(h[0].tokens) <= batch for h in found)
    assert theirs != whole or ours != nmt("translate", "--run-dir", narrow, stdin=stdin).out


def test_export_builds_a_shortlist_for_a_run_without_one(trained, tmp_path, nmt):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (RunDir(run).spm_folder / shortlist.NAME).unlink()
    assert "has no lexical shortlist" in one_error_line(
        nmt("translate", "--run-dir", run, "--shortlist", stdin=b"a dog\n")
    )
    run_ok(["export", tmp_path / "package", "--run-dir", run])
    assert (tmp_path / "package" / shortlist.NAME).read_bytes() == (
        RunDir(run).spm_folder / shortlist.NAME
    ).read_bytes()
    assert (trained / "bpe" / shortlist.NAME).read_bytes() == (
        tmp_path / "package" / shortlist.NAME
    ).read_bytes()


def test_a_damaged_or_missing_shortlist_is_one_error_line(narrow, tmp_path, nmt):
    package = tmp_path / "package"
    shutil.copytree(narrow.parent / "package", package)
    (package / shortlist.NAME).write_text("\t▁der\n▁dog\tnot-a-piece-of-this-model\n")
    line = one_error_line(nmt("translate", "--model", package, "--shortlist", stdin=b"a dog\n"))
    assert f"{package / shortlist.NAME} does not match the sha256 in nmt.json" in line
    run = tmp_path / "run"  # a run directory's, which no settings hash: parsed line by line
    shutil.copytree(narrow, run)
    (RunDir(run).spm_folder / shortlist.NAME).write_text("\t▁der\n▁dog\tnot-a-piece-of-this-model\n")
    line = one_error_line(nmt("translate", "--run-dir", run, "--shortlist", stdin=b"a dog\n"))
    assert f"{RunDir(run).spm_folder / shortlist.NAME}:2 is not a line of a shortlist" in line
    (package / shortlist.NAME).unlink()
    (package / shortlist.NAME).symlink_to("/dev/zero")
    refused = nmt("translate", "--model", package, "--shortlist", stdin=b"a dog\n")
    assert "shortlist.txt is not a regular file" in one_error_line(refused)
    (RunDir(run).spm_folder / shortlist.NAME).unlink()  # a run directory's too
    (RunDir(run).spm_folder / shortlist.NAME).symlink_to("/dev/zero")
    refused = nmt("translate", "--run-dir", run, "--shortlist", stdin=b"a dog\n")
    assert "shortlist.txt is a symbolic link" in one_error_line(refused)
    (package / shortlist.NAME).unlink()
    assert "has no lexical shortlist" in one_error_line(
        nmt("translate", "--model", package, "--shortlist", stdin=b"x\n")
    )
    ct2 = tmp_path / "ct2"
    shutil.copytree(narrow.parent / "ct2", ct2)
    (ct2 / "vmap.txt").unlink()
    assert "has no lexical shortlist" in one_error_line(
        nmt("translate", "--model", ct2, "--shortlist", stdin=b"x\n")
    )


def test_the_server_decodes_with_the_shortlist(narrow, multi30k_bpe):
    package = narrow.parent / "package"
    lines = sources_of(multi30k_bpe)[:10]
    expected = Translator(from_dir(package), TranslateConfig(shortlist=True)).translate(lines)
    server = Server(package, "--shortlist")
    try:
        status, answer, _ = server.post({"text": lines})
        assert status == 200 and answer["translations"] == expected, answer
    finally:
        assert server.stop() == 0
