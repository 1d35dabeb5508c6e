"""Separate source and target vocabularies (`nmt bpe --separate`) and untied embeddings: made,
trained, fine-tuned, exported and decoded by both engines and the server as a joint vocabulary
is. (On 2 gloo ranks: tests/system/test_resumes.)"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import LONGER, TINY, Server, final_weights, one_error_line, run_ok, sources_of

from nmt_cli.config import DecodeOptions, ModelConfig, TranslateConfig
from nmt_cli.engine.model import Transformer
from nmt_cli.inference.models import ensemble, from_dir, from_run, vocabulary_key
from nmt_cli.inference.translator import Translator
from nmt_cli.rundir import RunDir
from nmt_cli.shards import Shard
from nmt_cli.vocab import UNK

# Two sizes, so that a side given the other's model or embedding cannot go unnoticed.
SRC_PIECES, TGT_PIECES = 600, 900


@pytest.fixture(scope="session")
def separate_bpe(multi30k_bpe, tmp_path_factory) -> Path:
    """Multi30k prepared, its joint BPE replaced by a model for each side; copy before use."""
    run_dir = tmp_path_factory.mktemp("separate") / "run"
    shutil.copytree(multi30k_bpe, run_dir)
    run_ok(
        ["bpe", "--run-dir", run_dir, "--separate", "--src-vocab-size", SRC_PIECES,
         "--tgt-vocab-size", TGT_PIECES],
    )  # fmt: skip
    return run_dir


@pytest.fixture(scope="session")
def separate_trained(separate_bpe, tmp_path_factory) -> dict[str, Path]:
    """A LONGER model trained on `separate_bpe` (its run, averaged), as a package and as a
    CTranslate2 export."""
    root = tmp_path_factory.mktemp("separate-trained")
    run_dir = root / "run"
    shutil.copytree(separate_bpe, run_dir)
    run_ok(
        ["train", "--run-dir", run_dir, *LONGER, "--max-steps", 400, "--save-every", 200,
         "--eval-every", 10000, "--warmup", 100, "--lr-scale", 2],
        ["average", "--run-dir", run_dir, "--last", 2],
        ["export", root / "package", "--run-dir", run_dir],
        ["export", root / "ct2", "--run-dir", run_dir, "--format", "ctranslate2"],
    )  # fmt: skip
    return {"run": run_dir, "package": root / "package", "ct2": root / "ct2"}


def test_each_side_has_its_own_bpe_model_learned_from_its_own_text(separate_bpe, tmp_path):
    run = RunDir(separate_bpe)
    vocabs = run.vocabularies()
    assert not vocabs.joint and [p.name for p in vocabs.files()] == ["spm.source.model", "spm.target.model"]
    source, target = vocabs.processors()
    assert (source.get_piece_size(), target.get_piece_size()) == (SRC_PIECES, TGT_PIECES)
    manifest = run.load_manifest()["bpe"]
    assert (manifest["joint"], manifest["src_vocab_size"], manifest["vocab_size"]) == (
        False,
        SRC_PIECES,
        TGT_PIECES,
    )
    for lang, sp in (("en", source), ("de", target)):  # each side's shards in its own pieces
        shard = Shard(run.tokens("valid", lang))
        assert (
            sp.decode([shard[i].tolist() for i in range(len(shard))])
            == run.text("valid", lang).read_text(encoding="utf-8").splitlines()
        )
    # Each learned from its side alone: a character only the other side's text has (ß, ä) is a
    # piece of the other side's model, and not of its own (byte fallback spells it there).
    english, german = (set(run.text("train", x).read_text(encoding="utf-8")) for x in ("en", "de"))
    only = {"en": english - german, "de": german - english}
    assert only["de"] and only["en"]
    for sp, own, other in ((source, "en", "de"), (target, "de", "en")):
        assert all(sp.piece_to_id(c) == UNK for c in only[other])
        assert all(sp.piece_to_id(c) != UNK for c in only[own])
    # Learning the other layout leaves the run with that one alone.
    again = tmp_path / "run"
    shutil.copytree(separate_bpe, again)
    run_ok(["bpe", "--run-dir", again, "--vocab-size", 700])
    assert sorted(p.name for p in (again / "bpe").iterdir()) == ["shortlist.txt", "spm.model", "spm.vocab"]
    assert RunDir(again).vocabularies().joint


def test_bpe_refuses_sizes_without_separate_and_from_with_them(separate_bpe, nmt):
    for args, expected in (
        (["--src-vocab-size", "500"], "add --separate"),
        (["--from", str(separate_bpe), "--separate"], "drop --vocab-size and --separate"),
    ):
        result = nmt("bpe", "--run-dir", str(separate_bpe), *args)
        assert result.code == 1 and expected in one_error_line(result), result.err


def test_the_source_embedding_is_the_sources_own_where_untied():
    """The encoder reads the source's embedding; the decoder and the output the target's."""
    torch.manual_seed(0)
    shape = dict(num_encoder_layers=1, num_decoder_layers=1, d_model=16, ffn=32, heads=2, dropout=0.0)
    model = Transformer(ModelConfig(vocab_size=50, src_vocab_size=30, **shape)).eval()
    assert model.src_embed.weight.shape == (30, 16) and model.embed.weight.shape == (50, 16)
    src, tgt = torch.tensor([[5, 29, 3]]), torch.tensor([[2, 49, 5]])
    memory, states = model.encode(src)[0], model(src, tgt)
    assert model.logits(states).shape == (1, 3, 50)
    with torch.no_grad():
        model.embed.weight[5] += 1.0  # the target's piece of the same id as a source piece
    assert torch.equal(model.encode(src)[0], memory) and not torch.equal(model(src, tgt), states)
    with torch.no_grad():
        model.src_embed.weight[5] += 1.0
    assert not torch.equal(model.encode(src)[0], memory)
    tied = Transformer(ModelConfig(vocab_size=50, **shape))
    assert tied.src_embed is None and "src_embed.weight" not in tied.state_dict()


def test_training_unties_the_source_embedding_and_refuses_to_tie_separate_vocabularies(
    separate_trained, separate_bpe, tmp_path, nmt
):
    tensors, record = final_weights(separate_trained["run"])
    weights = tensors["model"]
    assert (
        weights["src_embed.weight"].shape[0] == SRC_PIECES and weights["embed.weight"].shape[0] == TGT_PIECES
    )
    assert record["model"]["src_vocab_size"] == SRC_PIECES
    run_dir = tmp_path / "run"
    shutil.copytree(separate_bpe, run_dir)
    result = nmt("train", "--run-dir", str(run_dir), *TINY, "--max-steps", "1", "--share-embeddings")
    assert result.code == 1 and "--share-embeddings needs one joint vocabulary" in one_error_line(result)


def test_a_joint_vocabulary_is_untied_on_request(run_copy):
    run_ok(["train", "--run-dir", run_copy, *TINY, "--max-steps", 2, "--no-share-embeddings"])
    weights = final_weights(run_copy)[0]["model"]
    assert weights["src_embed.weight"].shape == weights["embed.weight"].shape
    assert not torch.equal(weights["src_embed.weight"], weights["embed.weight"])


def test_both_engines_and_every_format_translate_a_separate_model_alike(separate_trained, separate_bpe):
    """nmt's engine on the run and on its package, CTranslate2 converting on the fly and from
    its export: the same translations, alignments and pair scores, with prefixes and constraints
    in the target's pieces."""
    lines = sources_of(separate_bpe)[:120]
    models = {
        "run": from_run(RunDir(separate_trained["run"]), None),
        "package": from_dir(separate_trained["package"]),
        "ct2": from_dir(separate_trained["ct2"]),
    }
    options = DecodeOptions(alignments=True)
    ours = Translator(models["run"], TranslateConfig(decode=options))
    expected = ours.hypotheses(lines)
    ended = [i for i, hs in enumerate(expected) if len(hs[0].tokens) < 40]
    assert len(ended) >= 100, len(ended)
    for name, engine in (("package", "nmt"), ("run", "ctranslate2"), ("ct2", "auto")):
        other = Translator(models[name], TranslateConfig(engine=engine, decode=options))
        found = other.hypotheses(lines)
        agree = [i for i in ended if found[i][0].tokens == expected[i][0].tokens]
        assert len(agree) >= 0.99 * len(ended), (name, engine)
        assert all(found[i][0].alignment == expected[i][0].alignment for i in agree), (name, engine)
        refs = [ours.texts([hs])[0][0] for hs in expected[:20]]
        mine, theirs = ours.score_pairs(lines[:20], refs), other.score_pairs(lines[:20], refs)
        assert all(abs(a.total - b.total) < 1e-3 for a, b in zip(mine, theirs)), (name, engine)
    # alignments pair the source's words (counted in its own pieces) with the target's
    for line, hs in zip(lines, expected):
        pairs = [tuple(map(int, p.split("-"))) for p in hs[0].alignment.split()]
        assert pairs and max(i for i, _ in pairs) < len(line.split()), line
        assert max(j for _, j in pairs) < len(ours.texts([hs])[0][0].split())
    # an ensemble of members that share both models: one member twice is that member (on the
    # lines that end: one that runs to the limit repeats a piece, and a rounding in the mean of
    # two equal distributions may break a tie between its beams there)
    twice = Translator(ensemble([models["run"], models["package"]]), TranslateConfig(decode=options))
    found = twice.hypotheses(lines[:30])
    assert [found[i][0].tokens for i in ended if i < 30] == [expected[i][0].tokens for i in ended if i < 30]
    prefixes = ["Zwei Hunde", "Eine Frau mit", "Ein Kind"]
    for engine in ("nmt", "ctranslate2"):
        started = Translator(models["run"], TranslateConfig(engine=engine))
        assert all(t.startswith(p) for t, p in zip(started.translate(lines[:3], prefixes=prefixes), prefixes))
    phrases = [["Hund"], ["Straße"], []]
    held = Translator(models["run"], TranslateConfig()).output(lines[:3], constraints=phrases)
    assert all(p in t for t, ps in zip(held, phrases) for p in ps), held
    # the shortlist lists the target's pieces for the source's: both engines read it alike
    listed = Translator(models["run"], TranslateConfig(shortlist=True, batch_size=1, engine="nmt"))
    allowed = listed.backend.shortlist
    found = listed.hypotheses(lines[:20])
    assert all(
        set(h[0].tokens) <= set(allowed.among([x]).tolist()) for x, h in zip(listed.encode(lines[:20]), found)
    )
    nmt_listed = Translator(models["package"], TranslateConfig(shortlist=True)).hypotheses(lines)
    ct2_listed = Translator(models["ct2"], TranslateConfig(shortlist=True)).hypotheses(lines)
    ended = [i for i, hs in enumerate(nmt_listed) if len(hs[0].tokens) < 40]
    assert sum(nmt_listed[i][0].tokens == ct2_listed[i][0].tokens for i in ended) >= 0.95 * len(ended)


