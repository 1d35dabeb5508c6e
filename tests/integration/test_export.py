"""A trained model on its own: the package `nmt export` writes, the files it holds and checks,
and a model named as a run, a checkpoint or a package; streaming through an open pipe."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEADLINE, one_error_line, read_line, sources_of

from nmt_cli.config import TranslateConfig
from nmt_cli.errors import NmtError
from nmt_cli.inference.models import from_dir, locate
from nmt_cli.inference.translator import Translator


def test_the_package_translates_as_the_run_did_without_unpickling(
    package, trained_longer, nmt, monkeypatch, multi30k_bpe
):
    assert sorted(p.name for p in package.iterdir()) == [
        "model.safetensors",
        "nmt.json",
        "provenance.json",
        "shortlist.txt",
        "spm.model",
    ]
    settings = json.loads((package / "nmt.json").read_text())
    assert (settings["format"], settings["src"], settings["tgt"]) == ("nmt", "en", "de")
    provenance = json.loads((package / "provenance.json").read_text())
    assert provenance["step"] == 800 and provenance["configs"]["train"]["max_steps"] == 800
    assert provenance["data"]["prep"]["splits"]["test"]["kept"] == 1000
    lines = "\n".join(sources_of(multi30k_bpe)[:40]).encode() + b"\n"
    from_the_run = nmt("translate", "--run-dir", trained_longer, stdin=lines)

    def no_pickles(*args, **kwargs):
        raise AssertionError("a package must load without torch.load")

    monkeypatch.setattr(torch, "load", no_pickles)
    from_the_package = nmt("translate", "--model", package, stdin=lines)
    assert from_the_package.code == 0, from_the_package.err
    assert from_the_package.out == from_the_run.out and from_the_run.out.count("\n") == 40


def test_translating_from_a_package_leaves_torch_compiler_unimported(package):
    """Checking a package's shapes and loading its weights draw no weights: on the meta device
    the draws' kernels import torch._dynamo, which a translation never uses and whose import
    would be most of the command's start."""
    run = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "nmt_cli",
            "translate",
            "--model",
            str(package),
            "--engine",
            "nmt",
        ],
        input=b"A dog runs.\n",
        capture_output=True,
        timeout=DEADLINE,
    )
    assert run.returncode == 0 and run.stdout.count(b"\n") == 1, run.stderr[-2000:]
    timed = [line for line in run.stderr.splitlines() if line.startswith(b"import time:")]
    imported = {line.rsplit(b"|", 1)[-1].strip() for line in timed}
    assert b"torch.nn" in imported and b"torch._dynamo" not in imported


def test_weights_that_miss_a_tensor_are_refused_not_left_undrawn(package):
    """The model is built undrawn and its weights loaded into it: a weights file without one of
    its tensors must stop the load, never leave that tensor as whatever memory it was given."""
    import dataclasses

    from nmt_cli.inference.backend_nmt import load_model

    model = from_dir(package)
    weights = model.load_weights()
    loaded = load_model(model, torch.device("cpu"), "fp32")
    assert loaded.decoder[0].ffn.inner.bias.equal(weights["decoder.0.ffn.inner.bias"])
    del weights["decoder.0.ffn.inner.bias"]
    short = dataclasses.replace(model, load_weights=lambda: weights)
    with pytest.raises(NmtError, match="does not fit its own model config"):
        load_model(short, torch.device("cpu"), "fp32")


def test_score_works_from_the_package_alone(package, multi30k_bpe, tmp_path, nmt):
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("\n".join(sources_of(multi30k_bpe)[:30]) + "\n")
    refs = (multi30k_bpe / "text" / "test.raw.de").read_text(encoding="utf-8").splitlines()
    ref.write_text("\n".join(refs[:30]) + "\n")
    result = nmt(
        "score", "--model", package, "--src", src, "--ref", ref, "--json", "--run-dir", tmp_path / "no-run"
    )
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["lines"] == 30 and report["scores"][0]["metric"] == "bleu"
    assert not (tmp_path / "no-run").exists()


