#!/usr/bin/env bash
# Put beside the working tree what benchmarks/gpu_check.sh needs on a GPU machine that has no
# network: the wheels of packages its image lacks (.whl/) and a copy of Multi30k (.gpu/data/).
# Both folders are git-ignored: they travel with the working tree, never into a commit.
#
#   bash benchmarks/gpu_carry.sh [SHARED_DATA]      # default ../shared/data
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-${NMT_SHARED_DATA:-../shared/data}}
mkdir -p .whl .gpu/data
# The GPU image (Python 3.12) has torch, typer, rich, sentencepiece and sacrebleu; not sacremoses.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d .whl sacremoses
rm -rf .gpu/data/multi30k .gpu/data/wmt14
cp -r "$DATA/multi30k" "$DATA/wmt14" .gpu/data/  # wmt14: newstest2014, for rehearsal.py
du -sh .whl .gpu
