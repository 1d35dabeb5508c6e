"""Using a trained model: the package, the CTranslate2 export, streaming, and `nmt serve`."""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import one_error_line

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.engine.hypothesis import max_lengths
from nmt_cli.errors import NmtError, Stopped
from nmt_cli.models import from_dir, locate
from nmt_cli.translate import Translator

DEADLINE = 60  # seconds: every wait on another process ends


def sources_of(multi30k_bpe) -> list[str]:
    return (multi30k_bpe / "text" / "test.raw.en").read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def package(trained_longer, tmp_path_factory) -> Path:
    """The model exported, then its run directory out of reach: the package stands alone."""
    run = tmp_path_factory.mktemp("pkg") / "run"
    shutil.copytree(trained_longer, run)
    out = run.parent / "package"
    subprocess.run(
        [sys.executable, "-m", "nmt_cli", "export", str(out), "--run-dir", str(run)],
        check=True,
        capture_output=True,
        timeout=DEADLINE,
    )
    shutil.rmtree(run)
    return out


def test_the_package_translates_as_the_run_did_without_unpickling(
    package, trained_longer, nmt, monkeypatch, multi30k_bpe
):
    assert sorted(p.name for p in package.iterdir()) == [
        "model.safetensors",
        "nmt.json",
        "provenance.json",
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


@pytest.fixture(scope="module")
def exported(package, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for quantization in ("float32", "int8"):
        where = tmp_path_factory.mktemp("ct2") / quantization
        subprocess.run(
            [
                sys.executable,
                "-m",
                "nmt_cli",
                "export",
                str(where),
                "--format",
                "ctranslate2",
                "--quantization",
                quantization,
                "--model",
                str(package),
            ],
            check=True,
            capture_output=True,
            timeout=DEADLINE,
        )
        out[quantization] = where
    return out


def test_the_ctranslate2_export_translates_as_nmt_does(package, exported, multi30k_bpe):
    """The same hypotheses with the same scores as nmt's own search (beam 4 and greedy, 1-best
    and n-best) wherever the search ends by itself. At a length limit the two differ: nmt ends
    every hypothesis there with an EOS, CTranslate2 cuts it (docs/guide.md)."""
    lines = sources_of(multi30k_bpe)[:300]
    for beam, nbest in ((4, 4), (1, 1)):
        ours = Translator(from_dir(package), TranslateConfig(decode=DecodeOptions(beam=beam, nbest=nbest)))
        theirs = Translator(
            from_dir(exported["float32"]), TranslateConfig(decode=DecodeOptions(beam=beam, nbest=nbest))
        )
        assert theirs.engine == "ctranslate2"
        a, b = ours.hypotheses(lines), theirs.hypotheses(lines)
        limits = max_lengths([len(x) for x in ours.encode(lines)], 1.0, 50, 1023)
        ended = [i for i in range(len(lines)) if all(len(h.tokens) < limits[i] - 1 for h in a[i])]
        assert len(ended) >= 250, len(ended)  # in one batch, sentences end at many steps
        assert sum(a[i][0].tokens == b[i][0].tokens for i in ended) >= 0.99 * len(ended)
        pairs = [(h, g) for i in ended for h, g in zip(a[i], b[i])]
        assert len(pairs) == nbest * len(ended)
        assert sum(h.tokens == g.tokens and abs(h.score - g.score) < 1e-3 for h, g in pairs) >= 0.97 * len(
            pairs
        )


def test_ctranslate2_keeps_nmts_line_guarantees(exported, nmt):
    stream = b"".join(
        [
            b"A man is riding a bike.\n",
            b"\n",
            b"   \t \n",
            " ".join(["word"] * 1500).encode() + b"\n",
            b"caf\xe9 \xff\xfe broken bytes\n",
            b"Two dogs play.\r\n",
            b"nul\x00inside\n",
            b"A woman sings.",
        ]
    )
    for where in exported.values():
        result = nmt("translate", "--model", where, "--max-len-b", "6", stdin=stream)
        assert result.code == 0, result.err
        lines = result.out.split("\n")
        assert len(lines) - 1 == 8 and lines[1] == lines[2] == ""
        assert all(lines[i] for i in (0, 3, 4, 5, 6, 7))
        assert "truncated" in result.err and "not UTF-8" in result.err


def test_a_ctranslate2_export_translates_without_torch(exported):
    """Importing torch is most of the start-up of a small model (docs/benchmarks.md)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "nmt_cli", "translate", "--model", exported["int8"]],
        input=b"A man is riding a bike.\n",
        capture_output=True,
        timeout=DEADLINE,
    )
    assert done.returncode == 0 and done.stdout.count(b"\n") == 1, done.stderr[-2000:]
    imported = {line.rsplit(b"|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert b"ctranslate2" in imported and b"torch" not in imported


def test_int8_stays_close_to_float32(package, exported, multi30k_bpe, tmp_path):
    """int8 loses a small part of the chrF (against the references) that an export with one
    weight matrix's rows out of place loses. Not lines equal to float32's, which a weak model's
    near-ties make depend on the CPU's kernels (AVX2 against AVX-512); and not the float32 model's
    score of the outputs, which a broken export's short, generic lines can raise."""
    import dataclasses

    from nmt_cli import export, metrics

    lines = sources_of(multi30k_bpe)[:200]
    refs = (multi30k_bpe / "text" / "test.raw.de").read_text(encoding="utf-8").splitlines()[:200]
    fp32 = Translator(from_dir(exported["float32"]), TranslateConfig()).translate(lines)
    int8 = Translator(from_dir(exported["int8"]), TranslateConfig()).translate(lines)
    on_the_fly = Translator(from_dir(package), TranslateConfig(int8=True)).translate(lines)
    assert on_the_fly == int8

    weights = from_dir(package).load_weights()
    name = "decoder.0.ffn.inner.weight"
    weights[name] = weights[name].roll(1, dims=0)  # one matrix's rows out of place
    broken_model = dataclasses.replace(from_dir(package), load_weights=lambda: weights)
    export.export_ct2(broken_model, tmp_path / "broken", "int8")
    broken = Translator(from_dir(tmp_path / "broken"), TranslateConfig()).translate(lines)

    best, quantized, wrong = (metrics.score(out, refs, ["chrf"])[0].score for out in (fp32, int8, broken))
    assert best - wrong > 5, (best, wrong)  # the control: a wrong weight is seen
    assert best - quantized < 0.25 * (best - wrong), (best, quantized, wrong)


def test_engine_errors(package, exported, tmp_path, nmt):
    assert "--engine ctranslate2" in one_error_line(
        nmt("translate", "--model", exported["int8"], "--engine", "nmt", stdin=b"x\n")
    )
    assert "unknown --engine" in one_error_line(
        nmt("translate", "--model", exported["int8"], "--engine", "x", stdin=b"x\n")
    )
    assert "unknown --quantization" in one_error_line(
        nmt("export", tmp_path / "x", "--format", "ctranslate2", "--quantization", "int3", "--model", package)
    )
    assert "already a CTranslate2 export" in one_error_line(
        nmt("export", tmp_path / "y", "--format", "ctranslate2", "--model", exported["int8"])
    )
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# -- streaming ---------------------------------------------------------------------------------


def read_line(stream, deadline: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], deadline)
    assert ready, f"no answer within {deadline} s"
    return stream.readline()


def test_a_line_into_an_open_pipe_is_answered_before_more_input(package):
    """The answer comes while stdin stays open: no waiting for 10,000 lines or EOF."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "nmt_cli", "translate", "--model", str(package)],
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


def _until_closed(sock) -> bytes:
    """What a socket receives until the server closes the connection."""
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    return answer


class Server:
    def __init__(self, model: Path, *options: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nmt_cli", "serve", "--model", str(model), "--port", "0", *options],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        line = read_line(self.proc.stderr, DEADLINE).decode()
        found = re.search(r"http://[\d.]+:(\d+)", line)
        assert found, line
        self.url = f"http://127.0.0.1:{found.group(1)}"

    def post(self, body: bytes | dict, path: str = "/translate", **headers: str) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **headers}
        request = urllib.request.Request(self.url + path, data=data, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=DEADLINE) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

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


def test_the_service_answers_concurrent_requests_in_order(package, multi30k_bpe):
    sources = sources_of(multi30k_bpe)[:60]
    expected = Translator(from_dir(package), TranslateConfig()).translate(sources)
    server = Server(package, "--max-wait-ms", "20")
    try:
        assert server.get("/health") == (
            200,
            {"status": "ok", "engine": "nmt", "queued": 0, "given_up": 0},  # no path: the operator's
        )
        answers: dict[int, tuple] = {}

        def client(i: int) -> None:  # requests of 1 to 6 sentences, 12 at once
            part = list(range(i * 5, i * 5 + 1 + i % 6))
            status, body, _ = server.post({"text": [sources[j] for j in part]})
            answers[i] = (status, body, part)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE)
        assert len(answers) == 10
        for status, body, part in answers.values():
            assert status == 200 and body["translations"] == [expected[j] for j in part]
        status, body, _ = server.post({"text": [sources[0], ""], "beam": 4, "nbest": 2})
        assert status == 200 and len(body["translations"][0]) == 2
        assert body["translations"][0][0]["text"] == expected[0]
        assert body["translations"][1] == [{"text": "", "score": 0.0}] * 2
        capped = Translator(from_dir(package), TranslateConfig(decode=DecodeOptions(max_len=4)))
        assert server.post({"text": sources[:4], "max_len": 4})[:2] == (
            200,
            {"translations": capped.translate(sources[:4])},
        )
        status, body, _ = server.post({"text": sources[:2], "scores": True})
        assert status == 200 and [t["text"] for t in body["translations"]] == expected[:2]
        assert all(isinstance(t["score"], float) and t["score"] < 0 for t in body["translations"])
        status, body, _ = server.post({"text": sources[:2], "alignments": True})
        assert status == 200 and [t["text"] for t in body["translations"]] == expected[:2]
        assert all(re.fullmatch(r"\d+-\d+( \d+-\d+)*", t["alignment"]) for t in body["translations"])
        phrases = [["Hund"], [], ["roten Ball", "Wiese"]]
        status, body, _ = server.post({"text": sources[:3], "constraints": phrases})
        assert status == 200 and body["translations"][1] == expected[1]
        assert all(p in t for t, ps in zip(body["translations"], phrases) for p in ps), body
        # Draws depend on the request alone, not on the requests decoded in the same batch.
        sampled = TranslateConfig(decode=DecodeOptions(sample=True, seed=4, nbest=2))
        drawn = Translator(from_dir(package), sampled)
        request = {"text": sources[:4], "sample": True, "seed": 4, "nbest": 2}
        alone = drawn.texts(drawn.hypotheses(sources[:4], keys=[0, 1, 2, 3]))
        together: list = []
        clients = [threading.Thread(target=lambda: together.append(server.post(request))) for _ in range(3)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(DEADLINE)
        assert len(together) == 3
        for status, body, _ in together:
            assert status == 200 and [[h["text"] for h in t] for t in body["translations"]] == alone
    finally:
        assert server.stop() == 0


def test_the_service_refuses_bad_requests_and_keeps_serving(package):
    server = Server(package, "--max-queue", "4", "--max-output-len", "64")
    try:
        refused = [
            (b"{not json", 400),
            (b'{"text": "one string"}', 400),
            (b'{"text": [1, 2]}', 400),
            (b'{"text": []}', 400),
            (b"[]", 400),
            (b'{"text": ["a"], "beam": 0}', 400),
            (b'{"text": ["a"], "beam": 2, "nbest": 3}', 400),
            (b'{"txt": ["a"]}', 400),
            (b'{"text": ["\xff\xfe"]}', 400),
            (json.dumps({"text": [" ".join(["word"] * 10_000)]}).encode(), 400),
            (json.dumps({"text": ["x" * 100] * 300}).encode(), 413),
            (json.dumps({"text": ["y" * 1000] * 2000}).encode(), 413),  # 2 MB body
            (json.dumps({"text": ["a"] * 100, "beam": 32}).encode(), 413),  # 3200 hypotheses
            (json.dumps({"text": ["a"] * 5}).encode(), 503),  # past --max-queue 4
            # Numbers past every option's range, NaN and infinities (Python's json reads them all)
            (b'{"text": ["a"], "alpha": Infinity}', 400),
            (b'{"text": ["a"], "alpha": NaN}', 400),
            (b'{"text": ["a"], "alpha": 1e308}', 400),
            (b'{"text": ["a"], "max_len_a": 1e400}', 400),
            (b'{"text": ["a"], "max_len_b": 1' + b"0" * 399 + b"}", 400),
            (b'{"text": ["a"], "max_len_b": 1000000000}', 400),
            (b'{"text": ["a"], "max_len": 65}', 400),  # past --max-output-len 64
            (b'{"text": ["a"], "sample": true, "seed": -5}', 400),
            (b'{"text": ["a"], "sample": true, "topk": 1' + b"0" * 50 + b"}", 400),
            (b'{"text": ["a"], "sample": true, "temperature": 1e-300}', 400),
            (b'{"text": ["a"], "sample": true, "temperature": Infinity}', 400),
        ]
        for body, status in refused:
            got, answer, headers = server.post(body)
            assert (got, set(answer)) == (status, {"error"}), (body[:40], got, answer)
            if status == 503:
                assert headers.get("Retry-After") == "1"
        # Thousands of nested brackets (the JSON parser recursed until RecursionError: 500 and
        # a traceback), and a compressed body, which is never decompressed.
        nested = b'{"text": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        assert server.post(nested)[:2] == (400, {"error": "the body is JSON nested too deeply"})
        import gzip

        bomb = gzip.compress(json.dumps({"text": ["a" * 1000] * 200}).encode())
        got, answer, _ = server.post(bomb, **{"Content-Encoding": "gzip"})
        assert got == 415 and "compressed" in answer["error"]
        assert server.get("/nowhere")[0] == 404 and server.get("/translate")[0] == 405
        # What a page in the operator's browser could send to 127.0.0.1: another Content-Type
        # (no CORS preflight), or our address under a name of its own (DNS rebinding).
        for headers, status in (
            ({"Content-Type": "text/plain"}, 415),
            ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
            ({"Host": "attacker.example:8080"}, 403),
        ):
            got, answer, _ = server.post({"text": ["a"]}, **headers)
            assert (got, set(answer)) == (status, {"error"}), headers
        # What aiohttp's HTTP parser refuses before any handler: JSON too, one line on stderr.
        import socket

        port = int(server.url.rsplit(":", 1)[1])
        for raw in (b"GARBAGE\r\n\r\n", b"POST /translate HTTP/1.1\r\nno colon\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
                s.sendall(raw)
                answer = _until_closed(s)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 400") and b"application/json" in head, answer
            assert set(json.loads(body)) == {"error"}
        assert server.post({"text": ["A dog runs."]})[0] == 200  # still serving
    finally:
        assert server.stop() == 0
    assert b"Traceback" not in server.proc.stderr.read()


def test_an_api_key_guards_translate_but_not_health(package):
    server = Server(package, env={"NMT_API_KEY": "s3cret"})
    try:
        assert server.post({"text": ["A dog runs."]})[:2] == (401, {"error": "a valid API key is required"})
        assert server.post({"text": ["A dog runs."]}, Authorization="Bearer wrong")[0] == 401
        assert server.post({"text": ["A dog runs."]}, Authorization="Bearer s3cret")[0] == 200
        assert server.get("/health")[0] == 200
    finally:
        assert server.stop() == 0
    assert b"s3cret" not in server.proc.stderr.read()


def test_a_request_whose_client_leaves_is_dropped_from_the_queue(package, multi30k_bpe):
    """A client that disconnects while its request waits behind another frees its place: its
    sentences leave the queue at once instead of being decoded for nobody."""
    import socket

    sources = sources_of(multi30k_bpe)[:500]
    server = Server(package, "--max-queue", "1000", "--max-sentences", "500")
    answer: list = []
    try:
        first = threading.Thread(target=lambda: answer.append(server.post({"text": sources})))
        first.start()
        deadline = time.monotonic() + DEADLINE
        while server.get("/health")[1]["queued"] < 500:  # the first request is being decoded
            assert time.monotonic() < deadline and not answer
            time.sleep(0.005)
        body = json.dumps({"text": sources[:300]}).encode()
        port = int(server.url.rsplit(":", 1)[1])
        leaving = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
        leaving.sendall(
            b"POST /translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        seen = []
        while not seen or seen[-1] != 800:  # queued behind the first
            assert time.monotonic() < deadline and not answer, seen
            seen.append(server.get("/health")[1]["queued"])
        leaving.close()
        while seen[-1] == 800:
            assert time.monotonic() < deadline
            seen.append(server.get("/health")[1]["queued"])
        # Its 300 sentences left while the first request was still being decoded.
        assert seen[-1] == 500 and not answer, seen
        first.join(DEADLINE)
        assert answer[0][0] == 200 and len(answer[0][1]["translations"]) == 500
        assert server.get("/health")[1]["queued"] == 0
    finally:
        assert server.stop() == 0


def test_the_batch_of_a_client_that_leaves_stops_decoding(package, multi30k_bpe):
    """The most expensive request allowed (2,048 hypotheses at beam 8), its client gone while
    its first batch decodes: that batch is given up between two steps, its other pieces never
    start, and the next client is served."""
    import socket

    sources = sources_of(multi30k_bpe)[:256]
    server = Server(package)
    try:
        body = json.dumps({"text": sources, "beam": 8, "max_len_a": 3.0}).encode()
        port = int(server.url.rsplit(":", 1)[1])
        leaving = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
        leaving.sendall(
            b"POST /translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + DEADLINE
        while server.get("/health")[1]["queued"] < 256:  # its first batch is being decoded
            assert time.monotonic() < deadline
            time.sleep(0.005)
        leaving.close()
        while (health := server.get("/health")[1])["given_up"] < 1:
            assert time.monotonic() < deadline, health
            time.sleep(0.005)
        assert health["queued"] == 0  # the batch given up, the rest never decoded
        assert server.post({"text": sources[:2]})[0] == 200
    finally:
        assert server.stop() == 0


def test_a_body_that_does_not_arrive_gets_408_and_its_connection_closed(package):
    """--read-timeout: a client whose Content-Length promises more than it sends does not hold
    its connection for ever."""
    import socket

    server = Server(package, "--read-timeout", "1")
    try:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as stalling:
            stalling.sendall(
                b"POST /translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"text": ["'
            )
            answer = _until_closed(stalling)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert "did not arrive within 1 s" in json.loads(body)["error"]
        assert server.post({"text": ["A dog runs."]})[0] == 200  # still serving
    finally:
        assert server.stop() == 0


def test_connections_without_a_whole_request_are_closed_and_their_number_capped(package):
    """--header-timeout and --max-connections (slowloris): connections that send half a request
    head, and go on sending bits of it, get a 408 and are closed once the timeout passes; past the cap a new
    connection gets a JSON 503 and is closed; then the service answers as before."""
    import socket

    server = Server(package, "--header-timeout", "1", "--max-connections", "6")
    port = int(server.url.rsplit(":", 1)[1])
    stalled = []
    try:
        for _ in range(6):
            stalled.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            stalled[-1].sendall(b"POST /translate HTTP/1.1\r\nHost: localhost\r\n")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            answer = _until_closed(extra)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert json.loads(body) == {"error": "too many connections: retry shortly"}
        start = time.monotonic()
        time.sleep(0.5)
        for s in stalled:  # data arriving does not count as a request
            s.sendall(b"X-Slow: 1\r\n")
        for s in stalled:  # a 408, then closed by the server
            answer = _until_closed(s)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer
            assert json.loads(body) == {"error": "the request's head did not arrive within 1 s"}
        assert time.monotonic() - start < 4
        assert server.get("/health")[0] == 200
        assert server.post({"text": ["A dog runs."]})[0] == 200
    finally:
        for s in stalled:
            s.close()
        assert server.stop() == 0


class StandIn:
    """Stands in for the translator in the server: fails on any batch holding "boom", waits for
    `release` on any holding "slow" (or gives up when nobody waits for it) or "stubborn", and
    upper-cases the rest; records each batch."""

    config, engine, tags = TranslateConfig(), "stand-in", ()

    def __init__(self):
        self.batches: list = []
        self.stopped: list = []  # the batches given up midway
        self.release = threading.Event()

    def hypotheses(self, sentences, options, keys=None, prefixes=None, constraints=None, stop=None):
        self.batches.append(list(sentences))
        if "slow" in sentences:  # held, and given up as nmt's engine does between its steps
            deadline = time.monotonic() + DEADLINE
            while not self.release.wait(0.01) and time.monotonic() < deadline:
                if stop is not None and stop():
                    self.stopped.append(list(sentences))
                    raise Stopped("nobody waits for this search any more")
        if "stubborn" in sentences:  # held whatever happens, as a CTranslate2 batch is
            self.release.wait(DEADLINE)
        if "boom" in sentences:
            raise ValueError("the decoder failed")
        return [[s] for s in sentences]

    def texts(self, hyps):
        return [[h[0].upper()] for h in hyps]


def _in_process(decoder: StandIn, scenario, on_loop_end=None, **config):
    """Run `scenario(post, get)` against the app over `decoder` on a local port; its result."""
    import asyncio
    from types import SimpleNamespace

    from aiohttp import ClientSession
    from aiohttp.test_utils import TestServer

    from nmt_cli.config import ServeConfig
    from nmt_cli.serve import make_app

    app = make_app(decoder, SimpleNamespace(where="stand-in"), ServeConfig(**config), on_loop_end=on_loop_end)

    async def run():
        async with TestServer(app) as server, ClientSession() as session:

            async def post(text):  # the sentences, or the whole request
                body = text if isinstance(text, dict) else {"text": text}
                async with session.post(server.make_url("/translate"), json=body) as r:
                    return r.status, await r.json()

            async def get(path):
                async with session.get(server.make_url(path)) as r:
                    return r.status, await r.json()

            return await scenario(post, get)

    return asyncio.run(run())


def test_a_failing_request_fails_alone_and_health_sees_the_decoding_loop():
    """A batch the decoder fails on is decoded again request by request: only the request that
    fails gets the error, which names nothing of the server's. Once the decoding loop has
    stopped, /health answers 503, a request 503 at once, and the server is told (it exits)."""
    import asyncio

    async def scenario(post, get):
        good, bad = await asyncio.gather(post(["a", "b"]), post(["boom"]))
        alive = await get("/health")
        next(t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Batcher.run").cancel()
        await asyncio.sleep(0)
        return good, bad, alive, await get("/health"), await post(["late"])

    decoder, ended = StandIn(), []
    good, bad, alive, dead, late = _in_process(decoder, scenario, on_loop_end=ended.append, max_wait_ms=200)
    assert decoder.batches[0] == ["a", "b", "boom"]  # one batch, which failed
    assert good == (200, {"translations": ["A", "B"]})
    assert bad == (500, {"error": "decoding this request failed; the server's log says why"})
    assert (alive[0], alive[1]["status"]) == (200, "ok")
    assert (dead[0], dead[1]["status"]) == (503, "the decoding loop has stopped")
    assert late == (503, {"error": "the decoding loop has stopped"})
    assert len(ended) == 1 and ended[0].cancelled()


def test_a_batch_that_fails_after_its_client_left_does_not_stop_the_decoding_loop():
    """A one-request batch that fails after its request got its 504 (the answer's future is
    cancelled) is nobody's error: the loop goes on serving."""
    import asyncio

    decoder, ended = StandIn(), []

    async def scenario(post, get):
        gone = await post(["stubborn", "boom"])  # held past its deadline, then failing
        decoder.release.set()
        while (await get("/health"))[1]["queued"]:
            await asyncio.sleep(0.01)
        return gone, await get("/health"), await post(["after"])

    gone, health, after = _in_process(
        decoder, scenario, on_loop_end=ended.append, request_timeout=0.5, max_wait_ms=0
    )
    assert gone[0] == 504
    assert (health[0], health[1]["status"]) == (200, "ok")
    assert after == (200, {"translations": ["AFTER"]})
    assert not ended


def test_the_server_exits_when_its_decoding_loop_stops(package, monkeypatch):
    """No zombie: a server whose decoding loop has ended (here a fault planted in it) stops
    and says why, instead of answering every request 503 for ever."""
    from nmt_cli import serve
    from nmt_cli.batcher import Batcher
    from nmt_cli.config import ServeConfig

    async def broken(self):
        raise RuntimeError("a fault in the loop")

    monkeypatch.setattr(Batcher, "run", broken)
    lingering = threading.Timer(DEADLINE, os.kill, (os.getpid(), signal.SIGTERM))  # a zombie: stopped
    lingering.start()
    try:
        with pytest.raises(NmtError, match=r"loop stopped \(RuntimeError: a fault in the loop\)"):
            serve.run(from_dir(package), TranslateConfig(), ServeConfig(port=0))
    finally:
        lingering.cancel()


@pytest.mark.parametrize("timeouts", [{"write_timeout": 1.0}, {"header_timeout": 1.0}])
def test_a_client_that_never_reads_its_answers_loses_its_connection(timeouts):
    """A client that pipelines requests with large answers and reads none fills the socket's
    buffers: its connection is aborted after --write-timeout (writing paused that long) or, once
    no request is in progress, after --header-timeout (an answer still unread); closing it would
    wait for the answer to drain, for ever, holding its slot."""
    import asyncio
    import socket
    from types import SimpleNamespace

    from nmt_cli.config import ServeConfig
    from nmt_cli.connections import Connections
    from nmt_cli.serve import listen, make_app

    config = ServeConfig(port=0, max_wait_ms=0, **{"write_timeout": 60.0, "header_timeout": 60.0, **timeouts})

    async def run():
        connections = Connections(10, config.header_timeout, config.write_timeout)
        app = make_app(StandIn(), SimpleNamespace(where="stand-in"), config, connections)
        runner, server = await listen(app, connections, config)
        watch = asyncio.ensure_future(connections.watch())
        loop = asyncio.get_running_loop()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        await loop.sock_connect(client, server.sockets[0].getsockname()[:2])
        body = json.dumps({"text": ["x" * 1999] * 256}).encode()  # 512 KB each way
        request = b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        request += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)

        async def send() -> None:
            try:
                for _ in range(8):
                    await loop.sock_sendall(client, request)
            except OSError:  # aborted
                pass

        sender = asyncio.ensure_future(send())
        while not connections.open:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        while connections.open and time.monotonic() - started < DEADLINE / 4:
            await asyncio.sleep(0.1)
        held = len(connections.open)
        sender.cancel()
        watch.cancel()
        client.close()
        server.close()
        await runner.cleanup()
        return held

    assert asyncio.run(run()) == 0


