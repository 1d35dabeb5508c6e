"""--engine auto: CTranslate2 wherever it does what was asked (on a CPU), nmt's engine otherwise,
said by --verbose and /health; the CTranslate2 conversion made once and kept, reused without
torch, refused in one line where damaged; the two engines' agreement on Multi30k."""

import builtins
import dataclasses
import json
import math
import shutil
import subprocess
import sys
from collections import Counter

import pytest
from conftest import DEADLINE, nmt_command, one_error_line, sources_of

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.errors import NmtError
from nmt_cli.inference import ct2_cache, models
from nmt_cli.inference.backend import FASTER, choose, refusal
from nmt_cli.inference.translator import Translator


def config(**options) -> TranslateConfig:
    decoding = {f.name for f in dataclasses.fields(DecodeOptions)}
    decode = DecodeOptions(**{k: v for k, v in options.items() if k in decoding})
    return TranslateConfig(decode=decode, **{k: v for k, v in options.items() if k not in decoding})


@pytest.fixture
def own_package(package, tmp_path):
    """A copy of the package, so that its kept conversion is this test's alone."""
    shutil.copytree(package, tmp_path / "package")
    return tmp_path / "package"


def test_auto_chooses_ctranslate2_where_it_does_all_that_is_asked(own_package, monkeypatch):
    model = models.from_dir(own_package)
    assert choose(model, config()).engine == "ctranslate2"
    for options in ({"beam": 1}, {"nbest": 4, "scores": True}, {"alignments": True}, {"int8": True}):
        assert choose(model, config(**options)).engine == "ctranslate2", options
    nmt_for = {
        "sample": config(sample=True),
        "epsilon": config(sample=True, epsilon=0.02),
        "cuda_graphs": config(cuda_graphs=False),
        "tf32": config(precision="tf32"),
        "gpu": config(device="cuda:0"),
        "forced": config(engine="nmt"),
    }
    for name, asked in nmt_for.items():
        assert choose(model, asked).engine == "nmt", name
    assert choose(model, config(), constraints=True).engine == "nmt"
    assert choose(model, config(), procs=2).engine == "nmt"
    assert choose(models.ensemble([model, model]), config()).engine == "nmt"
    # what CTranslate2 lacks is refused where it is forced, in one place for every caller
    assert refusal("ctranslate2", DecodeOptions(sample=True, epsilon=0.1)) is not None
    assert refusal("nmt", DecodeOptions(sample=True, epsilon=0.1)) is None
    with pytest.raises(NmtError, match="constraints.*drop --engine ctranslate2"):
        choose(model, config(engine="ctranslate2"), constraints=True)
    # without CTranslate2 installed, auto is nmt's engine, and says why
    real_import = builtins.__import__

    def no_ct2(name, *args, **kwargs):
        if name == "ctranslate2":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ct2)
    chosen = choose(model, config())
    assert chosen.engine == "nmt" and "not installed" in chosen.why


