"""Benchmark beam search: nmt cached and uncached, fairseq's SequenceGenerator, CTranslate2
float32 and int8 — same shape, same sources, same amount of work, in one run.

    python benchmarks/decode_speed.py [--shapes tiny base] [--sentences 96]
    python benchmarks/decode_speed.py --trained RUN_DIR    # a trained model, as users run it
    python benchmarks/decode_speed.py --trained PACKAGE    # the same, from `nmt export`'s package

Every system is forced to the same output length (64 tokens): fairseq and CTranslate2 through
their minimum/maximum lengths, nmt through its maximum length (max_len_a 0, max_len_b 65: 64
tokens and the EOS); a system that still stops early (random weights can end a hypothesis)
stops the benchmark, since the work would differ. Beam 4, batches of 32 sentences, 2 threads.
Sources are real sentences, encoded with the Multi30k BPE model: newstest2014 (news, long) and
Multi30k test2016 (short). The systems run in turn, --repeats rounds (3), and each figure is the
median of its rounds. nmt's uncached decoder (which reruns the decoder's self-attention over
the whole prefix; the encoder side is computed once) decodes the first --uncached-sentences,
and the cached decoder decodes those too, so their ratio is the self-attention cache's alone.
`--host-work` times only the search's own work per step besides the model (search_host_work).
`--trained RUN_DIR` (or an `nmt export` package, as deployed) instead times `nmt translate` on
that run's model as a user runs it (beam 4, early stopping, its own batching) on all of Multi30k
test2016 and the first 1000 lines of newstest2014, with the process's peak resident memory;
`--against CHECKOUT` times another checkout's code too, in alternate rounds (a change must not
slow decoding); `--variant OPTIONS` this code with other options, `--constraints N` with N terms
per line (the reference's N longest words), with the share of lines whose translation holds
them all.
Peers run in their own venvs (benchmarks/peers/install_fairseq.sh; `pip install ctranslate2`
in ../peers/ct2).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, cpu_name, model_config  # noqa: E402

from nmt_cli.config import DecodeOptions  # noqa: E402
from nmt_cli.engine import decoding  # noqa: E402
from nmt_cli.engine.model import Transformer  # noqa: E402
from nmt_cli.engine.packing import pack_for_cpu  # noqa: E402
from nmt_cli.vocab import EOS, PAD  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("NMT_SHARED_DATA", ROOT.parent / "shared" / "data"))
PEERS = ROOT.parent / "peers"


def sources(name: str, n: int) -> list[list[int]]:
    import sentencepiece as spm

    model = ROOT / "benchmarks/out/multi30k/bpe/spm.model"
    if not model.exists():
        sys.exit(f"{model} is missing: run benchmarks/data_pipeline.py first (it makes it)")
    sp = spm.SentencePieceProcessor(model_file=str(model))
    path = DATA / (
        "wmt14/newstest2014.en.gz" if name == "newstest2014" else "multi30k/test_2016_flickr.en.gz"
    )
    lines = gzip.open(path, "rt", encoding="utf-8").read().splitlines()[:n]
    return [ids[:200] for ids in sp.encode(lines)]


def nmt_decode(
    shape_name: str, ids: list[list[int]], cache: bool, dtype, length: int, label: str = ""
) -> dict:
    torch.manual_seed(0)
    model = Transformer(model_config(SHAPES[shape_name])).eval().to(dtype)
    pack_for_cpu(model)  # as `nmt translate` decodes on the CPU (fp32 only: bf16 stays as is)
    tokens = 0
    for i in [-1] + list(range(0, len(ids), 32)):  # -1: an untimed warm-up
        if i == 0:
            tokens, start = 0, time.perf_counter()
        chunk = ids[:2] if i < 0 else ids[i : i + 32]
        width = max(len(s) for s in chunk) + 1
        src = torch.full((len(chunk), width), PAD)
        for r, s in enumerate(chunk):
            src[r, : len(s)] = torch.tensor(s)
            src[r, len(s)] = EOS
        hyps = decoding.translate(
            model, src, DecodeOptions(beam=4, max_len_a=0.0, max_len_b=length + 1), use_cache=cache
        )
        tokens += sum(len(h[0].tokens) for h in hyps)
    seconds = time.perf_counter() - start
    name = f"nmt {'cached' if cache else 'uncached'} {str(dtype).replace('torch.', '')}{label}"
    return {"system": name, "seconds": seconds, "tokens": tokens, "sentences": len(ids)}


def search_host_work(
    device: str = "cpu",
    beam: int = 4,
    sentences: int = 64,
    steps: int = 60,
    vocab: int = 64,
    repeats: int = 5,
) -> float:
    """Milliseconds of work per step that a search does besides the model's own step: beam
    search (or greedy, beam 1) over `sentences` whose "model" hands back one row of a fixed
    table (EOS far down it, so each runs to its limit of `steps` tokens), on `device`. With a
    vocabulary this small the arithmetic is nothing: what is left is the host's bookkeeping and
    the launch of each of the search's kernels, what a GPU waits for between replayed steps.
    The median of `repeats` searches after two."""
    from nmt_cli.engine import beam as beam_search
    from nmt_cli.engine import sampling
    from nmt_cli.engine.rules import NextToken
    from nmt_cli.vocab import EOS as eos

    torch.manual_seed(0)
    table = torch.log_softmax(torch.randn(steps + 2, vocab), -1).to(device)
    table[:, eos] = -30.0
    times = []
    for _ in range(repeats + 2):
        taken = [0]

        def step(tokens: torch.Tensor, taken=taken) -> torch.Tensor:
            row = table[taken[0]]
            taken[0] += 1
            return row.expand(len(tokens), vocab).clone()

        rules = NextToken(DecodeOptions(beam=beam), [steps] * sentences, beam, device)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if beam == 1:
            sampling.greedy(step, lambda rows: None, rules, device)
        else:
            beam_search.search(step, lambda rows: None, rules, device)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / taken[0] * 1e3)
    return statistics.median(times[2:])


def peer(python: Path, script: str, shape: str, ids_file: Path, *extra: str) -> dict | None:
    if not python.exists():
        return None
    done = subprocess.run(
        [
            str(python),
            str(ROOT / "benchmarks/peers" / script),
            "--shape",
            shape,
            "--ids",
            str(ids_file),
            *extra,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {"system": script, "error": done.stderr[-400:]}


def trained(
    run: Path,
    out: Path,
    against: Path | None = None,
    rounds: int = 1,
    variants: tuple[str, ...] = (),
    constraints: tuple[int, ...] = (),
) -> list[dict]:
    """Wall time and peak RSS of `nmt translate` (a fresh process per test set); with `against`
    (another checkout of nmt), that code's too, with `variants` (translate's options, as
    "--sample --topk 10") this code with each, and with `constraints` (counts) this code with
    that many phrases per line from the line's reference (`terms`), all in alternate rounds; the
    sha256 of each output tells whether two translate alike."""
    codes = [("this", ROOT, ())] + ([("against", against.resolve(), ())] if against else [])
    codes += [(variant, ROOT, tuple(variant.split())) for variant in variants]
    rows = []
    for name, path, n in (
        ("multi30k test2016", "multi30k/test_2016_flickr.en.gz", 1000),
        ("newstest2014", "wmt14/newstest2014.en.gz", 1000),
    ):
        lines = gzip.open(DATA / path, "rt", encoding="utf-8").read().splitlines()[:n]
        src = out.parent / f"trained_{name.split()[0]}.en"
        src.write_text("\n".join(lines) + "\n", encoding="utf-8")
        refs = gzip.open(DATA / path.replace(".en.", ".de."), "rt", encoding="utf-8").read().splitlines()[:n]
        phrases = {k: terms(refs, k) for k in constraints}
        for k, per_line in phrases.items():
            terms_file = out.parent / f"trained_{name.split()[0]}.terms{k}"
            terms_file.write_text("".join("\t".join(t) + "\n" for t in per_line), encoding="utf-8")
            codes.append((f"{k} constraints/line", ROOT, ("--constraints", str(terms_file))))
        for r in range(rounds):
            for code, root, flags in codes if r % 2 == 0 else codes[::-1]:
                timed = _translate(run, src, root, code, flags)
                out_lines = timed.pop("lines")
                if "--constraints" in flags:
                    wanted = phrases[int(code.split()[0])]
                    held = sum(all(t in line for t in ts) for ts, line in zip(wanted, out_lines))
                    timed["constraints_held"] = held / len(wanted)
                rows.append({"set": name, "code": code, "round": r, **timed})
                print(json.dumps(rows[-1]), flush=True)
        codes = [c for c in codes if "--constraints" not in c[2]]
    return rows


def terms(refs: list[str], k: int) -> list[list[str]]:
    """Per reference, its `k` longest words (ties: the first), as terminology a user would ask
    for: words the reference holds, rarely all of them in an unconstrained translation."""
    words = [sorted(dict.fromkeys(re.findall(r"\w{3,}", ref)), key=len, reverse=True) for ref in refs]
    return [w[:k] for w in words]


def summarise(rows: list[dict]) -> list[dict]:
    """Per test set and code: the median sentences/s of its rounds, against the first code's,
    and whether its output is the same in every round and as the first code's."""
    out = []
    for name in dict.fromkeys(r["set"] for r in rows):
        codes = dict.fromkeys(r["code"] for r in rows if r["set"] == name)
        first = None
        for code in codes:
            mine = [r for r in rows if (r["set"], r["code"]) == (name, code)]
            speed = statistics.median(r["sentences_per_s"] for r in mine)
            words = statistics.median(r["target_words"] / r["seconds"] for r in mine)
            first = first or (speed, mine[0]["sha256"])
            out.append(
                {
                    "set": name,
                    "code": code,
                    "rounds": len(mine),
                    "sentences_per_s": round(speed, 1),
                    "words_per_s": round(words),
                    "spread": [
                        round(min(r["sentences_per_s"] for r in mine), 1),
                        round(max(r["sentences_per_s"] for r in mine), 1),
                    ],
                    "vs_first": round(speed / first[0], 3),
                    "same_output_as_first": all(r["sha256"] == first[1] for r in mine),
                    "peak_rss_mb": round(max(r["peak_rss_mb"] for r in mine)),
                    **(
                        {"constraints_held": min(r["constraints_held"] for r in mine)}
                        if "constraints_held" in mine[0]
                        else {}
                    ),
                }
            )
    return out