def test_a_request_past_its_deadline_gets_504_and_leaves_the_queue():
    """--request-timeout: a request not answered in time gets 504; one still queued then is
    never decoded, and the service goes on."""
    import asyncio

    decoder = StandIn()

    async def scenario(post, get):
        slow = asyncio.ensure_future(post(["stubborn"]))  # holds the decoder until released
        while not decoder.batches:
            await asyncio.sleep(0.01)
        queued = await post(["queued"])  # waits behind it, past its deadline
        waiting = await get("/health")
        decoder.release.set()
        return await slow, queued, waiting, await post(["after"])

    slow, queued, waiting, after = _in_process(decoder, scenario, request_timeout=0.5, max_wait_ms=0)
    assert slow[0] == queued[0] == 504 and "--request-timeout" in queued[1]["error"]
    assert waiting[1]["queued"] == 1  # the stubborn one, still being decoded; "queued" has left
    assert after == (200, {"translations": ["AFTER"]})
    assert ["queued"] not in decoder.batches


def test_a_batch_nobody_waits_for_is_given_up_between_steps():
    """A batch whose every request has left (504 here) stops decoding at its next step instead
    of running to its end for nobody; the decoder is free for the next request at once."""
    import asyncio

    decoder = StandIn()

    async def scenario(post, get):
        gone = await post(["slow", "held"])
        while (await get("/health"))[1]["given_up"] < 1:
            await asyncio.sleep(0.01)
        return gone, await post(["after"])

    gone, after = _in_process(decoder, scenario, request_timeout=0.5, max_wait_ms=0)
    assert gone[0] == 504 and after == (200, {"translations": ["AFTER"]})
    assert decoder.stopped == [["slow", "held"]] and not decoder.release.is_set()


