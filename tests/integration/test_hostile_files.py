"""Small files that would become gigabytes, and files that are not what they claim: each refused
in one line before anything is allocated from what it declares (a fresh interpreter measures
the peak memory of the attempt)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import DEADLINE, one_error_line
from marian import make_marian

from nmt_cli.engine import adapters, checkpoint
from nmt_cli.errors import NmtError
from nmt_cli.rundir import RunDir

MOST = 300 << 20  # bytes an attempt may add to the process's peak


def peak_of(code: str) -> tuple[str, int]:
    """What `code` raised (NmtError's message, or "no error") and how many bytes its run added
    to the peak memory of a fresh interpreter that had imported torch and nmt's readers."""
    script = textwrap.dedent(
        """
        import resource, sys, torch
        import nmt_cli.hf.read, nmt_cli.inference.models
        from nmt_cli.errors import NmtError
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
        {}
            said = "no error"
        except NmtError as e:
            said = str(e)
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(said.replace("\\n", " "))
        print(grew * 1024)
        """
    ).format(textwrap.indent(textwrap.dedent(code), "    "))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=DEADLINE)
    assert run.returncode == 0, run.stderr[-2000:]
    said, grew = run.stdout.strip().rsplit("\n", 1)
    return said, int(grew)


def deflated_bomb(path: Path, declared: int = 512 << 20) -> Path:
    """A PyTorch-shaped zip of about 1 MB whose data.pkl, deflated, declares `declared` bytes of
    zeros (torch.save stores its members; a reader that inflates this one holds them all)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr(zipfile.ZipInfo("archive/version"), "3\n")
        with z.open("archive/data.pkl", "w", force_zip64=True) as member:
            zeros = bytes(1 << 20)
            for _ in range(declared >> 20):
                member.write(zeros)
    return path


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    return deflated_bomb(tmp_path_factory.mktemp("bomb") / "bomb.pt")


@pytest.fixture(scope="module")
def marian(tmp_path_factory, multi30k_dir):
    pytest.importorskip("transformers")  # the test extra installs it: a real failure there
    return make_marian(tmp_path_factory.mktemp("hf") / "opus-mt-en-de", multi30k_dir)


def test_a_deflated_checkpoint_that_declares_gigabytes_is_refused_before_it_is_inflated(
    bomb, trained, tmp_path
):
    """A run's checkpoint whose record carries the bomb's own sha256 and size: refused from the
    zip's directory, before torch.load inflates anything."""
    assert bomb.stat().st_size < 2 << 20
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    path = checkpoint.path_for(RunDir(run).checkpoints, 99)
    shutil.copy(bomb, path)
    record = json.loads(path.with_name("checkpoint_00000040.json").read_text())
    record.update(file=path.name, sha256=checkpoint.sha256_file(path), bytes=path.stat().st_size)
    path.with_suffix(".json").write_text(json.dumps(record))
    said, grew = peak_of(f"nmt_cli.inference.models.locate({str(path)!r})")
    assert "holds a compressed member" in said and grew < MOST, (said, grew)


def test_a_deflated_pytorch_model_bin_is_refused_by_the_import(bomb, marian, tmp_path):
    folder = tmp_path / "opus-mt-en-de"
    shutil.copytree(marian, folder)
    (folder / "model.safetensors").unlink()
    shutil.copy(bomb, folder / "pytorch_model.bin")
    said, grew = peak_of(f"nmt_cli.hf.read.read_marian(__import__('pathlib').Path({str(folder)!r}))")
    assert "holds a compressed member" in said and grew < MOST, (said, grew)


def test_a_stored_zip_that_holds_more_than_its_model_needs_is_refused(trained, tmp_path):
    """Stored, not compressed, but more bytes than the declared model's weights, their average
    and Adam's moments could be: refused by the sizes in the zip's directory."""
    record = json.loads((trained / "checkpoints" / "checkpoint_00000040.json").read_text())
    most = checkpoint.most_bytes(record["model"])
    path = tmp_path / "checkpoint_00000001.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        with z.open("archive/data/0", "w", force_zip64=True) as member:
            chunk = bytes(1 << 20)
            for _ in range((most >> 20) + 1):
                member.write(chunk)
    with open(path, "rb") as f, pytest.raises(NmtError, match="more than the .* MiB the model"):
        checkpoint.check_torch_zip(f, path, most)
    path.unlink()


