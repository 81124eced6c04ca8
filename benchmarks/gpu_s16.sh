#!/usr/bin/env bash
# Session 16: one-GPU device calls.
#   a   issue 30's GPU parts: megatron-core's local CUDA graphs under
#       accumulation (benchmarks/megatron_cudagraph_accum.py 100 0) on releases
#       0.16.1, 0.17.1, 0.18.2 and 0.19.2, from carried cp312 wheels in .whl/
#       (the device's Python is 3.12); and whether transformer_engine imports
#   b   issue 34: README's gate at -n 16 on this session's code (a worker per
#       compile flavour, cases started on every flavour at once, heavy replay
#       groups dealt out by cases), alone on the machine
#   c   the same gate at -n 2 pinned to two cores (taskset): the 16-core
#       speed-up at the same budget
#   bash benchmarks/gpu_s16.sh a|b|c      # on the device machine, repository root
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
W=${W:-/tmp/s16}; mkdir -p "$W"; S=${OUT:?}/summary.txt
. benchmarks/device_steps.sh  # step and packer
packer & PACK=$!
{ python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
  echo "cores $(nproc)"; nvidia-smi -L 2>/dev/null; } >>"$S" 2>&1
CALL=${1:?call a, b or c}
if [ "$CALL" = a ]; then
    # megatron-core releases side by side (one small GPU job each); their logs are in
    # benchmarks/results-s16/accum-VERSION.log
    python -c "import transformer_engine" >>"$S" 2>&1 || echo "transformer_engine: not installed (its wheel is 729 MB)" >>"$S"
    for v in 0.16.1 0.17.1 0.18.2 0.19.2; do
        python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site$v .whl/megatron_core-$v-*.whl >>"$S" 2>&1
        (PYTHONPATH=/tmp/site$v:. timeout 250 python benchmarks/megatron_cudagraph_accum.py 100 0 >"$W/accum-$v.log" 2>&1) &
    done
    wait
    tail -qn 1 "$W"/accum-*.log >>"$S"
elif [ "$CALL" = b ]; then
    step gate16 570 python -m harness gate --examples 20 -n 16 --json "$W/gate16.json" --markdown "$W/gate.md" --save "$W/found-gate16"
else
    step gate2 570 taskset -c 0,1 python -m harness gate --examples 20 -n 2 --json "$W/gate2.json" --save "$W/found-gate2"
fi
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" .; cp "$W/gate.md" "$OUT/" 2>/dev/null
echo "done $(date -u +%T)" >>"$S"
