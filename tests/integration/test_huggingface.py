"""Models in the Hugging Face format: `nmt import` of a MarianMTModel (OPUS-MT's shape) computes
what transformers computes, CTranslate2's own converter agrees with it, it fine-tunes, and
`nmt export --format huggingface` writes what transformers loads and generates alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import LONGER, one_error_line, run_ok
from marian import LEFT_OUT, lines, make_marian

from nmt_cli import Translator
from nmt_cli.config import DecodeOptions
from nmt_cli.engine import checkpoint
from nmt_cli.engine.model import Transformer
from nmt_cli.inference import models
from nmt_cli.vocab import BOS, EOS, PAD

transformers = pytest.importorskip("transformers")  # the test extra installs it: a real failure there


@pytest.fixture(scope="module")
def marian(tmp_path_factory, multi30k_dir):
    return make_marian(tmp_path_factory.mktemp("hf") / "opus-mt-en-de", multi30k_dir)


@pytest.fixture(scope="module")
def imported(marian, tmp_path_factory):
    from nmt_cli.hf.read import import_marian

    out = tmp_path_factory.mktemp("imported") / "pkg"
    import_marian(marian, out)
    return out


def hf_model(folder):
    return transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()


def marian_ids(marian, translator):
    """nmt's target ids -> the Marian folder's (PAD/BOS: its decoder start; EOS: 0)."""
    vocab = json.loads((marian / "vocab.json").read_text())
    sp = translator.target_sp
    rows = [vocab.get(sp.id_to_piece(i), vocab["<unk>"]) for i in range(sp.get_piece_size())]
    rows[BOS], rows[EOS] = vocab["<pad>"], vocab["</s>"]
    return rows, vocab


def test_import_computes_what_transformers_computes(marian, imported, multi30k_dir):
    """Logits equal to transformers' on 50 Multi30k pairs (the rows Marian has), the source ids
    equal to MarianTokenizer's."""
    src, tgt = lines(multi30k_dir, "val", "en", 50), lines(multi30k_dir, "val", "de", 50)
    hf = hf_model(marian)
    tok = transformers.AutoTokenizer.from_pretrained(marian)
    found = models.locate(imported)
    net = Transformer(found.config)
    net.load_state_dict(found.weights())
    net.eval()
    tr = Translator.load(imported)
    rows, vocab = marian_ids(marian, tr)
    real = [
        i for i in range(len(rows)) if i != PAD and (i in (BOS, EOS) or tr.target_sp.id_to_piece(i) in vocab)
    ]
    assert len(real) == len(vocab) - 0  # every Marian row once: <pad> as BOS, the rest as themselves
    assert len(rows) - len(real) == 1 + LEFT_OUT  # PAD, and the pieces the vocabulary left out
    source_rows = {
        i: vocab.get(tr.source_sp.id_to_piece(i), vocab["<unk>"])
        for i in range(4, tr.source_sp.get_piece_size())
    }
    worst = same_ids = 0.0
    for s, t in zip(src, tgt):
        x, y = tr.encode([s])[0], tr.encode_targets([t])[0]
        theirs = tok([s], text_target=[t], return_tensors="pt")
        same_ids += theirs["input_ids"][0].tolist() == [source_rows[i] for i in x] + [vocab["</s>"]]
        with torch.no_grad():
            mine = net.logits(net(torch.tensor([x + [EOS]]), torch.tensor([[BOS, *y]])))[0]
            start = torch.tensor([[vocab["<pad>"]] + [rows[i] for i in y]])
            ref = hf(
                input_ids=torch.tensor([[source_rows[i] for i in x] + [0]]), decoder_input_ids=start
            ).logits[0]
        worst = max(worst, (mine[:, real] - ref[:, [rows[i] for i in real]]).abs().max().item())
        # the same distribution: log-probabilities over Marian's vocabulary (its <pad> as BOS)
        mine_lp, ref_lp = mine.log_softmax(-1), ref.log_softmax(-1)
        assert (mine_lp[:, real] - ref_lp[:, [rows[i] for i in real]]).abs().max() < 1e-4
    # float32 rounding is ~1e-6 here; Marian's LayerNorm epsilon taken as nmt's 1e-6 shows as 3e-5
    assert worst < 5e-6, worst
    assert same_ids >= 45, (
        same_ids
    )  # nmt cleans punctuation as OPUS-MT's training did; Marian's tokenizer does not