def test_package_errors(package, trained_longer, tmp_path, nmt):
    assert "not empty" in one_error_line(nmt("export", package, "--run-dir", trained_longer))
    assert "is not a model" in one_error_line(nmt("translate", "--model", tmp_path, stdin=b"x\n"))
    assert "not found" in one_error_line(nmt("translate", "--model", tmp_path / "none", stdin=b"x\n"))
    broken = tmp_path / "broken"
    shutil.copytree(package, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\0" * 8)
    assert "sha256" in one_error_line(nmt("translate", "--model", broken, stdin=b"x\n"))
    assert "two models" in one_error_line(
        nmt("translate", "--model", package, "--checkpoint", "x.pt", stdin=b"x\n")
    )


def test_a_package_that_declares_another_shape_than_it_holds_is_refused_before_any_allocation(
    package, tmp_path, nmt
):
    """nmt.json's shape is checked against the weights file's header before a model is built:
    a hostile package asking for a 16,384-wide model gets one error line, not a 4 GB allocation."""
    from nmt_cli.errors import NmtError

    hostile = tmp_path / "hostile"
    shutil.copytree(package, hostile)
    settings = json.loads((hostile / "nmt.json").read_text())
    settings["model"].update(d_model=16_384, heads=1)
    (hostile / "nmt.json").write_text(json.dumps(settings))
    with pytest.raises(NmtError, match="declares a model shape that model.safetensors does not hold"):
        from_dir(hostile)
    line = one_error_line(nmt("translate", "--model", hostile, stdin=b"x\n"))
    assert "declares a model shape" in line
    settings["model"].update(d_model=-4, heads=2)
    (hostile / "nmt.json").write_text(json.dumps(settings))
    assert "model setting d_model must be an integer from 1 to" in one_error_line(
        nmt("translate", "--model", hostile, stdin=b"x\n")
    )


def test_every_kind_of_model_file_has_its_settings_bounded(package, exported, trained_longer, tmp_path, nmt):
    """A setting past its bound (max_positions that would allocate ~100 GB of sinusoids and lift
    the server's length ceiling, a million layers built one by one, zero heads, a float) is
    refused naming the file, for a package, a CTranslate2 export and a run's checkpoint alike,
    before anything is built from it."""
    checkpoint = sorted((trained_longer / "checkpoints").glob("*.pt"))[-1]
    copies = {}
    for kind, source in (("package", package), ("ct2", exported["int8"])):
        copies[kind] = (tmp_path / kind, tmp_path / kind / "nmt.json")
        shutil.copytree(source, copies[kind][0])
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    shutil.copy(checkpoint, run / checkpoint.name)
    shutil.copy(checkpoint.with_suffix(".json"), run / checkpoint.with_suffix(".json").name)
    copies["checkpoint"] = (run / checkpoint.name, run / checkpoint.with_suffix(".json").name)
    (tmp_path / "run" / "bpe").mkdir()
    shutil.copy(trained_longer / "bpe" / "spm.model", tmp_path / "run" / "bpe")
    for setting, value in (
        ("max_positions", 20_000_000),
        ("num_decoder_layers", 1_000_000),
        ("heads", 0),
        ("d_model", 64.0),
    ):
        for model, declares in copies.values():
            original = declares.read_text()
            settings = json.loads(original)
            settings["model"][setting] = value
            declares.write_text(json.dumps(settings))
            with pytest.raises(NmtError, match=f"{declares.name}: model setting {setting} must be"):
                locate(model)
            if setting == "max_positions":
                line = one_error_line(nmt("translate", "--model", model, stdin=b"x\n"))
                assert f"model setting max_positions must be an integer from 2 to 16384, not {value}" in line
            declares.write_text(original)
        assert locate(model).config.max_positions <= 16384  # the untouched copy loads


def test_a_checkpoint_record_that_declares_another_shape_is_refused_before_a_model_is_built(
    trained_longer, tmp_path, nmt
):
    """A run's checkpoint record that declares a larger model than its weights (in-range
    settings: d_model 16384, 256 heads, 16384 positions, or a vocabulary of a million) is one
    error line when the model is located, compared on the meta device, before any model of
    that shape is built (it asked for gigabytes first); a checkpoint whose "model" holds no
    tensors is one line too."""
    from nmt_cli.files import sha256_file

    checkpoint = sorted((trained_longer / "checkpoints").glob("*.pt"))[-1]
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "bpe").mkdir()
    shutil.copy(trained_longer / "bpe" / "spm.model", run / "bpe")
    pt = run / "checkpoints" / checkpoint.name
    record = pt.with_suffix(".json")
    shutil.copy(checkpoint, pt)
    shutil.copy(checkpoint.with_suffix(".json"), record)
    original = record.read_text()
    for changes in ({"d_model": 16384, "heads": 256, "max_positions": 16384}, {"vocab_size": 1_000_000}):
        settings = json.loads(original)
        settings["model"].update(changes)
        record.write_text(json.dumps(settings))
        refused = f"{record.name} declares a model shape that {pt.name} does not hold"
        with pytest.raises(NmtError, match=refused):
            locate(pt)
    line = one_error_line(nmt("translate", "--model", pt, stdin=b"x\n"))
    assert "declares a model shape that" in line
    torch.save({"model": [1, 2]}, pt)
    settings = json.loads(original)
    settings.update(sha256=sha256_file(pt), bytes=pt.stat().st_size)
    record.write_text(json.dumps(settings))
    with pytest.raises(NmtError, match=f"{pt.name} holds no model weights"):
        locate(pt)


