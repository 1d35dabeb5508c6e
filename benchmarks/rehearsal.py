"""The paper's run rehearsed command for command: prep wmt14-en-de, bpe, train `big` on several
ranks with ~25k tokens per update, validation BLEU and the best checkpoints, a SIGTERM to the
launcher and the resume, average, translate newstest2014, score it with sacreBLEU and with the
paper's tokenized, compound-split BLEU. One PASS/FAIL line per step, its minutes, the peak memory
of each rank; exits 1 if a step failed.

    python benchmarks/rehearsal.py                  # 2 CPU cores, about 15 minutes
    python benchmarks/rehearsal.py --gpus 8 --full --mirror /data/wmt14 --out wmt14-big

On a CPU the recipe runs on a miniature mirror with the real archive names and layout: real
Multi30k pairs as the training corpora (the only real en-de training text here), Multi30k's
validation set as newstest2013, and the real full newstest2014 (3003 lines) as the test set; the
recipe's checksums are pinned to those archives. The `big` shape is kept but its width and depth
are scaled down to fit the minutes, as are warm-up, checkpoint and validation intervals; BLEU is
near 0 (captions against news): what is rehearsed is the pipeline. With --full, the real archives
(downloaded, or from --mirror) and the paper's settings, this is the paper's reproduction.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("NMT_SHARED_DATA", ROOT.parent / "shared" / "data"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_name  # noqa: E402

TOKENS_PER_UPDATE = 25_000  # the paper: ~25k source and ~25k target tokens per batch

# What `--full` changes: the paper's `big` (6 layers, d 1024, 16 heads, dropout 0.3), warm-up 4000,
# 300k updates at most (the paper trained big for 300k steps), a checkpoint every 1000 updates and
# the last 20 averaged. On a CPU the same command line with the shape and intervals scaled down.
CPU = {
    "shape": ["--d-model", "128", "--ffn", "512", "--heads", "4"]
    + ["--num-encoder-layers", "2", "--num-decoder-layers", "2"],
    "max_tokens": 3125,
    "warmup": 40,
    "eval_every": 20,
    "save_every": 10,
    "minutes": 7.0,
    "average": 3,
    "vocab": 8000,
}
FULL = {
    "shape": [],
    "max_tokens": 3125,
    "warmup": 4000,
    "eval_every": 1000,
    "save_every": 1000,
    "minutes": 0.0,
    "average": 20,
    "vocab": 37000,
}


def lines(name: str) -> list[str]:
    with gzip.open(name, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def _tgz(path: Path, files: dict[str, list[str]]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = ("\n".join(text) + "\n").encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _sgm(text: list[str], lang: str, kind: str) -> list[str]:
    out = [f'<{kind}set setid="newstest2014" srclang="any" trglang="{lang}">']
    out.append('<doc sysid="ref" docid="all" genreid="news" origlang="en">')
    out += [f'<seg id="{i}">{line}</seg>' for i, line in enumerate(text, 1)]
    return [*out, "</doc>", f"</{kind}set>"]


def build_mirror(folder: Path) -> None:
    """The four archives of the wmt14-en-de recipe, under their real names and inner paths."""
    folder.mkdir(parents=True, exist_ok=True)
    en, de = lines(SHARED / "multi30k/train.en.gz"), lines(SHARED / "multi30k/train.de.gz")
    _tgz(
        folder / "training-parallel-europarl-v7.tgz",
        {"training/europarl-v7.de-en.en": en[:12000], "training/europarl-v7.de-en.de": de[:12000]},
    )
    _tgz(
        folder / "training-parallel-commoncrawl.tgz",
        {"commoncrawl.de-en.en": en[12000:24000], "commoncrawl.de-en.de": de[12000:24000]},
    )
    _tgz(
        folder / "training-parallel-nc-v9.tgz",
        {
            "training/news-commentary-v9.de-en.en": en[24000:],
            "training/news-commentary-v9.de-en.de": de[24000:],
        },
    )
    test_en, test_de = lines(SHARED / "wmt14/newstest2014.en.gz"), lines(SHARED / "wmt14/newstest2014.de.gz")
    _tgz(
        folder / "dev.tgz",
        {
            "dev/newstest2013.en": lines(SHARED / "multi30k/val.en.gz"),
            "dev/newstest2013.de": lines(SHARED / "multi30k/val.de.gz"),
            "dev/newstest2014-deen-src.en.sgm": _sgm(test_en, "en", "src"),
            "dev/newstest2014-deen-ref.de.sgm": _sgm(test_de, "de", "ref"),
        },
    )


# `nmt prep wmt14-en-de` with the recipe's checksums pinned to the miniature mirror's archives.
PINNED_PREP = """
import dataclasses, hashlib, sys
from pathlib import Path
from nmt_cli import recipes
from nmt_cli.cli import main
folder = Path(sys.argv[1])
sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
def pin(part):
    source = dataclasses.replace(part.source, sha256=sums[part.source.name], size=None)
    return dataclasses.replace(part, source=source)
