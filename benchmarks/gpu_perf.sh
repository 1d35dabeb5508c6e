#!/usr/bin/env bash
# The GPU performance script: what limits training and decoding on one GPU, in one call.
#
#   bash benchmarks/gpu_perf.sh             # on a GPU machine: run it with a 540 s limit
#   bash benchmarks/gpu_perf.sh --dry-run   # every step on the CPU at tiny sizes (a few minutes)
#   bash benchmarks/gpu_perf.sh --sections machine step --rounds 2   # gpu_perf.py's options
#
# benchmarks/gpu_perf.py does the measuring (its docstring lists the sections, the most valuable
# first, each skipped when the time left would not hold it); this script prepares Multi30k for
# its last section (the trainer's loop) in the background while the others run. Like
# gpu_check.sh it needs no install and no network: sacremoses from .whl/ and Multi30k from
# $NMT_MIRROR, .gpu/data/multi30k or ../shared/data/multi30k (`bash benchmarks/gpu_carry.sh`
# fills .whl/ and .gpu/). Figures: $OUT/gpu_perf.jsonl (one JSON line each), the log beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/benchmarks/out/gpu_perf}
WORK=${NMT_GPU_WORK:-/tmp/nmt_gpu_perf}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
# Compiled kernels (the fused loss, --compile) are cached here for the runs of this call.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor}

. benchmarks/gpu_env.sh

DATA=$WORK/data
rm -rf "$DATA"
if [ -n "$MIRROR" ]; then
    (nice -n 19 python3 -m nmt_cli prep multi30k-en-de --run-dir "$DATA" --mirror "$MIRROR" \
        && nice -n 19 python3 -m nmt_cli bpe --run-dir "$DATA" --vocab-size 8000 \
        && touch "$DATA/.ready") >"$OUT/prep.log" 2>&1 &
else
    echo "no Multi30k (set NMT_MIRROR or run benchmarks/gpu_carry.sh): the loop section is skipped"
fi

SHARED=()
[ -n "$MIRROR" ] && SHARED=(--shared "$(dirname "$MIRROR")")  # multi30k/ and wmt14/ side by side
python3 benchmarks/gpu_perf.py --out "$OUT" --budget "${BUDGET:-470}" --data "$DATA" "${SHARED[@]}" "$@" \
    2>&1 | tee "$OUT/gpu_perf.log"
code=${PIPESTATUS[0]}
wait
exit "$code"
