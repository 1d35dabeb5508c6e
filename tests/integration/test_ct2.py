"""The CTranslate2 export and backend: the same translations as nmt's engine, its line
guarantees, int8, and its errors."""

import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

from conftest import DEADLINE, one_error_line, sources_of

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.engine.hypothesis import max_lengths
from nmt_cli.inference.backend_ct2 import band_top, shares
from nmt_cli.inference.models import from_dir
from nmt_cli.inference.translator import Translator


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


def test_a_sentence_runs_at_most_a_quarter_past_its_own_limit(exported, multi30k_bpe):
    """A CTranslate2 call has one length limit: a batch goes in calls of sentences whose limits
    share a band a quarter wide, each at its band's top, so that where every output runs to its
    limit (held there by min_len) none runs past 1.25 times its own, and those of one band share
    a call."""
    lines = sources_of(multi30k_bpe)[:64]
    options = DecodeOptions(beam=2, max_len_a=1.0, max_len_b=0, min_len=1000)
    translator = Translator(from_dir(exported["float32"]), TranslateConfig(decode=options, threads=1))
    events = logged_calls(translator)
    found = translator.hypotheses(lines)
    own = max_lengths([len(x) for x in translator.encode(lines)], 1.0, 0, 1023)
    assert len(set(own)) >= 10
    outputs = [len(hyps[0].tokens) + 1 for hyps in found]
    assert all(n <= o * 1.25 for n, o in zip(outputs, own)), list(zip(outputs, own))
    assert sum(n > o for n, o in zip(outputs, own)) > 0  # sentences of close limits share calls
    assert sum(e == "call" for e, _ in events) < len(set(own))