def test_a_models_members_are_regular_files_that_match_their_sha256(package, exported, tmp_path, nmt):
    """A member planted as a link to /dev/zero or as a FIFO (an endless read) is refused before
    it is opened for reading; a changed spm.model, or a CTranslate2 export's changed model.bin,
    does not match the sha256 nmt.json records."""
    for kind, source in (("package", package), ("ct2", exported["int8"])):
        copy = tmp_path / kind
        shutil.copytree(source, copy)
        for member, plant in (("provenance.json", "link"), ("spm.model", "fifo"), ("nmt.json", "link")):
            (copy / member).unlink()
            if plant == "link":
                (copy / member).symlink_to("/dev/zero")
            else:
                os.mkfifo(copy / member)
            with pytest.raises(NmtError, match=f"{member} is not a regular file"):
                from_dir(copy)
            (copy / member).unlink()
            shutil.copy(source / member, copy / member)
        changed = bytearray((source / "spm.model").read_bytes())
        changed[-1] ^= 1
        (copy / "spm.model").write_bytes(changed)
        with pytest.raises(NmtError, match="spm.model does not match the sha256 in nmt.json"):
            from_dir(copy)
        shutil.copy(source / "spm.model", copy / "spm.model")
        assert from_dir(copy).sha256 == from_dir(source).sha256
    with open(tmp_path / "ct2" / "model.bin", "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\0" * 8)
    line = one_error_line(nmt("translate", "--model", tmp_path / "ct2", stdin=b"x\n"))
    assert "model.bin does not match the sha256 in nmt.json" in line


