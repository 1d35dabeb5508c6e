"""`nmt prep custom` on the user's own files, and every bad input a user can hand it."""

import gzip

import pytest
from conftest import multi30k_slices, one_error_line, tagged_corpora

from nmt_cli.data.filters import SeenPairs
from nmt_cli.normalize import normalize
from nmt_cli.rundir import RunDir


def write(path, lines, newline=True):
    path.write_text("\n".join(lines) + ("\n" if newline else ""), encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path):
    src = [f"This is sentence number {i} ." for i in range(500)]
    tgt = [f"Das ist Satz Nummer {i} ." for i in range(500)]
    return write(tmp_path / "c.en", src), write(tmp_path / "c.de", tgt)


def test_custom_with_holdout_validation(corpus, tmp_path, nmt):
    run = RunDir(tmp_path / "run")
    result = nmt("prep", "custom", "--train-src", corpus[0], "--train-tgt", corpus[1], "--run-dir", run.root)
    assert result.code == 0, result.err
    assert f"next: nmt bpe --run-dir {run.root}" in result.err  # a step names the next one
    splits = run.load_manifest()["prep"]["splits"]
    assert splits["train"]["kept"] == 495 and splits["valid"]["kept"] == 5  # every 100th
    valid = run.text("valid", "en").read_text().splitlines()
    train = set(run.text("train", "en").read_text().splitlines())
    assert not train & set(valid)


def test_gzip_input_and_invalid_utf8_are_handled(tmp_path, nmt):
    src = tmp_path / "a.en.gz"
    with gzip.open(src, "wb") as f:
        f.write(b"caf\xe9 au lait\r\nplain line\n")  # Latin-1 byte, CRLF
    tgt = write(tmp_path / "a.de", ["Kaffee mit Milch", "einfache Zeile"], newline=False)
    run = RunDir(tmp_path / "run")
    result = nmt(
        "prep",
        "custom",
        "--train-src",
        src,
        "--train-tgt",
        tgt,
        "--valid-src",
        src,
        "--valid-tgt",
        tgt,
        "--run-dir",
        run.root,
    )
    assert result.code == 0, result.err
    assert "not UTF-8" in result.err and "replaced" in result.err
    assert run.text("train", "en").read_text(encoding="utf-8").splitlines() == [
        "caf\ufffd au lait",
        "plain line",
    ]
    assert run.load_manifest()["prep"]["splits"]["train"]["not_utf8"] == 1


def test_different_line_counts_name_both_files(corpus, tmp_path, nmt):
    short = write(tmp_path / "short.de", ["eins", "zwei"])
    line = one_error_line(
        nmt("prep", "custom", "--train-src", corpus[0], "--train-tgt", short, "--run-dir", tmp_path / "run")
    )
    assert str(corpus[0]) in line and "500 lines" in line
    assert str(short) in line and "has 2" in line


def test_failed_prep_loses_nothing(corpus, tmp_path, nmt):
    run = RunDir(tmp_path / "run")
    assert (
        nmt("prep", "custom", "--train-src", corpus[0], "--train-tgt", corpus[1], "--run-dir", run.root).code
        == 0
    )
    before = (run.text("train", "en").read_bytes(), run.manifest_path.read_bytes())
    short = write(tmp_path / "short.de", ["eins"])
    assert (
        nmt("prep", "custom", "--train-src", corpus[0], "--train-tgt", short, "--run-dir", run.root).code == 1
    )
    assert (run.text("train", "en").read_bytes(), run.manifest_path.read_bytes()) == before
    config = run.config_path("prep").read_bytes()
    assert (
        nmt(
            "prep",
            "custom",
            "--train-src",
            tmp_path / "missing",
            "--train-tgt",
            corpus[1],
            "--run-dir",
            run.root,
        ).code
        == 1
    )
    assert run.config_path("prep").read_bytes() == config  # a refused run changes nothing
    assert not [p for p in (run.root / "text").iterdir() if p.name.startswith(".")]


def test_missing_file(tmp_path, corpus, nmt):
    line = one_error_line(
        nmt(
            "prep",
            "custom",
            "--train-src",
            tmp_path / "nope.en",
            "--train-tgt",
            corpus[1],
            "--run-dir",
            tmp_path / "run",
        )
    )
    assert "nope.en" in line and "not found" in line


