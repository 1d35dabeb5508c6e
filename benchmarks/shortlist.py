"""Lexical shortlists on a trained Multi30k run directory: their sizes chosen on validation, then
the speed and BLEU of both engines with and without one on test2016.

    python benchmarks/shortlist.py RUN --choose
    python benchmarks/shortlist.py RUN --speed [--rounds 3]
    python benchmarks/shortlist.py RUN --profile

--choose builds shortlists of several sizes (the most frequent target pieces kept for every batch,
and each source piece's candidates) from the run's training data and translates the valid split
with each (nmt's engine, beam 4, batches of 32): the lines equal to the whole vocabulary's, BLEU,
and the mean number of target pieces a batch scores.
--speed exports the run (with the shortlist `nmt bpe` built, of the sizes in shortlist.py) as a
package and as CTranslate2 float32 and int8 exports, and times `nmt translate` end to end (start,
load, translate test2016, write) on each with and without --shortlist, in alternated rounds (the
best of each), printing sentences/s, BLEU and the lines equal to the same decoder without.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from nmt_cli.config import TranslateConfig  # noqa: E402
from nmt_cli.inference import shortlist
from nmt_cli.inference.models import locate  # noqa: E402
from nmt_cli.inference.translator import Translator  # noqa: E402
from nmt_cli.rundir import RunDir  # noqa: E402
from nmt_cli.shards import Shard  # noqa: E402
from nmt_cli.vocab import pieces  # noqa: E402

SIZES = [(64, 8), (128, 16), (256, 16), (256, 32), (256, 64), (512, 32)]  # (frequent, per source)


def nmt(*args: str, stdin: Path | None = None, stdout: Path | None = None) -> None:
    with open(stdin or "/dev/null", "rb") as i, open(stdout or "/dev/null", "wb") as o:
        subprocess.run([sys.executable, "-m", "nmt_cli", *args], stdin=i, stdout=o, check=True)


def bleu(hyps: Path, refs: Path) -> float:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "nmt_cli",
            "score",
            "--hyp",
            str(hyps),
            "--ref",
            str(refs),
            "--metrics",
            "bleu",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)["scores"][0]["score"]


def choose(run: Path) -> None:
    r = RunDir(run)
    prep = r.load_manifest()["prep"]
    vocabs = r.vocabularies()
    source, target = pieces(vocabs.source), pieces(vocabs.target)
    ids = {p: i for i, p in enumerate(target)}
    same = np.array([ids.get(p, -1) for p in source])
    pairs = Shard(r.tokens("train", prep["src"])), Shard(r.tokens("train", prep["tgt"]))
    lines = r.text("valid", prep["src"], raw=True).read_text(encoding="utf-8").splitlines()
    refs = r.text("valid", prep["tgt"], raw=True)
    model = Translator(locate(run), TranslateConfig(threads=2))
    full = model.translate(lines)
    out = Path(tempfile.mkdtemp(prefix="shortlist-"))
    (out / "full").write_text("\n".join(full) + "\n", encoding="utf-8")
    whole = bleu(out / "full", refs)
    print(f"valid, {len(lines)} lines, vocabulary {len(target)}; the whole vocabulary: BLEU {whole:.2f}")
    print("| frequent | per source piece | pieces a batch scores | lines equal | BLEU | build s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    batches = [model.encode(lines[i : i + 32]) for i in range(0, len(lines), 32)]
    for frequent, per_source in SIZES:
        start = time.perf_counter()
        built = shortlist.build(*pairs, len(source), len(target), same, frequent, per_source)
        took = time.perf_counter() - start
        model.backend.shortlist = built  # type: ignore[attr-defined]
        found = model.translate(lines)
        (out / "listed").write_text("\n".join(found) + "\n", encoding="utf-8")
        equal = sum(a == b for a, b in zip(full, found))
        scored = np.mean([len(built.among(b)) for b in batches])
        print(
            f"| {frequent} | {per_source} | {scored:.0f} | {equal} ({equal / len(lines):.1%}) | "
            f"{bleu(out / 'listed', refs):.2f} | {took:.1f} |",
            flush=True,
        )


def speed(run: Path, rounds: int) -> None:
    r = RunDir(run)
    prep = r.load_manifest()["prep"]
    source, refs = r.text("test", prep["src"], raw=True), r.text("test", prep["tgt"], raw=True)
    lines = len(source.read_text(encoding="utf-8").splitlines())
    out = Path(tempfile.mkdtemp(prefix="shortlist-speed-"))
    nmt("export", str(out / "package"), "--run-dir", str(run))
    for q in ("float32", "int8"):
        nmt(
            "export",
            str(out / q),
            "--format",
            "ctranslate2",
            "--quantization",
            q,
            "--model",
            str(out / "package"),
        )
    decoders = {
        "nmt fp32": out / "package",
        "CTranslate2 float32": out / "float32",
        "CTranslate2 int8": out / "int8",
    }
    best: dict[tuple[str, bool], float] = {}
    for _ in range(rounds):
        for name, where in decoders.items():
            for listed in (False, True):
                hyps = out / f"{name.replace(' ', '_')}{'_listed' if listed else ''}.txt"
                start = time.perf_counter()
                flags = ["--threads", "2", *(["--shortlist"] if listed else [])]
                nmt("translate", "--model", str(where), *flags, stdin=source, stdout=hyps)
                rate = lines / (time.perf_counter() - start)
                best[name, listed] = max(best.get((name, listed), 0.0), rate)
    print(f"test2016, {lines} lines, beam 4, 2 threads, end to end, best of {rounds} alternated rounds")
    print("| decoder | sentences/s | with --shortlist | BLEU | with --shortlist | lines equal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in decoders:
        plain, listed = (out / f"{name.replace(' ', '_')}{s}.txt" for s in ("", "_listed"))
        equal = sum(a == b for a, b in zip(plain.read_text().splitlines(), listed.read_text().splitlines()))
        print(
            f"| {name} | {best[name, False]:.1f} | {best[name, True]:.1f} | {bleu(plain, refs):.2f} | "
            f"{bleu(listed, refs):.2f} | {equal} |"
        )


def profile(run: Path) -> None:
    """Where a decoding step's time goes (one thread, torch's profiler, 512 validation lines,
    without a shortlist), and what starting a process costs each engine (one line, end to end)."""
    import torch

    r = RunDir(run)
    prep = r.load_manifest()["prep"]
    lines = r.text("valid", prep["src"], raw=True).read_text(encoding="utf-8").splitlines()[:512]
    model = Translator(locate(run), TranslateConfig(threads=1))
    model.translate(lines[:64])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        model.translate(lines)
    ops = {e.key: e.self_cpu_time_total for e in p.key_averages()}
    vocabulary = sum(ops.get(k, 0) for k in ("mkldnn::_linear_pointwise", "aten::topk", "aten::_log_softmax"))
    share = vocabulary / sum(ops.values())
    print(f"the output projection, top-k and log-softmax: {share:.0%} of the operators' time")
    out = Path(tempfile.mkdtemp(prefix="shortlist-start-"))
    nmt("export", str(out / "package"), "--run-dir", str(run))
    nmt("export", str(out / "float32"), "--format", "ctranslate2", "--model", str(out / "package"))
    (out / "one.txt").write_text(lines[0] + "\n", encoding="utf-8")
    for name in ("package", "float32"):
        took = []
        for _ in range(3):
            start = time.perf_counter()
            nmt("translate", "--model", str(out / name), "--threads", "2", stdin=out / "one.txt")
            took.append(time.perf_counter() - start)
        print(f"{name}: one line end to end, best of 3: {min(took):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", type=Path)
    parser.add_argument("--choose", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.choose:
        choose(args.run)
    if args.speed:
        speed(args.run, args.rounds)
    if args.profile:
        profile(args.run)


if __name__ == "__main__":
    main()
