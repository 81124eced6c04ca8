#!/bin/bash
# Device run, round 3 (nvidia-h200-x2, torch 2.11), jobs side by side, outputs under $OUT:
#  a) the gate on the paths that finish in a call (no pipeline ranks2, no compile), Markdown + JSON;
#  b) graphed.stock / graphed.fixed with the model parts, 300 examples, findings saved;
#  c) eager + split, and dtensor (gloo), with the model parts on 2.11, findings saved.
set -u
export PYTHONPATH=.
S=$OUT/summary.txt
log() { echo "$(date +%T) $*" | tee -a "$S"; }
python -c "import torch; print(torch.__version__, torch.cuda.device_count())" >> "$S" 2>&1
(
  t0=$(date +%s)
  timeout 520 python -m harness gate --no-selfcheck --examples 40 --seed 0 \
    --paths eager,split,dtensor,graphed,checkpoint,ddp,fsdp2 --dtensor-backend nccl --world-size 2 \
    --save "$OUT/found-gate" --json "$OUT/gate.json" --markdown "$OUT/gate.md" > "$OUT/gate.log" 2>&1
  log "gate: exit $? in $(( $(date +%s) - t0 )) s"
) &
(
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=1 timeout 300 python -m harness fuzz --db none --paths graphed.stock,graphed.fixed --examples 300 \
    --seed 5 --save "$OUT/found-graphed" --json "$OUT/graphed.json" > "$OUT/graphed.log" 2>&1
  log "graphed: exit $? in $(( $(date +%s) - t0 )) s"
) &
(
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES="" timeout 200 python -m harness fuzz --db none --paths eager,split --examples 600 --seed 6 \
    --save "$OUT/found-cpu" --json "$OUT/split211.json" > "$OUT/split211.log" 2>&1
  log "split211: exit $? in $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES="" timeout 200 python -m harness fuzz --db none --paths dtensor --examples 300 --seed 7 \
    --dtensor-backend gloo --save "$OUT/found-cpu" --json "$OUT/dtensor211.json" > "$OUT/dtensor211.log" 2>&1
  log "dtensor211: exit $? in $(( $(date +%s) - t0 )) s"
) &
wait
cd "$OUT" && tar czf found.tgz found-* 2>/dev/null; rm -rf found-*; tar czf logs.tgz *.log && rm -f *.log
log done
