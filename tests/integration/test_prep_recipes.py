"""The wmt14-en-fr and wmt16-en-ro code paths, offline, on miniature mirrors with the real
archive names and inner layout: zip archives (a gzipped member among them), OPUS's TMX, WMT's
plain and SGML dev and test sets. The text is Multi30k's (German standing in for the other
language)."""

import gzip
import zipfile
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
import wmt14_mirror
from conftest import one_error_line
from wmt14_mirror import real_lines, sgm

from nmt_cli.rundir import RunDir


def tmx(units: list[dict[str, str]]) -> str:
    """OPUS's TMX: one translation unit per pair, a variant per language, XML-escaped text."""
    out = ['<?xml version="1.0" encoding="utf-8"?>', '<tmx version="1.4">', '<header srclang="en"/>']
    out.append("<body>")
    for unit in units:
        out.append("<tu>")
        for lang, text in unit.items():
            out.append(f'<tuv xml:lang="{lang}"><seg>{escape(text)}</seg></tuv>')
        out.append("</tu>")
    out += ["</body>", "</tmx>"]
    return "\n".join(out) + "\n"


def build(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    en, ro = real_lines(500)
    with zipfile.ZipFile(folder / "training-parallel-ep-v8.zip", "w") as z:
        z.writestr("training-parallel-ep-v8/europarl-v8.ro-en.en", "\n".join(en[:200]) + "\n")
        z.writestr("training-parallel-ep-v8/europarl-v8.ro-en.ro", "\n".join(ro[:200]) + "\n")
        z.writestr("training-parallel-ep-v8/europarl-v8.fi-en.fi", "Tätä ei lueta.\n")
    units = [{"en": e, "ro": r} for e, r in zip(en[200:300], ro[200:300])]
    units.insert(40, {"en": "A unit with one side only."})  # must not shift the pairs after it
    units.append({"ro": "Salt & piper <sic>", "en": "Salt & pepper <sic>"})  # escaped in the file
    with gzip.open(folder / "en-ro.tmx.gz", "wt", encoding="utf-8") as f:
        f.write(tmx(units))
    with zipfile.ZipFile(folder / "dev.zip", "w") as z:
        for name, (a, b) in {"newsdev2016": (300, 400), "newstest2016": (400, 500)}.items():
            z.writestr(f"dev/{name}-roen-src.ro.sgm", sgm(ro[a:b], "ro", "src"))
            z.writestr(f"dev/{name}-roen-ref.en.sgm", sgm(en[a:b], "en", "ref"))
    pairs = list(zip(en[200:300], ro[200:300]))
    return {"train_read": 200 + len(units), "pairs": pairs, "test": (en[400:500], ro[400:500])}


def pin(monkeypatch, folder: Path, name: str = "wmt16-en-ro") -> None:
    wmt14_mirror.pin(monkeypatch, folder, name)


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    folder = tmp_path / "mirror"
    expected = build(folder)
    pin(monkeypatch, folder)
    return folder, expected


def test_wmt16_en_ro_end_to_end(mirror, tmp_path, nmt):
    folder, expected = mirror
    run = RunDir(tmp_path / "run")
    result = nmt("prep", "wmt16-en-ro", "--run-dir", run.root, "--mirror", folder)
    assert result.code == 0, result.err
    prep = run.load_manifest()["prep"]
    assert (prep["src"], prep["tgt"]) == ("en", "ro") and list(prep["splits"]) == ["train", "valid", "test"]
    train = prep["splits"]["train"]
    assert train["read"] == expected["train_read"] and train["dropped"].get("empty", 0) >= 1
    sides = [run.text("train", lang).read_text(encoding="utf-8").splitlines() for lang in ("en", "ro")]
    pairs = set(zip(*sides))
    # The TMX's last pair is still a pair after the unit with one side; its escapes are text.
    assert ("Salt & pepper <sic>", "Salt & piper <sic>") in pairs
    assert not any("Tätä" in line for line in sides[1])  # only the ro-en members
    assert prep["splits"]["valid"]["kept"] == 100
    test_en, test_ro = expected["test"]
    assert run.text("test", "en", raw=True).read_text(encoding="utf-8").splitlines() == test_en
    assert run.text("test", "ro", raw=True).read_text(encoding="utf-8").splitlines() == test_ro
    other = RunDir(tmp_path / "ro-en")
    assert nmt("prep", "wmt16-en-ro", "--src", "ro", "--run-dir", other.root, "--mirror", folder).code == 0
    assert other.load_manifest()["prep"]["tgt"] == "en"


def test_the_tmx_sides_stay_aligned_unit_for_unit(tmp_path):
    """Each side reads one segment per unit ('' where the unit has none of that language)."""
    from nmt_cli.prep import _read_tmx

    expected = build(tmp_path)
    en, ro = (list(_read_tmx(tmp_path / "en-ro.tmx.gz", lang)) for lang in ("en", "ro"))
    assert len(en) == len(ro) == expected["train_read"] - 200
    assert (en[40], ro[40]) == ("A unit with one side only.", "")
    assert list(zip(en[:40] + en[41:-1], ro[:40] + ro[41:-1])) == expected["pairs"]
    assert (en[-1], ro[-1]) == ("Salt & pepper <sic>", "Salt & piper <sic>")


def test_a_broken_tmx_is_one_error_line(mirror, tmp_path, monkeypatch, nmt):
    folder, _ = mirror
    with gzip.open(folder / "en-ro.tmx.gz", "wt", encoding="utf-8") as f:
        f.write('<tmx><body><tu><tuv xml:lang="en"><seg>cut off')
    pin(monkeypatch, folder)
    line = one_error_line(nmt("prep", "wmt16-en-ro", "--run-dir", tmp_path / "run", "--mirror", folder))
    assert "en-ro.tmx.gz is not a readable TMX file" in line


def test_wmt14_en_fr_end_to_end(tmp_path, monkeypatch, nmt):
    """Five training archives (giga-fren's members gzipped inside its zip), newstest2013 as
    plain text and the full newstest2014 as SGML from the dev zip."""
    folder = tmp_path / "mirror"
    folder.mkdir()
    en, fr = real_lines(700)
    corpora = {
        "training-parallel-europarl-v7.zip": ("training/europarl-v7.fr-en", 0),
        "training-parallel-commoncrawl.zip": ("commoncrawl.fr-en", 100),
        "training-parallel-un.zip": ("un/undoc.2000.fr-en", 200),
        "training-parallel-nc-v9.zip": ("training/news-commentary-v9.fr-en", 300),
    }
    for archive, (stem, start) in corpora.items():
        with zipfile.ZipFile(folder / archive, "w") as z:
            z.writestr(f"{stem}.en", "\n".join(en[start : start + 100]) + "\n")
            z.writestr(f"{stem}.fr", "\n".join(fr[start : start + 100]) + "\n")
    with zipfile.ZipFile(folder / "training-giga-fren.zip", "w") as z:
        z.writestr("giga-fren.release2.fixed.en.gz", gzip.compress(("\n".join(en[400:500]) + "\n").encode()))
        z.writestr("giga-fren.release2.fixed.fr.gz", gzip.compress(("\n".join(fr[400:500]) + "\n").encode()))
    with zipfile.ZipFile(folder / "dev.zip", "w") as z:
        z.writestr("dev/newstest2013.en", "\n".join(en[500:600]) + "\n")
        z.writestr("dev/newstest2013.fr", "\n".join(fr[500:600]) + "\n")
        z.writestr("dev/newstest2014-fren-src.fr.sgm", sgm(fr[600:700], "fr", "src"))
        z.writestr("dev/newstest2014-fren-ref.en.sgm", sgm(en[600:700], "en", "ref"))
    pin(monkeypatch, folder, "wmt14-en-fr")
    run = RunDir(tmp_path / "run")
    result = nmt("prep", "wmt14-en-fr", "--run-dir", run.root, "--mirror", folder)
    assert result.code == 0, result.err
    prep = run.load_manifest()["prep"]
    assert (prep["src"], prep["tgt"]) == ("en", "fr")
    assert prep["splits"]["train"]["read"] == 500 and prep["splits"]["valid"]["read"] == 100
    assert [c["pairs"] for c in prep["splits"]["train"]["corpora"]][-1] > 0  # giga-fren read
    assert run.text("test", "en", raw=True).read_text(encoding="utf-8").splitlines() == en[600:700]
    assert run.text("test", "fr", raw=True).read_text(encoding="utf-8").splitlines() == fr[600:700]
