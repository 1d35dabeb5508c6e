#!/usr/bin/env bash
# The second GPU call, for what does not fit the first (gpu_all.sh): tests/integration/test_gpu.py, the
# machine's ceilings, `base` and `big` compiled with a profile of a step, the training levers,
# the trainer's loop at ~25k tokens an update, a cold pass over new batch shapes. Within 540 s
# on an H100 or H200.
#
#   bash benchmarks/gpu_second.sh            # on the GPU machine (device tool: timeout 560)
#   bash benchmarks/gpu_second.sh --dry-run  # on the CPU
exec env BUDGET="${BUDGET:-500}" bash "$(dirname "$0")/gpu_all.sh" \
    --sections tests machine compiled levers loop cold "$@"
