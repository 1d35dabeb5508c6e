"""`nmt translate` as a Unix filter, and `nmt score`."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DEADLINE, children, nmt_command, one_error_line, read_line

from nmt_cli.errors import NmtError
from nmt_cli.rundir import RunDir

FAST = ["--max-len-b", "6"]  # a barely trained model would otherwise talk for 50 tokens


def test_every_awkward_line_gets_one_output_line_in_order(trained, nmt):
    long_line = " ".join(["word"] * 1500)  # longer than the model's 1024 positions
    stream = b"".join(
        [
            b"A man is riding a bike.\n",
            b"\n",  # empty
            b"   \t \n",  # whitespace only
            long_line.encode() + b"\n",
            b"caf\xe9 \xff\xfe broken bytes\n",  # not UTF-8
            b"Two dogs play.\r\n",  # CRLF
            b"nul\x00inside\n",
            b"A woman sings.",  # no final newline
        ]
    )
    result = nmt("translate", "--run-dir", trained, *FAST, stdin=stream)
    assert result.code == 0, result.err
    lines = result.out.split("\n")
    assert lines[-1] == "" and len(lines) - 1 == 8
    assert lines[1] == "" and lines[2] == ""
    assert all(lines[i] for i in (0, 3, 4, 5, 6, 7))
    assert "truncated" in result.err and "not UTF-8" in result.err
    # The same sentence alone gives the same translation as inside the stream.
    alone = nmt("translate", "--run-dir", trained, *FAST, stdin=b"Two dogs play.\n")
    assert alone.out == lines[5] + "\n"


def test_empty_stdin_gives_empty_output(trained, nmt):
    result = nmt("translate", "--run-dir", trained, stdin=b"")
    assert (result.code, result.out) == (0, "")


def test_batching_does_not_change_translations(trained, nmt):
    """nmt's engine: each sentence keeps its own length limit in any batch (CTranslate2 takes
    one per batch, its longest sentence's: where outputs reach it, batching can change them)."""
    text = RunDir(trained).text("test", "en", raw=True).read_bytes().splitlines(keepends=True)[:40]
    ours = [*FAST, "--engine", "nmt"]
    big = nmt("translate", "--run-dir", trained, *ours, stdin=b"".join(text))
    small = nmt("translate", "--run-dir", trained, *ours, "--batch-size", "3", stdin=b"".join(text))
    # One thread decodes the batches in turn; two decode two batches at once (backend_nmt.py).
    alone = nmt(
        "translate", "--run-dir", trained, *ours, "--batch-size", "3", "--threads", "1", stdin=b"".join(text)
    )
    assert big.code == small.code == alone.code == 0
    assert big.out == small.out == alone.out and big.out.count("\n") == 40


def test_nbest_and_greedy(trained, nmt):
    result = nmt("translate", "--run-dir", trained, *FAST, "--nbest", "3", stdin=b"A dog runs.\nA cat.\n")
    rows = [line.split("\t") for line in result.out.splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "0", "1", "1", "1"]
    scores = [float(r[1]) for r in rows[:3]]
    assert scores == sorted(scores, reverse=True)
    greedy = nmt("translate", "--run-dir", trained, *FAST, "--beam", "1", stdin=b"A dog runs.\n")
    assert greedy.code == 0 and greedy.out.count("\n") == 1


def test_bf16_and_int8_run(trained, nmt):
    for flags in (["--precision", "bf16"], ["--int8"]):  # --int8: CTranslate2's
        result = nmt("translate", "--run-dir", trained, *FAST, *flags, stdin=b"A dog runs.\n")
        assert result.code == 0, result.err
        assert result.out.count("\n") == 1