def _translate(run: Path, src: Path, root: Path, code: str, flags: tuple[str, ...]) -> dict:
    """One `nmt translate` of `src` by the nmt_cli found in `root`, with `flags`."""
    hyp = src.with_suffix(f".{hashlib.sha256(code.encode()).hexdigest()[:8]}.hyp")
    with open(src, "rb") as stdin, open(hyp, "wb") as stdout:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nmt_cli",
                "translate",
                "--model" if (run / "nmt.json").exists() else "--run-dir",
                str(run.resolve()),
                "--threads",
                "2",
                *flags,
            ],
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.DEVNULL,
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak memory
        seconds = time.perf_counter() - start
    if status:
        sys.exit(f"nmt translate ({code}) failed on {src} (status {status})")
    out_lines = hyp.read_text(encoding="utf-8").splitlines()
    sentences = len(src.read_text(encoding="utf-8").splitlines())
    assert len(out_lines) == sentences
    return {
        "sentences": sentences,
        "seconds": seconds,
        "sentences_per_s": sentences / seconds,
        "target_words": sum(len(x.split()) for x in out_lines),
        "sha256": hashlib.sha256(hyp.read_bytes()).hexdigest(),
        "lines": out_lines,
        "peak_rss_mb": usage.ru_maxrss / 1024,  # Linux: KiB
    }


