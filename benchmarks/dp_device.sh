#!/bin/bash
# Issue 16/18 device run: the ddp and fsdp2 paths with NCCL on one and two GPUs.
# Usage (device tool, nvidia-h200-x2): bash benchmarks/dp_device.sh   (writes under $OUT)
set -u
export PYTHONPATH=.
S=$OUT/summary.txt
log() { echo "$(date +%T) $*" | tee -a "$S"; }
python -c "import torch; print(torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())" >> "$S" 2>&1
run() {  # name seconds args...
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" python -m harness fuzz --db none --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  log "$name: exit $rc in $(( $(date +%s) - t0 )) s: $(grep -E '^  (ddp|fsdp2)' "$OUT/$name.log" | tr -s ' ' | tr '\n' ';')"
}
run nccl1-fixed 110 --paths ddp.fixed,fsdp2.fixed --examples 200 --seed 1 --world-size 1 --dtensor-backend nccl
run nccl1-stock 110 --paths ddp.stock,fsdp2.stock --examples 200 --seed 1 --world-size 1 --dtensor-backend nccl
run nccl2-fixed 130 --paths ddp.fixed,fsdp2.fixed --examples 200 --seed 1 --world-size 2 --dtensor-backend nccl
run nccl2-stock 130 --paths ddp.stock,fsdp2.stock --examples 200 --seed 1 --world-size 2 --dtensor-backend nccl
t0=$(date +%s)
timeout 60 python -m harness replay cases/parallel --paths ddp,fsdp2 --world-size 2 --dtensor-backend nccl > "$OUT/nccl2-replay.log" 2>&1
log "nccl2-replay: exit $? in $(( $(date +%s) - t0 )) s"
cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log
log done
