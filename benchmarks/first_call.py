"""The first `nmt translate` call after `nmt export` against the calls after it, on one line, with
nmt installed as a user gets it: `pip install --no-deps --target` into a temporary folder (pip
compiles the modules' bytecode), run from outside this checkout. Each round exports RUN's model
anew, then times the first call and two more; wall and CPU seconds per call, medians over rounds.

    python benchmarks/first_call.py RUN [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import cpu_name  # noqa: E402
from benchmarks.engines import timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    run = args.run.resolve()
    with tempfile.TemporaryDirectory(prefix="nmt-first-") as tmp:
        work = Path(tmp)
        target = work / "installed"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(ROOT)],
            check=True,
        )
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPATH"] = str(target)
        nmt = [sys.executable, "-m", "nmt_cli"]
        one = work / "one.txt"
        line = (run / "text" / "test.raw.en").read_text(encoding="utf-8").splitlines()[0]
        one.write_text(line + "\n", encoding="utf-8")
        calls: dict[str, list[dict]] = {"first": [], "second": [], "third": []}
        for r in range(args.rounds):
            package = work / f"package{r}"
            export = [*nmt, "export", str(package), "--run-dir", str(run)]
            subprocess.run(export, check=True, env=env, cwd=work)
            translate = [*nmt, "translate", "--model", str(package), "--threads", str(args.threads)]
            for name in calls:
                got = timed(translate, one, work / "out.txt", env, work)
                calls[name].append(got)
                print(json.dumps({"round": r, "call": name, **got}), flush=True)
    print(f"\n{cpu_name()}, {args.threads} threads, medians of {args.rounds} rounds\n")
    print("| call after the export | wall s | CPU s |\n| --- | ---: | ---: |")
    for name, got in calls.items():
        wall = statistics.median(g["wall"] for g in got)
        cpu = statistics.median(g["cpu"] for g in got)
        print(f"| {name} | {wall:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
