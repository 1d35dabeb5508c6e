"""`nmt quickstart` end to end on the real Multi30k mirror, `nmt plot`, and `--eval-bleu`."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from conftest import TINY, multi30k_folder, one_error_line

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quickstarted(tmp_path_factory, multi30k_dir):
    """A quickstart run with a miniature model in place of the recipe's (same pipeline)."""
    import contextlib
    import io

    from nmt_cli.cli import main

    run_dir = tmp_path_factory.mktemp("qs") / "run"
    err = io.StringIO()
    with pytest.raises(SystemExit) as done, contextlib.redirect_stderr(err):
        main(
            [
                "quickstart",
                "--run-dir",
                str(run_dir),
                "--mirror",
                str(multi30k_folder()),
                "--minutes",
                "5",
                *TINY,
                "--max-steps",
                "30",
                "--eval-every",
                "15",
                "--save-every",
                "10",
                "--warmup",
                "10",
                "--lr-scale",
                "4",
            ]
        )
    assert done.value.code == 0, err.getvalue()
    assert "next: nmt" not in err.getvalue()  # the pipeline runs the next step itself
    return run_dir


def test_quickstart_runs_every_step_and_reports(quickstarted, nmt):
    run = quickstarted
    manifest = json.loads((run / "manifest.json").read_text())
    assert {"prep", "bpe"} <= set(manifest)
    assert json.loads((run / "bpe.json").read_text())["vocab_size"] == 8000  # the recipe's
    train = json.loads((run / "train.json").read_text())
    assert train["eval_bleu"] and train["d_model"] == 16  # the recipe, overridden by the user
    averaged = json.loads((run / "averaged.json").read_text())
    assert averaged["averaged"] == [
        "checkpoint_00000010.pt",
        "checkpoint_00000020.pt",
        "checkpoint_00000030.pt",
    ]
    scores = json.loads((run / "scores" / "test.json").read_text())
    assert [s["metric"] for s in scores["scores"]] == ["bleu", "chrf"]
    assert scores["lines"] == 1000
    assert len((run / "translations" / "test.de").read_text().splitlines()) == 1000
    assert (run / "curves.png").read_bytes()[:8] == PNG_MAGIC


def test_quickstart_rerun_resumes_and_reports_on_stderr_only(tmp_path, nmt, quickstarted):
    # A rerun resumes: training is over (same budget), so it averages, reuses, scores, reports.
    run = tmp_path / "run"
    shutil.copytree(quickstarted, run)
    spm_before = (run / "bpe" / "spm.model").read_bytes()
    result = nmt(
        "quickstart",
        "--run-dir",
        run,
        "--mirror",
        multi30k_folder(),
        "--minutes",
        "5",
        *TINY,
        "--max-steps",
        "30",
        "--eval-every",
        "15",
        "--save-every",
        "10",
    )
    assert result.code == 0, result.err
    assert result.out == ""
    assert "nmt quickstart: Multi30k test2016" in result.err
    assert "BLEU, lowercased + Moses-tokenized" in result.err
    assert "nrefs:1|case:mixed|eff:no|tok:13a" in result.err  # the signatures are printed
    assert str(run / "curves.png") in result.err
    assert "resuming from step 30" in result.err  # the budget is spent: no further training
    assert "next: nmt" not in result.err
    # prep and bpe are not redone: the checkpoints stay tied to the BPE they were trained on
    assert result.err.count("already has this step's output") == 2
    assert (run / "bpe" / "spm.model").read_bytes() == spm_before


def test_quickstart_refuses_to_change_the_casing_of_a_run(tmp_path, nmt, quickstarted):
    run = tmp_path / "run"
    shutil.copytree(quickstarted, run)
    spm_before = (run / "bpe" / "spm.model").read_bytes()
    line = one_error_line(nmt("quickstart", "--run-dir", run, "--mirror", multi30k_folder(), "--lowercase"))
    assert "without --lowercase" in line and "new --run-dir" in line
    assert (run / "bpe" / "spm.model").read_bytes() == spm_before


