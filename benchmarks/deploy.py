"""Benchmarks of a deployed model: fidelity and speed of the CTranslate2 engine, the latency of
streaming translate. Each part prints JSON lines and a markdown row.

    python benchmarks/deploy.py fidelity RUN [--split test] [--precisions bf16 fp16] [--device D]
        RUN's model through nmt (fp32, and each of --precisions) and CTranslate2 exports
        (float32, int8; --no-ct2: none): lines equal to nmt fp32's, BLEU, chrF and seconds end
        to end of each (the choice of the default decoding precision: --split valid).
    python benchmarks/deploy.py speed RUN [--shape base] [--repeats 2]
        `nmt translate` end to end (process start, load, translate, write) on RUN's 1000 test
        sentences: nmt fp32 against CTranslate2 exports (float32, int8) and `--int8`, alternating;
        with --shape, a model of that shape with random weights and RUN's vocabulary (its
        outputs are cut at the source length: --max-len-a 1 --max-len-b 0, for every engine).
    python benchmarks/deploy.py latency RUN [--old REV] [--lines 10000] [--repeats 2]
        One line written into an open `nmt translate` pipe: seconds until its answer (median
        of 20). Then a file of the first --lines training sentences, this code against revision REV's
        (alternating), seconds each.

`nmt serve` under load: benchmarks/serve_load.py.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import checkout, cpu_name  # noqa: E402

NMT = [sys.executable, "-m", "nmt_cli"]


def nmt(
    *args: str,
    stdin: Path | None = None,
    stdout: Path | None = None,
    cwd: Path = ROOT,
    env: dict | None = None,
) -> float:
    """Run `nmt ARGS`; the wall-clock seconds it took."""
    start = time.perf_counter()
    with open(stdin or os.devnull, "rb") as i, open(stdout or os.devnull, "wb") as o:
        done = subprocess.run([*NMT, *args], stdin=i, stdout=o, stderr=subprocess.PIPE, cwd=cwd, env=env)
    if done.returncode:
        sys.exit(f"nmt {' '.join(args)} failed: {done.stderr.decode()[-2000:]}")
    return time.perf_counter() - start


def split_files(run: Path, split: str) -> tuple[Path, Path]:
    prep = json.loads((run / "manifest.json").read_text())["prep"]
    return (run / "text" / f"{split}.raw.{prep['src']}", run / "text" / f"{split}.raw.{prep['tgt']}")


def exports(run: Path, work: Path, ct2: bool = True, shape: str | None = None) -> dict[str, Path]:
    """RUN's model as a package (`shape`: a model of that shape with random weights instead),
    and (`ct2`) as CTranslate2 float32 and int8 exports."""
    out = {"package": work / "package", "float32": work / "ct2-float32", "int8": work / "ct2-int8"}
    if shape:
        random_model(run, shape, out["package"])
    else:
        nmt("export", str(out["package"]), "--run-dir", str(run))
    for q in ("float32", "int8") if ct2 else ():
        nmt(
            "export",
            str(out[q]),
            "--format",
            "ctranslate2",
            "--quantization",
            q,
            "--model",
            str(out["package"]),
        )
    return out


def fidelity(args, work: Path) -> None:
    from nmt_cli.metrics import score

    src, ref = split_files(args.run, args.split)
    models = exports(args.run, work, ct2=not args.no_ct2)
    refs = ref.read_text(encoding="utf-8").splitlines()
    package = ["--model", str(models["package"])]
    systems = [("nmt fp32", package)] + [(f"nmt {p}", [*package, "--precision", p]) for p in args.precisions]
    if not args.no_ct2:
        systems += [(f"CTranslate2 {q}", ["--model", str(models[q])]) for q in ("float32", "int8")]
    outs, rows = {}, []
    for name, flags in systems:
        hyp = work / f"{name.replace(' ', '_')}.hyp"
        common = ["--threads", str(args.threads), "--device", args.device]
        seconds = nmt("translate", *flags, *common, stdin=src, stdout=hyp)
        outs[name] = hyp.read_text(encoding="utf-8").splitlines()
        bleu, chrf = score(outs[name], refs, ["bleu", "chrf"])
        same = sum(a == b for a, b in zip(outs[name], outs["nmt fp32"]))
        row = {
            "system": name,
            "split": args.split,
            "lines": len(refs),
            "same_as_nmt": same,
            "bleu": round(bleu.score, 2),
            "chrf": round(chrf.score, 2),
            "bleu_signature": bleu.signature,
            "seconds": round(seconds, 2),
            "device": args.device,
            "cpu": cpu_name(),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        print(
            f"| {name} | {same} / {len(refs)} ({100 * same / len(refs):.1f}%) | "
            f"{row['bleu']:.2f} | {row['chrf']:.2f} | {seconds:.1f} s |",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


def random_model(run: Path, shape: str, out: Path) -> None:
    """A package of `shape` with random weights and `run`'s sentencepiece model."""
    import torch

    from nmt_cli.config import PRESETS, ModelConfig
    from nmt_cli.engine.model import Transformer
    from nmt_cli.inference.models import Model, from_run
    from nmt_cli.inference.packages import export_nmt
    from nmt_cli.rundir import RunDir

    trained = from_run(RunDir(run), None)
    config = ModelConfig(vocab_size=trained.config.vocab_size, **PRESETS[shape])
    torch.manual_seed(0)
    weights = Transformer(config).state_dict()
    export_nmt(Model(out, config, trained.vocabs, trained.src, trained.tgt, "random", lambda: weights), out)