def test_the_sentences_of_every_batch_share_their_bands_calls(exported, multi30k_bpe):
    """Outside a server the sentences of all batches are pooled by band: small batches make no
    more calls than their bands need (none larger than a batch), and the same lines as one
    batch of all."""
    lines = sources_of(multi30k_bpe)[:64]
    options = DecodeOptions(beam=2, max_len_a=1.0, max_len_b=0, min_len=1000)
    found, sizes = {}, {}
    for size in (8, 64):
        config = TranslateConfig(decode=options, threads=1, batch_size=size)
        translator = Translator(from_dir(exported["float32"]), config)
        events = logged_calls(translator, sizes.setdefault(size, []))
        found[size] = [[h.tokens for h in hyps] for hyps in translator.hypotheses(lines)]
        assert events
    own = max_lengths([len(x) for x in translator.encode(lines)], 1.0, 0, 1023)
    bands = Counter(band_top(n) for n in own)
    assert len(bands) >= 4
    assert len(sizes[8]) == sum(-(-m // 8) for m in bands.values()), sizes[8]
    assert max(sizes[8]) == 8
    assert found[8] == found[64]


def test_a_server_hands_a_batchs_calls_over_one_after_another(exported, multi30k_bpe):
    """`nmt translate` hands every call of every batch over at once, so that every worker has
    one; a server counts each batch as one worker's (serve/batcher.py), so there a batch's calls
    go one after another, each once the one before it has answered."""
    lines = sources_of(multi30k_bpe)[:32]
    options = DecodeOptions(beam=2, max_len_a=1.0, max_len_b=0, min_len=1000)
    for serving in (False, True):
        translator = Translator(
            from_dir(exported["float32"]), TranslateConfig(decode=options), serving=serving
        )
        events = logged_calls(translator)
        translator.hypotheses(lines)
        calls = sum(e == "call" for e, _ in events)
        assert calls >= 3, events  # one batch of 32, in calls by limit
        if serving:  # each call after the answers of the one before
            assert all(events.index(("answer", k - 1)) < events.index(("call", k)) for k in range(1, calls))
        else:
            assert [e for e, _ in events[:calls]] == ["call"] * calls


def logged_calls(translator: Translator, sizes: list[int] | None = None) -> list[tuple[str, int]]:
    """The CTranslate2 calls of `translator` as they happen, ("call", k), and each answer of
    call k as it is awaited, ("answer", k); each call's sentences counted into `sizes`."""
    events: list[tuple[str, int]] = []
    translate_batch = translator.backend.translator.translate_batch

    def logged(source, **settings):
        k = sum(e == "call" for e, _ in events)
        events.append(("call", k))
        if sizes is not None:
            sizes.append(len(source))
        pending = translate_batch(source, **settings)
        return [
            SimpleNamespace(result=lambda r=r: events.append(("answer", k)) or r.result()) for r in pending
        ]

    translator.backend.translator = SimpleNamespace(translate_batch=logged)
    return events


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
        # --min-len 1: a line of text gets text back whatever this small model makes of it
        result = nmt("translate", "--model", where, "--max-len-b", "6", "--min-len", "1", stdin=stream)
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

    from nmt_cli import metrics
    from nmt_cli.inference import packages as export

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
    assert "--no-cuda-graphs is for nmt's engine" in one_error_line(
        nmt("translate", "--model", exported["int8"], "--no-cuda-graphs", stdin=b"x\n")
    )
    assert "--no-cuda-graphs is for nmt's engine" in one_error_line(
        nmt("translate", "--model", package, "--int8", "--no-cuda-graphs", stdin=b"x\n")
    )
    assert "--no-cuda-graphs is for nmt's engine" in one_error_line(
        nmt("serve", "--model", exported["int8"], "--port", "0", "--no-cuda-graphs")
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


def test_gpus_puts_a_replica_on_each_gpu_and_hands_them_every_batch(exported, multi30k_bpe, monkeypatch):
    """`--gpus N` with CTranslate2: one translator with a replica on each of GPUs 0..N-1, one
    worker each, every batch handed over at once so that the replicas share them. No GPU here:
    CTranslate2 is told it has two, and its replicas become CPU workers (the same count) whose
    output must be the one CPU translator's; asking for more GPUs than it has is one line."""
    import ctranslate2
    import pytest

    from nmt_cli.errors import NmtError

    real, made = ctranslate2.Translator, []

    def on_the_cpu(path, device, device_index, **options):
        made.append((device, device_index, options["inter_threads"]))
        return real(path, device="cpu", **{**options, "inter_threads": len(device_index)})

    lines = sources_of(multi30k_bpe)[:60]
    config = TranslateConfig(decode=DecodeOptions(beam=4), threads=1)
    alone = Translator(from_dir(exported["float32"]), config).translate(lines)
    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 2)
    monkeypatch.setattr(ctranslate2, "Translator", on_the_cpu)
    spread = Translator(from_dir(exported["float32"]), config, gpus=2)
    assert made == [("cuda", [0, 1], 1)]
    assert spread.translate(lines) == alone
    with pytest.raises(NmtError, match="--gpus 3, but CTranslate2 sees 2 GPUs"):
        Translator(from_dir(exported["float32"]), config, gpus=3)


def test_the_server_hands_ctranslate2_as_many_batches_as_it_has_workers(exported):
    """CTranslate2 decodes batches side by side, one per worker (one per CPU thread): the
    server's default hands it that many at once, not one at a time (which left a worker idle);
    --concurrent-batches overrides it. On a CPU a server keeps one more worker, the long
    batches'; `nmt translate` does not (a worker more than threads only makes them take turns)."""
    from nmt_cli.config import ServeConfig
    from nmt_cli.serve.batcher import Batcher
    from nmt_cli.serve.contract import Served

    translating = Translator(from_dir(exported["int8"]), TranslateConfig(threads=3))
    assert translating.backend.spare == 0 and translating.backend.translator.num_translators == 3
    translator = Served(from_dir(exported["int8"]), TranslateConfig(threads=3), serving=True)
    assert translator.backend.workers == 3
    assert translator.backend.spare == 1 and translator.backend.translator.num_translators == 4
    assert Batcher(translator, ServeConfig()).at_once == 3
    assert Batcher(translator, ServeConfig()).spare == 1
    assert Batcher(translator, ServeConfig(concurrent_batches=1)).at_once == 1
    assert not Batcher(translator, ServeConfig()).stepped  # its batches take no turns


def test_the_batch_size_is_the_engines_own_unless_given(package, exported, multi30k_bpe):
    """--batch-size 0 (the default): nmt's engine decodes a narrow model (d_model 256 or less)
    on a CPU 64 sentences at a time, CTranslate2 32, and fewer lines than fill a batch for each
    thread in batches of 32 (no thread idle); a size given is kept."""
    ids = Translator(from_dir(package), TranslateConfig()).encode(sources_of(multi30k_bpe)[:200])
    sizes = {}
    for name, where, given in (("nmt", package, 0), ("ct2", exported["float32"], 0), ("given", package, 60)):
        engine = "ctranslate2" if name == "ct2" else "nmt"
        translator = Translator(from_dir(where), TranslateConfig(threads=2, batch_size=given, engine=engine))
        sizes[name] = [len(b) for b in translator.batches(ids)]
        sizes[name, "few"] = [len(b) for b in translator.batches(ids[:64])]
    assert sizes == {
        "nmt": [64, 64, 64, 8],
        ("nmt", "few"): [32, 32],
        "ct2": [32] * 6 + [8],
        ("ct2", "few"): [32, 32],
        "given": [60, 60, 60, 20],
        ("given", "few"): [60, 4],
    }


def test_a_bands_sentences_are_shared_out_in_calls_of_near_equal_size():
    assert shares(list(range(10)), [5] * 10, most=4, tokens=100) == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    # padded source tokens bound a call too: two sentences of 49 pieces (and their EOS) in 100
    assert [len(c) for c in shares(list(range(9)), [49] * 9, most=32, tokens=100)] == [1, 2, 2, 2, 2]
    assert shares([7], [500], most=32, tokens=100) == [[7]]
