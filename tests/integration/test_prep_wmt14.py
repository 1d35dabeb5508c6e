"""The whole wmt14-en-de code path, offline, on a miniature mirror with the real layout."""

import io
import tarfile

import pytest
import wmt14_mirror
from conftest import one_error_line

from nmt_cli.data import fetch
from nmt_cli.errors import NmtError
from nmt_cli.rundir import RunDir


def pin(monkeypatch, folder) -> None:
    wmt14_mirror.pin(monkeypatch, folder, "wmt14-en-de")


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    folder = tmp_path / "mirror"
    expected = wmt14_mirror.build(folder)
    pin(monkeypatch, folder)
    return folder, expected


def test_wmt14_recipe_end_to_end(mirror, tmp_path, nmt):
    folder, expected = mirror
    run = RunDir(tmp_path / "run")
    result = nmt("prep", "wmt14-en-de", "--run-dir", run.root, "--mirror", folder)
    assert result.code == 0, result.err
    splits = run.load_manifest()["prep"]["splits"]
    assert list(splits) == ["train", "valid", "test"]
    train = splits["train"]
    assert train["read"] == expected["train_read"]
    assert train["kept"] + sum(train["dropped"].values()) == train["read"]
    for reason, n in expected["dropped"].items():
        assert train["dropped"].get(reason, 0) >= n, (reason, train["dropped"])
    train_en = run.text("train", "en").read_text(encoding="utf-8").splitlines()
    assert len(train_en) == len(set(zip(train_en, run.text("train", "de").read_text().splitlines())))
    assert not any(line.startswith("word word") for line in train_en)
    assert splits["valid"]["kept"] == expected["valid"]
    # SGML parsed: the segments in order, across documents, exactly the released text.
    test_en, test_de = expected["test"]
    assert run.text("test", "en", raw=True).read_text(encoding="utf-8").splitlines() == test_en
    assert run.text("test", "de", raw=True).read_text(encoding="utf-8").splitlines() == test_de
    # Only the de-en members were extracted; the archives' other pairs were not.
    assert not list((run.extracted).rglob("*fr-en*"))


def test_de_en_direction(mirror, tmp_path, nmt):
    folder, _ = mirror
    run = RunDir(tmp_path / "run")
    assert (
        nmt(
            "prep", "wmt14-en-de", "--src", "de", "--tgt", "en", "--run-dir", run.root, "--mirror", folder
        ).code
        == 0
    )
    assert run.load_manifest()["prep"]["src"] == "de"
    assert run.text("test", "de").exists() and run.text("test", "en").exists()


def test_pinned_checksums_refuse_foreign_archives(tmp_path, monkeypatch, nmt):
    folder = tmp_path / "mirror"
    wmt14_mirror.build(folder)
    before = wmt14_mirror.checksums(folder)
    line = one_error_line(nmt("prep", "wmt14-en-de", "--run-dir", tmp_path / "run", "--mirror", folder))
    assert "checksum mismatch" in line and "training-parallel-europarl-v7.tgz" in line
    assert wmt14_mirror.checksums(folder) == before  # the mirror is never touched
    assert not (tmp_path / "run" / "text").exists()


def _tar_with(path, member: tarfile.TarInfo, data: bytes = b"x\n"):
    with tarfile.open(path, "w:gz") as tar:
        ok = tarfile.TarInfo("training/europarl-v7.de-en.en")
        ok.size = 2
        tar.addfile(ok, io.BytesIO(b"a\n"))
        if member.isfile():
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
        else:
            tar.addfile(member)


def _symlink(name, target):
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info


@pytest.mark.parametrize(
    "member,what",
    [
        (tarfile.TarInfo("../evil.txt"), "climbs out"),
        (tarfile.TarInfo("training/../../evil.txt"), "climbs out"),
        (tarfile.TarInfo("/tmp/evil.txt"), "absolute"),
        (_symlink("training/link", "../../outside"), "pointing outside"),
        (_symlink("training/link", "/etc/passwd"), "pointing outside"),
    ],
)
def test_hostile_archive_members_are_refused(tmp_path, member, what):
    archive = tmp_path / "training-parallel-europarl-v7.tgz"
    _tar_with(archive, member)
    dest = tmp_path / "out" / "x"
    with pytest.raises(NmtError, match=what):
        fetch.extract(archive, ["training/europarl-v7.de-en.en"], dest)
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "out" / "evil.txt").exists()
    assert not (dest / "training" / "europarl-v7.de-en.en").exists()  # nothing kept


def test_hostile_archive_is_refused_through_prep(mirror, tmp_path, monkeypatch, nmt):
    folder, _ = mirror
    _tar_with(folder / "training-parallel-europarl-v7.tgz", tarfile.TarInfo("../evil.txt"))
    pin(monkeypatch, folder)
    line = one_error_line(nmt("prep", "wmt14-en-de", "--run-dir", tmp_path / "run", "--mirror", folder))
    assert "refusing" in line and "'../evil.txt'" in line
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "run" / "evil.txt").exists()


def test_truncated_archive_is_a_clear_error(mirror, tmp_path, monkeypatch, nmt):
    folder, _ = mirror
    archive = folder / "training-parallel-commoncrawl.tgz"
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    pin(monkeypatch, folder)  # as if pinned so
    line = one_error_line(nmt("prep", "wmt14-en-de", "--run-dir", tmp_path / "run", "--mirror", folder))
    assert "training-parallel-commoncrawl.tgz is truncated or corrupt" in line


def test_missing_mirror_file(mirror, tmp_path, nmt):
    folder, _ = mirror
    (folder / "dev.tgz").unlink()
    line = one_error_line(nmt("prep", "wmt14-en-de", "--run-dir", tmp_path / "run", "--mirror", folder))
    assert "dev.tgz not found in mirror" in line
