#!/usr/bin/env bash
# Session 18, one device call on one GPU: DeepSpeed fp16 loss scaling under gradient accumulation
# (benchmarks/deepspeed_fp16_accum.py). DeepSpeed and the wheels it needs are carried in .whl (ignored
# by git; pass carry: [".whl"]); a requirement the device lacks comes from .whl/extra-s18, the device's
# own copy wins otherwise.
#   bash benchmarks/gpu_s18_fp16.sh [N] [SEED]      # on the device machine, from the repository root
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
O=${OUT:-/tmp/s18}; mkdir -p "$O"; S=$O/summary.txt; SITE=${SITE:-/tmp/site}; PY=${PY:-python}
N=${1:-100}; SEED=${2:-0}
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')" >>"$S" 2>&1
W=".whl/deepspeed-0.19.8-py3-none-any.whl $(ls .whl/hjson-*.whl .whl/pydantic-*.whl .whl/pydantic_core-*.whl \
    .whl/annotated_types-*.whl .whl/typing_inspection-*.whl .whl/typing_extensions-*.whl)"
for m in einops:einops msgpack:msgpack psutil:psutil tqdm:tqdm cpuinfo:py_cpuinfo ninja:ninja packaging:packaging; do
    if ! $PY -c "import ${m%%:*}" 2>/dev/null; then
        echo "device lacks ${m%%:*}: carried wheel" >>"$S"; W="$W $(ls .whl/extra-s18/${m##*:}-*.whl)"
    fi
done
$PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $W >>"$S" 2>&1; echo "pip rc $?" >>"$S"
PYTHONPATH=$SITE:. $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)" >>"$S" 2>&1
PYTHONPATH=$SITE:. BUDGET_S=${BUDGET_S:-330} timeout 400 $PY benchmarks/deepspeed_fp16_accum.py "$N" "$SEED" \
    >"$O/fp16.log" 2>"$O/fp16.err"
echo "bench rc $?" >>"$S"
grep -v '^\[20' "$O/fp16.log" | grep -E '^( *[0-9]+ (WRONG|ERROR)|#|\{)' | cut -c1-1500 >>"$S"
tail -5 "$O/fp16.err" | cut -c1-600 >>"$S"
cat "$S"