def test_translate_errors(trained, tmp_path, nmt):
    assert "nmt train" in one_error_line(nmt("translate", "--run-dir", tmp_path, stdin=b"x\n"))
    assert "--nbest 5 exceeds --beam 4" in one_error_line(
        nmt("translate", "--run-dir", trained, "--nbest", "5", stdin=b"x\n")
    )
    assert "not found" in one_error_line(
        nmt("translate", "--run-dir", trained, "--checkpoint", tmp_path / "none.pt", stdin=b"x\n")
    )
    assert "--batch-size must not be negative" in one_error_line(
        nmt("translate", "--run-dir", trained, "--batch-size", "-1", stdin=b"x\n")
    )


def test_score_files(tmp_path, nmt):
    ref = tmp_path / "ref.de"
    ref.write_text("Ein Hund läuft.\nZwei Katzen schlafen.\n")
    hyp = tmp_path / "hyp.de"
    hyp.write_text("Ein Hund läuft.\nZwei Katzen schlafen.\n")
    result = nmt("score", "--hyp", hyp, "--ref", ref)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith("BLEU = 100.00") and "nrefs:1|case:mixed" in lines[0]
    assert lines[1].startswith("chrF2 = 100.00") and lines[2].startswith("TER = 0.00")
    piped = nmt("score", "--ref", ref, "--metrics", "bleu", "--json", stdin=hyp.read_bytes())
    report = json.loads(piped.out)
    assert round(report["scores"][0]["score"], 6) == 100.0 and report["scores"][0]["metric"] == "bleu"
    # Given again, the option adds metrics (a metric named twice is scored once).
    again = nmt("score", "--hyp", hyp, "--ref", ref, "--metrics", "bleu", "--metrics", "chrf,bleu", "--json")
    assert [s["metric"] for s in json.loads(again.out)["scores"]] == ["bleu", "chrf"]


def test_score_moses_lc_and_compare(tmp_path, nmt):
    ref = tmp_path / "ref.de"
    ref.write_text('Ein "Hund" läuft.\n' * 30)
    hyp = tmp_path / "hyp.de"
    hyp.write_text('ein " hund " läuft .\n' * 30)  # what a tokenized lowercased system writes
    result = nmt(
        "score", "--hyp", hyp, "--ref", ref, "--moses-lc", "--lang", "de", "--metrics", "bleu", "--json"
    )
    report = json.loads(result.out)
    assert round(report["scores"][0]["score"], 6) == 100.0 and "tok:none" in report["scores"][0]["signature"]
    assert "tokenizing as English" not in result.err
    guessed = nmt("score", "--hyp", hyp, "--ref", ref, "--moses-lc", "--metrics", "bleu", "--json")
    assert guessed.code == 0 and "tokenizing as English (give --lang)" in guessed.err
    worse = tmp_path / "worse.de"
    worse.write_text("Katze\n" * 30)
    result = nmt("score", "--hyp", hyp, "--ref", ref, "--compare", worse, "--metrics", "chrf", "--json")
    c = json.loads(result.out)["compare"]["chrf"]
    assert c["system"] > c["baseline"] and c["p_value"] < 0.05


def test_score_compound_split_as_the_transformer_paper(tmp_path, nmt):
    """tensor2tensor's get_ende_bleu.sh: cased Moses tokens, hyphens between non-spaces set
    apart as ##AT##-##AT##, then BLEU on those tokens."""
    from nmt_cli.metrics import compound_split

    assert compound_split(['Die EU-Kommission hat 3-4 "neue" Vorschläge.'], "de") == [
        "Die EU ##AT##-##AT## Kommission hat 3 ##AT##-##AT## 4 &quot; neue &quot; Vorschläge ."
    ]
    ref = tmp_path / "ref.de"
    ref.write_text("Die EU-Kommission tagt heute in Brüssel.\n" * 20)
    hyp = tmp_path / "hyp.de"
    hyp.write_text(
        "Die EU-Kommission tagt heute in Brüssel .\n" * 10 + "Die EU Kommission tagt heute in Brüssel.\n" * 10
    )
    args = ["score", "--hyp", hyp, "--ref", ref, "--lang", "de", "--metrics", "bleu", "--json"]
    report = json.loads(nmt(*args, "--compound-split").out)
    assert report["compound_split"] and "tok:none" in report["scores"][0]["signature"]
    # The split compound's two halves match the unsplit one's; the hyphen counts as a token.
    from sacrebleu.metrics import BLEU

    expected = BLEU(tokenize="none", force=True).corpus_score(
        compound_split(hyp.read_text().splitlines(), "de"),
        [compound_split(ref.read_text().splitlines(), "de")],
    )
    assert report["scores"][0]["score"] == pytest.approx(expected.score)
    assert 0 < expected.score < 100
    both = nmt(*args, "--compound-split", "--moses-lc")
    assert "give one" in one_error_line(both)