def test_empty_after_cleaning(tmp_path, nmt):
    src = write(tmp_path / "e.en", ["", "  ", "x"])
    tgt = write(tmp_path / "e.de", ["a", "b", ""])
    line = one_error_line(
        nmt("prep", "custom", "--train-src", src, "--train-tgt", tgt, "--run-dir", tmp_path / "run")
    )
    assert "no pairs left in train" in line and "3 empty" in line


def test_custom_needs_train_files(tmp_path, nmt):
    assert "--train-src" in one_error_line(nmt("prep", "custom", "--run-dir", tmp_path / "r"))


def test_bpe_before_prep(tmp_path, nmt):
    (tmp_path / "run").mkdir()
    line = one_error_line(nmt("bpe", "--run-dir", tmp_path / "run"))
    assert "run `nmt prep` first" in line
    line = one_error_line(nmt("bpe", "--run-dir", tmp_path / "elsewhere"))
    assert "run `nmt prep` first" in line


def test_normalize():
    assert normalize("  a\u200bb \t c\x07 ", "en") == "a b c"  # format/control chars -> spaces
    assert normalize("\u201eZitat\u201c", "de") == '"Zitat"'  # Moses punctuation normalisation
    assert normalize("\ufeff", "en") == ""


def test_seen_pairs_across_flushes():
    seen = SeenPairs(flush_every=7)
    pairs = [(str(i), str(i * 2)) for i in range(50)]
    assert all(seen.add(a, b) for a, b in pairs)
    assert not any(seen.add(a, b) for a, b in pairs)
    assert seen.add("new", "pair")
    assert len(seen.old) + len(seen.recent) == 51


# The Universal Declaration of Human Rights, article 1, in its official translations, and one
# more sentence of it (article 3); the pairs a length filter by spaces would throw away.
UDHR = {
    "en": [
        "All human beings are born free and equal in dignity and rights. They are endowed "
        "with reason and conscience and should act towards one another in a spirit of "
        "brotherhood.",
        "Everyone has the right to life, liberty and security of person.",
    ],
    "zh": [
        "人人生而自由，在尊严和权利上一律平等。他们赋有理性和良心，并应以兄弟关系的精神相对待。",
        "人人有权享有生命、自由和人身安全。",
    ],
    "ja": [
        "すべての人間は、生まれながらにして自由であり、かつ、尊厳と権利とについて平等である。"
        "人間は、理性と良心とを授けられており、互いに同胞の精神をもって行動しなければならない。",
        "すべて人は、生命、自由及び身体の安全に対する権利を有する。",
    ],
    "th": [
        "มนุษย์ทั้งหลายเกิดมามีอิสระและเสมอภาคกันในเกียรติศักดิ์และสิทธิ ต่างมีเหตุผลและมโนธรรม "
        "และควรปฏิบัติต่อกันด้วยเจตนารมณ์แห่งภราดรภาพ",
        "บุคคลมีสิทธิในการดำเนินชีวิต ในเสรีภาพและในความมั่นคงแห่งร่างกาย",
    ],
}


def test_the_length_filter_keeps_translations_into_scripts_without_spaces(tmp_path, nmt):
    from nmt_cli.data.filters import length

    for lang in ("zh", "ja", "th"):
        for en, other in zip(UDHR["en"], UDHR[lang]):
            assert len(en.split()) > 4 * len(other.split())  # what counting spaces would see
            assert 1 / 1.5 <= length(other) / length(en) <= 1.5, (lang, length(other))
        src = write(tmp_path / f"u.{lang}.en", UDHR["en"] * 3)
        tgt = write(tmp_path / f"u.{lang}", UDHR[lang] * 3)
        run = RunDir(tmp_path / lang)
        result = nmt(
            "prep",
            "custom",
            "--src",
            "en",
            "--tgt",
            lang,
            "--train-src",
            src,
            "--train-tgt",
            tgt,
            "--valid-src",
            src,
            "--valid-tgt",
            tgt,
            "--run-dir",
            run.root,
        )
        assert result.code == 0, result.err
        train = run.load_manifest()["prep"]["splits"]["train"]
        assert train["kept"] == 2 and train["dropped"] == {"duplicate": 4}, train
    # A side far longer than the other is still dropped, in any script.
    assert length(UDHR["zh"][1]) * 1.5 < length(UDHR["en"][0])