def test_imported_searches_as_generate_does(marian, imported, multi30k_dir):
    """Greedy: token for token generate(num_beams=1). Beam 4 without length normalisation
    (alpha 0, length_penalty 0): where the outputs differ, nmt's is at least as likely (by the
    model the first test found equal to transformers'). transformers searches line by line here
    (its beam over a padded batch is its own question): 50 lines."""
    src = lines(multi30k_dir, "val", "en", 50)
    hf = hf_model(marian)
    tr = Translator.load(imported)
    found = models.locate(imported)
    net = Transformer(found.config)
    net.load_state_dict(found.weights())
    net.eval()

    def log_prob(x: list[int], y: list[int]) -> float:
        with torch.no_grad():
            lp = net.logits(net(torch.tensor([x + [EOS]]), torch.tensor([[BOS, *y]])))[0].log_softmax(-1)
        return sum(lp[i, t].item() for i, t in enumerate([*y, EOS]))

    rows, vocab = marian_ids(marian, tr)
    source_rows = [
        vocab.get(tr.source_sp.id_to_piece(i), vocab["<unk>"]) for i in range(tr.source_sp.get_piece_size())
    ]
    ids = tr.encode(src)
    limit = 20
    for beam in (1, 4):
        hyps = tr.hypotheses(src, DecodeOptions(beam=beam, max_len=limit, alpha=0.0, nbest=1))
        same = at_least = 0
        for x, h in zip(ids, hyps):
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([[source_rows[i] for i in x] + [0]]),
                    num_beams=beam,
                    do_sample=False,
                    max_new_tokens=limit,
                    length_penalty=0.0,
                    return_dict_in_generate=True,
                )
            theirs = out.sequences[0].tolist()[1:]
            theirs = theirs[:-1] if theirs and theirs[-1] == vocab["</s>"] else theirs
            if [rows[t] for t in h[0].tokens] == theirs:
                same += 1
            elif beam > 1:
                back = {r: i for i, r in reversed(list(enumerate(rows)))}
                at_least += log_prob(x, h[0].tokens) >= log_prob(x, [back[t] for t in theirs]) - 1e-4
        if beam == 1:
            assert same == len(src)
        else:
            assert same >= 0.8 * len(src) and same + at_least == len(src), (same, at_least)


def test_ctranslate2s_own_converter_agrees_with_the_import(marian, imported, tmp_path, multi30k_dir, nmt):
    ctranslate2 = pytest.importorskip("ctranslate2")
    theirs_dir, mine_dir = tmp_path / "ct2-converter", tmp_path / "nmt-export"
    ctranslate2.converters.TransformersConverter(str(marian)).convert(str(theirs_dir))
    assert nmt("export", mine_dir, "--model", imported, "--format", "ctranslate2").code == 0
    tr = Translator.load(imported)
    pieces = [tr.source_sp.id_to_piece(x) for x in tr.encode(lines(multi30k_dir, "val", "en", 200))]
    for beam in (1, 4):
        outs = []
        for folder, eos in ((mine_dir, []), (theirs_dir, ["</s>"])):  # nmt's export adds the EOS itself
            found = ctranslate2.Translator(str(folder)).translate_batch(
                [p + eos for p in pieces], beam_size=beam, max_decoding_length=19
            )
            outs.append([r.hypotheses[0] for r in found])
        assert sum(a == b for a, b in zip(*outs)) >= 0.99 * len(pieces)


@pytest.fixture(scope="module")
def imported_run(imported, tmp_path_factory, multi30k_dir):
    """Multi30k prepared and encoded with the imported model's sentencepiece models; copy before use."""
    run = tmp_path_factory.mktemp("imported-run") / "run"
    run_ok(
        ["prep", "multi30k-en-de", "--run-dir", run, "--mirror", multi30k_dir],
        ["bpe", "--from", imported, "--run-dir", run],
    )
    return run


FINE_TUNING = [
    *("--device", "cpu", "--max-steps", "12", "--eval-every", "12", "--save-every", "12"),
    *(
        "--max-tokens",
        "1024",
        "--precision",
        "fp32",
        "--lr",
        "1e-3",
        "--warmup",
        "1",
        "--schedule",
        "constant",
    ),
]


