#!/usr/bin/env bash
# Session 16: one-GPU device calls.
#   a   issue 30's GPU parts: megatron-core 0.16.1's local CUDA graphs under
#       accumulation (benchmarks/megatron_cudagraph_accum.py, two seeds), with
#       the carried wheels (.whl/: megatron-core, liger-kernel) in /tmp/site;
#       and whether transformer_engine imports there
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
    SITE=/tmp/site
    python -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/*.whl >>"$S" 2>&1
    { python -c "import triton; print('triton', triton.__version__)"; python -c "import transformer_engine" 2>&1 | tail -1; } >>"$S" 2>&1
    step mcg0 280 env PYTHONPATH=$SITE:. python benchmarks/megatron_cudagraph_accum.py 100 0
    step mcg1 200 env PYTHONPATH=$SITE:. python benchmarks/megatron_cudagraph_accum.py 100 1
    tail -3 "$W/mcg0.log" "$W/mcg1.log" >>"$S"
elif [ "$CALL" = b ]; then
    step gate16 570 python -m harness gate --examples 20 -n 16 --json "$W/gate16.json" --markdown "$W/gate.md" --save "$W/found-gate16"
else
    step gate2 570 taskset -c 0,1 python -m harness gate --examples 20 -n 2 --json "$W/gate2.json" --save "$W/found-gate2"
fi
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" .; cp "$W/gate.md" "$OUT/" 2>/dev/null
echo "done $(date -u +%T)" >>"$S"