def test_the_conversion_is_made_once_and_kept_beside_the_package(own_package, multi30k_bpe, monkeypatch):
    lines = sources_of(multi30k_bpe)[:40]
    first = Translator(models.from_dir(own_package), config())
    assert first.engine == "ctranslate2"
    kept = ct2_cache.folder_of(models.from_dir(own_package))
    assert kept is not None and kept.is_dir() and kept.parent.parent == own_package.parent
    written = (kept / "model.bin").stat().st_mtime_ns
    out = first.translate(lines)

    def converting_again(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr("nmt_cli.inference.packages.export_ct2", converting_again)
    again = Translator(models.from_dir(own_package), config())
    assert again.translate(lines) == out
    assert (kept / "model.bin").stat().st_mtime_ns == written
    # nmt's engine gives the same lines here (the agreement test below counts)
    ours = Translator(models.from_dir(own_package), config(engine="nmt")).translate(lines)
    assert sum(a == b for a, b in zip(out, ours)) >= 0.9 * len(lines)


def test_a_damaged_or_foreign_conversion_is_refused_in_one_line(own_package, nmt):
    assert nmt("translate", "--model", own_package, stdin=b"A dog runs.\n").code == 0
    kept = ct2_cache.folder_of(models.from_dir(own_package))
    assert kept is not None
    settings = json.loads((kept / "nmt.json").read_text())
    (kept / "nmt.json").write_text(json.dumps({**settings, "converted_from": "0" * 64}))
    line = one_error_line(nmt("translate", "--model", own_package, stdin=b"A dog runs.\n"))
    assert str(kept) in line and "other weights" in line and "remove it" in line
    (kept / "nmt.json").write_text(json.dumps(settings))
    with open(kept / "model.bin", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    line = one_error_line(nmt("translate", "--model", own_package, stdin=b"A dog runs.\n"))
    assert "corrupt" in line and "remove it" in line
    # forcing nmt's engine does not read it
    assert nmt("translate", "--model", own_package, "--engine", "nmt", stdin=b"A dog runs.\n").code == 0
    shutil.rmtree(kept)
    assert nmt("translate", "--model", own_package, stdin=b"A dog runs.\n").code == 0


def test_where_nothing_can_be_kept_the_conversion_is_this_processs_alone(own_package, monkeypatch):
    real = ct2_cache.tempfile.mkdtemp

    def read_only(suffix=None, prefix=None, dir=None):  # the package's folder only
        if dir is not None and ".ct2" in str(dir):
            raise PermissionError(f"{dir} is read-only")
        return real(suffix, prefix, dir)

    monkeypatch.setattr(ct2_cache.tempfile, "mkdtemp", read_only)
    t = Translator(models.from_dir(own_package), config())
    assert t.engine == "ctranslate2" and t.translate(["A dog runs."])[0]
    assert not (own_package.parent / f".{own_package.name}.ct2").exists() or not any(
        (own_package.parent / f".{own_package.name}.ct2").iterdir()
    )


def test_a_runs_kept_conversion_translates_without_torch(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    lines = b"A man is riding a bike.\nTwo dogs play in the snow.\n"
    made = subprocess.run(
        nmt_command("--verbose", "translate", "--run-dir", run),
        input=lines,
        capture_output=True,
        timeout=DEADLINE,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    assert b"engine: ctranslate2 (auto:" in made.stderr
    assert [p.name for p in (run / "ct2").iterdir()]
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *nmt_command("translate", "--run-dir", run)[1:]],
        input=lines,
        capture_output=True,
        timeout=DEADLINE,
    )
    assert done.returncode == 0 and done.stdout == made.stdout, done.stderr[-2000:]
    imported = {line.rsplit(b"|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert b"ctranslate2" in imported and b"torch" not in imported
    # nor what only a conversion, a download or worker processes need, nor typer and pydantic (a
    # plain command line, cli/plain.py) or rich (nothing shown on a stderr that is no terminal)
    unneeded = {b"numpy", b"urllib.request", b"tarfile", b"multiprocessing", b"typer", b"pydantic", b"rich"}
    assert not imported & unneeded, imported & unneeded
    # what needs nmt's engine is routed there, and --verbose says why
    sampled = subprocess.run(
        nmt_command("translate", "--run-dir", run, "--sample", "--verbose"),
        input=lines,
        capture_output=True,
        timeout=DEADLINE,
    )
    assert sampled.returncode == 0 and b"engine: nmt (auto: --sample" in sampled.stderr


def test_score_names_the_engine_in_its_signatures(trained, tmp_path, nmt):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    for engine in ("auto", "nmt"):
        result = nmt("score", "--run-dir", run, "--engine", engine, "--json")
        assert result.code == 0, result.err
        want = "ctranslate2" if engine == "auto" else "nmt"
        signatures = [s["signature"] for s in json.loads(result.out)["scores"]]
        assert signatures and all(s.endswith(f"|engine:{want}") for s in signatures), signatures


def test_the_engines_agree_on_multi30k(package, multi30k_bpe):
    """Beyond the 1-best and n-best of beam and greedy search (test_ct2.py): prefixes, forced
    scores, alignments, and sampling's distribution."""
    lines = sources_of(multi30k_bpe)[:200]
    model = models.from_dir(package)
    ours, theirs = (Translator(model, config(engine=e)) for e in ("nmt", "ctranslate2"))
    greedy = ours.translate(lines[:50], beam=1)
    prefixes = [" ".join(t.split()[:2]) for t in greedy]
    a = ours.translate(lines[:50], prefixes)
    b = theirs.translate(lines[:50], prefixes)
    assert all(x.startswith(p) for x, p in zip(b, prefixes))
    assert sum(x == y for x, y in zip(a, b)) >= 45
    # forced decoding scores the same
    targets = ours.translate(lines)
    for x, y in zip(ours.score(lines, targets), theirs.score(lines, targets)):
        assert x.total == pytest.approx(y.total, abs=1e-3) and x.tokens == y.tokens
    # alignments: the same pairs on nearly every line
    aligned = [t.translations(lines[:50], alignments=True) for t in (ours, theirs)]
    same = sum(x[0].alignment == y[0].alignment for x, y in zip(*aligned))
    assert same >= 45, same
    # sampling: the first word's distribution over many draws: its likeliest words as often in
    # each engine's draws, within four standard errors of the difference of two frequencies
    draws = 400
    for line in lines[:3]:
        first = []
        for t in (ours, theirs):
            found = t.translations([line], sample=True, nbest=draws, seed=3)[0]
            first.append(Counter(x.text.split()[0] if x.text else "" for x in found))
        for word, n in first[0].most_common(3):
            p = n / draws
            assert abs(n - first[1][word]) / draws <= 4 * math.sqrt(2 * p * (1 - p) / draws) + 0.01, first


def test_the_server_says_its_engine_and_refuses_what_it_lacks_naming_the_way(own_package):
    from conftest import Server

    server = Server(own_package)
    try:
        status, health = server.get("/health")
        assert status == 200 and health["engine"] == "ctranslate2" and health["engine_why"] == FASTER
        status, body, _ = server.post({"text": ["A dog runs."], "constraints": [["Hund"]]})
        assert status == 400 and "start it with --engine nmt" in body["error"], body
        status, body, _ = server.post({"text": ["A dog runs."]})
        assert status == 200 and body["translations"][0]
    finally:
        assert server.stop() == 0


def test_the_punctuation_normalizer_loaded_alone_is_sacremoses_own():
    """normalize.py loads sacremoses' normalizer module without the package (whose tokenizer
    would cost most of a one-line start), and compiles its rules once: it must normalise exactly
    as the package's does."""
    code = (
        "import sys\n"
        "from nmt_cli.normalize import normalize\n"
        "lines = ['«Hello»  „world“ – it’s 5 %…', 'A dog  runs .\\u00a0x', \"l'école « oui » ; 3,5 %\",\n"
        "         'Sie ( ICAC ) sagte : \"ja\", 5\\u00a0000 ``gut\\'\\' ;', '、１２ ，（x）！']\n"
        "langs = ('en', 'de', 'fr', 'cs')\n"
        "ours = [normalize(x, lang) for x in lines for lang in langs]\n"
        "assert 'sacremoses' not in sys.modules\n"
        "from sacremoses import MosesPunctNormalizer as N\n"
        "theirs = [' '.join(N(lang=lang).normalize(x).split()) for x in lines for lang in langs]\n"
        "assert ours == theirs, (ours, theirs)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=DEADLINE)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("engine", ["nmt", "ctranslate2"])
def test_lines_without_prefixes_or_constraints_ask_sentencepiece_for_none(package, engine, monkeypatch):
    """sentencepiece takes about a millisecond over an empty list (its pool of threads), which
    was most of what nmt added to CTranslate2's time on a thousand lines."""
    t = Translator(models.from_dir(package), config(engine=engine))
    asked = []
    for sp in {id(x): x for x in (t.source_sp, t.target_sp)}.values():
        real = sp.encode
        monkeypatch.setattr(sp, "encode", lambda x, *a, _real=real, **k: asked.append(x) or _real(x, *a, **k))
    lines = ["A dog runs.", "Two men play football in the park."]
    assert t.translate(lines) and [] not in asked and asked
    assert t.translate(lines, prefixes=["Ein", ""])
    assert [] not in asked