def test_a_damaged_package_is_one_error_line_before_anything_large_is_read(package, tmp_path, nmt):
    """A package folder of many entries (a FIFO among them past any part a scan would look at),
    a version that is not a number, provenance that is not an object, a weights file whose
    header claims a GiB (its sha256 recorded with it), and one whose header was changed (the
    sha256 is checked before the header is parsed): each one error line naming the file,
    nothing hangs, no traceback."""
    cases = {}
    crowded, hidden = tmp_path / "crowded", tmp_path / "hidden"
    for folder in (crowded, hidden):
        shutil.copytree(package, folder)
        for i in range(150):
            (folder / f"extra-{i:03d}").write_text("x")
    os.mkfifo(hidden / "zz-config.json")
    cases[crowded] = "crowded holds more than 100 entries"
    found = one_error_line(nmt("translate", "--model", hidden, stdin=b"a dog\n"))
    assert "zz-config.json is not a regular file" in found or "hidden holds more than 100 entries" in found
    for name, value, said in (
        ("version", "9", "nmt.json is damaged: its version is '9'"),
        ("version", True, "nmt.json is damaged: its version is True"),
    ):
        copy = tmp_path / f"{name}-{value}"
        shutil.copytree(package, copy)
        settings = json.loads((copy / "nmt.json").read_text())
        (copy / "nmt.json").write_text(json.dumps({**settings, name: value}))
        cases[copy] = said
    listed = tmp_path / "listed"
    shutil.copytree(package, listed)
    (listed / "provenance.json").write_text("[]")
    cases[listed] = "provenance.json holds a JSON list, not what nmt wrote there"
    header = tmp_path / "header"
    shutil.copytree(package, header)
    weights = header / "model.safetensors"
    claimed = (1 << 30).to_bytes(8, "little")  # a GiB of header promised
    weights.write_bytes(claimed + weights.read_bytes()[8:])
    settings = json.loads((header / "nmt.json").read_text())  # crafted: its sha256 recorded
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()
    (header / "nmt.json").write_text(json.dumps({**settings, "sha256": sha}))
    cases[header] = "model.safetensors is not a safetensors file nmt wrote (a header of 1073741824 bytes)"
    changed = tmp_path / "changed"  # its header still JSON of the same size, never parsed
    shutil.copytree(package, changed)
    data = (changed / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    (changed / "model.safetensors").write_bytes(data[:8] + b"{" + b" " * (size - 2) + b"}" + data[8 + size :])
    cases[changed] = "model.safetensors does not match the sha256 in nmt.json"
    for folder, said in cases.items():
        line = one_error_line(nmt("translate", "--model", folder, stdin=b"a dog\n"))
        assert said in line, line


def test_an_export_is_on_disk_before_it_appears(trained, tmp_path, monkeypatch, nmt):
    """Every file of an export is fsynced before the rename that makes it visible."""
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    renamed = []
    real_rename = Path.rename
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", lambda self, to: renamed.append(len(synced)) or real_rename(self, to))
    out = tmp_path / "pkg"
    assert nmt("export", out, "--run-dir", trained).code == 0
    before_rename = synced[: renamed[-1]]
    for name in os.listdir(out):
        assert any(path.endswith(f"/.pkg.partial/{name}") for path in before_rename), name


def test_model_names_a_run_or_a_checkpoint_too(trained, multi30k_bpe, nmt):
    lines = "\n".join(sources_of(multi30k_bpe)[:30]).encode() + b"\n"
    first = sorted((trained / "checkpoints").glob("checkpoint_*.pt"))[0]

    def translate(*model):  # with scores: two models' texts can agree (this one is barely trained)
        return nmt("translate", *model, "--scores", stdin=lines)

    by_run = translate("--run-dir", trained)  # the averaged model
    by_checkpoint = translate("--run-dir", trained, "--checkpoint", first)
    assert by_run.code == by_checkpoint.code == 0 and by_run.out != by_checkpoint.out
    assert translate("--model", trained).out == by_run.out
    assert translate("--model", first).out == by_checkpoint.out
    assert translate("--model", trained / "averaged.pt").out == by_run.out


# -- CTranslate2 -------------------------------------------------------------------------------


# -- streaming ---------------------------------------------------------------------------------


@pytest.mark.parametrize("procs", ["1", "2"])
def test_a_line_into_an_open_pipe_is_answered_before_more_input(package, procs):
    """The answer comes while stdin stays open: no waiting for 10,000 lines or EOF (also from
    worker processes)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "nmt_cli", "translate", "--model", str(package), "--procs", procs],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        alone = Translator(from_dir(package), TranslateConfig())
        for sentence in ("A man is riding a bike.", "Two dogs play in the snow."):
            proc.stdin.write(sentence.encode() + b"\n")
            proc.stdin.flush()
            assert read_line(proc.stdout, DEADLINE).decode() == alone.translate([sentence])[0] + "\n"
        proc.stdin.close()
        assert proc.wait(DEADLINE) == 0 and proc.stdout.read() == b""
    finally:
        proc.kill()


# -- nmt serve ---------------------------------------------------------------------------------
