"""Multilingual models from the Hugging Face format: `nmt import` of an M2M100 and of an
NLLB-shaped folder (tests/m2m100.py) computes what transformers computes, its language tokens
where the tokenizer and `generate(forced_bos_token_id=…)` put them, and CTranslate2's own
converter agrees with nmt's export of the import."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import one_error_line
from m2m100 import NLLB_CODES, make_m2m100
from marian import lines

from nmt_cli import Translator
from nmt_cli.config import DecodeOptions
from nmt_cli.engine.model import Transformer
from nmt_cli.inference import models
from nmt_cli.vocab import BOS, EOS

transformers = pytest.importorskip("transformers")  # the test extra installs it: a real failure there

KINDS = ("m2m100", "nllb")
# (source, target) directions, by Multi30k's names of the languages
DIRECTIONS = (("en", "de"), ("de", "en"), ("fr", "cs"))


def code(kind: str, lang: str) -> str:
    return lang if kind == "m2m100" else NLLB_CODES[lang]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, multi30k_dir):
    root = tmp_path_factory.mktemp("multilingual")
    return {kind: make_m2m100(root / kind, multi30k_dir, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def imported(folders, tmp_path_factory):
    from nmt_cli.hf.read import import_marian

    out = {}
    for kind, folder in folders.items():
        out[kind] = tmp_path_factory.mktemp("imported") / kind
        import_marian(folder, out[kind], code(kind, "en"), code(kind, "de"))
    return out


def hf_tokenizer(folder, kind: str, src: str):
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.src_lang = code(kind, src)
    return tok


def their_ids(tok, tr: Translator, ids: list[int]) -> list[int]:
    """nmt's ids as the folder's, by the pieces' names (a row no name gave: `<hf:ROW>`; BOS: the
    decoder's start, </s>)."""
    out = []
    for i in ids:
        name = tr.target_sp.id_to_piece(i)
        out.append(
            2 if i == BOS else int(name[4:-1]) if name.startswith("<hf:") else tok.convert_tokens_to_ids(name)
        )
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_import_computes_what_transformers_computes(folders, imported, multi30k_dir, kind):
    """Source ids equal to the tokenizer's, its language token first; logits within 1e-4 of
    transformers' on 50 pairs, over every row of its output (each row once in nmt's softmax),
    and the same log-probabilities."""
    src, tgt = lines(multi30k_dir, "val", "en", 50), lines(multi30k_dir, "val", "de", 50)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(folders[kind]).eval()
    tok = hf_tokenizer(folders[kind], kind, "en")
    found = models.locate(imported[kind])
    assert found.config.position_offset == 2 and found.languages[code(kind, "de")]
    net = Transformer(found.config)
    net.load_state_dict(found.weights())
    net.eval()
    tr = Translator.load(imported[kind])
    first, forced = tr.language_tokens(DecodeOptions())
    rows = their_ids(tok, tr, list(range(tr.target_sp.get_piece_size())))
    inside = [i for i, b in enumerate(found.weights()["output_bias"].tolist()) if b > -50]
    assert sorted(rows[i] for i in inside) == list(range(hf.config.vocab_size))
    out = [rows[i] for i in inside]
    worst = same_ids = 0.0
    for s, t in zip(src, tgt):
        x = tr.encode([s], "", first)[0]
        y = forced + tr.encode_targets([t])[0]
        same_ids += tok([s])["input_ids"][0] == [*their_ids(tok, tr, x), 2]
        with torch.no_grad():
            mine = net.logits(net(torch.tensor([x + [EOS]]), torch.tensor([[BOS, *y]])))[0]
            ref = hf(
                input_ids=torch.tensor([[*their_ids(tok, tr, x), 2]]),
                decoder_input_ids=torch.tensor([[2, *their_ids(tok, tr, y)]]),
            ).logits[0]
        worst = max(worst, (mine[:, inside] - ref[:, out]).abs().max().item())
        assert (mine.log_softmax(-1)[:, inside] - ref.log_softmax(-1)[:, out]).abs().max() < 1e-4
    assert worst < 1e-4, worst
    assert same_ids >= 45, same_ids  # nmt cleans punctuation as Moses does; the tokenizer does not


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_is_generates_with_the_target_language_forced(folders, imported, multi30k_dir, kind):
    """Token for token generate(forced_bos_token_id=…) from the tokenizer's own ids, 50 lines in
    each of three directions; beam 4 (no length normalisation): where the outputs differ,
    nmt's is at least as likely, by the model the first test found equal to transformers'."""
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(folders[kind]).eval()
    tr = Translator.load(imported[kind])
    found = models.locate(imported[kind])
    net = Transformer(found.config)
    net.load_state_dict(found.weights())
    net.eval()
    back = {}
    for i, row in enumerate(
        their_ids(
            transformers.AutoTokenizer.from_pretrained(folders[kind]),
            tr,
            list(range(tr.target_sp.get_piece_size())),
        )
    ):
        back.setdefault(row, i)

    def log_prob(x: list[int], y: list[int]) -> float:
        with torch.no_grad():
            lp = net.logits(net(torch.tensor([x + [EOS]]), torch.tensor([[BOS, *y]])))[0].log_softmax(-1)
        return sum(lp[i, t].item() for i, t in enumerate([*y[1:], EOS], 1))

    limit = 20
    for src, tgt in DIRECTIONS:
        tok = hf_tokenizer(folders[kind], kind, src)
        forced = tok.convert_tokens_to_ids(found.languages[code(kind, tgt)])
        text = lines(multi30k_dir, "val", src, 50)
        options = DecodeOptions(
            max_len=limit + 1, alpha=0.0, src_lang=code(kind, src), tgt_lang=code(kind, tgt)
        )
        first, start = tr.language_tokens(options)
        ids = tr.encode(text, "", first)
        for beam in (1, 4):
            hyps = tr.hypotheses(text, dataclasses.replace(options, beam=beam))
            same = at_least = 0
            for x, line, (h, *_) in zip(ids, text, hyps):
                with torch.no_grad():
                    out = hf.generate(
                        torch.tensor(tok([line])["input_ids"]),
                        num_beams=beam,
                        do_sample=False,
                        max_new_tokens=limit,
                        length_penalty=0.0,
                        forced_bos_token_id=forced,
                        bad_words_ids=[[1]],  # nmt's search never emits PAD, as fairseq's
                    )[0].tolist()
                assert out[:2] == [2, forced]
                theirs = out[2:-1] if out[-1] == 2 else out[2:]
                if their_ids(tok, tr, h.tokens) == theirs:
                    same += 1
                elif beam > 1:
                    mine = log_prob(x, start + h.tokens)
                    at_least += mine >= log_prob(x, start + [back[t] for t in theirs]) - 1e-4
            if beam == 1:
                assert same == len(text), (src, tgt, same)
            else:
                assert same >= 0.6 * len(text) and same + at_least == len(text), (src, tgt, same, at_least)


