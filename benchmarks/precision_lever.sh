#!/usr/bin/env bash
# fp32 against bf16 training on the Multi30k CPU recipe: two runs side by side, one thread each,
# for MINUTES, on the data of an already prepared run (prep + bpe); then the last 5 checkpoints
# of each averaged and both compared on the validation set (benchmarks/seed_noise.py).
#   bash benchmarks/precision_lever.sh PREPARED_RUN [MINUTES] [OUT]
# e.g. bash benchmarks/precision_lever.sh benchmarks/out/quality_ens2/run1 20 benchmarks/out/bf16_lever
set -euo pipefail
src=$1 minutes=${2:-20} out=${3:-benchmarks/out/bf16_lever}
cd "$(dirname "$0")/.."
for p in fp32 bf16; do
    rm -rf "$out/$p" && mkdir -p "$out/$p"
    cp -r "$src"/{manifest.json,prep.json,bpe.json,text,bpe,data} "$out/$p/"
done
for p in fp32 bf16; do
    OMP_NUM_THREADS=1 python -m nmt_cli train --run-dir "$out/$p" --size small --max-tokens 1024 \
        --warmup 1000 --eval-every 500 --save-every 250 --keep-last 10 --max-steps 0 \
        --max-time "$minutes" --threads 1 --seed 1 --precision "$p" > "$out/$p.log" 2>&1 &
done
wait
for p in fp32 bf16; do python -m nmt_cli average --run-dir "$out/$p" --last 5; done
python benchmarks/seed_noise.py "$out/bf16" "$out/fp32"