pinned = {
    split: [{lang: pin(p) for lang, p in corpus.items()} for corpus in corpora]
    for split, corpora in recipes.WMT14_EN_DE.items()
}
known = recipes.RECIPES["wmt14-en-de"]
recipes.RECIPES["wmt14-en-de"] = dataclasses.replace(known, corpora=pinned)
main(sys.argv[2:])
"""


class Steps:
    def __init__(self, out: Path):
        self.out, self.results, self.failed = out, [], False
        self.log = open(out / "rehearsal.log", "a", encoding="utf-8")

    def run(
        self, name: str, argv: list[str], stdin: Path | None = None, stdout: Path | None = None, **checks
    ):
        """Run one command; PASS if it exits as expected and its stderr holds what `checks` ask."""
        if self.failed:
            return None
        start = time.monotonic()
        self.log.write(f"\n$ {' '.join(map(str, argv))}\n")
        self.log.flush()
        with open(stdin or os.devnull, "rb") as i, open(stdout or os.devnull, "wb") as o:
            done = subprocess.run(
                [str(a) for a in argv], stdin=i, stdout=o, stderr=subprocess.PIPE, text=True
            )
        self.log.write(done.stderr)
        ok = done.returncode == checks.get("code", 0) and all(
            text in done.stderr for text in checks.get("says", [])
        )
        self.record(name, ok, time.monotonic() - start, "" if ok else done.stderr.strip()[-400:])
        return done

    def record(self, name: str, ok: bool, seconds: float, detail: str = "", **extra) -> None:
        self.failed |= not ok
        self.results.append({"step": name, "pass": ok, "minutes": round(seconds / 60, 2), **extra})
        more = " ".join(f"{k} {v}" for k, v in extra.items())
        print(f"{'PASS' if ok else 'FAIL'} {name:<10} {seconds / 60:6.2f} min {more}", flush=True)
        if detail:
            print(f"     {detail}", flush=True)


def train_watched(steps: Steps, argv: list[str], stop_after: Path | None) -> tuple[subprocess.Popen, dict]:
    """Start the launcher; record each rank's peak resident memory (VmHWM) while it lives; with
    `stop_after`, SIGTERM the launcher once that checkpoint exists. Returns it finished."""
    steps.log.write(f"\n$ {' '.join(map(str, argv))}\n")
    steps.log.flush()
    proc = subprocess.Popen([str(a) for a in argv], stderr=steps.log, stdout=subprocess.DEVNULL)
    peaks: dict[int, int] = {}
    signalled = False
    while proc.poll() is None:
        for pid, rank in _workers(proc.pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            kb = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")), 0)
            peaks[rank] = max(peaks.get(rank, 0), kb)
        if stop_after is not None and not signalled and stop_after.exists():
            proc.send_signal(signal.SIGTERM)
            signalled = True
        time.sleep(0.5)
    return proc, {rank: round(kb / 1024**2, 2) for rank, kb in sorted(peaks.items())}


def train_part(steps: Steps, name: str, argv: list, stop_at: Path | None, code: int, says: str) -> None:
    """One launch of `nmt train` (see train_watched): PASS if it exits with `code` and the run's
    log then holds `says`."""
    if steps.failed:
        return
    start = time.monotonic()
    proc, peaks = train_watched(steps, argv, stop_at)
    run = Path(argv[argv.index("--run-dir") + 1])
    ok = proc.returncode == code and says in (run / "log.txt").read_text()
    detail = "" if ok else f"exit {proc.returncode}"
    steps.record(name, ok, time.monotonic() - start, detail, peak_gb_per_rank=peaks)


def newest_step(run: Path) -> int | None:
    saved = sorted((run / "checkpoints").glob("checkpoint_*.json"))
    return json.loads(saved[-1].read_text())["step"] if saved else None


def _workers(parent: int) -> list[tuple[int, int]]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != parent:
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((int(x[5:]) for x in env if x.startswith(b"RANK=")), None)
        if rank is not None:
            found.append((int(entry), rank))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/rehearsal")
    parser.add_argument("--procs", type=int, default=2, help="CPU ranks (gloo)")
    parser.add_argument("--gpus", type=int, default=0, help="GPU ranks (NCCL) instead of --procs")
    parser.add_argument("--full", action="store_true", help="the paper's sizes and the real archives")
    parser.add_argument("--mirror", type=Path, help="with --full: a folder holding the real archives")
    parser.add_argument(
        "--minutes", type=float, help="training budget (default: 7 on a CPU, none with --full)"
    )
    args = parser.parse_args()
    settings = FULL if args.full else CPU
    minutes = settings["minutes"] if args.minutes is None else args.minutes
    out = args.out
    if out.exists() and any(out.iterdir()):
        print(f"{out} is not empty: give another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    run = out / "run"
    nmt = [sys.executable, "-m", "nmt_cli"]
    steps = Steps(out)
    ranks = args.gpus or args.procs
    update_freq = max(1, round(TOKENS_PER_UPDATE / (settings["max_tokens"] * ranks)))
    where = "GPU" if args.gpus else cpu_name()
    print(
        f"rehearsal on {where}: {ranks} ranks x {settings['max_tokens']} tokens x {update_freq} = "
        f"{ranks * settings['max_tokens'] * update_freq:,} tokens per update",
        flush=True,
    )
    started = time.monotonic()

    if args.full:
        mirror = ["--mirror", args.mirror] if args.mirror else []
        steps.run("prep", [*nmt, "prep", "wmt14-en-de", "--run-dir", run, *mirror])
    else:
        build_mirror(out / "mirror")
        prep = ["prep", "wmt14-en-de", "--run-dir", run, "--mirror", out / "mirror"]
        steps.run("prep", [sys.executable, "-c", PINNED_PREP, out / "mirror", *prep])
    steps.run("bpe", [*nmt, "bpe", "--run-dir", run, "--vocab-size", settings["vocab"]])

    launch = ["--gpus", args.gpus] if args.gpus else ["--procs", args.procs, "--device", "cpu"]
    train = [*nmt, "train", "--run-dir", run, "--size", "big", *settings["shape"], *launch]
    train += ["--max-tokens", settings["max_tokens"], "--update-freq", update_freq]
    train += ["--warmup", settings["warmup"], "--max-time", minutes, "--max-steps", 300_000]
    train += ["--eval-every", settings["eval_every"], "--save-every", settings["save_every"]]
    train += ["--eval-bleu", "--keep-best", 3, "--best-metric", "bleu", "--keep-last", settings["average"]]
    # First part: SIGTERM to the launcher once the second checkpoint exists; the workers save.
    stop_at = run / "checkpoints" / f"checkpoint_{2 * settings['save_every']:08d}.json"
    train_part(steps, "train", train, stop_at, 128 + signal.SIGTERM, "stopped by SIGTERM")
    # The same command again resumes from the checkpoint that SIGTERM saved, and trains to the end.
    train_part(steps, "resume", train, None, 0, f"resuming from step {newest_step(run)}")
    steps.run("average", [*nmt, "average", "--run-dir", run, "--last", settings["average"]])
    # newstest2014 as released (prep keeps it beside the cleaned text), translated as a filter.
    src, ref = run / "text" / "test.raw.en", run / "text" / "test.raw.de"
    hyp = out / "newstest2014.hyp.de"
    steps.run("translate", [*nmt, "translate", "--run-dir", run], stdin=src, stdout=hyp)
    scores = {}
    for name, extra in (("sacrebleu", []), ("tok+split", ["--compound-split", "--lang", "de"])):
        report = out / f"score_{name}.json"
        done = steps.run(
            f"score {name}",
            [*nmt, "score", "--hyp", hyp, "--ref", ref, "--metrics", "bleu", "--json", *extra],
            stdout=report,
        )
        if done is not None and done.returncode == 0:
            scores[name] = json.loads(report.read_text())["scores"][0]
            print(f"     {scores[name]['text']}  {scores[name]['signature']}", flush=True)
    total = time.monotonic() - started
    print(f"{'PASS' if not steps.failed else 'FAIL'} {'all':<10} {total / 60:6.2f} min", flush=True)
    record = {"cpu": where, "ranks": ranks, "update_freq": update_freq, "minutes": round(total / 60, 2)}
    record.update(steps=steps.results, scores=scores)
    (out / "rehearsal.json").write_text(json.dumps(record, indent=2))
    return 1 if steps.failed else 0


if __name__ == "__main__":
    sys.exit(main())