def test_quickstart_lowercase_translates_and_scores_in_lowercase(tmp_path, nmt):
    run = tmp_path / "run"
    tiny = [*TINY, "--max-steps", "10", "--save-every", "10", "--eval-every", "10", "--warmup", "5"]
    result = nmt(
        "quickstart", "--run-dir", run, "--mirror", multi30k_folder(), "--minutes", "5", "--lowercase", *tiny
    )
    assert result.code == 0, result.err
    assert json.loads((run / "bpe.json").read_text())["lowercase"] is True
    hyps = (run / "translations" / "test.de").read_text(encoding="utf-8")
    assert hyps.strip() and hyps == hyps.lower()
    assert "scores are case-insensitive" in result.err
    assert "nrefs:1|case:lc|eff:no|tok:13a" in result.err


def test_quickstart_refuses_a_run_directory_of_another_corpus(run_copy, nmt):
    prep = json.loads((run_copy / "prep.json").read_text())
    (run_copy / "prep.json").write_text(json.dumps({**prep, "recipe": "custom"}))
    line = one_error_line(nmt("quickstart", "--run-dir", run_copy, "--mirror", multi30k_folder()))
    assert "new --run-dir" in line


def test_logged_validation_bleu_is_the_greedy_translation_score(quickstarted, nmt):
    """--eval-bleu logs what `nmt translate --beam 1` + `nmt score` give for that checkpoint."""
    run = quickstarted
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in rows if r["kind"] == "valid"]
    assert [r["step"] for r in valid] == [15, 30]
    logged = valid[-1]["valid_bleu"]
    assert 0.0 <= logged <= 100.0
    source = (run / "text" / "valid.raw.en").read_bytes()
    translated = nmt(  # training validates with nmt's engine, the model in memory
        "translate",
        "--run-dir",
        run,
        "--engine",
        "nmt",
        "--beam",
        "1",
        "--checkpoint",
        run / "checkpoints" / "checkpoint_00000030.pt",
        stdin=source,
    )
    assert translated.code == 0, translated.err
    hyp = run / "valid.hyp"
    hyp.write_text(translated.out, encoding="utf-8")
    scored = nmt("score", "--hyp", hyp, "--ref", run / "text" / "valid.raw.de", "--metrics", "bleu", "--json")
    assert json.loads(scored.out)["scores"][0]["score"] == pytest.approx(logged, abs=1e-6)


def test_quickstart_refuses_a_budget_too_short(nmt, tmp_path):
    line = one_error_line(nmt("quickstart", "--run-dir", tmp_path / "r", "--minutes", "1"))
    assert "--minutes 1 is too short" in line
    assert not (tmp_path / "r").exists()


def test_quickstart_passes_unknown_options_to_train_which_rejects_them(nmt, tmp_path):
    line = one_error_line(
        nmt("quickstart", "--run-dir", tmp_path / "r", "--mirror", multi30k_folder(), "--no-such-option", "3")
    )
    assert "--no-such-option" in line


def test_quickstart_refuses_launch_options_before_any_step(nmt, tmp_path):
    line = one_error_line(
        nmt("quickstart", "--run-dir", tmp_path / "r", "--mirror", multi30k_folder(), "--gpus", "2")
    )
    assert "--gpus is not for `nmt quickstart`" in line
    assert not (tmp_path / "r").exists()


def test_plot_draws_a_png_into_the_run_directory(trained, tmp_path, nmt):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    result = nmt("plot", "--run-dir", run)
    assert result.code == 0, result.err
    assert (run / "curves.png").read_bytes()[:8] == PNG_MAGIC
    elsewhere = tmp_path / "pictures" / "c.png"
    assert nmt("plot", "--run-dir", run, "--out", elsewhere).code == 0
    assert elsewhere.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_matplotlib_says_how_to_get_it(trained, nmt, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    line = one_error_line(nmt("plot", "--run-dir", trained))
    assert "pip install 'nmt-cli[plot]'" in line


def test_plot_before_training_is_a_clear_error(run_copy, nmt):
    line = one_error_line(nmt("plot", "--run-dir", run_copy))
    assert "run `nmt train` first" in line
