# Sourced by the GPU scripts (gpu_all.sh, gpu_perf.sh, gpu_check.sh), with ROOT and WORK set:
# the Python packages the GPU machine lacks from the wheels in .whl/ (gpu_carry.sh puts them
# there; the machine has no network), this checkout on PYTHONPATH, and MIRROR: the folder of the
# Multi30k files ($NMT_MIRROR, .gpu/data/multi30k or ../shared/data/multi30k; empty if none).
if ! python3 -c "import sacremoses" 2>/dev/null && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "$ROOT"/.whl/*.whl || exit 1
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
MIRROR=
for m in "${NMT_MIRROR:-}" "$ROOT/.gpu/data/multi30k" "$ROOT/../shared/data/multi30k"; do
    if [ -n "$m" ] && [ -f "$m/train.en.gz" ]; then MIRROR=$(cd "$m" && pwd); break; fi
done
