"""COMET's speed and memory, nmt's against unbabel-comet's own, on a model of wmt22-comet-da's
shape (XLM-R large: 24 layers, d 1024; random weights, tests/comet_model.py), the same segments,
each system in a fresh process per round, rounds alternated; and --mbr comet's cost per sentence
at 8 and 16 candidates against scoring every pair (K^2 triples) one by one.

    python benchmarks/comet_speed.py --peer comet-venv/bin/python [--segments 64] [--rounds 2]

unbabel-comet runs in its own venv (../shared/PEERS.md). Sources and references are Multi30k's
validation lines (en, de), the translations the references of the next line; every figure comes
from this run. Prints one JSON object per measurement and a table at the end.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def segments(n: int) -> dict[str, list[str]]:
    data = next(
        p
        for p in (ROOT / ".." / "shared" / "data" / "multi30k", ROOT / ".gpu" / "data" / "multi30k")
        if p.exists()
    )
    read = {
        lang: gzip.open(data / f"val.{lang}.gz", "rt", encoding="utf-8").read().splitlines()
        for lang in ("en", "de")
    }
    return {"src": read["en"][:n], "ref": read["de"][:n], "mt": read["de"][1 : n + 1]}


def peak_rss_gib() -> float:
    """This process's peak resident memory since its exec (VmHWM; ru_maxrss keeps the parent's
    from before the exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def nmt_worker(folder: str, files: str, precision: str) -> None:
    """One round of nmt's COMET in this process: load, score, report (JSON on stdout)."""
    from nmt_cli.inference import comet

    texts = json.loads(Path(files).read_text())
    start = time.perf_counter()
    model = comet.load(folder, precision)
    loaded = time.perf_counter()
    scores = model.score(texts["mt"], texts["src"], texts["ref"])
    done = time.perf_counter()
    peak = peak_rss_gib()
    print(
        json.dumps(
            {"segments": scores, "load_s": loaded - start, "score_s": done - loaded, "peak_rss_gib": peak}
        )
    )


def mbr_cost(folder: Path, texts: dict[str, list[str]], sentences: int) -> list[dict]:
    """Seconds per sentence of --mbr comet's utilities (one encoding per candidate) against the
    K^2 (candidate, pseudo-reference) triples scored one by one, K = 8 and 16."""
    from nmt_cli.inference import comet

    model = comet.load(folder)
    rows = []
    for k in (8, 16):
        pools = [[texts["mt"][(i + j) % len(texts["mt"])] for j in range(k)] for i in range(sentences)]
        start = time.perf_counter()
        tables = model.mbr_utilities(texts["src"][:sentences], pools)
        ours = (time.perf_counter() - start) / sentences
        start = time.perf_counter()
        naive = []
        for src, pool in zip(texts["src"], pools):
            pairs = [(h, r) for h in pool for r in pool]
            naive.append(model.score([h for h, _ in pairs], [src] * len(pairs), [r for _, r in pairs]))
        by_pairs = (time.perf_counter() - start) / sentences
        gap = max(abs(a - b) for t, n in zip(tables, naive) for a, b in zip(t.flatten().tolist(), n))
        rows.append({"candidates": k, "one_encoding_s": ours, "pairs_s": by_pairs, "largest_gap": gap})
        print(json.dumps({"mbr": rows[-1]}), flush=True)
    return rows


def main() -> None:
    import platform

    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True, help="unbabel-comet's venv's python")
    ap.add_argument("--segments", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mbr-sentences", type=int, default=1)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return nmt_worker(*args.worker)
    import comet_model

    texts = segments(args.segments)
    with tempfile.TemporaryDirectory() as tmp:
        folder = comet_model.build(Path(tmp) / "large", "regression_metric", shape="large")
        files = Path(tmp) / "texts.json"
        files.write_text(json.dumps(texts))
        for side in ("src", "mt", "ref"):
            (Path(tmp) / side).write_text("\n".join(texts[side]) + "\n", encoding="utf-8")
        paths = [a for side in ("src", "mt", "ref") for a in (f"--{side}", str(Path(tmp) / side))]
        peer = [args.peer, str(ROOT / "benchmarks/peers/comet_score.py"), "--model", str(folder), *paths]
        ours = [sys.executable, __file__, "--peer", args.peer, "--worker", str(folder), str(files)]
        commands = {
            "unbabel-comet 2.2.7, fp32, batch 16": peer,
            "nmt, fp32": [*ours, "fp32"],
            "nmt, bf16": [*ours, "bf16"],
        }
        results: dict[str, list[dict]] = {name: [] for name in commands}
        for r in range(args.rounds):
            for name in commands if r % 2 == 0 else list(commands)[::-1]:
                done = subprocess.run(commands[name], capture_output=True, text=True, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
                results[name].append(row)
                figures = {k: v for k, v in row.items() if k not in ("segments", "system")}
                print(json.dumps({"run": name, "round": r, **figures}), flush=True)
        mbr = mbr_cost(folder, texts, args.mbr_sentences)
    reference = results["unbabel-comet 2.2.7, fp32, batch 16"][0]["segments"]
    print(f"\n{platform.processor() or platform.machine()}; {args.segments} segments, {args.rounds} rounds\n")
    print("| system | segments/s (median) | load s | peak RSS GiB | largest segment gap to unbabel-comet |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, rows in results.items():
        speed = statistics.median(args.segments / r["score_s"] for r in rows)
        gap = max(abs(a - b) for a, b in zip(rows[0]["segments"], reference))
        load = statistics.median(r["load_s"] for r in rows)
        peak = max(r["peak_rss_gib"] for r in rows)
        print(f"| {name} | {speed:.2f} | {load:.1f} | {peak:.2f} | {gap:.2e} |")
    print("\n| candidates | --mbr comet s/sentence | K^2 pairs s/sentence | largest gap |")
    print("| ---: | ---: | ---: | ---: |")
    for row in mbr:
        k, ours_s, pairs_s, gap = (row[x] for x in ("candidates", "one_encoding_s", "pairs_s", "largest_gap"))
        print(f"| {k} | {ours_s:.2f} | {pairs_s:.2f} | {gap:.1e} |")


if __name__ == "__main__":
    main()