def test_a_short_request_waits_for_one_batch_behind_a_large_one():
    """A large request is decoded in pieces, and the request served least goes first: short
    requests that arrive while a 12-sentence one is being decoded are in the very next batches
    (one at another beam, which cannot share a batch, in a batch of its own), and every request
    gets its answers whole and in order."""
    import asyncio

    decoder = StandIn()
    large = ["slow"] + [f"s{i}" for i in range(11)]

    async def scenario(post, get):
        first = asyncio.ensure_future(post(large))
        while not decoder.batches:  # its first piece holds the decoder
            await asyncio.sleep(0.01)
        short = asyncio.ensure_future(post(["short"]))
        while (await get("/health"))[1]["queued"] < 13:
            await asyncio.sleep(0.01)
        other = asyncio.ensure_future(post({"text": ["other"], "beam": 8}))
        while (await get("/health"))[1]["queued"] < 14:
            await asyncio.sleep(0.01)
        decoder.release.set()
        answered = await first, await short, await other
        return (*answered, await post({"text": ["w1", "w2", "w3"], "beam": 16}))

    first, short, other, wide = _in_process(decoder, scenario, max_batch=4, max_wait_ms=0)
    # 4 sentences at the default beam 4 per batch; at beam 16, one.
    assert decoder.batches[:5] == [large[:4], ["short", *large[4:7]], ["other"], large[7:11], large[11:]]
    assert decoder.batches[5:] == [["w1"], ["w2"], ["w3"]]
    assert first == (200, {"translations": [s.upper() for s in large]})
    assert short == (200, {"translations": ["SHORT"]}) and other == (200, {"translations": ["OTHER"]})
    assert wide == (200, {"translations": ["W1", "W2", "W3"]})


