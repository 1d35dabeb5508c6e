#!/usr/bin/env bash
# Put beside the working tree what benchmarks/gpu_check.sh and gpu_perf.sh need on a GPU
# machine that has no network: the wheels of packages its image lacks (.whl/), a copy of
# Multi30k and newstest2014 (.gpu/data/) and, given a trained run, its package (.gpu/model/,
# which gpu_perf.sh translates with). The folders are git-ignored: they travel with the working
# tree, never into a commit. CTranslate2 is not carried: its wheel (43 MB) loads CUDA 12's
# cuBLAS, which the GPU image (CUDA 13) lacks and which is far larger than a call may carry.
#
#   bash benchmarks/gpu_carry.sh [SHARED_DATA [RUN]]     # default ../shared/data
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-${NMT_SHARED_DATA:-../shared/data}}
RUN=${2:-}
mkdir -p .whl .gpu/data
# The GPU image (Python 3.12) has torch, typer, rich, sentencepiece and sacrebleu; not sacremoses.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d .whl sacremoses
rm -rf .gpu/data/multi30k .gpu/data/wmt14
cp -r "$DATA/multi30k" "$DATA/wmt14" .gpu/data/  # wmt14: newstest2014, for rehearsal.py
if [ -n "$RUN" ]; then
    rm -rf .gpu/model
    python3 -m nmt_cli export .gpu/model --run-dir "$RUN"
fi
du -sh .whl .gpu
