"""`nmt translate` in one process and over worker processes: lines/s, and the outputs compared.

    python benchmarks/translate_procs.py RUN [--lines 3003] [--procs 1 2] [--rounds 2] [--threads 2]

RUN is a trained run directory (its model decodes; a Multi30k model on news text is slow and
wrong, which is what a back-translation of out-of-domain text looks like). The input is the
source side of newstest2014 (../shared/data/wmt14, or $NMT_SHARED_DATA). Each --procs value runs
once a round, the order reversed every other round; --threads is the whole process tree's
(each of N workers gets threads / N). Every run's output must be the same, byte for byte.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("NMT_SHARED_DATA", ROOT.parent / "shared" / "data"))


def run(run_dir: Path, source: Path, procs: int, threads: int, extra: list[str]) -> tuple[float, str]:
    """Wall seconds of one `nmt translate`, and the sha256 of its output."""
    with open(source, "rb") as stdin, tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        command = [sys.executable, "-m", "nmt_cli", "translate", "--run-dir", str(run_dir)]
        command += ["--threads", str(threads), "--procs", str(procs), *extra]
        done = subprocess.run(command, stdin=stdin, stdout=out, stderr=subprocess.PIPE, cwd=ROOT)
        seconds = time.perf_counter() - start
        if done.returncode:
            raise SystemExit(done.stderr.decode(errors="replace")[-2000:])
        out.seek(0)
        return seconds, hashlib.sha256(out.read()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--lines", type=int, default=3003)
    ap.add_argument("--procs", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extra", nargs="*", default=[], help="more `nmt translate` options, e.g. --sample")
    args = ap.parse_args()
    with gzip.open(SHARED / "wmt14" / "newstest2014.en.gz", "rb") as f:
        lines = f.read().splitlines(keepends=True)[: args.lines]
    with tempfile.NamedTemporaryFile(suffix=".en") as source:
        source.write(b"".join(lines))
        source.flush()
        digests = set()
        for r in range(args.rounds):
            order = args.procs if r % 2 == 0 else args.procs[::-1]
            for procs in order:
                seconds, digest = run(args.run, Path(source.name), procs, args.threads, args.extra)
                digests.add(digest)
                row = {"round": r, "procs": procs, "threads": args.threads, "lines": len(lines)}
                row["seconds"] = seconds
                print(json.dumps({**row, "lines_per_s": len(lines) / seconds, "output_sha256": digest[:16]}))
                sys.stdout.flush()
        print(json.dumps({"outputs_identical": len(digests) == 1, "extra": args.extra}))


if __name__ == "__main__":
    main()
