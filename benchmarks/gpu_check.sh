#!/usr/bin/env bash
# The GPU check: everything a GPU machine must prove, one PASS/FAIL line per check, then figures.
#
#   bash benchmarks/gpu_check.sh 1    # train base in bf16/fp16/fp32, resume, average; decode
#                                     # validation in each precision, test2016
#                                     # in fp32 on the GPU and on the CPU     (~8 min on an H100)
#   bash benchmarks/gpu_check.sh 2    # --compile, --gpus 1 (launcher + NCCL), torchrun, and
#                                     # tests/integration/test_gpu.py                     (~6 min)
#   bash benchmarks/gpu_check.sh 3    # the throughput benchmark: base and big in bf16, eager
#                                     # and compiled, MFU, the trainer's loop (~5 min)
#   bash benchmarks/gpu_check.sh 4    # the launcher's options on CUDA: --gpus 1 --compile
#                                     # --update-freq 2, --eval-bleu --keep-best by BLEU, SIGTERM
#                                     # to the launcher and the resume; the paper's pipeline
#                                     # rehearsed on --gpus 1 (benchmarks/rehearsal.py) (~8 min)
#   bash benchmarks/gpu_check.sh      # all four (over 10 minutes: split it where a command
#                                     # has a time limit)
#
# Each part prepares Multi30k itself (prep + BPE 8000, under a minute). It runs from the
# repository's working tree with no install and no network: Python packages the GPU machine
# lacks (sacremoses) are installed from wheels in .whl/, and Multi30k is read from $NMT_MIRROR,
# else .gpu/data/multi30k, else ../shared/data/multi30k. `bash benchmarks/gpu_carry.sh` fills
# .whl/ and .gpu/ (both kept out of git). Logs and gpu_check.json go to $OUT (default
# benchmarks/out/gpu_check); exit status 1 if any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/benchmarks/out/gpu_check}
WORK=${NMT_GPU_WORK:-/tmp/nmt_gpu_check}
case "${1:-all}" in
    1) CHECKS="prep train resume fp16 fp32 average precision score" ;;
    2) CHECKS="prep compile gpus1 torchrun tests" ;;
    3) CHECKS="prep throughput" ;;
    4) CHECKS="prep gpus1_compile gpus1_bleu gpus1_sigterm rehearsal" ;;
    only) CHECKS="prep ${*:2}" ;;  # only prep and the checks named after it
    all) CHECKS="prep train resume fp16 fp32 average precision score compile gpus1 torchrun tests throughput gpus1_compile gpus1_bleu gpus1_sigterm rehearsal" ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [1|2|3|4|all|only CHECK...]" >&2; exit 2 ;;
esac
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1

. benchmarks/gpu_env.sh
: "${MIRROR:?no Multi30k: set NMT_MIRROR or run benchmarks/gpu_carry.sh}"
export NMT_SHARED_DATA=${NMT_SHARED_DATA:-$(dirname "$MIRROR")}  # for tests/integration/test_gpu.py

DATA=$WORK/data           # prep + bpe once; every training run starts from a copy
FAILED=0
want() { [[ " $CHECKS " == *" $1 "* ]]; }

# check NAME COMMAND...: run it with its output in $OUT/NAME.log; one line PASS/FAIL.
check() {
    local name=$1; shift
    local start=$SECONDS
    if timeout "${CHECK_TIMEOUT:-480}" "$@" >"$OUT/$name.log" 2>&1; then
        echo "PASS $name ($((SECONDS - start)) s)"
    else
        local rc=$?
        FAILED=$((FAILED + 1))
        echo "FAIL $name (exit $rc after $((SECONDS - start)) s); the end of $OUT/$name.log:"
        tail -n 8 "$OUT/$name.log" | sed 's/^/    /'
    fi
}

fresh_run() { rm -rf "${WORK:?}/$1"; cp -r "$DATA" "$WORK/$1"; echo "$WORK/$1"; }
checkpoints_in() { ls "$1"/checkpoints/checkpoint_*.pt >/dev/null 2>&1 || { echo "no checkpoint in $1"; return 1; }; }

# base on Multi30k, with warm-up and batches chosen so that a few hundred updates translate.
TRAIN="--size base --max-tokens 8192 --warmup 400 --eval-every 200 --save-every 100 --keep-last 5"

train_check() {  # NAME STEPS OPTIONS...: a fresh run of base
    local name=$1 steps=$2; shift 2
    local run; run=$(fresh_run "$name")
    check "$name" bash -c "python3 -m nmt_cli train --run-dir '$run' $TRAIN --max-steps $steps \
        $* && $(declare -f checkpoints_in); checkpoints_in '$run'"
}

echo "== $(python3 -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, " + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible"))')"
echo "== checks: $CHECKS"

want prep && check prep bash -c "rm -rf '$DATA' && python3 -m nmt_cli prep multi30k-en-de \
    --run-dir '$DATA' --mirror '$MIRROR' && python3 -m nmt_cli bpe --run-dir '$DATA' --vocab-size 8000"

want train && train_check train 600 --device cuda --precision bf16
# Continues the bf16 run from its last checkpoint (600) to 800.
want resume && check resume bash -c "python3 -m nmt_cli train --run-dir '$WORK/train' --max-steps 800 \
    2>&1 | tee /dev/stderr | grep 'resuming from step 600' >/dev/null \
    && ls '$WORK/train/checkpoints/checkpoint_00000800.pt'"
want fp16 && train_check fp16 300 --device cuda --precision fp16
want fp32 && train_check fp32 300 --device cuda --precision fp32
want average && check average python3 -m nmt_cli average --run-dir "$WORK/train" --last 5
# The choice of the default decoding precision is made on the validation set.
want precision && check precision python3 benchmarks/deploy.py fidelity "$WORK/train" \
    --split valid --device cuda --precisions bf16 fp16 --no-ct2 --out "$OUT/decode_precision.json"