def one_round(shape: str, ids: list[list[int]], ids_file: Path, args) -> list[dict]:
    """Every system once, in turn, on the same sentences. The uncached decoder and the cached
    one are also compared on the same (fewer) sentences."""
    common = ["--length", str(args.length), "--batch", "32"]
    few = ids[: args.uncached_sentences]
    rows = [
        nmt_decode(shape, ids, True, torch.float32, args.length),
        nmt_decode(shape, few, True, torch.float32, args.length, " (uncached's sentences)"),
        nmt_decode(shape, few, False, torch.float32, args.length),
        *([nmt_decode(shape, ids, True, torch.bfloat16, args.length)] if args.bf16 else []),
        peer(PEERS / "fairseq/bin/python", "fairseq_decode.py", shape, ids_file, *common),
        peer(PEERS / "ct2/bin/python", "ct2_decode.py", shape, ids_file, *common),
        peer(PEERS / "ct2/bin/python", "ct2_decode.py", shape, ids_file, *common, "--compute-type", "int8"),
    ]
    rows = [r for r in rows if r]
    for row in rows:
        if "seconds" not in row:
            continue
        # Random weights may end a hypothesis early in any system; then the systems would not
        # do the same work, and the comparison would mean nothing.
        if row["tokens"] != row["sentences"] * args.length:
            sys.exit(
                f"{row['system']} made {row['tokens']} tokens, not {args.length} for each "
                f"of {row['sentences']} sentences: the systems did not do the same work"
            )
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["sentences_per_s"] = row["sentences"] / row["seconds"]
    return rows


