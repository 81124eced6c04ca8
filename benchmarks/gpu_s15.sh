#!/usr/bin/env bash
# Session 15: one-GPU device calls for issue 34's GPU rows, each step alone
# on the machine's 16 cores (call "a": table and gate; call "b": gate2;
# call "c": the table again after shard-major planning, and the gate's fuzz
# phase alone at -n 16 twice, each with a cold inductor cache of its own:
# inductor's default compile threads, then one thread per worker; call "d":
# the gate at -n 16 again, with a limit that lets it finish):
#   table   issue 34's table in one run: the fast families, the process-group
#           families (gloo, world size 2), checkpointing, the compile paths
#           and graphed.fixed, 100 examples each, 16 workers
#   gate    README's gate (--examples 20 -n 16) on the GPU machine, every path
#           that runs there, with its phase breakdown
#   gate2   the same gate at -n 2: the 16-core speed-up at the same budget
#           (issue 34 item 6)
# Logs and JSON go to $W, re-tarred into $OUT/all.tgz every 20 s.
#
#   bash benchmarks/gpu_s15.sh a      # on the device machine, repository root
#   bash benchmarks/gpu_s15.sh b
#   bash benchmarks/gpu_s15.sh c
#   bash benchmarks/gpu_s15.sh d
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
W=${W:-/tmp/s15}; mkdir -p "$W"; S=${OUT:?}/summary.txt
. benchmarks/device_steps.sh  # step and packer
packer & PACK=$!
{ echo "checkout $(git log -1 --format=%H 2>/dev/null)"
  python -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
  echo "cores $(nproc)"; nvidia-smi -L 2>/dev/null; } >>"$S" 2>&1
TABLE=split.fixed,eager.accumulate,ddp.fixed,fsdp2.fixed,dtensor.fixed,checkpoint.fixed,compile.aot_eager,compile.inductor,graphed.fixed
CALL=${1:?call a, b, c or d}
if [ "$CALL" = a ]; then
step table 150 python -m harness fuzz --paths $TABLE --examples 100 --seed 0 --db none -n 16 --json "$W/table.json"
step gate 420 python -m harness gate --examples 20 -n 16 --json "$W/gate.json" --markdown "$W/gate.md" --save "$W/found-gate"
elif [ "$CALL" = c ]; then
step table 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ic_t python -m harness fuzz --paths $TABLE --examples 100 --seed 0 --db none -n 16 --json "$W/table.json"
FZ="python -m harness fuzz --examples 20 -n 16 --shards 1 --seed 0 --db none --progress plain"
step fuzz16 200 env TORCHINDUCTOR_CACHE_DIR=/tmp/ic_a $FZ --json "$W/fuzz16.json"
step fuzz16t1 200 env TORCHINDUCTOR_CACHE_DIR=/tmp/ic_b TORCHINDUCTOR_COMPILE_THREADS=1 $FZ --json "$W/fuzz16t1.json"
elif [ "$CALL" = d ]; then
step gate16 570 python -m harness gate --examples 20 -n 16 --json "$W/gate16.json" --markdown "$W/gate.md" --save "$W/found-gate16"
else
step gate2 520 python -m harness gate --examples 20 -n 2 --json "$W/gate2.json" --save "$W/found-gate2"
fi
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" .; cp "$W/gate.md" "$OUT/" 2>/dev/null
echo "done $(date -u +%T)" >>"$S"