if want score; then  # the averaged bf16-trained model on test2016: GPU fp32 and the CPU, line by line
    for p in fp32 cpu; do
        device=cuda; [ $p = cpu ] && device=cpu
        check "score_$p" python3 -m nmt_cli score --run-dir "$WORK/train" --device $device \
            --precision fp32 --json --metrics bleu,chrf
        cp "$WORK/train/translations/test.de" "$OUT/test_$p.de" 2>/dev/null
    done
fi

want compile && train_check compile 300 --device cuda --precision bf16 --compile
if want gpus1; then  # the launcher, a real NCCL group, checkpoints (RNG states gathered)
    run=$(fresh_run gpus1)
    check gpus1 bash -c "python3 -m nmt_cli train --run-dir '$run' $TRAIN --max-steps 300 --gpus 1 \
        && ls '$run'/checkpoints/checkpoint_00000300.pt"
fi
if want torchrun; then
    run=$(fresh_run torchrun)
    check torchrun bash -c "python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
        -m nmt_cli train --run-dir '$run' $TRAIN --max-steps 300 --device cuda \
        && ls '$run'/checkpoints/checkpoint_00000300.pt"
fi
want tests && check tests env NMT_TEST_GPU=1 python3 -m pytest -q -m gpu tests/integration/test_gpu.py \
    -p no:cacheprovider
if want gpus1_compile; then  # DDP's no_sync under torch.compile, through the launcher
    run=$(fresh_run gpus1_compile)
    check gpus1_compile bash -c "python3 -m nmt_cli train --run-dir '$run' $TRAIN --max-steps 200 \
        --gpus 1 --compile --update-freq 2 && ls '$run'/checkpoints/checkpoint_00000200.pt"
fi
if want gpus1_bleu; then  # rank 0's BLEU shared with every rank; best models by BLEU
    run=$(fresh_run gpus1_bleu)
    check gpus1_bleu bash -c "python3 -m nmt_cli train --run-dir '$run' $TRAIN --max-steps 400 \
        --gpus 1 --eval-bleu --keep-best 2 --best-metric bleu --patience 5 \
        && ls '$run'/checkpoints/best/best_*.pt && python3 -m nmt_cli average --run-dir '$run' --best 2"
fi
if want gpus1_sigterm; then  # the launcher forwards SIGTERM, exits 143, the same command resumes
    run=$(fresh_run gpus1_sigterm)
    check gpus1_sigterm bash -c "python3 -m nmt_cli train --run-dir '$run' $TRAIN --max-steps 100000 \
        --gpus 1 & pid=\$!; until ls '$run'/checkpoints/checkpoint_00000100.json 2>/dev/null; do \
        sleep 1; kill -0 \$pid || exit 1; done; kill -TERM \$pid; wait \$pid; code=\$?; \
        [ \$code = 143 ] || { echo exit \$code; exit 1; }; \
        python3 -m nmt_cli train --run-dir '$run' $TRAIN --max-steps 300 --gpus 1 2>&1 \
        | tee /dev/stderr | grep 'resuming from step' >/dev/null"
fi
want rehearsal && rm -rf "$WORK/rehearsal" && CHECK_TIMEOUT=600 check rehearsal python3 benchmarks/rehearsal.py --gpus 1 \
    --minutes 4 --out "$WORK/rehearsal"
want throughput && check throughput python3 benchmarks/train_throughput.py --device cuda \
    --shapes base big --loop "$DATA" --out "$OUT/train_throughput_gpu.json"

echo "== figures"
OUT="$OUT" WORK="$WORK" python3 - <<'EOF'
import json, os, pathlib
out, work = pathlib.Path(os.environ["OUT"]), pathlib.Path(os.environ["WORK"])
figures = {}
for run in ("train", "fp16", "fp32", "compile", "gpus1", "torchrun"):
    m = work / run / "metrics.jsonl"
    if not m.exists():
        continue
    rows = [json.loads(line) for line in m.read_text().splitlines() if line.strip()]
    speeds = sorted(r["tokens_per_s"] for r in rows if r.get("kind") == "train" and r["step"] > 20)
    valid = [r for r in rows if r.get("kind") == "valid"]
    figures[f"train_{run}"] = {
        "steps": max(r["step"] for r in rows),
        "median_tgt_tokens_per_s": round(speeds[len(speeds) // 2]) if speeds else None,
        "last_valid_nll": round(valid[-1]["valid_nll"], 3) if valid else None}
fp32 = (out / "test_fp32.de").read_text().splitlines() if (out / "test_fp32.de").exists() else None
for name in ("fp32", "bf16", "fp16", "cpu"):
    log = out / f"score_{name}.log"
    if not log.exists():
        continue
    text = log.read_text()
    try:
        report = json.loads(text[text.index("{"):text.rindex("}") + 1])
    except ValueError:
        continue
    row = {s["metric"]: round(s["score"], 2) for s in report["scores"]}
    hyp = out / f"test_{name}.de"
    if fp32 and hyp.exists():
        same = sum(a == b for a, b in zip(fp32, hyp.read_text().splitlines()))
        row["lines_as_gpu_fp32"] = f"{same}/{len(fp32)}"
    figures[f"test2016_{name}"] = row
for name in ("decode_precision.json", "train_throughput_gpu.json"):
    if (out / name).exists():
        figures[name.split(".")[0]] = json.loads((out / name).read_text())
for key, value in figures.items():
    print(key, json.dumps(value))
(out / "gpu_check.json").write_text(json.dumps(figures, indent=2))
EOF
echo "== $FAILED check(s) failed"
exit $((FAILED > 0))