def test_score_errors(tmp_path, nmt):
    ref = tmp_path / "ref"
    ref.write_text("a\nb\n")
    hyp = tmp_path / "hyp"
    hyp.write_text("a\n")
    line = one_error_line(nmt("score", "--hyp", hyp, "--ref", ref))
    assert "has 1 lines but" in line and "has 2" in line
    assert "unknown metric" in one_error_line(nmt("score", "--hyp", ref, "--ref", ref, "--metrics", "meteor"))
    assert "nmt prep" in one_error_line(nmt("score", "--run-dir", tmp_path / "none"))


def test_score_translates_the_test_set_once(trained, tmp_path, nmt):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    first = nmt("score", "--run-dir", run, "--beam", "1", *FAST, "--json")
    assert first.code == 0, first.err
    saved = json.loads((run / "scores" / "test.json").read_text())
    assert saved == json.loads(first.out)
    assert (run / "translations" / "test.de").read_text().count("\n") == 1000
    again = nmt("score", "--run-dir", run, "--beam", "1", *FAST, "--json")
    assert "reusing" in again.err and json.loads(again.out) == saved


def test_sentences_that_finish_at_different_steps_of_one_batch(trained_longer, nmt):
    """One batch whose sentences end at different steps (by EOS, or at their own length
    limits): each gets what it gets alone."""
    lines = [
        "Dogs.",
        "A man in a red shirt is riding a bike down a long and dusty road .",
        "Two children play.",
        "A woman with a hat sings on a stage in front of people .",
    ]
    for search in (["--beam", "4"], ["--beam", "1"]):
        together = nmt(
            "translate", "--run-dir", trained_longer, *search, stdin="\n".join(lines).encode() + b"\n"
        )
        assert together.code == 0, together.err
        out = together.out.split("\n")[:-1]
        assert len({len(x) for x in out}) > 1, out  # they did not all stop at one step
        for line, got in zip(lines, out):
            alone = nmt("translate", "--run-dir", trained_longer, *search, stdin=line.encode() + b"\n")
            assert alone.out == got + "\n"


