"""`nmt translate` with no engine option (--engine auto) against CTranslate2's own Python API on
the same conversion (the floor: sentencepiece, translate_batch, detokenize, in a process of its
own) and against nmt's own engine (--engine nmt): wall time, CPU time and peak memory of the
whole process, on 1, 100 and 1,000 lines of Multi30k test2016 and newstest2014, alternated
rounds, beam 4.

    python benchmarks/engines.py RUN [--shapes tiny small base] [--rounds 2] [--threads 2]

`small` is RUN's trained model; any other shape a model of that shape with random weights and
RUN's vocabulary, its outputs cut at the source length for every system (--max-len-a 1
--max-len-b 0). The kept conversion is made before the rounds (the first call's cost is printed
apart). Prints JSON lines and the markdown rows of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import cpu_name  # noqa: E402
from benchmarks.deploy import random_model  # noqa: E402

NMT = [sys.executable, "-m", "nmt_cli"]
# Every system runs with its modules' bytecode kept, as from an installed package (pip compiles
# it), even where this environment asks Python not to write it (PYTHONDONTWRITEBYTECODE): else
# every call would compile nmt's modules anew.
AS_INSTALLED = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
DATA = ROOT.parent / "shared" / "data"

# The floor: CTranslate2 alone on the same conversion, with the same sentencepiece model, beam 4,
# batched as nmt's CTranslate2 backend batches (length-sorted batches of 32, each handed to a
# worker of its own, one worker per thread), each batch's outputs as long as nmt's default
# limit allows its longest source (|x| + 50; with `cut`, |x|), order restored.
FLOOR = r"""
import sys, ctranslate2, sentencepiece as spm
folder, threads, cut = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
sp = spm.SentencePieceProcessor(model_file=folder + "/spm.model")
t = ctranslate2.Translator(folder, device="cpu", inter_threads=threads, intra_threads=1)
lines = sys.stdin.read().splitlines()
pieces = [sp.encode(line, out_type=str) for line in lines]
order = sorted(range(len(lines)), key=lambda i: -len(pieces[i]))
batches = [order[k : k + 32] for k in range(0, len(order), 32)]
pending = []
for b in batches:
    limit = max(1, len(pieces[b[0]]) + (0 if cut else 50))
    pending.append(
        t.translate_batch([pieces[i] for i in b], beam_size=4, max_decoding_length=limit, asynchronous=True)
    )
out = [""] * len(lines)
for b, results in zip(batches, pending):
    for i, r in zip(b, results):
        out[i] = sp.decode(r.result().hypotheses[0])
sys.stdout.write("".join(x + "\n" for x in out))
"""


def timed(command: list[str], stdin: Path, stdout: Path, env: dict | None = None, cwd: Path = ROOT) -> dict:
    """Run `command` (in `cwd`, with `env` or AS_INSTALLED): its wall seconds, CPU seconds (user
    + system, children included) and peak resident memory (MB), the last by /usr/bin/time: a
    child forked from this process would count this process's own memory in its peak."""
    report = stdout.with_suffix(".time")
    start = time.perf_counter()
    with open(stdin, "rb") as i, open(stdout, "wb") as o:
        done = subprocess.run(
            ["/usr/bin/time", "-o", str(report), "-f", "%e %U %S %M", *command],
            stdin=i,
            stdout=o,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=AS_INSTALLED if env is None else env,
        )
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed: {done.stderr.decode()[-2000:]}")
    _, user, system, kb = report.read_text().split()[-4:]
    return {"wall": wall, "cpu": float(user) + float(system), "mb": int(kb) / 1024}


def texts(run: Path, work: Path) -> dict[str, list[str]]:
    test = (run / "text" / "test.raw.en").read_text(encoding="utf-8").splitlines()
    with gzip.open(DATA / "wmt14" / "newstest2014.en.gz", "rt", encoding="utf-8") as f:
        news = f.read().splitlines()
    return {"test2016": test, "newstest2014": news}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--shapes", nargs="+", default=["tiny", "small", "base"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[1, 100, 1000])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--skip", nargs="*", default=[], help="SHAPE:TEXT:LINES cells left out (base:newstest2014:1000)"
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nmt-engines-"))
    corpora = texts(args.run, work)
    rows = []
    try:
        for shape in args.shapes:
            package = work / shape / "package"
            package.parent.mkdir(parents=True)
            if shape == "small":
                subprocess.run([*NMT, "export", str(package), "--run-dir", str(args.run)], check=True)
            else:
                random_model(args.run, shape, package)
            cut = shape != "small"
            limits = ["--max-len-a", "1", "--max-len-b", "0"] if cut else []
            threads = ["--threads", str(args.threads)]
            one = work / "one.txt"
            one.write_text(corpora["test2016"][0] + "\n", encoding="utf-8")
            first = timed([*NMT, "translate", "--model", str(package), *threads], one, work / "out.txt")
            again = timed([*NMT, "translate", "--model", str(package), *threads], one, work / "out.txt")
            print(json.dumps({"shape": shape, "first call (converts)": first, "next": again}), flush=True)
            kept = next((package.parent / f".{package.name}.ct2").iterdir())
            systems = {
                "nmt (auto)": [*NMT, "translate", "--model", str(package), *threads, *limits],
                "CTranslate2 API": [sys.executable, "-c", FLOOR, str(kept), str(args.threads), str(int(cut))],
                "nmt --engine nmt": [
                    *NMT,
                    "translate",
                    "--model",
                    str(package),
                    "--engine",
                    "nmt",
                    *threads,
                    *limits,
                ],
            }
            for corpus, lines in corpora.items():
                for size in args.sizes:
                    if f"{shape}:{corpus}:{size}" in args.skip:
                        continue
                    given = work / f"{corpus}.{size}.txt"
                    given.write_text("\n".join(lines[:size]) + "\n", encoding="utf-8")
                    found: dict[str, list[dict]] = {name: [] for name in systems}
                    for _ in range(args.rounds):
                        for name, command in systems.items():
                            found[name].append(timed(command, given, work / "out.txt"))
                    row = {"shape": shape, "corpus": corpus, "lines": size}
                    for name, runs in found.items():
                        row[name] = {k: statistics.median(r[k] for r in runs) for k in ("wall", "cpu", "mb")}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{cpu_name()}, {args.threads} threads, medians of {args.rounds} alternated rounds\n")
    print("| shape | text | lines | nmt (auto) wall / CPU s, MB | CTranslate2 API | nmt --engine nmt |")
    print("| --- | --- | ---: | --- | --- | --- |")
    for r in rows:
        cells = [
            f"{r[n]['wall']:.2f} / {r[n]['cpu']:.2f}, {r[n]['mb']:.0f}"
            for n in ("nmt (auto)", "CTranslate2 API", "nmt --engine nmt")
        ]
        print(f"| {r['shape']} | {r['corpus']} | {r['lines']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
