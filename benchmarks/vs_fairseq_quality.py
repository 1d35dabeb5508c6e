"""nmt and fairseq 0.12.2 side by side on Multi30k en-de: the same data, recipe and training time,
trained at the same time on this machine, one thread each; decoded by each toolkit's own beam
search (beam 4, every other setting at its default); scored by the same scorer with the paired
bootstrap.

    bash benchmarks/peers/install_fairseq.sh          # once: fairseq in ../peers/fairseq
    python benchmarks/vs_fairseq_quality.py [--minutes 60] [--out benchmarks/out/vs_fairseq]
    python benchmarks/vs_fairseq_quality.py --pool OUT OUT [OUT ...]   # draws of several --seed
        [--nmt-precision auto|fp32|bf16] [--seed 1]

1. `nmt prep multi30k-en-de` and `nmt bpe --vocab-size 8000` (joint sentencepiece). fairseq gets
   the same cleaned text cut into the same pieces (`fairseq-preprocess --joined-dictionary`).
2. Both train for --minutes at once, each with one thread: the quickstart's recipe (4+4 layers,
   d 128, FFN 256, 4 heads, pre-norm, dropout 0.2 / attention 0.1 / ReLU 0.1, 1024-token
   batches, warmup 1000 to a peak of 128^-0.5 * 1000^-0.5 = 2.8e-3, inverse square root decay,
   Adam (0.9, 0.98, 1e-9), label smoothing 0.1, a checkpoint every 250 updates). Validation:
   nmt's NLL every 500 updates; fairseq's loss at each checkpoint and epoch (its behaviour with
   --save-interval-updates). Precision: nmt's --precision (default auto, which is bf16 autocast
   on a CPU with bf16 arithmetic, fp32 elsewhere); fairseq fp32, as its --bf16 on a CPU stops in
   its Trainer looking for a TPU (fairseq 0.12.2: get_tpu_device, 'NoneType' has no 'xla_device').
3. Each averages its last 5 checkpoints and translates with beam 4, first with its default
   length penalty (nmt: GNMT's ((5+|Y|)/6)^alpha, alpha 0.6; fairseq: score / |Y|^lenpen,
   lenpen 1), then with the penalty that gave it the best BLEU on the validation set among five
   (NMT_ALPHAS, FAIRSEQ_LENPENS): the same lever for both, chosen before any test set is read.
   fairseq's pieces are joined by the same sentencepiece model.
4. Both are scored against the references as released: cased sacreBLEU and chrF, BLEU on
   lowercased Moses-tokenised text (`nmt score --moses-lc`), and sacreBLEU's paired bootstrap
   (1000 samples) of nmt against fairseq for each. The validation rows are where recipe and
   decoding choices are made; the test rows are the figure.

Results go to OUT/vs_fairseq.json (the translations to OUT/hyps/SET.WHO.PENALTY.de) and print
as the markdown table of docs/benchmarks.md. OUT is made afresh (an existing OUT is refused).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MULTI30K = Path(os.environ.get("NMT_SHARED_DATA", ROOT.parent / "shared" / "data")) / "multi30k"
FAIRSEQ_PYTHON = ROOT.parent / "peers" / "fairseq" / "bin" / "python"
SPLITS = {"valid": "valid", "test2016": "test", "test2017": "test2017"}  # shown name: nmt's split
FAIRSEQ_SUBSET = {"valid": "valid", "test": "test", "test2017": "test1"}  # nmt's split: fairseq's
SHAPE = dict(layers=4, d=128, ffn=256, heads=4, dropout=0.2, attention_dropout=0.1, relu_dropout=0.1)
RECIPE = dict(max_tokens=1024, warmup=1000, save_every=250, eval_every=500, average=5, beam=4, seed=1)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
ENV = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}  # fairseq 0.12.2 pickles its settings
# Length penalties tried on the validation set: nmt's GNMT alpha, fairseq's exponent of |Y|.
NMT_ALPHAS = (0.6, 1.0, 1.5, 2.0, 2.5)
FAIRSEQ_LENPENS = (0.5, 1.0, 1.5, 2.0, 2.5)
DEFAULTS = {"nmt": 0.6, "fairseq": 1.0}


def run(cmd: list, log: Path, env: dict | None = None) -> str:
    with open(log, "a", encoding="utf-8") as err:
        err.write(f"$ {' '.join(map(str, cmd))}\n")
        err.flush()
        done = subprocess.run(
            [str(c) for c in cmd],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **(env or {})},
        )
    if done.returncode:
        sys.exit(f"{' '.join(map(str, cmd[:4]))} ... failed (exit {done.returncode}); see {log}")
    return done.stdout


def nmt(*args) -> list:
    return [sys.executable, "-m", "nmt_cli", *map(str, args)]


def prepare(out: Path, log: Path) -> Path:
    """nmt's run directory with its data, and fairseq's binarized copy of the same pieces."""
    import sentencepiece as spm

    run_dir = out / "nmt"
    run(nmt("prep", "multi30k-en-de", "--mirror", MULTI30K, "--run-dir", run_dir), log)
    run(nmt("bpe", "--vocab-size", 8000, "--run-dir", run_dir), log)
    sp = spm.SentencePieceProcessor(model_file=str(run_dir / "bpe" / "spm.model"))
    pieces = out / "fairseq" / "pieces"
    pieces.mkdir(parents=True)
    for split in ("train", *FAIRSEQ_SUBSET):
        for lang in ("en", "de"):
            lines = (run_dir / "text" / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
            encoded = sp.encode(lines, out_type=str)
            (pieces / f"{split}.{lang}").write_text("".join(" ".join(p) + "\n" for p in encoded), "utf-8")
    run(
        [
            FAIRSEQ_PYTHON, "-m", "fairseq_cli.preprocess", "--source-lang", "en", "--target-lang", "de",
            "--trainpref", pieces / "train", "--validpref", pieces / "valid",
            "--testpref", f"{pieces / 'test'},{pieces / 'test2017'}", "--joined-dictionary",
            "--destdir", out / "fairseq" / "bin", "--workers", 2,
        ],
        log,
    )  # fmt: skip
    return run_dir


def train_both(out: Path, run_dir: Path, minutes: float, precision: str, seed: int) -> dict:
    """Both trainings at once, one thread each, the same seed; returns their wall-clock seconds."""
    s, r = SHAPE, {**RECIPE, "seed": seed}
    nmt_cmd = nmt(
        "train", "--run-dir", run_dir, "--size", "small", "--max-tokens", r["max_tokens"],
        "--warmup", r["warmup"], "--save-every", r["save_every"], "--eval-every", r["eval_every"],
        "--keep-last", 10, "--seed", r["seed"], "--max-time", minutes, "--threads", 1,
        "--precision", precision,
    )  # fmt: skip
    peak = s["d"] ** -0.5 * r["warmup"] ** -0.5  # nmt's schedule at its peak (step = warmup)
    fairseq_cmd = [
        FAIRSEQ_PYTHON, "-m", "fairseq_cli.train", out / "fairseq" / "bin", "--arch", "transformer",
        "--share-all-embeddings", "--encoder-normalize-before", "--decoder-normalize-before",
        "--encoder-layers", s["layers"], "--decoder-layers", s["layers"],
        "--encoder-embed-dim", s["d"], "--decoder-embed-dim", s["d"],
        "--encoder-ffn-embed-dim", s["ffn"], "--decoder-ffn-embed-dim", s["ffn"],
        "--encoder-attention-heads", s["heads"], "--decoder-attention-heads", s["heads"],
        "--dropout", s["dropout"], "--attention-dropout", s["attention_dropout"],
        "--activation-dropout", s["relu_dropout"],
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9",
        "--lr", f"{peak:.6g}", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", r["warmup"],
        "--warmup-init-lr", "1e-7", "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", 0.1, "--max-tokens", r["max_tokens"], "--seed", r["seed"],
        "--cpu", "--num-workers", 0, "--stop-time-hours", f"{minutes / 60:.6g}",
        "--save-dir", out / "fairseq" / "checkpoints", "--save-interval-updates", r["save_every"],
        "--keep-interval-updates", r["average"], "--no-epoch-checkpoints",
        "--log-format", "simple", "--log-interval", 100,
    ]  # fmt: skip
    started = time.perf_counter()
    procs = {}
    for name, cmd in (("nmt", nmt_cmd), ("fairseq", fairseq_cmd)):
        logfile = open(out / f"train_{name}.log", "w", encoding="utf-8")  # noqa: SIM115
        procs[name] = (
            subprocess.Popen(
                [str(c) for c in cmd],
                stdout=logfile,
                stderr=subprocess.STDOUT,
                env={**os.environ, **ONE_THREAD},
            ),
            logfile,
        )
    seconds = {}  # each one's own end, whichever ends first
    while len(seconds) < len(procs):
        for name, (proc, _) in procs.items():
            if name not in seconds and proc.poll() is not None:
                seconds[name] = time.perf_counter() - started
        time.sleep(0.5)
    for name, (proc, logfile) in procs.items():
        logfile.close()
        if proc.returncode:
            sys.exit(f"{name} training failed (exit {proc.returncode}); see {out / f'train_{name}.log'}")
    return seconds


def nmt_hyps(run_dir: Path, split: str, alpha: float, log: Path) -> list[str]:
    report = json.loads(
        run(nmt("score", "--run-dir", run_dir, "--split", split, "--alpha", alpha, "--json"), log)
    )
    return Path(report["hyp"]).read_text(encoding="utf-8").splitlines()


def average_fairseq(out: Path, log: Path) -> dict:
    script = ROOT / "benchmarks" / "peers" / "fairseq_average.py"
    checkpoints, averaged = out / "fairseq" / "checkpoints", out / "fairseq" / "averaged.pt"
    return json.loads(
        run([FAIRSEQ_PYTHON, script, checkpoints, averaged, "--last", RECIPE["average"]], log, ENV)
    )


def fairseq_hyps(out: Path, run_dir: Path, split: str, lenpen: float, log: Path) -> list[str]:
    """fairseq-generate's translations, its pieces joined by nmt's sentencepiece model."""
    import sentencepiece as spm

    text = run(
        [
            FAIRSEQ_PYTHON, "-m", "fairseq_cli.generate", out / "fairseq" / "bin",
            "--path", out / "fairseq" / "averaged.pt", "--gen-subset", FAIRSEQ_SUBSET[split],
            "--beam", RECIPE["beam"], "--lenpen", lenpen, "--batch-size", 64, "--cpu",
        ],
        log,
        ENV,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=str(run_dir / "bpe" / "spm.model"))
    found = {}
    for line in text.splitlines():
        m = re.match(r"H-(\d+)\t\S+\t(.*)$", line)
        if m:
            found[int(m.group(1))] = sp.decode_pieces(m.group(2).split())
    want = len((run_dir / "text" / f"{split}.en").read_text(encoding="utf-8").splitlines())
    if sorted(found) != list(range(want)):
        sys.exit(f"fairseq-generate gave {len(found)} of {want} {split} translations; see {log}")
    return [found[i] for i in range(want)]


def bleu(hyps: list[str], refs: list[str]) -> float:
    from nmt_cli import metrics

    return metrics.score(hyps, refs, ["bleu"])[0].score


def train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def compare(ours: list[str], theirs: list[str], refs: list[str]) -> dict:
    from nmt_cli import score

    names = ("nmt", "ref")
    cased = score.report(ours, refs, names, ["bleu", "chrf"], baseline=("fairseq", theirs))
    lc = score.report(ours, refs, names, ["bleu"], moses_lc_lang="de", baseline=("fairseq", theirs))
    own = score.report(theirs, refs, ("fairseq", "ref"), ["bleu"])
    c, m = cased["compare"], lc["compare"]
    return {
        "nmt": {"moses_lc": m["bleu"]["system"], "bleu": c["bleu"]["system"], "chrf": c["chrf"]["system"]},
        "fairseq": {
            "moses_lc": m["bleu"]["baseline"],
            "bleu": c["bleu"]["baseline"],
            "chrf": c["chrf"]["baseline"],
        },
        "p": {"moses_lc": m["bleu"]["p_value"], "bleu": c["bleu"]["p_value"], "chrf": c["chrf"]["p_value"]},
        "bleu_text": {"nmt": cased["scores"][0]["text"], "fairseq": own["scores"][0]["text"]},
        "signatures": {
            "bleu": cased["scores"][0]["signature"],
            "chrf": cased["scores"][1]["signature"],
            "moses_lc": lc["scores"][0]["signature"],
        },
    }


# -- --pool: several draws together
SETTINGS = ("defaults", "chosen on valid")  # vs_fairseq.json's rows
METRICS = ("moses_lc", "bleu", "chrf")


def penalties(draw: dict, setting: str) -> dict:
    return DEFAULTS if setting == "defaults" else draw["chosen"]


def hyps(out: Path, name: str, who: str, penalty: float) -> list[str]:
    return (out / "hyps" / f"{name}.{who}.{penalty:g}.de").read_text(encoding="utf-8").splitlines()


def refs(out: Path, name: str) -> list[str]:
    path = out / "nmt" / "text" / f"{SPLITS[name]}.raw.de"
    return path.read_text(encoding="utf-8").splitlines()


def paired(ours: list[str], theirs: list[str], ref: list[str], names: tuple[str, str]) -> dict:
    """Scores of both and p of `ours` against `theirs` in the three measures."""
    from nmt_cli import score

    cased = score.report(ours, ref, (names[0], "ref"), ["bleu", "chrf"], baseline=(names[1], theirs))
    lc = score.report(ours, ref, (names[0], "ref"), ["bleu"], moses_lc_lang="de", baseline=(names[1], theirs))
    rows = {
        "moses_lc": lc["compare"]["bleu"],
        "bleu": cased["compare"]["bleu"],
        "chrf": cased["compare"]["chrf"],
    }
    return {m: {"a": r["system"], "b": r["baseline"], "p": r["p_value"]} for m, r in rows.items()}


def gaps(r: dict) -> str:
    return " / ".join(f"{r[m]['a'] - r[m]['b']:+.2f}" for m in METRICS)


def ps(r: dict) -> str:
    return " / ".join(f"{r[m]['p']:.3f}" for m in METRICS)


def pool(outs: list[Path]) -> None:
    """Several draws (this script's --out folders, one per --seed) side by side and pooled:
    each draw's gap and p as it recorded them; every draw's translations of a set one after
    another against the references repeated as often, with the paired bootstrap, so each
    toolkit is scored on all its trainings at once; and each toolkit's draws against each other
    on validation, the noise a gap must beat. Nothing is decoded or trained again."""
    if len(outs) < 2:
        sys.exit("give --pool two or more draws (this script's --out folders)")
    draws = {out: json.loads((out / "vs_fairseq.json").read_text()) for out in outs}
    for out, draw in draws.items():
        u = draw["updates"]
        print(
            f"- {out}: seed {draw.get('seed', 1)}, nmt {u['nmt']} updates ({draw['precision']['nmt']}), "
            f"fairseq {u['fairseq']}; chosen alpha {draw['chosen']['nmt']:g}, "
            f"lenpen {draw['chosen']['fairseq']:g}"
        )
    target_met = {}
    for setting in SETTINGS:
        print(f"\n{setting}: nmt - fairseq, moses-lc / cased BLEU / chrF (p)\n")
        print(
            "| set | "
            + " | ".join(f"seed {d.get('seed', 1)}" for d in draws.values())
            + " | pooled | pooled p |"
        )
        print("| --- |" + " --- |" * (len(draws) + 2))
        for name in SPLITS:
            per_draw = []
            for draw in draws.values():
                r = draw[setting][name]
                per_draw.append(
                    " / ".join(f"{r['nmt'][m] - r['fairseq'][m]:+.2f}" for m in METRICS)
                    + " (" + " / ".join(f"{r['p'][m]:.3f}" for m in METRICS) + ")"
                )  # fmt: skip
            ours, theirs, ref = [], [], []
            for out, draw in draws.items():
                pen = penalties(draw, setting)
                ours += hyps(out, name, "nmt", pen["nmt"])
                theirs += hyps(out, name, "fairseq", pen["fairseq"])
                ref += refs(out, name)
            pooled = paired(ours, theirs, ref, ("nmt", "fairseq"))
            print(f"| {name} | " + " | ".join(per_draw) + f" | {gaps(pooled)} | {ps(pooled)} |")
            if name != "valid":
                # The bar: ahead by 1 BLEU (both measures) and 1 chrF, each with p < 0.05.
                target_met[(setting, name)] = all(
                    pooled[m]["a"] - pooled[m]["b"] >= 1 and pooled[m]["p"] < 0.05 for m in METRICS
                )
    print("\nEach toolkit's draws against each other on the validation set (defaults), A / B (p):\n")
    print("| toolkit | draws | moses-lc | cased BLEU | chrF |\n| --- | --- | --- | --- | --- |")
    outs = list(draws)
    ref = refs(outs[0], "valid")
    for who in ("nmt", "fairseq"):
        first = hyps(outs[0], "valid", who, DEFAULTS[who])
        for later in outs[1:]:
            r = paired(first, hyps(later, "valid", who, DEFAULTS[who]), ref, (str(outs[0]), str(later)))
            cells = " | ".join(f"{r[m]['a']:.2f} / {r[m]['b']:.2f} ({r[m]['p']:.3f})" for m in METRICS)
            print(f"| {who} | {outs[0].name} / {later.name} | {cells} |")
    print("\nTarget (pooled: nmt ahead by >= 1 in moses-lc, cased BLEU and chrF, each p < 0.05):")
    for (setting, name), met in target_met.items():
        print(f"- {setting}, {name}: {'met' if met else 'not met'}")


def main() -> None:
    from nmt_cli.config import resolve_precision
    from nmt_cli.engine.device import cpu_has_bf16

    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=60.0, help="minutes of training, each")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "vs_fairseq")
    ap.add_argument("--nmt-precision", default="auto", choices=("auto", "fp32", "bf16"))
    # One training per toolkit is one draw: a seed alone moves validation BLEU by up to 1.4.
    ap.add_argument("--seed", type=int, default=RECIPE["seed"], help="both toolkits' training seed")
    ap.add_argument(
        "--pool", type=Path, nargs="+", metavar="OUT", help="instead: pool the draws of these --out folders"
    )
    args = ap.parse_args()
    if args.pool:
        return pool(args.pool)
    if not FAIRSEQ_PYTHON.exists():
        sys.exit(f"no fairseq at {FAIRSEQ_PYTHON}: run `bash benchmarks/peers/install_fairseq.sh` first")
    if args.out.exists():
        sys.exit(f"{args.out} exists: remove it, or give another --out")
    args.out.mkdir(parents=True)
    log = args.out / "steps.log"
    started = time.perf_counter()
    run_dir = prepare(args.out, log)
    seconds = train_both(args.out, run_dir, args.minutes, args.nmt_precision, args.seed)
    run(nmt("average", "--last", RECIPE["average"], "--run-dir", run_dir), log)
    averaged = average_fairseq(args.out, log)
    refs = {
        split: (run_dir / "text" / f"{split}.raw.de").read_text(encoding="utf-8").splitlines()
        for split in SPLITS.values()
    }
    # The length penalty of each, chosen by validation BLEU; the test sets are read afterwards.
    sweep = {
        "nmt": {a: bleu(nmt_hyps(run_dir, "valid", a, log), refs["valid"]) for a in NMT_ALPHAS},
        "fairseq": {
            lp: bleu(fairseq_hyps(args.out, run_dir, "valid", lp, log), refs["valid"])
            for lp in FAIRSEQ_LENPENS
        },
    }
    chosen = {who: max(scores, key=scores.get) for who, scores in sweep.items()}
    results = {
        "minutes": args.minutes,
        "seed": args.seed,
        "train_seconds": seconds,
        "precision": {"nmt": resolve_precision(args.nmt_precision, "cpu", cpu_has_bf16()), "fairseq": "fp32"},
        "updates": {
            "nmt": max(r["step"] for r in train_records(run_dir)),
            "fairseq": averaged["updates"][-1],
        },
        "fairseq_averaged": averaged,
        "valid_bleu_by_length_penalty": sweep,
        "chosen": chosen,
    }
    for setting, penalty in (("defaults", DEFAULTS), ("chosen on valid", chosen)):
        rows = results.setdefault(setting, {})
        for name, split in SPLITS.items():
            ours = nmt_hyps(run_dir, split, penalty["nmt"], log)
            theirs = fairseq_hyps(args.out, run_dir, split, penalty["fairseq"], log)
            for who, hyps in (("nmt", ours), ("fairseq", theirs)):  # kept for a look at the outputs
                kept = args.out / "hyps" / f"{name}.{who}.{penalty[who]:g}.de"
                kept.parent.mkdir(exist_ok=True)
                kept.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
            rows[name] = compare(ours, theirs, refs[split])
    results["pipeline_minutes"] = (time.perf_counter() - started) / 60
    (args.out / "vs_fairseq.json").write_text(json.dumps(results, indent=2))

    u = results["updates"]
    p = results["precision"]
    print(
        f"{args.minutes:g} minutes each: nmt {u['nmt']} updates ({p['nmt']}), "
        f"fairseq {u['fairseq']} ({p['fairseq']})"
    )
    for who, scores in sweep.items():
        tried = ", ".join(f"{k:g}: {v:.2f}" for k, v in scores.items())
        print(f"- {who} valid BLEU by length penalty: {tried}; chosen {chosen[who]:g}")
    for setting, penalty in (("defaults", DEFAULTS), ("chosen on valid", chosen)):
        print(f"\n{setting}: nmt alpha {penalty['nmt']:g}, fairseq lenpen {penalty['fairseq']:g}\n")
        print(
            "| set | nmt moses-lc / cased / chrF | fairseq moses-lc / cased / chrF "
            "| p (moses-lc / cased / chrF) |"
        )
        print("|---|---|---|---|")
        for name in SPLITS:
            r = results[setting][name]
            row = [
                " / ".join(f"{r[who][m]:.2f}" for m in ("moses_lc", "bleu", "chrf"))
                for who in ("nmt", "fairseq")
            ]
            p = " / ".join(f"{r['p'][m]:.3f}" for m in ("moses_lc", "bleu", "chrf"))
            print(f"| {name} | {row[0]} | {row[1]} | {p} |")
        for name in SPLITS:
            for who, text in results[setting][name]["bleu_text"].items():
                print(f"- {name} {who}: {text}")
    for metric, signature in results["defaults"]["test2016"]["signatures"].items():
        print(f"- {metric}: `{signature}`")
    print(f"\nwhole pipeline: {results['pipeline_minutes']:.1f} minutes")


if __name__ == "__main__":
    main()
