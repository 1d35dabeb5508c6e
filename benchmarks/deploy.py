"""Benchmarks of a deployed model: fidelity and speed of the CTranslate2 engine, the latency of
streaming translate, and `nmt serve` under load. Each part prints JSON lines and a markdown row.

    python benchmarks/deploy.py fidelity RUN [--split test]
        RUN's model through nmt (fp32) and CTranslate2 exports (float32, int8): lines equal to
        nmt's, BLEU and chrF of each.
    python benchmarks/deploy.py speed RUN [--shape base] [--repeats 2]
        `nmt translate` end to end (process start, load, translate, write) on RUN's 1000 test
        sentences: nmt fp32 against CTranslate2 exports (float32, int8) and `--int8`, alternating;
        with --shape, a model of that shape with random weights and RUN's vocabulary (its
        outputs are cut at the source length: --max-len-a 1 --max-len-b 0, for every engine).
    python benchmarks/deploy.py latency RUN [--old REV] [--lines 10000] [--repeats 2]
        One line written into an open `nmt translate` pipe: seconds until its answer (median
        of 20). Then a file of the first --lines training sentences, this code against revision REV's
        (alternating), seconds each.
    python benchmarks/deploy.py serve RUN [--clients 16] [--requests 2000] [--ct2 int8]
        `nmt serve` on RUN's model exported (--ct2: as a CTranslate2 export of that
        quantization), with and without dynamic batching: a bounded load
        generator (each client one request at a time, 1-8 sentences each) reports requests/s,
        sentences/s, p50/p99 latency, and checks every answer against `nmt translate`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import cpu_name  # noqa: E402

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
    from nmt_cli.score import score

    src, ref = split_files(args.run, args.split)
    models = exports(args.run, work)
    refs = ref.read_text(encoding="utf-8").splitlines()
    outs = {}
    for name, flags in (
        ("nmt fp32", ["--model", str(models["package"])]),
        ("CTranslate2 float32", ["--model", str(models["float32"])]),
        ("CTranslate2 int8", ["--model", str(models["int8"])]),
    ):
        hyp = work / f"{name.replace(' ', '_')}.hyp"
        nmt("translate", *flags, "--threads", str(args.threads), stdin=src, stdout=hyp)
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
            "cpu": cpu_name(),
        }
        print(json.dumps(row), flush=True)
        print(
            f"| {name} | {same} / {len(refs)} ({100 * same / len(refs):.1f}%) | "
            f"{row['bleu']:.2f} | {row['chrf']:.2f} |",
            flush=True,
        )


def random_model(run: Path, shape: str, out: Path) -> None:
    """A package of `shape` with random weights and `run`'s sentencepiece model."""
    import torch

    from nmt_cli.config import PRESETS, ModelConfig
    from nmt_cli.engine.model import Transformer
    from nmt_cli.package import Model, export_nmt, from_run
    from nmt_cli.rundir import RunDir

    trained = from_run(RunDir(run), None)
    config = ModelConfig(vocab_size=trained.config.vocab_size, **PRESETS[shape])
    torch.manual_seed(0)
    weights = Transformer(config).state_dict()
    export_nmt(Model(out, config, trained.spm, trained.src, trained.tgt, "random", lambda: weights), out)


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
    old = work / "old"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(old), args.old], cwd=ROOT, check=True, capture_output=True
    )
    try:
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
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)


def load(
    url: str, requests: list[list[str]], expected: dict[str, str], clients: int
) -> tuple[float, list[float], list[str], list[int]]:
    """`clients` threads send `requests`, each one at a time; the seconds it took, each
    answered request's latency, the failures, and the requests answered wrongly."""
    todo, lock = list(enumerate(requests)), threading.Lock()
    latencies: list[float] = []
    failed: list[str] = []
    wrong: list[int] = []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, sentences = todo.pop()
            body = json.dumps({"text": sentences}).encode()
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(url + "/translate", data=body, method="POST"), timeout=300
                ) as r:
                    answer = json.loads(r.read())["translations"]
            except Exception as e:  # noqa: BLE001 - counted and reported
                failed.append(f"{i}: {e}")
                continue
            latencies.append(time.perf_counter() - start)
            if answer != [expected[s] for s in sentences]:
                wrong.append(i)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, latencies, failed, wrong


def serve(args, work: Path) -> None:
    models = exports(args.run, work, ct2=bool(args.ct2))
    served = models[args.ct2] if args.ct2 else models["package"]
    src, _ = split_files(args.run, "valid")
    pool = src.read_text(encoding="utf-8").splitlines()[:500]
    (work / "pool.txt").write_text("\n".join(pool) + "\n", encoding="utf-8")
    nmt(
        "translate",
        "--model",
        str(served),
        "--threads",
        str(args.threads),
        stdin=work / "pool.txt",
        stdout=work / "pool.out",
    )
    expected = dict(zip(pool, (work / "pool.out").read_text(encoding="utf-8").split("\n")))
    rng = random.Random(0)
    requests = [rng.sample(pool, rng.randint(1, 8)) for _ in range(args.requests)]
    print(
        f"cpu: {cpu_name()}; {args.clients} clients, {len(requests)} requests, "
        f"{sum(map(len, requests))} sentences"
    )
    for batching in (["--max-wait-ms", "5"], ["--no-batching"]):
        proc = subprocess.Popen(
            [
                *NMT,
                "serve",
                "--model",
                str(served),
                "--port",
                "0",
                "--threads",
                str(args.threads),
                *batching,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        url = "http://127.0.0.1:" + re.search(rb":(\d+)", proc.stderr.readline()).group(1).decode()
        seconds, latencies, failed, wrong = load(url, requests, expected, args.clients)
        proc.terminate()
        proc.wait(60)
        q = statistics.quantiles(latencies, n=100)
        row = {
            "batching": batching[0] != "--no-batching",
            "requests": len(latencies),
            "failed": len(failed),
            "wrong": len(wrong),
            "seconds": round(seconds, 1),
            "requests_per_s": round(len(latencies) / seconds, 1),
            "sentences_per_s": round(sum(map(len, requests)) / seconds, 1),
            "p50_ms": round(q[49] * 1000),
            "p99_ms": round(q[98] * 1000),
        }
        print(json.dumps(row), flush=True)
        print(
            f"| {' '.join(batching)} | {row['requests_per_s']} | {row['sentences_per_s']} | "
            f"{row['p50_ms']} | {row['p99_ms']} | {row['failed']} | {row['wrong']} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["fidelity", "speed", "latency", "serve"])
    ap.add_argument("run", type=Path, help="a run directory with a trained, averaged model")
    ap.add_argument("--split", default="test")
    ap.add_argument("--shape", default=None, help="speed: a preset shape, random weights")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--old", default="8390ef8", help="latency: the revision to compare with")
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--ct2", choices=["float32", "int8"], help="serve: a CTranslate2 export instead")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nmt-deploy-"))
    try:
        {"fidelity": fidelity, "speed": speed, "latency": latency, "serve": serve}[args.part](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