def test_a_vocabulary_far_larger_than_its_embedding_table_is_refused_before_the_gather(marian, tmp_path):
    """vocab.json of 300,000 pieces over an embedding table 8 KB wide (2 x 1024): gathering a
    row for each piece would make 1.2 GB; the table's width and rows are checked first."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "opus-mt-en-de"
    shutil.copytree(marian, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(decoder_start_token_id=1, pad_token_id=1, eos_token_id=0)
    (folder / "config.json").write_text(json.dumps(config))
    weights = {k: v for k, v in load_file(folder / "model.safetensors").items() if "embed" not in k}
    weights = {k: v for k, v in weights.items() if k not in ("model.shared.weight", "lm_head.weight")}
    weights["model.shared.weight"] = torch.zeros(2, 1024)
    weights["final_logits_bias"] = torch.zeros(1, 2)
    save_file(weights, folder / "model.safetensors")
    vocab = {"</s>": 0, "<unk>": 1, **{f"piece{i}": i % 2 for i in range(300_000)}}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    said, grew = peak_of(f"nmt_cli.hf.read.read_marian(__import__('pathlib').Path({str(folder)!r}))")
    assert "an embedding table is (2, 1024)" in said and grew < MOST, (said, grew)


def test_adapters_whose_product_would_be_gigabytes_are_refused_before_it():
    """A (30000, 1) B and a (1, 30000) A over a 4 x 4 weight: 3.6 GB if multiplied first."""
    base = {"decoder.0.ffn.inner.weight": torch.zeros(4, 4)}
    held = {
        "decoder.0.ffn.inner.lora_a": torch.zeros(1, 30000),
        "decoder.0.ffn.inner.lora_b": torch.zeros(30000, 1),
    }
    with pytest.raises(ValueError, match=r"adapters are \(30000, 1\) x \(1, 30000\)"):
        adapters.merged(base, held)
    wide = {"decoder.0.ffn.inner.lora_a": torch.zeros(8, 4), "decoder.0.ffn.inner.lora_b": torch.zeros(4, 8)}
    with pytest.raises(ValueError, match="not of a rank at most 4"):
        adapters.merged(base, wide)
    fitting = {"decoder.0.ffn.inner.lora_a": torch.ones(2, 4), "decoder.0.ffn.inner.lora_b": torch.ones(4, 2)}
    assert adapters.merged(base, fitting)["decoder.0.ffn.inner.weight"].equal(torch.full((4, 4), 2.0))


def test_adapters_that_name_their_own_checkpoint_as_their_base_are_one_short_error(trained, tmp_path, nmt):
    """An adapted checkpoint whose record names itself as its base: one level is merged, so the
    base must be a plain model; one short line, not a chain read again at every level."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    path = checkpoint.path_for(RunDir(run).checkpoints, 99)
    record = json.loads(path.with_name("checkpoint_00000040.json").read_text())
    meta = {k: record[k] for k in ("model", "src", "tgt")}
    meta["adapters"] = {"rank": 1, "base": str(path), "base_sha256": "0" * 64}
    held = {
        "decoder.0.ffn.inner.lora_a": torch.zeros(1, 16),
        "decoder.0.ffn.inner.lora_b": torch.zeros(32, 1),
    }
    checkpoint.save_tensors(path, {"model": held}, meta)
    line = one_error_line(nmt("translate", "--run-dir", run, "--checkpoint", path, stdin=b"a dog\n"))
    assert "the base of adapters must be a plain model" in line and len(line) < 600, line


def test_a_shortlist_row_wider_than_any_nmt_builds_is_refused(tmp_path):
    """One source piece with 20,000 candidates: each of the 8,000 source pieces would get a row
    that wide (1.3 GB)."""
    from nmt_cli.inference import shortlist

    source, target = [f"s{i}" for i in range(8000)], [f"t{i}" for i in range(8000)]
    path = tmp_path / shortlist.NAME
    path.write_text("\tt4\ns9\t" + " ".join(["t5"] * 20_000) + "\n")
    with pytest.raises(
        NmtError, match=f"lists 20000 candidates for one source piece, more than {shortlist.MAX_ROW}"
    ):
        shortlist.load(path, source, target)
    path.write_text("\tt4\ns9\t" + " ".join(["t5"] * shortlist.MAX_ROW) + "\n")
    assert shortlist.load(path, source, target).candidates.shape == (8000, shortlist.MAX_ROW)