def fine_tuned(imported, base: Path, run: Path, procs: int, *extra) -> Path:
    shutil.copytree(base, run)
    run_ok(["train", "--run-dir", run, "--init-from", imported, "--procs", procs, *FINE_TUNING, *extra])
    return run


@pytest.fixture(scope="module")
def tuned(imported, imported_run, tmp_path_factory):
    """The imported model fine-tuned by nmt on one process, its embeddings and first encoder
    layer frozen: an nmt-trained post-norm model."""
    run = tmp_path_factory.mktemp("tuned") / "run"
    return fine_tuned(imported, imported_run, run, 1, "--freeze", "embeddings,encoder.0")


def valid_nll(model, run: Path) -> float:
    src = (run / "text" / "valid.en").read_text().splitlines()[:300]
    tgt = (run / "text" / "valid.de").read_text().splitlines()[:300]
    found = Translator.load(model).score(src, tgt)
    return -sum(p.total for p in found) / sum(p.tokens for p in found)


def test_the_imported_model_fine_tunes_with_parts_frozen(imported, imported_run, tuned, tmp_path):
    """`nmt bpe --from` the package and `train --init-from` it, on one process and on 2 gloo
    ranks: the validation loss falls below the imported model's own, the frozen tensors stay
    bit for bit."""
    before = valid_nll(imported, imported_run)
    start = models.locate(imported).weights()
    two = fine_tuned(imported, imported_run, tmp_path / "two", 2, "--freeze", "embeddings,encoder.0")
    for run in (tuned, two):
        weights = checkpoint.weights_of(
            checkpoint.load_tensors(checkpoint.listed(run / "checkpoints")[-1])[0]
        )
        for name, value in weights.items():
            frozen = name.startswith(("embed.", "src_embed.", "encoder.0.")) or name == "output_bias"
            assert torch.equal(value, start[name]) == frozen, name
        assert valid_nll(run, imported_run) < before - 0.05, (run, before)


def test_export_of_a_fine_tuned_import_loads_in_transformers_and_imports_back(
    tuned, tmp_path, nmt, multi30k_dir
):
    """A post-norm model nmt trained (the import, fine-tuned) as MarianMTModel: transformers'
    greedy outputs are nmt's on 200 lines; `nmt import` of it is the model again."""
    out, back = tmp_path / "hf", tmp_path / "back"
    result = nmt("export", out, "--run-dir", tuned, "--format", "huggingface")
    assert result.code == 0, result.err
    hf, tok = hf_model(out), transformers.AutoTokenizer.from_pretrained(out)
    assert type(hf).__name__ == "MarianMTModel"
    src = lines(multi30k_dir, "val", "en", 200)
    tr = Translator.load(tuned)
    mine = tr.hypotheses(src, DecodeOptions(beam=1, max_len=20))
    with torch.no_grad():
        theirs = hf.generate(**tok(src, return_tensors="pt", padding=True), num_beams=1, max_new_tokens=20)
    assert [h[0].tokens for h in mine] == [
        [t for t in row[1:] if t not in (EOS, PAD)] for row in theirs.tolist()
    ]
    assert nmt("import", out, back).code == 0
    a, b = models.locate(tuned), models.locate(back)
    assert a.config == b.config and a.src == b.src and a.tgt == b.tgt
    wa, wb = a.weights(), b.weights()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [p.read_bytes() for p in a.vocabs.files()] == [p.read_bytes() for p in b.vocabs.files()]


def test_export_of_a_pre_norm_model_is_m2m100_and_generates_what_nmt_does(trained_longer, tmp_path, nmt):
    out = tmp_path / "hf"
    result = nmt("export", out, "--model", trained_longer, "--format", "huggingface")
    assert result.code == 0, result.err
    hf, tok = hf_model(out), transformers.AutoTokenizer.from_pretrained(out)
    assert type(hf).__name__ == "M2M100ForConditionalGeneration"
    src = (trained_longer / "text" / "test.en").read_text().splitlines()[:200]
    tr = Translator.load(trained_longer)
    mine = tr.hypotheses(src, DecodeOptions(beam=1, max_len=40))
    enc = tok(src, return_tensors="pt", padding=True)
    assert enc["input_ids"][0].tolist()[: len(tr.encode(src[:1])[0]) + 1] == tr.encode(src[:1])[0] + [EOS]
    with torch.no_grad():
        theirs = hf.generate(**enc, num_beams=1, max_new_tokens=40)
    rows = [[t for t in row[1:] if t not in (EOS, PAD)] for row in theirs.tolist()]
    assert [h[0].tokens for h in mine] == rows
    assert nmt("import", out, tmp_path / "back").code == 0  # nmt's own M2M100 export reads back
    a, b = models.locate(trained_longer), models.locate(tmp_path / "back")
    assert a.config == b.config and b.vocabs.joint
    wa, wb = a.weights(), b.weights()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.vocabs.source.read_bytes() == b.vocabs.source.read_bytes()


