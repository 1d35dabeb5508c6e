#!/usr/bin/env bash
# The one GPU call: the GPU paths checked (benchmarks/gpu_all.py lists the sections and their
# checks), within 330 s on an H100 or H200, so that a second try fits the device's time. Run it
# first whenever a GPU is lent; it exits 1 when a check fails ("ok": false rows).
#
#   bash benchmarks/gpu_all.sh              # on the GPU machine (device tool: timeout 330)
#   bash benchmarks/gpu_all.sh --dry-run    # every section on the CPU, tiny sizes, and every
#                                           # check fed the broken rows it must refuse
#   bash benchmarks/gpu_second.sh           # what did not fit: tests/integration/test_gpu.py and speed
#
# It needs no install and no network: sacremoses from .whl/ and Multi30k from $NMT_MIRROR,
# .gpu/data/multi30k or ../shared/data/multi30k (`bash benchmarks/gpu_carry.sh` fills .whl/ and
# .gpu/). Multi30k is prepared in the background while the first sections run. Everything it
# writes (every log, the figures, the Inductor cache's small files) is packed into
# $OUT/gpu_all.tgz every few seconds, so that a call cut at its limit still returns it; the
# figures are also in $OUT/gpu_all.jsonl, one JSON line each.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/benchmarks/out/gpu_all}
WORK=${NMT_GPU_WORK:-/tmp/nmt_gpu_all}
DRY=0
for a in "$@"; do [ "$a" = --dry-run ] && DRY=1; done
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK/logs"
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor}

pack() {  # the logs, the figures and the Inductor cache's files under 1 MB, as one tarball
    local list="$WORK/.pack" tmp="$WORK/.gpu_all.tgz" cache=${TORCHINDUCTOR_CACHE_DIR#"$WORK"/}
    (cd "$WORK" && find logs -type f && [ -d "$cache" ] && \
        find "$cache" -type f -size -1024k 2>/dev/null | head -3000) >"$list" 2>/dev/null
    cp "$OUT"/gpu_all.jsonl "$WORK/logs/" 2>/dev/null
    tar -czf "$tmp" -C "$WORK" -T "$list" 2>/dev/null && cp "$tmp" "$OUT/gpu_all.part" \
        && mv "$OUT/gpu_all.part" "$OUT/gpu_all.tgz"
}
( while sleep 5; do pack; done ) &
PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack' EXIT

. benchmarks/gpu_env.sh

DATA=$WORK/data
VOCAB=8000; [ $DRY = 1 ] && VOCAB=1000  # a smaller vocabulary learns faster on two cores
if [ -n "$MIRROR" ]; then
    (nice -n 10 python3 -m nmt_cli prep multi30k-en-de --run-dir "$DATA" --mirror "$MIRROR" \
        && nice -n 10 python3 -m nmt_cli bpe --run-dir "$DATA" --vocab-size $VOCAB \
        && touch "$DATA/.ready") >"$WORK/logs/prep.log" 2>&1 &
else
    echo "no Multi30k (set NMT_MIRROR or run benchmarks/gpu_carry.sh): the sections on it are skipped"
fi

python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())' \
    2>&1 | tee "$WORK/logs/versions.log"
python3 benchmarks/gpu_all.py --out "$OUT" --work "$WORK" --budget "${BUDGET:-300}" --data "$DATA" \
    ${MIRROR:+--mirror "$MIRROR"} "$@" 2>&1 | tee "$WORK/logs/gpu_all.log"
code=${PIPESTATUS[0]}
jobs -p | grep -v "^$PACKER$" | xargs -r kill 2>/dev/null
exit "$code"