def test_several_corpora_with_tags_and_weights(tmp_path, multi30k_dir, nmt):
    """A clean corpus and a tagged one of weight 2.5 (as back-translations are used): the tag
    starts the second corpus's source lines as one BPE piece, and each epoch takes its pairs
    2.5 times on average, the extra half changing from epoch to epoch."""
    import numpy as np

    from nmt_cli import train as train_mod
    from nmt_cli.engine.batches import Split

    files = multi30k_slices(multi30k_dir, tmp_path)
    run = RunDir(tmp_path / "run")
    args = [
        "prep",
        "custom",
        "--run-dir",
        run.root,
        "--valid-src",
        files["v", "en"],
        "--valid-tgt",
        files["v", "de"],
    ]
    args += tagged_corpora(files, 2.5)
    result = nmt(*args)
    assert result.code == 0, result.err
    corpora = run.load_manifest()["prep"]["splits"]["train"]["corpora"]
    assert [(c["source"], c["tag"], c["weight"]) for c in corpora] == [
        (str(files["a", "en"]), "", 1.0),
        (str(files["b", "en"]), "<bt>", 2.5),
    ]
    na, nb = corpora[0]["pairs"], corpora[1]["pairs"]
    assert 2800 < na <= 3000 and 1800 < nb <= 2000  # pairs over the 1.5 length ratio go
    train = run.text("train", "en").read_text(encoding="utf-8").splitlines()
    assert len(train) == na + nb
    assert not any(x.startswith("<bt>") for x in train[:na])
    assert all(x.startswith("<bt> ") and not x.startswith("<bt> <bt>") for x in train[na:])
    assert train[na][len("<bt> ") :] == normalize(files["b", "en"].read_text().splitlines()[0], "en")
    assert not any(x.startswith("<bt>") for x in run.text("valid", "en").read_text().splitlines())

    assert nmt("bpe", "--run-dir", run.root, "--vocab-size", "1000").code == 0
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(run.vocabularies().source))
    tag = sp.piece_to_id("<bt>")
    # One piece (after sentencepiece's word-start piece).
    assert tag != sp.unk_id() and sp.encode("<bt> A dog runs.", out_type=str)[:3] == [
        "\u2581",
        "<bt>",
        "\u2581A",
    ]
    data = train_mod.data_of(run)
    assert list(data.corpora) == corpora
    split = Split.of(*data.train, 1024, corpora)
    assert all(split.src[i][1] == tag for i in range(na, na + nb)) and tag not in split.src[0]
    e0, e1 = split.chosen(seed=1, epoch=0), split.chosen(seed=1, epoch=1)
    counts = np.bincount(e0, minlength=na + nb)
    assert np.all(counts[:na] == 1)
    assert set(counts[na:]) == {2, 3} and (counts[na:] == 3).sum() == round(0.5 * nb)
    assert not np.array_equal(np.sort(e0), np.sort(e1))  # another half each epoch
    assert np.array_equal(e0, split.chosen(seed=1, epoch=0))
    batched = np.concatenate([b.sentences for b in split.batches(1024, 1, 0)])
    assert sorted(batched.tolist()) == sorted(e0.tolist())
    steps = ["--size", "tiny", "--d-model", "16", "--ffn", "32", "--heads", "2", "--max-steps", "3"]
    assert nmt("train", "--run-dir", run.root, *steps, "--max-tokens", "256", "--eval-every", "3").code == 0


def test_corpus_options_must_match(corpus, tmp_path, nmt):
    base = [
        "prep",
        "custom",
        "--run-dir",
        tmp_path / "run",
        "--train-src",
        corpus[0],
        "--train-tgt",
        corpus[1],
    ]
    assert "one per corpus" in one_error_line(nmt(*base, "--tag", "<a>", "--tag", "<b>"))
    assert "one token" in one_error_line(nmt(*base, "--tag", "two words"))
    assert "above 0" in one_error_line(nmt(*base, "--weight", "0"))
    assert "one of each" in one_error_line(nmt(*base, "--train-src", corpus[0]))
    assert "nmt prep custom" in one_error_line(
        nmt("prep", "multi30k-en-de", "--run-dir", tmp_path / "m", "--weight", "2")
    )
    assert not (tmp_path / "run").exists()
