"""Minimum-Bayes-risk decoding against beam search on a trained Multi30k run directory.

    python benchmarks/mbr.py RUN --choose             # Multi30k valid: the candidates' grid
    python benchmarks/mbr.py RUN --report "--mbr chrf --candidates 16"   # test2016, once

--choose translates the run's valid split with beam 4 and with each MBR setting of the grid
(candidates from the beam's n-best or from epsilon sampling, chrF or BLEU as the utility),
printing sacreBLEU BLEU and chrF and sentences/s (`Translator.hypotheses` on the whole split,
the candidates' search and the utilities together); and the utilities' cost alone, nmt's bulk
computation against sacreBLEU's sentence scores pair by pair, on the chosen setting's candidates.
--report translates the test split (test2016) with beam 4 and with the chosen setting, once,
and compares them with `nmt score --compare` (sacreBLEU's paired bootstrap, 1,000 samples).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nmt_cli.inference import mbr
from nmt_cli.inference.translator import Translator  # noqa: E402
from nmt_cli.rundir import RunDir  # noqa: E402

GRID = [
    "--mbr chrf --candidates 4",
    "--mbr chrf --candidates 8",
    "--mbr chrf --candidates 16",
    "--mbr chrf --sample --epsilon 0.02 --candidates 16",
    "--mbr chrf --sample --epsilon 0.02 --candidates 32",
    "--mbr bleu --candidates 8",
    "--mbr bleu --sample --epsilon 0.02 --candidates 16",
]


def options_of(flags: str) -> dict:
    """`nmt translate`'s decoding flags as Translator options."""
    out: dict = {}
    words = shlex.split(flags)
    while words:
        name = words.pop(0).removeprefix("--").replace("-", "_")
        if not words or words[0].startswith("--"):
            out[name] = True
        else:
            value = words.pop(0)
            out[name] = int(value) if value.isdigit() else float(value) if "." in value else value
    return out


def translate(model: Translator, lines: list[str], flags: str) -> tuple[list[str], float]:
    """The translations of `lines` and sentences/s."""
    options = options_of(flags)
    start = time.perf_counter()
    found = model.translate(lines, **options)
    return found, len(lines) / (time.perf_counter() - start)


def scores(hyps: Path, refs: Path, baseline: Path | None = None) -> dict:
    command = [sys.executable, "-m", "nmt_cli", "score", "--hyp", str(hyps), "--ref", str(refs), "--json"]
    command += ["--metrics", "bleu,chrf"] + (["--compare", str(baseline)] if baseline else [])
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def utility_cost(model: Translator, lines: list[str], flags: str) -> None:
    """Seconds of the utilities over the candidates of `lines`: bulk, and sacreBLEU pair by pair."""
    import sacrebleu

    options = options_of(flags)
    decode = model.config.decode.__class__(**{**vars(model.config.decode), **options})
    search = decode.for_candidates()
    found = model.hypotheses(lines, search)
    pools = model.texts(found)
    metric = decode.mbr
    start = time.perf_counter()
    for pool in pools:
        first, times = mbr.deduplicated(pool)
        mbr.ranked([pool[i] for i in first], metric, times)
    bulk = time.perf_counter() - start
    score = sacrebleu.sentence_chrf if metric == "chrf" else sacrebleu.sentence_bleu
    start = time.perf_counter()
    for pool in pools:
        unique = list(dict.fromkeys(pool))
        [[score(h, [r]).score for r in unique] for h in unique]
    pairwise = time.perf_counter() - start
    n = sum(len(set(p)) for p in pools) / len(pools)
    print(
        f"utilities ({metric}, {len(lines)} lines, {n:.1f} different candidates a line): "
        f"bulk {bulk:.2f} s, sacreBLEU pair by pair {pairwise:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", type=Path)
    parser.add_argument("--choose", action="store_true", help="the grid on the valid split")
    parser.add_argument("--report", metavar="FLAGS", help="this setting and beam 4 on the test split, once")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lines", type=int, default=0, help="the first N lines only (0: all)")
    args = parser.parse_args()
    run = RunDir(args.run)
    model = Translator.load(args.run, threads=args.threads)
    out = Path(tempfile.mkdtemp(prefix="mbr-"))
    split = "valid" if args.choose else "test"
    lines = run.text(split, "en", raw=True).read_text(encoding="utf-8").splitlines()
    refs = run.text(split, "de", raw=True)
    if args.lines:
        lines = lines[: args.lines]
        (out / "refs").write_text(
            "\n".join(refs.read_text(encoding="utf-8").splitlines()[: args.lines]) + "\n"
        )
        refs = out / "refs"
    settings = ["--beam 4"] + (GRID if args.choose else [args.report])
    print(f"{split}: {len(lines)} lines, {args.threads} threads, outputs in {out}")
    print("| setting | BLEU | chrF | sentences/s | p against beam 4 (BLEU / chrF) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for i, flags in enumerate(settings):
        found, speed = translate(model, lines, flags)
        path = out / f"{i}.txt"
        path.write_text("\n".join(found) + "\n", encoding="utf-8")
        result = scores(path, refs, out / "0.txt" if i else None)
        bleu, chrf = (s["score"] for s in result["scores"])
        row = f"| `{flags}` | {bleu:.2f} | {chrf:.2f} | {speed:.1f} |"
        if "compare" in result:
            p = result["compare"]
            row += f" {p['bleu']['p_value']:.4f} / {p['chrf']['p_value']:.4f} |"
        print(row if "compare" in result else row + " |", flush=True)
    if args.report:
        utility_cost(model, lines, args.report)


if __name__ == "__main__":
    main()
