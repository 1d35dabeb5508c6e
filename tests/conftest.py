"""Shared test helpers: the real data beside the checkout, and running the real CLI in-process."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

# The suite behaves the same on every machine: GPUs stay hidden (from this process and every
# command it starts) unless NMT_TEST_GPU=1 asks for them, as tests/integration/test_gpu.py's command does.
# Set before torch first looks for a device.
if os.environ.get("NMT_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

ROOT = Path(__file__).resolve().parents[1]


def machine_lines() -> list[str]:
    """The machine, as every log of the suite names it: the CPU's kind, as torch's kernels see it
    (a forced ATEN_CPU_CAPABILITY too), the threads, and what `--precision auto` picks for
    training (held to fp32 where the kernels are held below bf16)."""
    import torch

    from nmt_cli.engine.device import cpu_has_bf16

    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    kind = next(
        (k for k, f in (("amx", "amx_bf16"), ("bf16", "avx512_bf16"), ("avx512", "avx512f")) if f in flags),
        "avx2",
    )
    facts = dict(line.split(":", 1) for line in flags.splitlines()[:30] if ":" in line)
    facts = {k.strip(): v.strip() for k, v in facts.items()}
    name, family, number = (facts.get(k, "?") for k in ("model name", "cpu family", "model"))
    model = f"{name}, family {family} model {number}"
    forced = {
        v: os.environ[v]
        for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "CT2_FORCE_CPU_ISA")
        if v in os.environ
    }
    return [
        f"cpu: {model} ({kind}); torch kernels: {torch.backends.cpu.get_cpu_capability()}"
        + (f" (forced: {forced})" if forced else ""),
        f"threads: {torch.get_num_threads()}; --precision auto trains in "
        f"{'bf16' if cpu_has_bf16() else 'fp32'} (the fixtures in fp32 on every CPU)",
    ]


def pytest_sessionstart(session) -> None:
    """Name the machine at the top of every log, `-q` too (which hides the report header)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in machine_lines():
            reporter.write_line(line)


@pytest.fixture(autouse=True)
def as_found():
    """Each test leaves torch's thread count and the environment as it found them: what a later
    test trains or decodes must not depend on the order of the tests."""
    import torch

    threads, env = torch.get_num_threads(), dict(os.environ)
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)