def test_what_cannot_cross_is_one_error_line(marian, trained_longer, tmp_path, nmt):
    def folder_with(name: str, change) -> str:
        copy = tmp_path / name
        shutil.copytree(marian, copy)
        change(copy)
        return str(copy)

    def config(**settings):
        def change(folder):
            c = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**c, **settings}))

        return change

    cases = [
        (folder_with("bart", config(model_type="bart")), "MarianMTModel"),
        (folder_with("m2m", config(model_type="m2m_100")), "M2M100"),
        (folder_with("tanh", config(activation_function="tanh")), "activation"),
        (folder_with("heads", config(decoder_attention_heads=2)), "heads"),
        (folder_with("nospm", lambda f: (f / "source.spm").unlink()), "source.spm"),
        (folder_with("badspm", lambda f: (f / "target.spm").write_bytes(b"\xff" * 64)), "sentencepiece"),
        (folder_with("noweights", lambda f: (f / "model.safetensors").unlink()), "no weights"),
        (folder_with("badvocab", lambda f: (f / "vocab.json").write_bytes(b"\xff{")), "vocab.json"),
        (folder_with("badsize", config(d_model="wide")), "d_model"),
        (folder_with("deeper", config(encoder_layers=3)), "does not hold"),
        (str(tmp_path / "nowhere"), "not found"),
        (folder_with("nolang", lambda f: (f / "tokenizer_config.json").unlink()), "--src"),
    ]
    for folder, said in cases:
        line = one_error_line(nmt("import", folder, tmp_path / f"out-{len(said)}"))
        assert said in line, line
        assert not (tmp_path / f"out-{len(said)}").exists()
    post_t2t = tmp_path / "post"
    shutil.copytree(
        trained_longer, post_t2t, ignore=shutil.ignore_patterns("checkpoints", "averaged*", "metrics.jsonl")
    )
    assert nmt("train", "--run-dir", post_t2t, *LONGER, "--post-norm", "--max-steps", "1").code == 0
    line = one_error_line(nmt("export", tmp_path / "x", "--run-dir", post_t2t, "--format", "huggingface"))
    assert "post-norm" in line and not (tmp_path / "x").exists()


def test_a_multilingual_models_language_tags_are_its_tokenizers(marian, tmp_path, nmt):
    """`>>deu<<` at the start of a line is one piece with the tag's row, as MarianTokenizer
    makes it, through the import and through its export."""
    folder = tmp_path / "opus-mt-en-mul"
    shutil.copytree(marian, folder)
    vocab = json.loads((folder / "vocab.json").read_text())
    by_id = {i: p for p, i in vocab.items()}
    pad = vocab["<pad>"]
    for tag, row in ((">>deu<<", pad - 1), (">>fra<<", pad - 2)):  # in place of two pieces
        del vocab[by_id[row]]
        vocab[tag] = row
    (folder / "vocab.json").write_text(json.dumps(vocab))
    assert nmt("import", folder, tmp_path / "pkg").code == 0
    assert nmt("export", tmp_path / "hf", "--model", tmp_path / "pkg", "--format", "huggingface").code == 0
    tr = Translator.load(tmp_path / "pkg")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    found = models.locate(tmp_path / "pkg").weights()["src_embed.weight"]
    table = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).get_input_embeddings().weight
    for line in (">>deu<< A man rides a horse.", ">>fra<< Two dogs."):
        ids, want = tr.encode([line])[0], theirs([line])["input_ids"][0]
        assert len(ids) + 1 == len(want) and want[0] == vocab[line[:7]]
        assert torch.equal(found[ids], table[want[:-1]])  # the same rows, the tag's first
        assert exported([line])["input_ids"][0] == [*ids, EOS]