def test_ensembles_translate_and_score(trained, tmp_path, nmt):
    """--model twice decodes the two models together (decoding.translate on both, tested in
    tests/unit), from checkpoints or packages alike; mixed vocabularies or languages are one
    error line."""
    import sentencepiece as spm
    import torch

    from nmt_cli.config import DecodeOptions, TranslateConfig
    from nmt_cli.engine import decoding
    from nmt_cli.inference.models import locate
    from nmt_cli.inference.translator import Translator
    from nmt_cli.vocab import EOS

    first, last = sorted((trained / "checkpoints").glob("*.pt"))[-2:]
    lines = ["A dog runs on the grass.", "", "Two men play football in a park."]
    stdin = "\n".join(lines).encode() + b"\n"
    both = nmt("translate", "--model", first, "--model", last, *FAST, stdin=stdin)
    assert both.code == 0, both.err
    # What the engine's ensemble search gives on the two models, decoded by hand here.
    models = [Translator(locate(p), TranslateConfig(engine="nmt")).backend.models[0] for p in (first, last)]
    sp = spm.SentencePieceProcessor(model_file=str(RunDir(trained).vocabularies().source))
    expected = []
    for line in lines:
        if not line:
            expected.append("")
            continue
        src = torch.tensor([sp.encode(line) + [EOS]])
        expected.append(sp.decode(decoding.translate(models, src, DecodeOptions(max_len_b=6))[0][0].tokens))
    assert both.out.split("\n")[:-1] == expected
    alone = nmt("translate", "--model", last, "--engine", "nmt", *FAST, stdin=stdin)
    twice = nmt("translate", "--model", last, "--model", last, *FAST, stdin=stdin)
    assert twice.out == alone.out
    # The Python API's ensemble (the guide's Translator.load([a, b])) is the command line's.
    api = Translator.load([first, last], max_len_b=6)
    assert api.translate(lines) == both.out.split("\n")[:-1]
    # score-pairs with two models: each pair's log-probability the mean of the models' per
    # step, as forced decoding of the ensemble gives it (one model twice: that model).
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    (pairs / "src").write_text("A dog runs on the grass.\nTwo men play football in a park.\n")
    (pairs / "tgt").write_text("Ein Hund läuft auf dem Gras.\nZwei Männer spielen Fußball.\n")
    files = ["--src", pairs / "src", "--tgt", pairs / "tgt"]
    one = nmt("score-pairs", "--model", last, *files)
    pair = nmt("score-pairs", "--model", last, "--model", last, *files)
    mixed = nmt("score-pairs", "--model", first, "--model", last, *files)
    assert one.code == pair.code == mixed.code == 0, (one.err, pair.err, mixed.err)
    assert pair.out == one.out and mixed.out != one.out and len(mixed.out.splitlines()) == 2
    ensemble = Translator.load([first, last]).score(
        ["A dog runs on the grass."], ["Ein Hund läuft auf dem Gras."]
    )
    assert float(mixed.out.splitlines()[0].split("\t")[0]) == pytest.approx(ensemble[0].total, abs=1e-3)
    # score translates with the ensemble too, from a package and a checkpoint.
    package = tmp_path / "pkg"
    assert nmt("export", str(package), "--model", first).code == 0
    src, ref = RunDir(trained).text("valid", "en", raw=True), RunDir(trained).text("valid", "de", raw=True)
    scored = nmt("score", "--model", package, "--model", last, "--src", src, "--ref", ref, *FAST, "--json")
    assert scored.code == 0, scored.err
    assert json.loads(scored.out)["lines"] == 1014
    # Errors.
    other = tmp_path / "other"
    shutil.copytree(package, other)
    (other / "spm.model").write_bytes((other / "spm.model").read_bytes() + b"\0")
    declared = json.loads((other / "nmt.json").read_text())  # as if exported with that vocabulary
    declared["spm_sha256"] = hashlib.sha256((other / "spm.model").read_bytes()).hexdigest()
    (other / "nmt.json").write_text(json.dumps(declared))
    line = one_error_line(nmt("translate", "--model", package, "--model", other, stdin=b"x\n"))
    assert "one vocabulary" in line
    settings = json.loads((package / "nmt.json").read_text())
    (other / "spm.model").write_bytes((package / "spm.model").read_bytes())
    (other / "nmt.json").write_text(json.dumps({**settings, "src": "fr"}))
    assert "one language pair" in one_error_line(
        nmt("translate", "--model", package, "--model", other, stdin=b"x\n")
    )
    assert "--engine" in one_error_line(
        nmt("translate", "--model", package, "--model", last, "--int8", stdin=b"x\n")
    )
    assert "one --model" in one_error_line(
        nmt("export", str(tmp_path / "e"), "--model", package, "--model", last)
    )


def test_worker_processes_give_the_lines_of_one_process_in_input_order(trained, tmp_path, nmt):
    text = RunDir(trained).text("test", "en", raw=True).read_bytes().splitlines(keepends=True)[:30]
    text = b"".join([*text[:10], b"\n", *text[10:]])  # a blank line among them
    prefixes = tmp_path / "prefixes"
    prefixes.write_text("".join("Ein\n" if i % 3 == 0 else "\n" for i in range(31)))
    for options in ([], ["--sample", "--seed", "5", "--nbest", "2"], ["--prefix", prefixes]):
        one = nmt("translate", "--run-dir", trained, *FAST, *options, stdin=text)
        two = nmt("translate", "--run-dir", trained, *FAST, *options, "--procs", "2", stdin=text)
        assert one.code == two.code == 0, two.err
        assert two.out == one.out and one.out.count("\n") == 31 * (2 if "--nbest" in options else 1)