def _data_root() -> Path:
    """Where the tests' data is: $NMT_SHARED_DATA; else ../shared/data beside the checkout, where
    it holds Multi30k; else a cache ($NMT_TEST_DATA, default ~/.cache/nmt/test-data) that
    multi30k_folder() fills once."""
    if os.environ.get("NMT_SHARED_DATA"):
        return Path(os.environ["NMT_SHARED_DATA"])
    beside = ROOT.parent / "shared" / "data"
    if (beside / "multi30k" / "train.en.gz").is_file():
        return beside
    if os.environ.get("NMT_TEST_DATA"):
        return Path(os.environ["NMT_TEST_DATA"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nmt" / "test-data"


SHARED_DATA = _data_root()
MULTI30K = SHARED_DATA / "multi30k"
# A mirror of the pinned files for the tests' own data only: the tests of downloading must meet
# the URLs they give, whatever the environment says (so it leaves the environment here).
DATA_MIRROR_URL = os.environ.pop("NMT_MIRROR_URL", "")


@functools.cache
def multi30k_folder() -> Path:
    """MULTI30K, holding the Multi30k recipe's files, each with its pinned sha256: fetched the
    first time through nmt's own download (nmt_cli.data.fetch: resumable, checked; $NMT_MIRROR_URL
    for a mirror of them) where they are missing."""
    from nmt_cli.data import fetch, recipes
    from nmt_cli.errors import NmtError

    for (_, name), sides in (*recipes.MULTI30K_FILES.items(), *recipes.MULTI30K_MORE_FILES.items()):
        for lang, (sha256, size) in sides.items():
            source = fetch.Source(f"{recipes.MULTI30K_BASE}{name}.{lang}.gz", sha256, size)
            try:
                with pytest.MonkeyPatch.context() as env:
                    if DATA_MIRROR_URL:
                        env.setenv(fetch.MIRROR_URL, DATA_MIRROR_URL)
                    fetch.fetch(source, MULTI30K)
            except NmtError as e:
                pytest.fail(
                    f"the tests' Multi30k copy could not be had in {MULTI30K}: {e} (set NMT_SHARED_DATA "
                    "to a folder holding multi30k/, or NMT_MIRROR_URL to a mirror of the files)"
                )
    return MULTI30K


@dataclass
class Result:
    code: int
    out: str
    err: str


def nmt_command(*args) -> list[str]:
    """`nmt ARGS...` as the command line of a process of its own."""
    return [sys.executable, "-m", "nmt_cli", *map(str, args)]


# Copying a trained run with this leaves its data and model settings, not its training.
UNTRAINED = shutil.ignore_patterns("checkpoints", "metrics.jsonl", "log.txt")


@pytest.fixture
def nmt(capfd, monkeypatch):
    """Run `nmt ARGS...` through the real entry point; returns exit code, stdout and stderr."""
    import io
    import sys

    from nmt_cli.cli import main

    def run(*args: str, stdin: bytes = b"") -> Result:
        fake = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
        monkeypatch.setattr(sys, "stdin", fake)
        capfd.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capfd.readouterr()
        return Result(code, out, err)

    return run


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a launcher's workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def env_of(pid: int, name: str) -> str | None:
    """The environment variable `name` of process `pid`, or None."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next(
        (item.split(b"=", 1)[1].decode() for item in env if item.startswith(name.encode() + b"=")), None
    )


def rank_of(pid: int) -> int | None:
    """The RANK a launcher gave process `pid`, or None for a process that is no worker."""
    rank = env_of(pid, "RANK")
    return None if rank is None else int(rank)


def one_error_line(result: Result) -> str:
    """The single line an error must print; fails on tracebacks or multi-line output."""
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert result.code != 0, result
    assert "Traceback" not in result.err, result.err
    errors = [line for line in lines if line.startswith("nmt: error:")]
    assert len(errors) == 1, result.err
    return errors[0]


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    return multi30k_folder()


def run_ok(*commands: list) -> None:
    """Run each `nmt` command line through the real entry point; each must succeed."""
    from nmt_cli.cli import main

    for args in commands:
        with pytest.raises(SystemExit) as done:
            main([str(a) for a in args])
        assert done.value.code == 0, args


def prepared_multi30k(run_dir: Path, vocab_size: int) -> Path:
    run_ok(
        ["prep", "multi30k-en-de", "--run-dir", run_dir, "--mirror", MULTI30K],
        ["bpe", "--run-dir", run_dir, "--vocab-size", vocab_size],
    )
    return run_dir


def prepared_pairs(run_dir: Path, pairs: tuple[str, ...], vocab_size: int) -> Path:
    """A run of several Multi30k directions (`nmt prep multi30k --pair ...`), binarized."""
    run_ok(
        [
            "prep",
            "multi30k",
            "--run-dir",
            run_dir,
            "--mirror",
            MULTI30K,
            *(a for p in pairs for a in ("--pair", p)),
        ],
        ["bpe", "--run-dir", run_dir, "--vocab-size", vocab_size],
    )
    return run_dir


@pytest.fixture(scope="session")
def multi30k_bpe(tmp_path_factory, multi30k_dir) -> Path:
    """A run directory with Multi30k prepared and binarized (vocabulary 1000); copy before use."""
    return prepared_multi30k(tmp_path_factory.mktemp("m30k-bpe"), 1000)


def multi30k_slices(multi30k_dir: Path, folder: Path) -> dict[tuple[str, str], Path]:
    """Two training corpora and a validation set cut from Multi30k, as plain files in `folder`:
    (key, lang) -> path, key "a" (training pairs 0-2,999), "b" (3,000-4,999), "v" (validation
    0-299)."""
    import gzip

    files = {}
    for key, (name, start, stop) in {
        "a": ("train", 0, 3000),
        "b": ("train", 3000, 5000),
        "v": ("val", 0, 300),
    }.items():
        for lang in ("en", "de"):
            with gzip.open(multi30k_dir / f"{name}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()[start:stop]
            files[key, lang] = folder / f"{key}.{lang}"
            files[key, lang].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return files


def tagged_corpora(files: dict, weight: float) -> list:
    """`nmt prep custom`'s options for multi30k_slices' training corpora: "a" as it is, "b"
    tagged '<bt>' and of sampling weight `weight`."""
    plain = ["--train-src", files["a", "en"], "--train-tgt", files["a", "de"], "--tag", "", "--weight", 1]
    return [
        *plain,
        "--train-src",
        files["b", "en"],
        "--train-tgt",
        files["b", "de"],
        "--tag",
        "<bt>",
        "--weight",
        weight,
    ]


@pytest.fixture(scope="session")
def tagged_bpe(tmp_path_factory, multi30k_dir) -> Path:
    """Tagged back-translation's layout on real Multi30k lines: a clean corpus (3,000 pairs) and
    one tagged '<bt>' of weight 2 (2,000 pairs), validation 300 pairs, binarized (vocabulary
    1000); copy before use."""
    root = tmp_path_factory.mktemp("tagged")
    files = multi30k_slices(multi30k_dir, root)
    run_dir = root / "run"
    valid = ["--valid-src", files["v", "en"], "--valid-tgt", files["v", "de"]]
    run_ok(
        ["prep", "custom", "--run-dir", run_dir, *tagged_corpora(files, 2), *valid],
        ["bpe", "--run-dir", run_dir, "--vocab-size", 1000],
    )
    return run_dir


@pytest.fixture
def run_copy(multi30k_bpe, tmp_path) -> Path:
    """A fresh copy of the prepared Multi30k run directory."""
    dest = tmp_path / "run"
    shutil.copytree(multi30k_bpe, dest)
    return dest


# A model small enough that a training step takes milliseconds. In fp32 on every CPU: `auto`
# trains in bf16 where the CPU has bf16 arithmetic, which would make the fixtures a different
# model on each kind of CPU (a test about precision names its own after these).
TINY = [
    "--precision",
    "fp32",
    "--size",
    "tiny",
    "--d-model",
    "16",
    "--ffn",
    "32",
    "--heads",
    "2",
    "--num-encoder-layers",
    "1",
    "--num-decoder-layers",
    "1",
    "--max-tokens",
    "256",
]


# trained_longer's model: wider, for tests that need a model that has learned something.
LONGER = [*TINY, "--d-model", "64", "--ffn", "128", "--max-tokens", "512"]


def train_command(run_dir, steps, *extra) -> list[str]:
    """Train TINY for `steps`, a checkpoint at every one: for the resume tests."""
    return nmt_command(
        "train", "--run-dir", run_dir, *TINY, "--max-steps", steps, "--save-every", 1,
        "--eval-every", 5, "--seed", 3, *extra,
    )  # fmt: skip


def final_weights(run_dir) -> tuple[dict, dict]:
    """The tensors and record of the run's last checkpoint."""
    from nmt_cli.engine import checkpoint

    return checkpoint.load_tensors(checkpoint.listed(Path(run_dir) / "checkpoints")[-1])


def tiny_trainer(run_dir, **options):
    """A Trainer of a TINY-shaped model on a run directory's data, in this process."""
    from nmt_cli import train as train_mod
    from nmt_cli.config import TrainConfig
    from nmt_cli.engine import state
    from nmt_cli.rundir import RunDir

    options = {"precision": "fp32", **options}  # as TINY: the same model on every CPU
    config = TrainConfig(
        size="tiny", d_model=16, ffn=32, heads=2, num_encoder_layers=1, num_decoder_layers=1,
        max_tokens=256, device="cpu", **options,
    )  # fmt: skip
    return train_mod.build_trainer(config, RunDir(run_dir), state.Quiet())


@pytest.fixture(scope="session")
def trained(tmp_path_factory, multi30k_bpe) -> Path:
    """A tiny model trained briefly on Multi30k, with its checkpoints averaged; copy before writing."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    shutil.copytree(multi30k_bpe, run_dir)
    run_ok(
        [
            "train",
            "--run-dir",
            run_dir,
            *TINY,
            "--max-steps",
            "40",
            "--save-every",
            "20",
            "--eval-every",
            "100",
            "--warmup",
            "10",
            "--lr-scale",
            "4",
        ],
        ["average", "--run-dir", run_dir, "--last", "2"],
    )
    return run_dir


@pytest.fixture(scope="session")
def trained_longer(tmp_path_factory, multi30k_bpe):
    """A small model after 800 updates (15 s): most sentences end by themselves now."""
    run_dir = tmp_path_factory.mktemp("trained-longer") / "run"
    shutil.copytree(multi30k_bpe, run_dir)
    run_ok(
        [
            "train",
            "--run-dir",
            run_dir,
            *TINY,
            "--d-model",
            "64",
            "--ffn",
            "128",
            "--max-tokens",
            "512",
            "--max-steps",
            "800",
            "--save-every",
            "800",
            "--eval-every",
            "10000",
            "--warmup",
            "100",
            "--lr-scale",
            "2",
            "--dropout",
            "0.1",
        ]
    )
    return run_dir


@contextlib.contextmanager
def host_reads():
    """Count what would make the host wait for a GPU, on any device: reading a tensor's values
    (item, float, bool, tolist, cpu) and shapes that depend on values (nonzero, as in
    boolean-mask indexing). Yields a dict whose "n" grows with each. Not counted, so not to be
    used for reading in nmt: numpy() (it refuses GPU tensors) and to("cpu") (on a CPU machine
    it cannot be told from a copy to the device)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"n": 0}
    reads = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in reads:
                counts["n"] += 1
            return func(*args, **(kwargs or {}))

    patched = {}
    for name in ("tolist", "cpu"):  # these read without an aten call on a CPU tensor
        real = getattr(torch.Tensor, name)

        def counting(self, *args, _real=real, **kwargs):
            counts["n"] += 1
            return _real(self, *args, **kwargs)

        patched[name] = real
        setattr(torch.Tensor, name, counting)
    try:
        with Mode():
            yield counts
    finally:
        for name, real in patched.items():
            setattr(torch.Tensor, name, real)


def count_decoding_steps(model) -> dict:
    """Wrap `model.decode` so that the returned dict's "n" counts its calls (one per step)."""
    steps = {"n": 0}
    decode = model.decode

    def counting(*args, **kwargs):
        steps["n"] += 1
        return decode(*args, **kwargs)

    model.decode = counting
    return steps


# -- a trained model exported, for the tests of packages, CTranslate2 and the server -------------

DEADLINE = 60  # seconds: every wait on another process ends


def sources_of(multi30k_bpe) -> list[str]:
    return (multi30k_bpe / "text" / "test.raw.en").read_text(encoding="utf-8").splitlines()


def read_line(stream, deadline: float) -> bytes:
    import select

    ready, _, _ = select.select([stream], [], [], deadline)
    assert ready, f"no answer within {deadline} s"
    return stream.readline()


@pytest.fixture(scope="session")
def package(trained_longer, tmp_path_factory) -> Path:
    """The model exported, then its run directory out of reach: the package stands alone."""
    run = tmp_path_factory.mktemp("pkg") / "run"
    shutil.copytree(trained_longer, run)
    out = run.parent / "package"
    run_ok(["export", out, "--run-dir", run])
    shutil.rmtree(run)
    return out


@pytest.fixture(scope="session")
def exported(package, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for quantization in ("float32", "int8"):
        where = tmp_path_factory.mktemp("ct2") / quantization
        run_ok(
            ["export", where, "--format", "ctranslate2", "--quantization", quantization, "--model", package]
        )
        out[quantization] = where
    return out


# -- processes stopped on purpose ----------------------------------------------------------------


def hooked_env(folder: Path, code: str) -> dict[str, str]:
    """The environment of a process that runs `code` at its start (a sitecustomize module in
    `folder`): to plant a fault or a stand-in in a launcher's workers."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(code)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}


def signal_at_step(proc, run_dir: Path, step: int, signum: int, seconds: float = 180) -> str:
    """Send `signum` to a training process once its metrics log `step`; its stderr once it ends."""
    import signal as _signal
    import time

    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + seconds
    while not (metrics.exists() and f'"step": {step},' in metrics.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, f"no step {step} in {seconds} s"
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err, err
    assert _signal.Signals(signum).name in err, err
    return err


def stopped_step(err: str, signum: int) -> int:
    """The step of the one line that says the run stopped by `signum` and saved."""
    import signal as _signal

    name = _signal.Signals(signum).name
    stopped = [line for line in err.splitlines() if line.startswith(f"stopped by {name} at step")]
    assert len(stopped) == 1 and "run the same `nmt train` command again to resume" in stopped[0], err
    return int(stopped[0].split(" at step ")[1].split(";")[0])


class Server:
    """`nmt serve` on `model` in a process of its own, on a port the system chose."""

    def __init__(self, model: Path, *options: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nmt_cli", "serve", "--model", str(model), "--port", "0", *options],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        line = read_line(self.proc.stderr, DEADLINE).decode()
        found = re.search(r"http://([\d.]+):(\d+)", line)
        assert found, line
        self.host, self.port = found.group(1), int(found.group(2))
        self.url = f"http://{self.host}:{self.port}"

    def post(self, body: bytes | dict, path: str = "/translate", **headers: str) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **headers}
        request = urllib.request.Request(self.url + path, data=data, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=DEADLINE) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

    def sent(self, body: dict):
        """`body` posted on a connection of its own whose answer is left unread: a client that
        leaves closes it."""
        import socket

        data = json.dumps(body).encode()
        connection = socket.create_connection((self.host, self.port), timeout=DEADLINE)
        connection.sendall(
            b"POST /translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        return connection

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=DEADLINE) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(DEADLINE)
        finally:
            self.proc.kill()