def test_adapters_train_alone_and_merge_into_a_plain_model(imported, imported_run, tmp_path, nmt):
    """--adapters on the imported model, on one process and on 2 gloo ranks: the validation loss
    falls, the checkpoints hold the adapters alone and name the model they adapt; the merged
    model (what translate, average and export hand on) computes what the model with its adapters
    beside the weights computes, and `nmt average` is the mean of the merged models."""
    from nmt_cli.engine import adapters

    run = imported_run
    val_src = (run / "text" / "valid.en").read_text().splitlines()[:300]
    val_tgt = (run / "text" / "valid.de").read_text().splitlines()[:300]

    def nll(model) -> float:
        found = Translator.load(model).score(val_src, val_tgt)
        return -sum(p.total for p in found) / sum(p.tokens for p in found)

    package = models.locate(imported)
    before = nll(imported)
    for procs in (1, 2):
        tuned = tmp_path / f"adapted{procs}"
        shutil.copytree(run, tuned)
        result = nmt(
            *("train", "--run-dir", tuned, "--init-from", imported, "--adapters", "4"),
            *("--procs", procs, "--device", "cpu", "--max-steps", "12", "--eval-every", "12"),
            *("--save-every", "6", "--max-tokens", "1024", "--precision", "fp32"),
            *("--lr", "3e-3", "--warmup", "1", "--schedule", "constant"),
        )
        assert result.code == 0, result.err
        paths = checkpoint.listed(tuned / "checkpoints")
        tensors, meta = checkpoint.load_tensors(paths[-1])
        held = tensors["model"]
        assert held and all(adapters.is_adapter(k) for k in held)
        assert meta["adapters"]["base_sha256"] == package.sha256
        assert nll(tuned) < before - 0.05, (procs, before)
    # the merged model = the model with its adapters beside the weights
    plain = models.locate(paths[-1]).weights()
    assert not any(adapters.is_adapter(k) for k in plain)
    beside = Transformer(package.config)
    beside.load_state_dict(package.weights())
    adapters.attach(beside, 4)
    beside.load_state_dict({**beside.state_dict(), **held})
    merged = Transformer(package.config)
    merged.load_state_dict(plain)
    tr = Translator.load(tuned)
    for net in (beside, merged):
        net.eval()
    worst = 0.0
    for s, t in zip(val_src[:30], val_tgt[:30]):
        x, y = torch.tensor([tr.encode([s])[0] + [EOS]]), torch.tensor([[BOS, *tr.encode_targets([t])[0]]])
        with torch.no_grad():
            worst = max(worst, (beside.logits(beside(x, y)) - merged.logits(merged(x, y))).abs().max().item())
    assert worst < 1e-4, worst
    # nmt average: the mean of the merged models, a plain one
    assert nmt("average", "--run-dir", tuned, "--last", "2").code == 0
    averaged = checkpoint.weights_of(checkpoint.load_tensors(tuned / "averaged.pt")[0])
    each = [models.locate(p).weights() for p in paths[-2:]]
    assert averaged.keys() == each[0].keys()
    assert all(torch.allclose(averaged[k], (each[0][k] + each[1][k]) / 2, atol=1e-6) for k in averaged)


def test_a_pickled_marian_model_imports_as_its_safetensors_does(marian, imported, tmp_path, nmt):
    """pytorch_model.bin (older OPUS-MT uploads), read with weights_only: the same package."""
    folder = tmp_path / "opus-mt-en-de"
    shutil.copytree(marian, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    state = transformers.AutoModelForSeq2SeqLM.from_pretrained(marian).state_dict()
    torch.save({k: v for k, v in state.items() if "embed_positions" not in k}, folder / "pytorch_model.bin")
    assert nmt("import", folder, tmp_path / "pkg").code == 0
    a, b = models.locate(imported).weights(), models.locate(tmp_path / "pkg").weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_imported_model_serves_as_it_translates(imported, tmp_path, nmt, multi30k_dir):
    """`nmt serve` of the package and of its CTranslate2 export answers what the Python API gives."""
    from conftest import Server

    sources = lines(multi30k_dir, "val", "en", 12)
    ct2 = tmp_path / "ct2"
    assert nmt("export", ct2, "--model", imported, "--format", "ctranslate2").code == 0
    for model in (imported, ct2):
        expected = Translator.load(model, beam=2, max_len=12).translate(sources)
        server = Server(model)
        try:
            status, body, _ = server.post({"text": sources, "beam": 2, "max_len": 12})
            assert status == 200 and body["translations"] == expected
        finally:
            server.stop()