def speed(args, work: Path) -> None:
    src, _ = split_files(args.run, "test")
    lines = src.read_text(encoding="utf-8").splitlines()[:1000]
    (work / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    exports(args.run, work, shape=args.shape)
    # random weights never stop: outputs cut at the source length, for every engine
    limits = ["--max-len-a", "1", "--max-len-b", "0"] if args.shape else []
    systems = {
        "nmt fp32": ["--model", str(work / "package")],
        "CTranslate2 float32": ["--model", str(work / "ct2-float32")],
        "CTranslate2 int8 (export)": ["--model", str(work / "ct2-int8")],
        "CTranslate2 int8 (`--int8`, converted on load)": ["--model", str(work / "package"), "--int8"],
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, flags in systems.items():
            times[name].append(
                nmt(
                    "translate",
                    *flags,
                    *limits,
                    "--threads",
                    str(args.threads),
                    stdin=work / "in.txt",
                    stdout=work / "out.txt",
                )
            )
            print(json.dumps({"system": name, "seconds": round(times[name][-1], 2)}), flush=True)
    base = statistics.median(times["nmt fp32"])
    what = f"{args.shape} shape, random weights" if args.shape else "trained model"
    for name, ts in times.items():
        s = statistics.median(ts)
        print(f"| {what} | {name} | {s:.1f} | {len(lines) / s:.1f} | {base / s:.2f}x |")
    print(f"cpu: {cpu_name()}")


def latency(args, work: Path) -> None:
    models = exports(args.run, work, ct2=False)
    src, _ = split_files(args.run, "valid")
    sentences = src.read_text(encoding="utf-8").splitlines()[:21]
    proc = subprocess.Popen(
        [*NMT, "translate", "--model", str(models["package"]), "--threads", str(args.threads)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    waits = []
    for sentence in sentences:
        start = time.perf_counter()
        proc.stdin.write(sentence.encode() + b"\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        if not ready:
            sys.exit("no answer in 120 s: the pipe does not stream")
        proc.stdout.readline()
        waits.append(time.perf_counter() - start)
    proc.stdin.close()
    proc.wait()
    # The first answer also waits for the model to load.
    print(
        json.dumps(
            {
                "first_line_s": round(waits[0], 3),
                "median_line_s": round(statistics.median(waits[1:]), 3),
                "max_line_s": round(max(waits[1:]), 3),
            }
        ),
        flush=True,
    )
    train = split_files(args.run, "valid")[0].with_name(f"train.{src.name.split('.')[-1]}")
    with open(train, encoding="utf-8") as f:
        text = "".join(line for _, line in zip(range(args.lines), f))
    (work / "file.txt").write_text(text, encoding="utf-8")
    with checkout(args.old, work / "old") as old:
        # The old code reads the run directory; the new one reads it too, for the same model.
        runs = {"new": ROOT, f"old ({args.old})": old}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.repeats):
            for name, where in runs.items():
                times[name].append(
                    nmt(
                        "translate",
                        "--run-dir",
                        str(args.run.resolve()),
                        "--threads",
                        str(args.threads),
                        stdin=work / "file.txt",
                        stdout=work / f"{name[:3]}.out",
                        cwd=where,
                    )
                )
                print(json.dumps({"code": name, "seconds": round(times[name][-1], 2)}), flush=True)
        same = (work / "new.out").read_bytes() == (work / "old.out").read_bytes()
        a, b = (statistics.median(t) for t in times.values())
        print(
            f"| {args.lines:,} lines | {b:.1f} s | {a:.1f} s | {a / b:.3f} | "
            f"{'identical' if same else 'DIFFERENT'} |"
        )
        print(
            f"| one line into an open pipe | median {statistics.median(waits[1:]):.3f} s, "
            f"max {max(waits[1:]):.3f} s (first, with the model's load: {waits[0]:.2f} s) |"
        )
        print(f"cpu: {cpu_name()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["fidelity", "speed", "latency"])
    ap.add_argument("run", type=Path, help="a run directory with a trained, averaged model")
    ap.add_argument("--split", default="test")
    ap.add_argument("--shape", default=None, help="speed: a preset shape, random weights")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--old", default="8390ef8", help="latency: the revision to compare with")
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precisions", nargs="*", default=[], help="fidelity: nmt in these too (bf16, fp16)")
    ap.add_argument("--device", default="auto", help="fidelity: where `nmt translate` decodes")
    ap.add_argument("--no-ct2", action="store_true", help="fidelity: nmt alone, no CTranslate2 exports")
    ap.add_argument("--out", type=Path, help="fidelity: the rows as JSON")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nmt-deploy-"))
    try:
        {"fidelity": fidelity, "speed": speed, "latency": latency}[args.part](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
