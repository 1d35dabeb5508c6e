"""`nmt quickstart`: Multi30k English-German end to end, in one call of each step's function:
prep, BPE, training on the CPU recipe, averaging, translating and scoring test2016, the plot."""

from __future__ import annotations

import dataclasses
import time

from nmt_cli import average, bpe, plot, prep, score, translate, ui
from nmt_cli import train as train_mod
from nmt_cli.config import MULTI30K_CPU, BpeConfig, PrepConfig, TrainConfig, TranslateConfig
from nmt_cli.data import recipes
from nmt_cli.errors import NmtError
from nmt_cli.files import atomic_write_json, read_json
from nmt_cli.rundir import RunDir
from nmt_cli.textio import read_lines
from nmt_cli.vocab import folds_case

# The minute of the budget the steps besides training take (prep, BPE, decoding and scoring the
# test set; docs/benchmarks.md times them); the rest trains.
RESERVE_MINUTES = 1.0
STEPS = 6


def run(
    run_dir: RunDir,
    minutes: float,
    mirror: str | None,
    threads: int,
    train_options: dict,
    lowercase: bool = False,
) -> None:
    """The whole pipeline in `run_dir`; `train_options` (TrainConfig fields) override the
    recipe's; `lowercase` is `nmt bpe --lowercase`. A rerun keeps the data steps already done
    and resumes training."""
    # Checked before prep and BPE run, not after.
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for name in sorted(set(train_options) - fields):
        raise NmtError(
            f"--{name.replace('_', '-')} is not for `nmt quickstart`, which trains "
            "in this process: run the steps one by one to use it"
        )
    if minutes < RESERVE_MINUTES + 1:
        raise NmtError(
            f"--minutes {minutes:g} is too short: give at least "
            f"{RESERVE_MINUTES + 1:g} (15 shows a readable model)"
        )
    started = time.monotonic()
    done = _data_steps_done(run_dir)
    _step(1, "prep Multi30k")
    if "prep" in done:
        ui.say(f"{run_dir.root} already has this step's output (manifest.json): kept")
    else:
        config = recipes.resolved(PrepConfig(recipe="multi30k-en-de", mirror=mirror))
        prep.check_inputs(config)
        with run_dir.lock("prep"):
            run_dir.save_config("prep", config)
            prep.show(prep.prepare(config, run_dir))
    _step(2, "learn BPE and binarize")
    # A rerun must not re-learn the BPE its checkpoints were trained on.
    if "bpe" in done:
        learned = folds_case(run_dir.vocabularies().target)  # the model, not its config: what encodes
        if learned != lowercase:
            raise NmtError(
                f"{run_dir.root} holds a BPE model learned {'with' if learned else 'without'} "
                "--lowercase: give `nmt quickstart` a new --run-dir, or the same option again"
            )
        ui.say(f"{run_dir.root} already has this step's output (manifest.json): kept")
    else:
        config = BpeConfig(vocab_size=MULTI30K_CPU.vocab_size, lowercase=lowercase)
        with run_dir.lock("bpe"):
            run_dir.save_config("bpe", config)
            bpe.show(bpe.run_bpe(config, run_dir))
    _step(3, f"train for {minutes - RESERVE_MINUTES:g} minutes")
    _train(run_dir, minutes - RESERVE_MINUTES, threads, train_options)
    _step(4, "average checkpoints")
    with run_dir.lock("average"):
        average.average_run(run_dir, MULTI30K_CPU.average, ui.say)
    _step(5, "translate and score test2016")
    hyp, ref, _ = translate.translate_split(run_dir, "test", TranslateConfig(threads=threads))
    hyps, refs = list(read_lines(hyp)), list(read_lines(ref))
    lowercase = score.writes_lowercase(None, run_dir, moses_lc=False)
    report = score.report(hyps, refs, (str(hyp), str(ref)), ["bleu", "chrf"], lowercase=lowercase)
    atomic_write_json(run_dir.scores("test"), report)
    _step(6, "plot")
    try:
        picture = str(plot.plot(run_dir))
    except NmtError as e:
        picture = f"not drawn: {e}"
    lc = score.report(hyps, refs, (str(hyp), str(ref)), ["bleu"], moses_lc_lang="de")
    _summary(run_dir, report, lc["scores"][0], picture, time.monotonic() - started)


def _train(run_dir: RunDir, minutes: float, threads: int, options: dict) -> None:
    recipe = {**MULTI30K_CPU.train, "max_steps": 0, "max_time": minutes}
    if threads:
        recipe["threads"] = threads
    given = {**{f.name: f.default for f in dataclasses.fields(TrainConfig)}, **recipe, **options}
    with run_dir.lock("train"):
        config = train_mod.settings(run_dir, given, set(recipe) | set(options))
        train_mod.train_here(run_dir, config, rank=0)


def _data_steps_done(run_dir: RunDir) -> set[str]:
    """The data steps a quickstart run directory already has: none, prep, or prep and bpe."""
    if not run_dir.manifest_path.exists():
        return set()
    manifest = run_dir.load_manifest()
    prep_config = run_dir.config_path("prep")
    recipe = read_json(prep_config).get("recipe") if prep_config.exists() else None
    if "prep" in manifest and (recipe != "multi30k-en-de" or manifest["prep"].get("src") != "en"):
        raise NmtError(
            f"{run_dir.root} holds another corpus or direction ({recipe}): give "
            "`nmt quickstart` a new --run-dir"
        )
    done = {step for step in ("prep", "bpe") if step in manifest}
    return done if "prep" in done else set()


def _step(i: int, title: str) -> None:
    ui.console().rule(f"[bold]{i}/{STEPS}: {title}")


def _summary(run_dir: RunDir, report: dict, lc: dict, picture: str, seconds: float) -> None:
    named = [
        ("BLEU" if s["metric"] == "bleu" else "chrF", s["score"], s["signature"]) for s in report["scores"]
    ]
    named.append(("BLEU, lowercased + Moses-tokenized", lc["score"], lc["signature"]))
    ui.table(
        f"nmt quickstart: Multi30k test2016 en-de, {seconds / 60:.1f} minutes",
        ["score", "test2016"],
        [[name, f"{value:.2f}"] for name, value, _ in named],
    )
    for name, _, signature in named:
        ui.say(f"{name}: {signature}")
    # Paths as plain lines, not table cells: a narrow terminal must not fold them.
    for what, where in [
        ("run directory", str(run_dir.root)),
        ("model (averaged)", str(run_dir.averaged)),
        ("test translations", report["hyp"]),
        ("scores", str(run_dir.scores("test"))),
        ("training figures", str(run_dir.metrics)),
        ("curves", picture),
    ]:
        ui.say(f"{what}: {where}")
    ui.say(
        f"translate your own text: echo 'A man is riding a bike.' | nmt translate --run-dir {run_dir.root}"
    )