def medians(rounds: list[list[dict]]) -> dict[str, float]:
    """Each system's median tokens/s over the alternating rounds."""
    import statistics

    speeds: dict[str, list[float]] = {}
    for rows in rounds:
        for row in rows:
            if "tokens_per_s" in row:
                speeds.setdefault(row["system"], []).append(row["tokens_per_s"])
    return {system: statistics.median(v) for system, v in speeds.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["tiny", "base"])
    ap.add_argument("--sets", nargs="*", default=["newstest2014", "multi30k"])
    ap.add_argument("--sentences", type=int, default=96)
    ap.add_argument("--uncached-sentences", type=int, default=32)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument(
        "--repeats", type=int, default=3, help="rounds of every system in turn; the figures are their medians"
    )
    ap.add_argument(
        "--bf16", action="store_true", help="Also nmt with bf16 weights (slow on CPUs without AVX512_BF16)."
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/decode_speed.json")
    ap.add_argument(
        "--trained",
        type=Path,
        metavar="RUN_DIR",
        help="Time `nmt translate` with this run's model (or this package) on the real test sets.",
    )
    ap.add_argument(
        "--against",
        type=Path,
        metavar="CHECKOUT",
        help="With --trained: also time another checkout of nmt (e.g. a `git worktree` of the code "
        "before a change), the two in --repeats alternate rounds.",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="OPTIONS",
        help='With --trained: also time this code with these translate options (e.g. "--sample '
        '--topk 10"), in the same alternate rounds; give it again for more.',
    )
    ap.add_argument(
        "--constraints",
        action="append",
        type=int,
        default=[],
        metavar="N",
        help="With --trained: also time this code with N constraints per line (the line's reference's "
        "N longest words), in the same alternate rounds; give it again for more counts.",
    )
    ap.add_argument(
        "--host-work",
        action="store_true",
        help="Only the search's own work per step, besides the model (search_host_work), beam 4 and 1.",
    )
    args = ap.parse_args()
    if args.host_work:
        for beam in (4, 1):
            ms = search_host_work(beam=beam)
            print(
                json.dumps(
                    {"cpu": cpu_name(), "beam": beam, "sentences": 64, "host_ms_per_step": round(ms, 3)}
                )
            )
        return
    if args.trained:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        several = args.against or args.variant or args.constraints
        rows = trained(
            args.trained,
            args.out,
            args.against,
            args.repeats if several else 1,
            tuple(args.variant),
            tuple(args.constraints),
        )
        summary = summarise(rows)
        args.out.with_name("decode_trained.json").write_text(
            json.dumps(
                {"cpu": cpu_name(), "run": str(args.trained), "rows": rows, "summary": summary}, indent=2
            )
        )
        for row in summary:
            print(json.dumps(row))
        return
    torch.set_num_threads(2)
    results = {"cpu": cpu_name(), "threads": 2, "runs": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        for name in args.sets:
            ids = sources(name, args.sentences)
            ids_file = args.out.parent / f"decode_ids_{name}.json"
            ids_file.write_text(json.dumps(ids))
            entry = {
                "shape": shape,
                "set": name,
                "repeats": [one_round(shape, ids, ids_file, args) for _ in range(args.repeats)],
            }
            entry["median"] = medians(entry["repeats"])
            results["runs"].append(entry)
            print(json.dumps({"shape": shape, "set": name, "median": entry["median"]}), flush=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