def test_requests_nobody_waits_for_are_not_decoded_again():
    """A batch that fails after its requests passed their deadline is not retried for them."""
    import asyncio

    decoder = StandIn()

    async def scenario(post, get):
        answers = asyncio.gather(post(["stubborn"]), post(["boom"]))  # one batch, held, then failing
        while not decoder.batches:
            await asyncio.sleep(0.01)
        done = await answers  # both past their deadline while the batch is held
        decoder.release.set()
        while (await get("/health"))[1]["queued"]:
            await asyncio.sleep(0.01)
        return done

    answers = _in_process(decoder, scenario, request_timeout=0.5, max_wait_ms=200)
    assert [status for status, _ in answers] == [504, 504]
    assert decoder.batches == [["stubborn", "boom"]]  # not decoded again one by one


def test_sigterm_finishes_the_requests_in_flight(package, multi30k_bpe):
    sources = sources_of(multi30k_bpe)[:500]
    server = Server(package, "--max-queue", "1000", "--max-sentences", "500")
    answer: list = []
    request = threading.Thread(target=lambda: answer.append(server.post({"text": sources})))
    request.start()
    time.sleep(0.05)
    deadline = time.monotonic() + DEADLINE
    while server.get("/health")[1]["queued"] == 0 and not answer:  # in, not yet answered
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not answer  # SIGTERM comes while the request is in flight
    assert server.stop() == 0
    request.join(DEADLINE)
    status, body, _ = answer[0]
    assert status == 200 and len(body["translations"]) == 500
    with pytest.raises(urllib.error.URLError):  # and it listens no more
        server.get("/health")


