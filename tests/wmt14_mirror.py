"""A miniature WMT14 mirror: the real archive names and inner layout, a few hundred real lines
(Multi30k's validation pairs: the tests need no more data than Multi30k, which they fetch where
it is missing)."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from pathlib import Path

from conftest import multi30k_folder

# Lines that cleaning must drop from the training data, and why.
DIRTY = [
    ("", "Leere Quelle", "empty"),
    (" ".join(["word"] * 260), " ".join(["Wort"] * 260), "too long"),
    ("One two three four five six seven eight nine ten.", "Eins.", "length ratio"),
]


def real_lines(n: int, start: int = 0) -> tuple[list[str], list[str]]:
    """`n` real English-German pairs (at most 1,014)."""
    folder = multi30k_folder()
    en = gzip.open(folder / "val.en.gz", "rt", encoding="utf-8").read().splitlines()
    de = gzip.open(folder / "val.de.gz", "rt", encoding="utf-8").read().splitlines()
    return en[start : start + n], de[start : start + n]


def _add(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode("utf-8")
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tgz(path: Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            _add(tar, name, text)


def sgm(lines: list[str], lang: str, kind: str) -> str:
    out = [f'<{kind}set setid="newstest2014" srclang="any" trglang="{lang}">']
    for d in range(0, len(lines), 7):  # documents of 7 segments, ids restart per document
        out.append(f'<doc sysid="ref" docid="doc{d}" genreid="news" origlang="en">')
        for i, line in enumerate(lines[d : d + 7], 1):
            out.append(f'<seg id="{i}">{line}</seg>')
        out.append("</doc>")
    out.append(f"</{kind}set>")
    return "\n".join(out) + "\n"


def build(folder: Path) -> dict:
    """Write the mirror into `folder`; returns what the tests expect of it."""
    folder.mkdir(parents=True, exist_ok=True)
    en, de = real_lines(900)
    europarl = (en[:300], de[:300])
    # 10 exact duplicates of pairs well inside the length-ratio limit (so they are kept once).
    balanced = [i for i in range(300, 600) if 0.8 < len(en[i].split()) / max(1, len(de[i].split())) < 1.25][
        :10
    ]
    crawl = (
        en[300:600] + [d[0] for d in DIRTY] + [en[i] for i in balanced],
        de[300:600] + [d[1] for d in DIRTY] + [de[i] for i in balanced],
    )
    news = (en[600:700], de[600:700])
    write_tgz(
        folder / "training-parallel-europarl-v7.tgz",
        {
            "training/europarl-v7.de-en.en": "\n".join(europarl[0]) + "\n",
            "training/europarl-v7.de-en.de": "\n".join(europarl[1]) + "\n",
            "training/europarl-v7.fr-en.fr": "Ce fichier ne sert pas.\n",
        },
    )
    write_tgz(
        folder / "training-parallel-commoncrawl.tgz",
        {
            "commoncrawl.de-en.en": "\n".join(crawl[0]) + "\n",
            "commoncrawl.de-en.de": "\n".join(crawl[1]),  # no final newline
        },
    )
    write_tgz(
        folder / "training-parallel-nc-v9.tgz",
        {
            "training/news-commentary-v9.de-en.en": "\n".join(news[0]) + "\n",
            "training/news-commentary-v9.de-en.de": "\n".join(news[1]) + "\n",
        },
    )
    test_en, test_de = en[800:900], de[800:900]
    write_tgz(
        folder / "dev.tgz",
        {
            "dev/newstest2013.en": "\n".join(en[700:800]) + "\n",
            "dev/newstest2013.de": "\n".join(de[700:800]) + "\n",
            "dev/newstest2014-deen-src.en.sgm": sgm(test_en, "en", "src"),
            "dev/newstest2014-deen-ref.de.sgm": sgm(test_de, "de", "ref"),
        },
    )
    return {
        "train_read": 300 + len(crawl[0]) + 100,
        "dropped": {"empty": 1, "too long": 1, "length ratio": 1, "duplicate": 10},
        "valid": 100,
        "test": (test_en, test_de),
    }


def checksums(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def pin(monkeypatch, folder: Path, name: str) -> None:
    """The recipe `name` with its checksums those of the miniature archives in `folder` (the
    mirrors of tests/integration/test_prep_wmt14.py and tests/integration/test_prep_recipes.py)."""
    import dataclasses

    from nmt_cli.data import recipes

    sums = checksums(folder)

    def repin(part):
        source = dataclasses.replace(part.source, sha256=sums[part.source.name], size=None)
        return dataclasses.replace(part, source=source)

    known = recipes.RECIPES[name]
    corpora = {
        split: [{lang: repin(p) for lang, p in corpus.items()} for corpus in corpora]
        for split, corpora in known.corpora.items()
    }
    monkeypatch.setitem(recipes.RECIPES, name, dataclasses.replace(known, corpora=corpora))
