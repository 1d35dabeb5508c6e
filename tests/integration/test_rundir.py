import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from nmt_cli import files
from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_open, atomic_write_text, file_stats
from nmt_cli.rundir import RunDir


def test_atomic_write_keeps_old_content_on_failure(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write_text(path, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_open(path) as f:
            f.write("half of the new")
            raise RuntimeError("disk trouble")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]  # no temp file left behind


def test_written_files_get_the_umasks_permissions_not_mkstemps(tmp_path):
    mask = os.umask(0)
    os.umask(mask)
    atomic_write_text(tmp_path / "a.txt", "x")
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o666 & ~mask != 0o600


def test_manifest_records_sha256_and_lines(tmp_path):
    run = RunDir(tmp_path)
    out = tmp_path / "text" / "x"
    atomic_write_text(out, "a\nb\n")
    run.record("prep", [out], note=1)
    entry = json.loads(run.manifest_path.read_text())["prep"]
    import hashlib

    assert entry["files"]["text/x"] == {
        "bytes": 4,
        "sha256": hashlib.sha256(b"a\nb\n").hexdigest(),
        "lines": 2,
    }
    assert entry["note"] == 1
    assert file_stats(out)["lines"] == 2


def test_second_writer_is_refused(tmp_path):
    run = RunDir(tmp_path)
    with run.lock("train"):
        with pytest.raises(NmtError, match="in use by `nmt train`"):
            with RunDir(tmp_path).lock("bpe"):
                pass
    with run.lock("bpe"):  # released: free again
        pass


def test_stale_lock_of_a_killed_process_is_taken_over(tmp_path, capfd):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom nmt_cli.rundir import RunDir\n"
            f"with RunDir({str(tmp_path)!r}).lock('train'):\n    print('held', flush=True)\n"
            "    time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(NmtError, match=f"pid {holder.pid}"):
        with RunDir(tmp_path).lock("bpe"):
            pass
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    capfd.readouterr()
    with RunDir(tmp_path).lock("bpe"):
        err = capfd.readouterr().err
        assert "taking over" in err and str(holder.pid) in err
    with RunDir(tmp_path).lock("bpe"):  # released cleanly: no warning this time
        assert "taking over" not in capfd.readouterr().err
    time.sleep(0)


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_a_runs_logs_and_lock_are_never_written_through_a_link_or_into_a_fifo(tmp_path, planted):
    """.lock, log.txt and metrics.jsonl planted as a link to a file outside the run (which
    would be overwritten or grown) or as a FIFO (which would block): one error, nothing written
    elsewhere."""
    from nmt_cli import ui

    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    for path, use in (
        (run.lock_path, lambda: run.lock("train").__enter__()),
        (run.log, lambda: ui.log_to(run.log, "train")),
        (run.metrics, lambda: run.add_metric({"kind": "train", "step": 1})),
    ):
        if planted == "link":
            path.symlink_to(victim)
        else:
            os.mkfifo(path)
        with pytest.raises(NmtError, match="symbolic link|not a regular file"):
            use()
        path.unlink()
    ui.log_to(None)
    assert victim.read_text() == "untouched\n"
    run.add_metric({"kind": "train", "step": 1})  # a regular file is written as before
    assert run.metric_records() == [{"kind": "train", "step": 1}]


@pytest.mark.parametrize("planted", ["link to /dev/zero", "fifo"])
def test_what_nmt_reads_from_a_run_directory_is_a_regular_file_or_one_error(trained, tmp_path, planted):
    """A checkpoint, its record, the manifest, metrics.jsonl and the sentencepiece model an
    export copies, each planted as a link to /dev/zero (read or copied for ever) or as a FIFO
    (a read that waits for ever): one error naming the file, at once, and no half-written
    export left behind. A record that is JSON but not an object, and a checkpoint holding a
    list, are one error too."""
    import torch

    from nmt_cli.engine import checkpoint
    from nmt_cli.inference.models import locate
    from nmt_cli.inference.packages import export_nmt

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    run = RunDir(run_dir)
    newest = checkpoint.listed(run.checkpoints)[-1]
    uses = {
        newest: lambda: checkpoint.load_tensors(newest),
        newest.with_suffix(".json"): lambda: checkpoint.load_tensors(newest),
        run.manifest_path: run.load_manifest,
        run.metrics: run.metric_records,
        run_dir / "bpe" / "spm.model": lambda: export_nmt(locate(run_dir), tmp_path / "out"),
    }

    def endless(signum, frame):
        raise TimeoutError("still reading after 20 s")

    signal.signal(signal.SIGALRM, endless)
    for path, use in uses.items():
        kept = path.with_name(path.name + ".kept")
        path.rename(kept)
        if planted == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to("/dev/zero")
        signal.alarm(20)  # a read for ever fails the test, not hangs the suite
        try:
            with pytest.raises(NmtError, match=f"{path.name} (is not a regular file|is a symbolic link)"):
                use()
        finally:
            signal.alarm(0)
        path.unlink()
        kept.rename(path)
    assert not list(tmp_path.glob(".out*")) and not (tmp_path / "out").exists()
    kept = newest.with_name("elsewhere.pt")  # a link to a regular file is read as that file
    newest.rename(kept)
    newest.symlink_to(kept.name)
    assert checkpoint.load_tensors(newest)[1]["sha256"] == files.sha256_file(kept)
    newest.unlink()
    kept.rename(newest)
    record = newest.with_suffix(".json")
    meta = json.loads(record.read_text())
    record.write_text("[]")
    with pytest.raises(NmtError, match=f"{record.name} holds a JSON list, not what nmt wrote there"):
        checkpoint.load_tensors(newest)
    torch.save([1, 2], newest)
    sha256, size = files.sha256_file(newest), newest.stat().st_size
    record.write_text(json.dumps({**meta, "sha256": sha256, "bytes": size}))
    with pytest.raises(NmtError, match=f"{newest.name} holds a list, not a checkpoint's tensors"):
        checkpoint.load_tensors(newest)


def test_the_settings_nmt_reads_back_are_regular_files_or_one_error(trained, tmp_path, nmt):
    """A resume reads the run's train.json, `--config` its file: a FIFO there (a read that waits
    for ever) or a link to /dev/zero (one that never ends) is one error line naming the file."""
    from conftest import one_error_line

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    saved = RunDir(run_dir).config_path("train")
    saved.unlink()
    os.mkfifo(saved)
    line = one_error_line(nmt("train", "--run-dir", run_dir, "--max-steps", "41"))
    assert "train.json is not a regular file" in line, line
    settings = tmp_path / "settings.yaml"
    settings.symlink_to("/dev/zero")
    line = one_error_line(nmt("translate", "--model", run_dir, "--config", settings, stdin=b"a dog\n"))
    assert "--config" in line and "settings.yaml is not a regular file" in line, line