def imported_token(package, kind: str, lang: str) -> str:
    return models.locate(package).languages[code(kind, lang)]


@pytest.mark.parametrize("kind", KINDS)
def test_ctranslate2s_own_converter_agrees_with_the_import(
    folders, imported, tmp_path, multi30k_dir, kind, nmt
):
    """CTranslate2's converter of the folder and nmt's export of its import (decoded through
    `nmt`'s CTranslate2 engine, the languages as options) give the same translations."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from ctranslate2.converters import transformers as converters

    def vocabulary(self, model, tokenizer):
        """CTranslate2 4.8's reads the language tokens from `additional_special_tokens`, which
        transformers 5 no longer keeps: every row by the tokenizer's name of it, the rows it
        does not name as the converter names them."""
        names = tokenizer.convert_ids_to_tokens(list(range(model.config.vocab_size)))
        unnamed = (i for i, n in enumerate(names) if n == tokenizer.unk_token and i != tokenizer.unk_token_id)
        for n, i in enumerate(unnamed):
            names[i] = f"madeupword{n}"
        return names

    theirs_dir, mine_dir = tmp_path / "ct2-converter", tmp_path / "nmt-export"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(converters.M2M100Loader, "get_vocabulary", vocabulary)
        ctranslate2.converters.TransformersConverter(str(folders[kind])).convert(str(theirs_dir))
    assert nmt("export", mine_dir, "--model", imported[kind], "--format", "ctranslate2").code == 0
    tr = Translator.load(mine_dir)
    assert tr.engine == "ctranslate2"
    theirs = ctranslate2.Translator(str(theirs_dir))
    for src, tgt in DIRECTIONS[:2]:
        tok = hf_tokenizer(folders[kind], kind, src)
        text = lines(multi30k_dir, "val", src, 100)
        target = models.locate(imported[kind]).languages[code(kind, tgt)]
        for beam in (1, 4):
            options = DecodeOptions(beam=beam, max_len=20, src_lang=code(kind, src), tgt_lang=code(kind, tgt))
            mine = [tr.target_sp.id_to_piece(h[0].tokens) for h in tr.hypotheses(text, options)]
            found = theirs.translate_batch(
                [tok.convert_ids_to_tokens(tok(line)["input_ids"]) for line in text],
                target_prefix=[[target]] * len(text),
                beam_size=beam,
                max_decoding_length=19,  # with the prefix: nmt's 20 counts the EOS
            )
            same = sum(m == r.hypotheses[0][1:] for m, r in zip(mine, found))
            assert same >= 0.95 * len(text), (src, tgt, beam, same)


def test_languages_are_options_and_what_cannot_be_is_one_line(folders, imported, trained, tmp_path, nmt):
    """`nmt translate --src-lang/--tgt-lang` on the import (its defaults: the languages it was
    imported with); an unknown language, or languages for a model of one pair: one line."""
    stdin = b"A dog runs in the snow.\nTwo men talk.\n"
    plain = nmt("translate", "--model", imported["m2m100"], "--beam", "1", stdin=stdin)
    told = nmt(
        "translate",
        "--model",
        imported["m2m100"],
        "--beam",
        "1",
        "--src-lang",
        "en",
        "--tgt-lang",
        "de",
        stdin=stdin,
    )
    other = nmt("translate", "--model", imported["m2m100"], "--beam", "1", "--tgt-lang", "fr", stdin=stdin)
    assert plain.code == told.code == other.code == 0, (plain.err, other.err)
    assert plain.out == told.out and len(plain.out.splitlines()) == 2 and other.out != plain.out
    assert "__de__" not in plain.out
    for args, said in (
        (["--model", imported["m2m100"], "--tgt-lang", "xx"], "--tgt-lang 'xx' is not a language of"),
        (["--model", imported["nllb"], "--src-lang", "de"], "--src-lang 'de' is not a language of"),
        (["--run-dir", trained, "--tgt-lang", "de"], "translates one pair"),
    ):
        assert said in one_error_line(nmt("translate", *args, stdin=stdin))
    for settings in ({"pad_token_id": "1"}, {"vocab_size": 10**9}, {"pad_token_id": 2000}):
        broken = tmp_path / f"broken-{len(str(settings))}"
        shutil.copytree(folders["m2m100"], broken)
        config = json.loads((broken / "config.json").read_text())
        (broken / "config.json").write_text(json.dumps({**config, **settings}))
        line = one_error_line(nmt("import", broken, tmp_path / "x"))
        assert "vocab_size must be a number of rows up to" in line and not (tmp_path / "x").exists()
    for kind in KINDS:
        line = one_error_line(nmt("import", folders[kind], tmp_path / "x", "--tgt", "xx"))
        assert "is multilingual: give --tgt, one of its" in line and not (tmp_path / "x").exists()


def test_the_server_takes_the_languages_of_each_request(imported, multi30k_dir):
    """`nmt serve` of the import: "src_lang" and "tgt_lang" per request, as the API translates
    them; an unknown language is a 400 and the server goes on."""
    from conftest import Server

    sources = lines(multi30k_dir, "val", "de", 6)
    server = Server(imported["nllb"])
    try:
        for tgt in ("fra_Latn", "ces_Latn"):
            expected = Translator.load(imported["nllb"], beam=2, max_len=12).translate(
                sources, src_lang="deu_Latn", tgt_lang=tgt
            )
            status, body, _ = server.post(
                {"text": sources, "beam": 2, "max_len": 12, "src_lang": "deu_Latn", "tgt_lang": tgt}
            )
            assert status == 200 and body["translations"] == expected, body
        status, body, _ = server.post({"text": sources, "tgt_lang": "xx_Latn"})
        assert status == 400 and "is not a language of" in json.dumps(body), (status, body)
        assert server.post({"text": sources[:1]})[0] == 200
    finally:
        server.stop()


def test_trimming_keeps_the_corpus_pieces_and_its_translations(
    folders, imported, multi30k_dir, tmp_path, nmt
):
    """--trim cuts the vocabulary to the pieces of a corpus and of the languages kept: the corpus
    is cut into the same pieces, its greedy translations are the untrimmed model's wherever those
    were made of kept pieces, and any other text still encodes."""
    corpus = tmp_path / "corpus.txt"
    text = lines(multi30k_dir, "val", "en", 60) + lines(multi30k_dir, "val", "de", 60)
    corpus.write_text("\n".join(text) + "\n")
    out = tmp_path / "trimmed"
    done = nmt("import", folders["nllb"], out, "--src", "eng_Latn", "--tgt", "deu_Latn", "--trim", corpus,
               "--languages", "fra_Latn")  # fmt: skip
    assert done.code == 0, done.err
    whole, cut = Translator.load(imported["nllb"]), Translator.load(out)
    assert set(models.locate(out).languages) == {"eng_Latn", "deu_Latn", "fra_Latn"}
    assert cut.target_sp.get_piece_size() < 0.8 * whole.target_sp.get_piece_size()
    english = text[:60]
    pieces = [whole.source_sp.id_to_piece(x) for x in whole.encode(english)]
    assert [cut.source_sp.id_to_piece(x) for x in cut.encode(english)] == pieces
    kept = {cut.target_sp.id_to_piece(i) for i in range(cut.target_sp.get_piece_size())}
    options = DecodeOptions(beam=1, max_len=16)
    before, after = (m.texts(m.hypotheses(english, options)) for m in (whole, cut))
    held = [
        (a, b)
        for (a,), (b,), h in zip(before, after, whole.hypotheses(english, options))
        if set(whole.target_sp.id_to_piece(h[0].tokens)) <= kept
    ]
    assert len(held) >= 30 and all(a == b for a, b in held)
    assert cut.translate(["Ωmega ☃ zebra"], beam=1, max_len=8)  # unseen characters: <unk>, not an error
    line = one_error_line(
        nmt(
            "import",
            folders["nllb"],
            tmp_path / "no",
            "--tgt",
            "deu_Latn",
            "--trim",
            corpus,
            "--languages",
            "xx_Latn",
        )
    )
    assert "--languages 'xx_Latn' is not a language of" in line and not (tmp_path / "no").exists()
    assert "--languages chooses what --trim keeps" in one_error_line(
        nmt("import", folders["nllb"], tmp_path / "no", "--languages", "fra_Latn")
    )


@pytest.mark.parametrize("procs, how", [(1, ["--adapters", "4"]), (2, ["--freeze", "embeddings"])])
def test_an_import_fine_tunes_on_one_pair_with_its_language_tokens(
    imported, multi30k_dir, tmp_path, nmt, procs, how
):
    """`nmt bpe --from` a multilingual import puts each side's language token first in the
    binarized data, as M2M100 trains; `train --init-from` fine-tunes it (with adapters on one
    process, its embeddings frozen on 2 gloo ranks); the run's model keeps its languages,
    translates the pair by default (the token never in the text) and others when told."""
    from nmt_cli.rundir import RunDir
    from nmt_cli.shards import Shard

    run = tmp_path / "run"
    assert nmt("prep", "multi30k-en-de", "--run-dir", run, "--mirror", multi30k_dir).code == 0
    package = imported["nllb"]
    line = one_error_line(nmt("bpe", "--run-dir", run, "--from", package))
    assert "is multilingual and has no language 'en': give --src-lang" in line
    languages = ["--src-lang", "eng_Latn", "--tgt-lang", "deu_Latn"]
    assert nmt("bpe", "--run-dir", run, "--from", package, *languages).code == 0
    tr = Translator.load(package)
    for lang, code_ in (("en", "eng_Latn"), ("de", "deu_Latn")):
        shard = Shard(RunDir(run).tokens("valid", lang))
        token = tr.target_sp.piece_to_id(models.locate(package).languages[code_])
        assert {int(shard[i][0]) for i in range(len(shard))} == {token}
    trained = nmt(
        "train", "--run-dir", run, "--init-from", package, "--procs", procs, "--device", "cpu",
        "--max-steps", "4", "--eval-every", "4", "--save-every", "4", "--max-tokens", "1024",
        "--precision", "fp32", "--eval-bleu", *how,
    )  # fmt: skip
    assert trained.code == 0, trained.err
    found = models.locate(run)
    assert found.languages == models.locate(package).languages
    assert found.language_pair == ("eng_Latn", "deu_Latn")
    stdin = b"A dog runs in the snow.\nTwo men talk.\n"
    plain = nmt("translate", "--run-dir", run, "--beam", "1", "--max-len", "8", stdin=stdin)
    other = nmt(
        "translate", "--run-dir", run, "--beam", "1", "--max-len", "8", "--tgt-lang", "fra_Latn", stdin=stdin
    )
    assert plain.code == other.code == 0, (plain.err, other.err)
    assert len(plain.out.splitlines()) == 2 and "_Latn" not in plain.out + other.out