def test_shares_of_small_chunks_come_back_in_order_with_their_counts(trained, tmp_path):
    import io

    from nmt_cli.config import DecodeOptions, TranslateConfig
    from nmt_cli.inference import workers
    from nmt_cli.inference.models import from_run
    from nmt_cli.inference.translator import Translator

    lines = RunDir(trained).text("test", "en", raw=True).read_bytes().splitlines(keepends=True)[:23]
    lines[4] = b"bad \xff byte\n"
    config = TranslateConfig(decode=DecodeOptions(beam=2, sample=True, seed=1), chunk=7, threads=2)
    one, translator = io.StringIO(), Translator(from_run(RunDir(trained), None), config)
    alone = translator.stream(io.BytesIO(b"".join(lines)), one, lambda n: None)
    two, advanced = io.StringIO(), []
    spread = workers.Spread(trained, [], None, procs=2)
    counts = workers.stream(spread, config, io.BytesIO(b"".join(lines)), two, advanced.append)
    assert two.getvalue() == one.getvalue() and one.getvalue().count("\n") == 23
    assert sum(advanced) == counts.lines == alone.lines == 23
    assert len(advanced) == 8  # 4 chunks, 2 shares each
    assert counts.damage.not_utf8 == alone.damage.not_utf8 == 1
    # A worker that cannot start: its error, raised in the parent at the first share.
    with pytest.raises(NmtError, match="nmt train"):
        nowhere = workers.Spread(tmp_path, [], None, procs=2)
        workers.stream(nowhere, config, io.BytesIO(b"A dog.\n"), io.StringIO(), advanced.append)


def test_the_parent_of_workers_loads_no_model(trained, nmt, monkeypatch):
    """`--procs 2`: the workers load the model; the parent, which reads and writes the lines,
    reads the model's settings only (a copy of the weights, and with --gpus a CUDA context on
    GPU 0, would be its own). Its output is the workers'."""
    from nmt_cli.engine import checkpoint
    from nmt_cli.inference import backend_nmt

    text = RunDir(trained).text("test", "en", raw=True).read_bytes().splitlines(keepends=True)[:12]
    expected = nmt("translate", "--run-dir", trained, *FAST, stdin=b"".join(text))
    loaded: list = []
    for where, name in ((backend_nmt, "load_model"), (checkpoint, "load_tensors")):
        real = getattr(where, name)
        monkeypatch.setattr(where, name, lambda *a, real=real, **k: loaded.append(a) or real(*a, **k))
    spread = nmt("translate", "--run-dir", trained, *FAST, "--procs", "2", stdin=b"".join(text))
    assert spread.code == 0 and spread.out == expected.out, spread.err
    assert loaded == []