def test_a_second_signal_stops_the_drain_at_once(package, multi30k_bpe):
    """SIGTERM drains; a second SIGTERM while it drains exits at once (143), the request in
    flight lost and said so, instead of being ignored."""
    sources = sources_of(multi30k_bpe)[:500]
    server = Server(package, "--max-queue", "1000", "--max-sentences", "500", "--beam", "8")
    answer: list = []
    request = threading.Thread(target=lambda: answer.append(server.post({"text": sources})), daemon=True)
    request.start()
    deadline = time.monotonic() + DEADLINE
    while server.get("/health")[1]["queued"] == 0 and not answer:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    server.proc.send_signal(signal.SIGTERM)
    read_line(server.proc.stderr, DEADLINE)  # "stopping: ..."
    server.proc.send_signal(signal.SIGTERM)
    try:
        assert server.proc.wait(DEADLINE) == 128 + signal.SIGTERM
    finally:
        server.proc.kill()
    assert b"stopped at once: the requests in flight are lost" in server.proc.stderr.read()
    request.join(DEADLINE)
    assert not answer or answer[0][0] != 200


def test_connections_per_client_address_are_capped():
    """--max-connections-per-client: past it, a client's new connection gets 503 and is closed;
    one of its connections closing makes room again."""
    import asyncio
    import socket
    from types import SimpleNamespace

    from nmt_cli.config import ServeConfig
    from nmt_cli.connections import Connections
    from nmt_cli.serve import listen, make_app

    config = ServeConfig(port=0, max_connections_per_client=2)

    async def run():
        connections = Connections(10, 60.0, 30.0, config.max_connections_per_client)
        app = make_app(StandIn(), SimpleNamespace(where="stand-in"), config, connections)
        runner, server = await listen(app, connections, config)
        loop, where = asyncio.get_running_loop(), server.sockets[0].getsockname()[:2]

        async def connect() -> tuple[socket.socket, bytes]:
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, where)
            try:  # a refused connection is answered at once; an accepted one waits for a request
                return s, await asyncio.wait_for(loop.sock_recv(s, 4096), 0.5)
            except asyncio.TimeoutError:
                return s, b""

        first, second, third = [await connect() for _ in range(3)]
        first[0].close()
        while len(connections.open) > 1:
            await asyncio.sleep(0.01)
        fourth = await connect()
        for s, _ in (second, third, fourth):
            s.close()
        server.close()
        await runner.cleanup()
        return [answer for _, answer in (first, second, third, fourth)]

    first, second, third, fourth = asyncio.run(run())
    assert first == second == fourth == b""
    assert third.startswith(b"HTTP/1.1 503") and b"too many connections" in third
