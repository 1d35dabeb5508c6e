"""`nmt score` below the CLI: translating a run's split once per model and settings, and the
report of scores (sacreBLEU, optionally as the Multi30k literature computes them, with a paired
bootstrap against another system)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from nmt_cli import metrics as measure
from nmt_cli import translate, ui, vocab
from nmt_cli.config import ScoreConfig, TranslateConfig
from nmt_cli.errors import NmtError
from nmt_cli.inference import comet
from nmt_cli.inference.models import Model
from nmt_cli.rundir import RunDir
from nmt_cli.textio import read_lines

if TYPE_CHECKING:
    from nmt_cli.inference.comet import Comet


def parse_metrics(values: list[str] | None) -> list[str]:
    """--metrics, given any number of times, each comma-separated; not given: every metric."""
    text = ",".join(values) if values else ",".join(measure.METRICS)
    names = list(dict.fromkeys(m.strip().lower() for m in text.split(",") if m.strip()))
    for m in names:
        if m not in measure.METRICS:
            raise NmtError(f"unknown metric {m!r} in --metrics: choose from {', '.join(measure.METRICS)}")
    return names


def run(
    run_dir: Path,
    config: ScoreConfig,
    translating: TranslateConfig,
    model: list[Path],
    stdin: Callable[[], list[str]],
) -> None:
    """`nmt score`: the report of `config`'s translations against their references, printed (and
    saved in the run directory when it scores the run's own split); `model`: what translates,
    if anything does (default: the run's)."""
    from nmt_cli.files import atomic_write_json
    from nmt_cli.inference import models

    metric_names = parse_metrics(list(config.metrics))
    run = RunDir(run_dir)

    def given(path: str | None) -> Path | None:
        return Path(path) if path is not None else None

    hyps, refs, names, found, sources, engine = inputs(
        run,
        config.split,
        translating,
        lambda: models.load(run_dir, model, translating.checkpoint),
        bool(model),
        src=given(config.src),
        hyp=given(config.hyp),
        ref=given(config.ref),
        stdin=stdin,
    )
    lang = config.lang
    if (config.moses_lc or config.compound_split) and lang is None:
        lang = target_language(run, found)
    by_run = run if config.ref is None else None
    lowercase = config.lowercase or writes_lowercase(found, by_run, config.moses_lc)
    compare = given(config.compare)
    if config.source is not None:
        if config.src is not None or config.ref is None:
            raise NmtError(
                "--source gives the sources of --hyp (with --ref); --src and the run's split bring their own"
            )
        sources = list(read_lines(Path(config.source)))
    neural = neural_metrics(config, translating, sources)
    settings = {"tokenize": config.tokenize, "lowercase": lowercase, "neural": neural}
    pairs = run.load_manifest()["prep"]["splits"][config.split].get("pairs") if by_run else None
    if pairs:  # a run of several directions: a report for each, and their mean
        if compare is not None:
            raise NmtError("--compare scores one direction: give its lines with --hyp and --ref")
        out = by_pair(hyps, refs, names, metric_names, pairs, sources, config, settings)
    else:
        out = report(
            hyps,
            refs,
            names,
            metric_names,
            moses_lc_lang=lang if config.moses_lc else None,
            compound_split_lang=lang if config.compound_split else None,
            baseline=(str(compare), list(read_lines(compare))) if compare is not None else None,
            sources=sources,
            **settings,
        )
    if engine is not None:  # the scores of translations made here name the engine that made them
        for r in [*out["scores"], *(r for p in out.get("pairs", {}).values() for r in p["scores"])]:
            r["signature"] += f"|engine:{engine}"
    if config.ref is None and not model:
        atomic_write_json(run.scores(config.split), out)
    if config.json:
        print(json.dumps(out, indent=2))
        return
    for pair, reported in out.get("pairs", {}).items():
        for r in reported["scores"]:
            print(f"{pair}\t{r['text']}\t{r['signature']}")
    for r in out["scores"]:
        print(f"{'mean' if 'pairs' in out else ''}\t{r['text']}\t{r['signature']}".lstrip("\t"))
    for m, c in out.get("compare", {}).items():
        if m != "baseline":
            places = 4 if m in ("comet", "kiwi") else 2  # COMET's scale: around 0 to 1
            print(
                f"{m}: system {c['system']:.{places}f} vs baseline {c['baseline']:.{places}f}, "
                f"p = {c['p_value']:.4f} (paired bootstrap)"
            )


def by_pair(
    hyps: list[str],
    refs: list[str],
    names: tuple[str, str],
    metrics: list[str],
    pairs: list[dict],
    sources: list[str] | None,
    config: ScoreConfig,
    settings: dict,
) -> dict:
    """The report of a split of several directions (`nmt prep multi30k --pair ...`): each
    direction's lines scored apart (--moses-lc and --compound-split in its target language), and
    as "scores" the mean of each figure over the directions."""
    measure.check_lengths(hyps, refs, *names)
    out: dict = {"hyp": names[0], "ref": names[1], "lines": len(hyps), "pairs": {}}
    start = 0
    for pair in pairs:
        end = start + pair["lines"]
        tgt = pair["tgt"]
        out["pairs"][f"{pair['src']}-{tgt}"] = report(
            hyps[start:end],
            refs[start:end],
            names,
            metrics,
            moses_lc_lang=tgt if config.moses_lc else None,
            compound_split_lang=tgt if config.compound_split else None,
            # the sources as written, without the token that chose the direction (COMET reads them)
            sources=[x.removeprefix(f"{pair['tag']} ") for x in sources[start:end]]
            if sources is not None
            else None,
            **settings,
        )
        start = end
    reports = list(out["pairs"].values())
    out["scores"] = []
    for i, first in enumerate(reports[0]["scores"]):
        mean = sum(r["scores"][i]["score"] for r in reports) / len(reports)
        shown = first["text"].split(" =")[0]
        out["scores"].append(
            {
                "metric": first["metric"],
                "score": mean,
                "signature": f"mean of {len(reports)} directions|{first['signature']}",
                "text": f"{shown} = {mean:.2f}",
            }
        )
    return out


def inputs(
    run: RunDir,
    split: str,
    config: TranslateConfig,
    load: Callable[[], Model],
    model_given: bool,
    *,
    src: Path | None,
    hyp: Path | None,
    ref: Path | None,
    stdin: Callable[[], list[str]],
) -> tuple[list[str], list[str], tuple[str, str], Model | None, list[str] | None, str | None]:
    """What `nmt score` scores, with the names of where it came from: `src` translated by the
    model (`load`), the run's `split` translated, or `hyp` (else stdin) as given; each against its
    references. Also the model, where one was loaded, the source lines, where known, and the
    engine that translated, where this command did."""
    if src is not None:
        if ref is None or hyp is not None:
            raise NmtError("--src needs --ref, and not --hyp")
        model = load()
        lines, engine = translate.translate_lines(model, config, src)
        return (
            lines,
            list(read_lines(ref)),
            (f"{src} translated", str(ref)),
            model,
            list(read_lines(src)),
            engine,
        )
    if ref is None:
        if hyp is not None:
            raise NmtError("--hyp needs --ref (or give neither to score the run's test set)")
        model = load() if model_given else None
        hyp_path, ref_path, engine = translate.translate_split(run, split, config, model)
        src_path = run.text(split, run.load_manifest()["prep"]["src"], raw=True)
        names = (str(hyp_path), str(ref_path))
        return (
            list(read_lines(hyp_path)),
            list(read_lines(ref_path)),
            names,
            model,
            list(read_lines(src_path)),
            engine,
        )
    hyps = list(read_lines(hyp)) if hyp is not None else stdin()
    return hyps, list(read_lines(ref)), (str(hyp) if hyp else "stdin", str(ref)), None, None, None


def target_language(run: RunDir, model: Model | None) -> str:
    """The model's target language, else the run's, else English."""
    if model is not None:
        return model.tgt
    prepped = run.load_manifest().get("prep", {}) if run.manifest_path.exists() else {}
    if "tgt" not in prepped:
        ui.warn(
            "--moses-lc, --compound-split: no run or model here names the target language; tokenizing as "
            "English (give --lang)"
        )
    return prepped.get("tgt", "en")


def writes_lowercase(model: Model | None, run: RunDir | None, moses_lc: bool) -> bool:
    """Whether the translations scored come from a model that writes lowercase (`nmt bpe
    --lowercase`): then case-insensitive scores, said so, rather than cased ones no casing of
    the model could reach. `run`: the run whose model translated, where no other did."""
    vocabs = model.vocabs if model is not None else run.vocabularies(False) if run is not None else None
    spm = vocabs.target if vocabs is not None else None  # the side it writes
    if moses_lc or spm is None or not spm.exists() or not vocab.folds_case(spm):
        return False
    ui.say("the model writes lowercase (`nmt bpe --lowercase`): the scores are case-insensitive")
    return True


def report(
    hyps: list[str],
    refs: list[str],
    names: tuple[str, str],
    metrics: list[str],
    *,
    tokenize: str = "13a",
    lowercase: bool = False,
    moses_lc_lang: str | None = None,
    compound_split_lang: str | None = None,
    baseline: tuple[str, list[str]] | None = None,
    neural: list[tuple[str, Comet]] | None = None,
    sources: list[str] | None = None,
) -> dict:
    """The scores of `hyps` (and the comparison with a baseline's lines) as `nmt score` reports
    them. `names` are the hypotheses' and references' sources; `moses_lc_lang` lowercases and
    Moses-tokenizes both sides in that language first, `compound_split_lang` Moses-tokenizes
    and splits compounds (and BLEU then tokenizes nothing). `neural`: COMET models, each scoring
    the text as it is, with `sources`."""
    measure.check_lengths(hyps, refs, *names)
    other = None
    if baseline is not None:
        other = baseline[1]
        measure.check_lengths(other, refs, baseline[0], names[1])
    as_is = (hyps, refs, other)
    if moses_lc_lang is not None:
        hyps, refs = measure.moses_lc(hyps, moses_lc_lang), measure.moses_lc(refs, moses_lc_lang)
        other = measure.moses_lc(other, moses_lc_lang) if other is not None else None
        tokenize = "none"
    if compound_split_lang is not None:
        split = measure.compound_split
        hyps, refs = split(hyps, compound_split_lang), split(refs, compound_split_lang)
        other = split(other, compound_split_lang) if other is not None else None
        tokenize = "none"
    results = measure.score(hyps, refs, metrics, tokenize=tokenize, lowercase=lowercase)
    out = {
        "hyp": names[0],
        "ref": names[1],
        "lines": len(hyps),
        "moses_lc": moses_lc_lang is not None,
        "compound_split": compound_split_lang is not None,
        "scores": [r.as_dict() for r in results],
    }
    if other is not None:
        out["compare"] = {
            "baseline": baseline[0],
            **measure.compare(hyps, other, refs, metrics, tokenize, lowercase),
        }
    for name, model in neural or []:
        hyps, refs, other = as_is
        if sources is not None:
            measure.check_lengths(sources, hyps, "the sources", names[0])
        segments = _neural_scores(model, hyps, sources, refs, f"{name} {names[0]}")
        system = comet.system_score(segments)
        shown = {"comet": "COMET", "kiwi": "CometKiwi"}[name]
        row = measure.Score(name, system, model.signature(), f"{shown} = {system:.4f}")
        out["scores"].append({**row.as_dict(), "segments": segments})
        if other is not None:
            theirs = _neural_scores(model, other, sources, refs, f"{name} {baseline[0]}")
            out["compare"][name] = measure.compare_means(segments, theirs)
    return out


def neural_metrics(
    config: ScoreConfig, loading: TranslateConfig, sources: list[str] | None
) -> list[tuple[str, Comet]]:
    """--comet and --kiwi's models, loaded on --device in --comet-precision; one line where they
    cannot score here."""
    wanted = [(name, path) for name, path in (("comet", config.comet), ("kiwi", config.kiwi)) if path]
    if wanted and sources is None:
        raise NmtError(
            "--comet and --kiwi score a translation with its source: give --source FILE (the lines --hyp "
            "translates), or --src, or score the run's split"
        )
    loaded = []
    for name, path in wanted:
        model = comet.load(path, loading.comet_precision, loading.device)
        if model.hparams.needs_reference != (name == "comet"):
            given = {
                "comet": "reference-free model: give it as --kiwi",
                "kiwi": "reference-based model: give it as --comet",
            }
            raise NmtError(f"{path} is a {given[name]}")
        loaded.append((name, model))
    return loaded


def _neural_scores(
    model: Comet, hyps: list[str], sources: list[str] | None, refs: list[str], what: str
) -> list[float]:
    with ui.progress() as bar:
        task = bar.add_task(what, total=len(hyps))
        return model.score(
            hyps, sources, refs if model.hparams.takes_reference else None, lambda n: bar.advance(task, n)
        )