def test_a_worker_that_dies_ends_the_command_with_one_line_naming_it_never_a_hang(trained):
    """`--procs 2` on an open pipe: a worker killed while it translates its share (SIGKILL, as
    the kernel's out-of-memory killer sends) ends the command with one error line naming the
    worker and the lines not translated; the pool does not wait for the lost share for ever."""
    lines = RunDir(trained).text("test", "en", raw=True).read_bytes().splitlines(keepends=True)
    proc = subprocess.Popen(
        nmt_command("translate", "--run-dir", trained, "--procs", "2", "--beam", "8"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(lines[0])
        proc.stdin.flush()
        assert read_line(proc.stdout, time.monotonic() + DEADLINE)  # a worker is up
        proc.stdin.write(b"".join(lines * 3))  # two shares of 1,500 lines: seconds each
        proc.stdin.flush()
        deadline = time.monotonic() + DEADLINE
        while len(spawned := _workers_of(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # both decoding their shares
        os.kill(spawned[-1], signal.SIGKILL)
        _, err = proc.communicate(timeout=DEADLINE)  # closes the input
    finally:  # on a failure, no worker left behind either
        for pid in _workers_of(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    said = err.decode()
    assert proc.returncode == 1 and "Traceback" not in said, said
    errors = [line for line in said.splitlines() if line.startswith("nmt: error:")]
    assert len(errors) == 1, said
    died = (
        f"nmt: error: a worker process died (pid {spawned[-1]}, killed by signal 9) while translating lines "
    )
    assert errors[0].startswith(died) and "onward were not translated" in errors[0], said


def test_the_worker_named_is_the_one_that_died_not_one_the_pool_ended():
    """Asked at once, before the killed worker can be reaped and while the pool's SIGTERM to the
    other is on its way (the order a broken pool wakes its caller in), the line names the one
    killed."""
    import multiprocessing
    from types import SimpleNamespace

    from nmt_cli.inference.workers import _died

    context = multiprocessing.get_context("fork")
    ended, killed = (context.Process(target=time.sleep, args=(60,)) for _ in range(2))
    for process in (ended, killed):
        process.start()
    pool = SimpleNamespace(_processes={ended.pid: ended, killed.pid: killed})
    os.kill(killed.pid, signal.SIGKILL)
    ended.terminate()
    assert _died(pool) == f"a worker process died (pid {killed.pid}, killed by signal 9)"  # type: ignore[arg-type]


def _workers_of(pid: int) -> list[int]:
    """The worker processes multiprocessing spawned for `pid` (not its resource tracker)."""
    found = []
    for child in children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return sorted(found)


def test_worker_options_that_cannot_be_had_are_one_line(trained, nmt):
    for flags, said in (
        (["--procs", "2", "--gpus", "1"], "give one of them"),
        (["--gpus", "1"], "GPUs are visible"),
        (["--procs", "2", "--device", "cuda"], "--procs decodes on the CPU"),
        (["--procs", "2", "--engine", "ctranslate2"], "CTranslate2 decodes several batches"),
    ):
        assert said in one_error_line(nmt("translate", "--run-dir", trained, *flags, stdin=b"A dog.\n"))


def test_the_python_api_sets_its_threads_for_its_searches_only(trained, monkeypatch):
    """Translator.load(threads=1) decodes on one thread and leaves the program's own thread
    count as it was, before and after (torch's count is the whole process's)."""
    import torch

    from nmt_cli.engine import decoding
    from nmt_cli.inference.translator import Translator

    torch.set_num_threads(2)
    seen = []
    translate = decoding.translate
    monkeypatch.setattr(
        decoding, "translate", lambda *a, **k: seen.append(torch.get_num_threads()) or translate(*a, **k)
    )
    api = Translator.load(trained, threads=1, engine="nmt")
    assert torch.get_num_threads() == 2
    assert len(api.translate(["a dog runs .", "two men talk ."])) == 2
    assert seen == [1] and torch.get_num_threads() == 2


def test_a_long_line_is_cut_before_sentencepiece_sees_all_of_it(trained):
    """A source line of 1 MiB: sentencepiece is handed no more than PIECE_CHARS characters per
    position the model reads (a list of ids of all of it held ~1 GB for 60 such lines), and
    what the model reads is what it read of the whole line."""
    from nmt_cli.inference import searcher as translator_module
    from nmt_cli.inference.translator import Translator

    api = Translator.load(trained)
    line = "a dog runs on the grass . " * 40_000
    whole = api.source_sp.encode([line], out_type=int)[0][: api.max_src]
    handed = []
    encode = api.source_sp.encode
    api.source_sp.encode = lambda lines, **k: handed.extend(map(len, lines)) or encode(lines, **k)
    ids = api.encode([line])
    assert handed and max(handed) <= translator_module.PIECE_CHARS * api.max_src
    assert ids == [whole] and api.counts.truncated == 1