def test_a_packages_shortlist_is_hashed_in_its_settings_and_checked(package, tmp_path, nmt):
    from nmt_cli.inference import shortlist

    settings = json.loads((package / "nmt.json").read_text())
    assert settings[shortlist.SHA_KEY] == checkpoint.sha256_file(package / shortlist.NAME)
    changed = tmp_path / "package"
    shutil.copytree(package, changed)
    with open(changed / shortlist.NAME, "a") as f:
        f.write("▁dog\t▁Hund\n")
    line = one_error_line(nmt("translate", "--model", changed, "--shortlist", stdin=b"a dog\n"))
    assert "shortlist.txt does not match the sha256 in nmt.json" in line
    del settings[shortlist.SHA_KEY]  # an export from before the record: its shortlist is not read
    (changed / "nmt.json").write_text(json.dumps(settings))
    line = one_error_line(nmt("translate", "--model", changed, "--shortlist", stdin=b"a dog\n"))
    assert "not recorded in its nmt.json" in line


def test_an_export_ships_only_what_it_parsed_never_a_linked_or_private_file(trained, tmp_path, nmt):
    """A run whose shortlist links to a private file: the export is refused in one line and
    leaves nothing. A private sentencepiece model is shipped no more readable than it was, and
    the shortlist that ships is what was parsed, written anew."""
    from nmt_cli.inference import shortlist

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    secret = tmp_path / "secret"
    secret.write_text("\troot:x:0:0\n")
    os.chmod(secret, 0o600)
    listed = RunDir(run).spm_folder / shortlist.NAME
    kept = listed.read_text()
    listed.unlink()
    listed.symlink_to(secret)
    line = one_error_line(nmt("export", "--run-dir", run, tmp_path / "out"))
    assert "shortlist.txt is a symbolic link" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    listed.unlink()
    listed.write_text(kept + kept.splitlines()[1] + "\n")  # a line twice: parsed, not copied
    spm = RunDir(run).spm_folder / "spm.model"
    os.chmod(spm, 0o600)
    assert nmt("export", "--run-dir", run, tmp_path / "out").code == 0
    assert (tmp_path / "out" / "spm.model").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "out" / shortlist.NAME).read_text() == kept
    os.chmod(spm, 0o644)
    spm.rename(spm.with_suffix(".kept"))
    spm.symlink_to(spm.with_suffix(".kept"))
    line = one_error_line(nmt("export", "--run-dir", run, tmp_path / "again"))
    assert "spm.model is a symbolic link" in line and not (tmp_path / "again").exists()


def test_an_export_into_a_link_is_refused_and_leaves_nothing_half_written(trained, tmp_path, nmt):
    (tmp_path / "empty").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "empty")
    line = one_error_line(nmt("export", "--run-dir", trained, tmp_path / "out"))
    assert "out is a symbolic link" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]
    assert not any((tmp_path / "empty").iterdir())


@pytest.mark.parametrize("planted", ["/dev/zero", "fifo"])
def test_a_runs_sentencepiece_model_that_is_a_device_or_a_fifo_is_one_error_line(trained, tmp_path, planted):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    spm = RunDir(run).spm_folder / "spm.model"
    spm.unlink()
    if planted == "fifo":
        os.mkfifo(spm)
    else:
        spm.symlink_to(planted)
    done = subprocess.run(
        [sys.executable, "-m", "nmt_cli", "translate", "--run-dir", str(run)],
        input=b"a dog\n",
        capture_output=True,
        timeout=DEADLINE,
    )
    err = done.stderr.decode()
    assert done.returncode == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "spm.model is a symbolic link" in err or "spm.model is not a regular file" in err


def test_odd_types_in_a_runs_files_are_one_error_line_not_an_internal_error(trained, tmp_path, nmt):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    manifest = json.loads((run / "manifest.json").read_text())
    for change, said in (
        ({"prep": "x"}, "'prep' is not a record of a step"),
        ({"prep": {**manifest["prep"], "src": [1]}}, "prep's src is [1], not a language code"),
        ({"prep": {**manifest["prep"], "splits": 5}}, "prep's splits are not records of splits"),
    ):
        (run / "manifest.json").write_text(json.dumps({**manifest, **change}))
        line = one_error_line(nmt("translate", "--run-dir", run, stdin=b"a dog\n"))
        assert said in line and "internal error" not in line, line
    (run / "manifest.json").write_text(json.dumps(manifest))
    record = json.loads((run / "averaged.json").read_text())
    (run / "averaged.json").write_text(json.dumps({**record, "src": ["en"]}))
    line = one_error_line(nmt("translate", "--run-dir", run, stdin=b"a dog\n"))
    assert "its src is ['en'], not a language code" in line


def test_an_escape_sequence_in_what_a_user_gave_is_not_sent_to_the_terminal(nmt):
    line = one_error_line(nmt("translate", "--model", "\x1b]0;owned\x07\x1b[31mred", stdin=b"x\n"))
    assert "\x1b" not in line and "\x07" not in line and "\\x1b]0;owned\\x07\\x1b[31mred" in line