def test_the_server_decodes_a_separate_model(separate_trained, separate_bpe):
    sources = sources_of(separate_bpe)[:8]
    package = separate_trained["package"]
    expected = Translator(from_dir(package), TranslateConfig(engine="nmt")).translate(sources)
    server = Server(package, "--engine", "nmt")  # constraints: nmt's engine's
    try:
        status, body, _ = server.post({"text": sources})
        assert status == 200 and body["translations"] == expected
        status, body, _ = server.post(
            {"text": sources[:2], "alignments": True, "constraints": [["Hund"], []]}
        )
        assert status == 200 and "Hund" in body["translations"][0]["text"]
        assert all(re.fullmatch(r"\d+-\d+( \d+-\d+)*", t["alignment"]) for t in body["translations"])
    finally:
        assert server.stop() == 0


def test_a_package_of_separate_vocabularies_is_verified(separate_trained, tmp_path, nmt):
    settings = json.loads((separate_trained["package"] / "nmt.json").read_text())
    assert settings["version"] == 2 and {"spm_source_sha256", "spm_target_sha256"} <= settings.keys()
    damaged = tmp_path / "package"
    shutil.copytree(separate_trained["package"], damaged)
    with open(damaged / "spm.target.model", "ab") as f:
        f.write(b"\0")
    result = nmt("translate", "--model", str(damaged), stdin=b"A dog.\n")
    assert result.code == 1 and "spm.target.model does not match the sha256" in one_error_line(result)


def test_fine_tuning_takes_both_models_and_refuses_a_joint_run(separate_trained, run_copy, tmp_path, nmt):
    """`bpe --from` a separate model turns a joint run (Multi30k prepared, joint BPE) into one
    with that model's two; a run left joint is refused --init-from it."""
    joint = tmp_path / "joint"
    shutil.copytree(run_copy, joint)
    run_ok(
        ["bpe", "--run-dir", run_copy, "--from", separate_trained["package"]],
        ["train", "--run-dir", run_copy, *LONGER, "--max-steps", 2, "--init-from", separate_trained["run"]],
    )
    taken = from_dir(separate_trained["package"]).vocabs
    assert vocabulary_key(RunDir(run_copy).vocabularies()) == vocabulary_key(taken) and not taken.joint
    assert not (run_copy / "bpe" / "spm.model").exists()
    result = nmt("train", "--run-dir", str(joint), *LONGER, "--max-steps", "1", "--init-from",
                 str(separate_trained["package"]))  # fmt: skip
    assert result.code == 1 and "encode the data with `nmt bpe --from" in one_error_line(result)
