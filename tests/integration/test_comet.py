"""COMET and CometKiwi as unbabel-comet computes them: nmt's scores of tiny random COMET models
(tests/comet_model.py) equal those unbabel-comet 2.2.7 gave in its own venv
(benchmarks/peers/comet_score.py wrote tests/data/comet_expected.json), for each estimator; the
checkpoint is read as weights only; `nmt score --comet/--kiwi` reports them with a signature and
the paired bootstrap."""

import dataclasses
import json
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch
from comet_model import SEGMENTS, build

from nmt_cli.errors import NmtError
from nmt_cli.inference import comet

EXPECTED = json.loads((Path(__file__).parents[1] / "data" / "comet_expected.json").read_text())["models"]
ESTIMATORS = ("regression_metric", "referenceless_regression_metric", "unified_metric")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("comet")
    return {e: build(root / e, e) for e in ESTIMATORS}


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("texts")
    src, mt, ref = map(list, zip(*SEGMENTS))
    files = {"src": src, "mt": mt, "ref": ref, "other": list(reversed(mt))}
    for name, lines in files.items():
        (root / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {name: root / name for name in files}


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_scores_equal_unbabel_comets(models, estimator):
    model = comet.load(models[estimator])
    src, mt, ref = map(list, zip(*SEGMENTS))
    scores = model.score(mt, src, ref if estimator == "regression_metric" else None)
    expected = EXPECTED[estimator]
    assert len(scores) == len(expected["segments"])
    for ours, theirs in zip(scores, expected["segments"]):
        assert ours == pytest.approx(theirs, abs=1e-3)
    assert comet.system_score(scores) == pytest.approx(expected["system"], abs=1e-4)


def test_sparsemax_projects_onto_the_simplex():
    weights = comet.sparsemax(torch.tensor([1.5, 0.2, -3.0, 1.1]))
    assert weights.sum().item() == pytest.approx(1.0) and weights[2] == 0 and weights[0] > weights[1]
    assert torch.allclose(comet.sparsemax(torch.zeros(4)), torch.full((4,), 0.25))


def _resave(folder: Path, change) -> None:
    path = folder / "checkpoints" / "model.ckpt"
    data = torch.load(path, weights_only=True)
    change(data)
    torch.save(data, path)


class Payload:
    def __reduce__(self):
        return (print, ("unpickled",))


def test_a_checkpoint_holding_an_object_is_refused_in_one_line(models, tmp_path, capsys):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(models["regression_metric"], folder)
    _resave(folder, lambda d: d.__setitem__("callbacks", {"x": Payload()}))
    with pytest.raises(NmtError, match="could not be read as weights only .*Unsupported global") as e:
        comet.load(folder)
    assert "\n" not in str(e.value) and "unpickled" not in capsys.readouterr().out


def test_an_encoder_config_larger_than_the_checkpoint_is_refused_before_allocating(models, tmp_path):
    """A config.json is a few bytes: one declaring a billion-row vocabulary (4 TB of fp32)
    is refused from its count on the meta device, before any weight is allocated."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(models["regression_metric"], folder)
    config = folder / "tiny-xlmr" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "vocab_size": 10**9}))
    with pytest.raises(NmtError, match=r"describes 32,\d{3},\d{3},\d{3} weights, more than .* holds"):
        comet.load(folder)


def test_lightnings_attribute_dictionary_is_read_as_the_hyperparameters(models, tmp_path, monkeypatch):
    """Lightning 1 pickled hyperparameters as its AttributeDict: allowed, read as a dict."""
    import shutil

    module = types.ModuleType("pytorch_lightning.utilities.parsing")

    class AttributeDict(dict):
        pass

    AttributeDict.__module__, AttributeDict.__qualname__ = module.__name__, "AttributeDict"
    module.AttributeDict = AttributeDict
    for parent in ("pytorch_lightning", "pytorch_lightning.utilities"):  # pickle imports the path
        monkeypatch.setitem(sys.modules, parent, sys.modules.get(parent) or types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    folder = tmp_path / "m"
    shutil.copytree(models["unified_metric"], folder)
    (folder / "hparams.yaml").write_text("class_identifier: something_else\n")  # the checkpoint's own win
    _resave(folder, lambda d: d.__setitem__("hyper_parameters", AttributeDict(d["hyper_parameters"])))
    assert b"AttributeDict" in pickle.dumps(AttributeDict())
    model = comet.load(folder)
    assert model.hparams.estimator == "unified_metric"


def test_score_reports_comet_and_kiwi_with_signatures_and_the_bootstrap(models, texts, nmt):
    result = nmt(
        "score", "--hyp", texts["mt"], "--ref", texts["ref"], "--source", texts["src"],
        "--comet", models["regression_metric"], "--kiwi", models["unified_metric"],
        "--compare", texts["other"], "--json", "--metrics", "bleu",
    )  # fmt: skip
    assert result.code == 0, result.err
    out = json.loads(result.out)
    rows = {r["metric"]: r for r in out["scores"]}
    for name, estimator in (("comet", "regression_metric"), ("kiwi", "unified_metric")):
        assert rows[name]["score"] == pytest.approx(EXPECTED[estimator]["system"], abs=1e-4)
        assert f"estimator:{estimator}" in rows[name]["signature"] and len(rows[name]["segments"]) == len(
            SEGMENTS
        )
        assert 0 < out["compare"][name]["p_value"] <= 1
    text = nmt(
        "score", "--hyp", texts["mt"], "--ref", texts["ref"], "--source", texts["src"],
        "--comet", models["regression_metric"], "--metrics", "bleu",
    )  # fmt: skip
    assert text.code == 0 and "COMET = " in text.out and "|comet:regression_metric|" in text.out
    assert "|fp32|cpu|" in text.out
    bf16 = nmt(
        "score", "--hyp", texts["mt"], "--ref", texts["ref"], "--source", texts["src"],
        "--comet", models["regression_metric"], "--metrics", "bleu", "--comet-precision", "bf16", "--json",
    )  # fmt: skip
    assert bf16.code == 0, bf16.err
    (row,) = [r for r in json.loads(bf16.out)["scores"] if r["metric"] == "comet"]
    assert "|bf16|cpu|" in row["signature"]
    assert row["score"] == pytest.approx(EXPECTED["regression_metric"]["system"], abs=0.5)


@pytest.mark.parametrize(
    "args, line",
    [
        (["--comet", "{regression_metric}"], "--comet and --kiwi score a translation with its source"),
        (
            ["--source", "{src}", "--comet", "{unified_metric}"],
            "is a reference-free model: give it as --kiwi",
        ),
        (
            ["--source", "{src}", "--kiwi", "{regression_metric}"],
            "is a reference-based model: give it as --comet",
        ),
        (["--source", "{src}", "--comet", "{src}"], "is not a COMET model folder"),
        (
            ["--source", "{src}", "--comet", "{regression_metric}", "--comet-precision", "fp16"],
            "unknown --comet-precision 'fp16': choose fp32 or bf16",
        ),
    ],
)
def test_what_cannot_be_scored_is_one_line(models, texts, nmt, args, line):
    names = {**{k: str(v) for k, v in models.items()}, "src": str(texts["src"])}
    result = nmt("score", "--hyp", texts["mt"], "--ref", texts["ref"], *[a.format(**names) for a in args])
    assert result.code != 0 and line in result.err and "Traceback" not in result.err, result.err


# -- choosing among a search's candidates: --mbr comet, --rerank kiwi, in both engines


def _choosing(model, engine: str, **options):
    from nmt_cli.config import DecodeOptions, TranslateConfig
    from nmt_cli.inference.translator import Translator

    config = TranslateConfig(engine=engine, comet=options.pop("comet", None), kiwi=options.pop("kiwi", None))
    return Translator(model, dataclasses.replace(config, decode=DecodeOptions(**options)))


def _weighted(texts: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in texts:
        counts[t] = counts.get(t, 0) + 1
    return counts


@pytest.fixture(scope="module")
def lines(trained_longer) -> list[str]:
    from nmt_cli.rundir import RunDir

    return RunDir(trained_longer).text("valid", "en", raw=True).read_text().splitlines()[:20]


@pytest.mark.parametrize("engine", ["nmt", "ctranslate2"])
def test_mbr_comet_chooses_the_highest_mean_utility_of_the_naive_pairs(
    models, lines, package, exported, engine
):
    """--mbr comet from one encoding of each candidate chooses, on 20 lines, what scoring every
    (candidate, pseudo-reference) pair with COMET one by one chooses, with that mean as its score."""
    from nmt_cli.inference.models import from_dir

    model = from_dir(package if engine == "nmt" else exported["float32"])
    chooser = _choosing(model, engine, mbr="comet", candidates=6, comet=str(models["regression_metric"]))
    chosen = chooser.hypotheses(lines)
    pools = _choosing(model, engine, **dataclasses.asdict(chooser.config.decode.for_candidates()))
    pools = pools.texts(pools.hypotheses(lines))
    metric = comet.load(models["regression_metric"])
    chose_otherwise = 0
    for line, pool, (best,) in zip(lines, pools, chooser.texts(chosen)):
        counts = _weighted(pool)
        pairs = [(h, r) for h in counts for r in counts]
        scores = metric.score([h for h, _ in pairs], [line] * len(pairs), [r for _, r in pairs])
        by_hand = {h: 0.0 for h in counts}
        for (h, r), s in zip(pairs, scores):
            by_hand[h] += s * counts[r] / len(pool)
        assert by_hand[best] == pytest.approx(max(by_hand.values()), abs=1e-5)
        chose_otherwise += best != pool[0]
    assert [h[0].score for h in chosen] == pytest.approx(
        [max(v for v in _mean_table(metric, line, pool).values()) for line, pool in zip(lines, pools)],
        abs=1e-5,
    )
    assert chose_otherwise > 0  # not the search's own best on every line


def _mean_table(metric, line: str, pool: list[str]) -> dict[str, float]:
    counts = _weighted(pool)
    table = metric.mbr_utilities([line], [list(counts)])[0]
    weights = torch.tensor([counts[c] for c in counts], dtype=table.dtype)
    return dict(zip(counts, (table @ weights / weights.sum()).tolist()))


@pytest.mark.parametrize("engine", ["nmt", "ctranslate2"])
def test_rerank_kiwi_chooses_the_candidate_cometkiwi_scores_highest(models, lines, package, exported, engine):
    from nmt_cli.inference.models import from_dir

    model = from_dir(package if engine == "nmt" else exported["float32"])
    chooser = _choosing(
        model, engine, rerank="kiwi", candidates=6, nbest=2, kiwi=str(models["unified_metric"])
    )
    chosen = chooser.hypotheses(lines)
    pools = _choosing(model, engine, **dataclasses.asdict(chooser.config.decode.for_candidates()))
    pools = pools.texts(pools.hypotheses(lines))
    metric = comet.load(models["unified_metric"])
    for line, pool, hyps, got in zip(lines, pools, chosen, chooser.texts(chosen)):
        unique = list(dict.fromkeys(pool))
        scores = dict(zip(unique, metric.score(unique, [line] * len(unique))))
        best = sorted(unique, key=lambda c: -scores[c])[:2]
        assert [scores[t] for t in got] == pytest.approx([scores[t] for t in best], abs=1e-5)
        assert [h.score for h in hyps] == pytest.approx([scores[t] for t in got], abs=1e-5)


def test_choosing_by_comet_refuses_in_one_line(models, lines, trained_longer, nmt):
    stdin = ("\n".join(lines[:3]) + "\n").encode()
    for args, line in (
        (["--mbr", "comet"], "--mbr comet needs --comet DIR"),
        (["--rerank", "kiwi", "--kiwi", str(models["regression_metric"])], "is not a CometKiwi model"),
        (["--mbr", "chrf", "--rerank", "kiwi"], "--mbr and --rerank each choose among the candidates"),
    ):
        result = nmt("translate", "--run-dir", trained_longer, *args, stdin=stdin)
        assert result.code != 0 and line in result.err and "Traceback" not in result.err, result.err
    kiwi = ["--rerank", "kiwi", "--kiwi", models["unified_metric"], "--candidates", "4"]
    done = nmt("translate", "--run-dir", trained_longer, *kiwi, stdin=stdin)
    assert done.code == 0 and len(done.out.splitlines()) == 3, done.err


# -- training: --best-metric comet


@pytest.mark.parametrize("ranks", [1, 2])
def test_best_metric_comet_keeps_the_checkpoint_comet_prefers(models, run_copy, nmt, ranks):
    """Validation COMET (rank 0 scores the first --comet-lines lines' greedy translations; every
    rank shares the figure) chooses the kept best model, on one process and on 2 gloo ranks."""
    from conftest import TINY

    from nmt_cli.engine import checkpoint

    launch = ["--procs", "2", "--device", "cpu"] if ranks > 1 else []
    result = nmt(
        "train", "--run-dir", run_copy, *TINY, "--max-steps", "40", "--eval-every", "10",
        "--save-every", "10", "--warmup", "10", "--lr-scale", "4", "--keep-best", "1",
        "--best-metric", "comet",
        "--comet", models["regression_metric"], "--comet-lines", "40", *launch,
    )  # fmt: skip
    assert result.code == 0, result.err
    assert "validation COMET: greedy translations of the first 40 of" in result.err
    rows = [json.loads(x) for x in (run_copy / "metrics.jsonl").read_text().splitlines()]
    valid = {r["step"]: r["valid_comet"] for r in rows if r["kind"] == "valid"}
    assert sorted(valid) == [10, 20, 30, 40] and len(set(valid.values())) > 1
    (score, path), *_ = checkpoint.best_listed(run_copy / "checkpoints" / "best")
    best_step = max(valid, key=lambda s: valid[s])
    assert path.name == f"best_{best_step:08d}.pt" and score == pytest.approx(-valid[best_step])


def test_score_pairs_kiwi_prints_cometkiwis_score_of_each_pair(models, texts, nmt):
    """Quality estimation of a corpus's pairs, no translation model read: `sort -rn` on the
    scores keeps the pairs CometKiwi prefers."""
    result = nmt(
        "score-pairs", "--src", texts["src"], "--tgt", texts["mt"], "--kiwi", models["unified_metric"]
    )
    assert result.code == 0, result.err
    scores = [float(x) for x in result.out.split()]
    assert scores == pytest.approx(EXPECTED["unified_metric"]["segments"], abs=1e-4)
    refused = nmt(
        "score-pairs", "--src", texts["src"], "--tgt", texts["mt"], "--kiwi", models["regression_metric"]
    )
    assert refused.code != 0 and "reference-based model: --kiwi takes a CometKiwi model" in refused.err


def test_score_pairs_kiwi_keeps_the_pairs_scoring_at_least_min_score(models, texts, nmt, tmp_path):
    """A QE filter: the pairs CometKiwi scores at or above --min-score, line-aligned, in order."""
    scores = EXPECTED["unified_metric"]["segments"]
    cut = sorted(scores)[len(scores) // 2]
    kept = [tmp_path / "kept.src", tmp_path / "kept.tgt"]
    pairs = ["--src", texts["src"], "--tgt", texts["mt"], "--kiwi", models["unified_metric"]]
    result = nmt(
        "score-pairs", *pairs, "--min-score", f"{cut - 1e-4}", "--kept-src", kept[0], "--kept-tgt", kept[1]
    )
    assert result.code == 0, result.err
    src, mt, _ = map(list, zip(*SEGMENTS))
    wanted = [(s, t) for s, t, v in zip(src, mt, scores) if v >= cut]
    assert list(zip(*(k.read_text().splitlines() for k in kept))) == wanted
    assert 0 < len(wanted) < len(scores) and f"kept {len(wanted)} of {len(scores)} pairs" in result.err
    alone = nmt("score-pairs", *pairs, "--min-score", "0.5")
    assert alone.code != 0 and "--min-score X with --kept-src FILE and --kept-tgt FILE" in alone.err
    assert "Traceback" not in alone.err


# -- on a GPU (tests/strict_cuda.py: the tensors stay on the CPU)


@pytest.fixture
def recorded_gpus(monkeypatch):
    """Two recorded GPUs; a COMET model's weights and batches stay on the CPU whatever device it
    names, and each pass of its encoder notes which GPU was current in its thread."""
    from strict_cuda import StrictCuda

    cuda = StrictCuda(count=2).install(monkeypatch)
    monkeypatch.setattr(comet.Comet, "to", lambda self, device: self)
    monkeypatch.setattr(comet.Comet, "_placed", lambda self, x: x)
    current: list[int] = []
    layers = comet.Comet._layers

    def noting(self, ids, mask):
        current.append(cuda.current())
        return layers(self, ids, mask)

    monkeypatch.setattr(comet.Comet, "_layers", noting)
    return cuda, current


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_comet_model_on_a_gpu_runs_with_that_gpu_current(models, recorded_gpus, estimator):
    """`--device cuda:1` (and `cuda`, which is cuda:0): every encoder pass runs with the model's
    GPU current, from a new thread (GPU 0 current, as a server's or a worker's); the scores are
    the CPU's."""
    import threading

    _, current = recorded_gpus
    src, mt, ref = map(list, zip(*SEGMENTS))
    reference = ref if estimator == "regression_metric" else None
    for name, index in (("cuda:1", 1), ("cuda", 0)):
        current.clear()
        model = comet.load(models[estimator], device=name)
        assert model.device == torch.device("cuda", index) and "|cuda|" in model.signature()
        found: list = []

        def scoring(model=model, found=found):
            found.append(model.score(mt, src, reference))

        thread = threading.Thread(target=scoring)
        thread.start()
        thread.join()
        assert found and found[0] == pytest.approx(EXPECTED[estimator]["segments"], abs=1e-3)
        assert current and set(current) == {index}, current
    if estimator == "regression_metric":
        current.clear()
        model.mbr_utilities(src[:2], [mt[:3], mt[1:4]])
        assert current and set(current) == {0}


def test_training_scores_comet_on_the_gpu_its_rank_trains_on(models, recorded_gpus, trained):
    """`train --comet` on a GPU rank: the model is read onto the rank's own GPU, named by index."""
    from nmt_cli.rundir import RunDir
    from nmt_cli.train import comet_of_ids

    cuda, current = recorded_gpus
    loaded = []
    load = comet.load
    scorer = comet_of_ids(RunDir(trained), str(models["regression_metric"]), 4, device="cuda")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(comet, "load", lambda *a: loaded.append(a[1:]) or load(*a))
        cuda.set_device(1)
        try:
            scorer([[5, 6, 7]] * 4)
        finally:
            cuda.set_device(0)
    assert loaded == [("fp32", "cuda:1")] and set(current) == {1}
