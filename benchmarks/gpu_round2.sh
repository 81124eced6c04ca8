#!/bin/bash
# Device run, round 2 (nvidia-h200-x2, torch 2.11): three jobs side by side, each
# writing under $OUT as it goes:
#  a) ddp/fsdp2 stock + fixed with NCCL at world size 2, findings saved (the
#     "illegal memory access" of round 1), then the model-parts fixed run;
#  b) gradfuzz selfcheck (every canary family, on the GPU machine);
#  c) compile.inductor.cuda fuzzed 4 minutes from a cold start, findings saved.
set -u
export PYTHONPATH=.
S=$OUT/summary.txt
log() { echo "$(date +%T) $*" | tee -a "$S"; }
python -c "import torch; print(torch.__version__, torch.cuda.device_count())" >> "$S" 2>&1
(
  t0=$(date +%s)
  timeout 150 python -m harness fuzz --db none --paths ddp.stock,fsdp2.stock --examples 200 --seed 1 --world-size 2 \
    --dtensor-backend nccl --save "$OUT/found-dp" --json "$OUT/dp-stock.json" > "$OUT/dp-stock.log" 2>&1
  log "dp-stock: exit $? in $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  timeout 150 python -m harness fuzz --db none --paths ddp.fixed,fsdp2.fixed --examples 300 --seed 2 --world-size 2 \
    --dtensor-backend nccl --save "$OUT/found-dp" --json "$OUT/dp-fixed.json" > "$OUT/dp-fixed.log" 2>&1
  log "dp-fixed: exit $? in $(( $(date +%s) - t0 )) s"
) &
(
  t0=$(date +%s)
  timeout 480 python -m harness selfcheck --seed 0 > "$OUT/selfcheck.log" 2>&1
  log "selfcheck: exit $? in $(( $(date +%s) - t0 )) s"
) &
(
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=1 timeout 300 python -m harness fuzz --db none --paths compile.inductor.cuda --minutes 4 --seed 3 \
    --save "$OUT/found-compile" --json "$OUT/compile-cuda.json" > "$OUT/compile-cuda.log" 2>&1
  log "compile-cuda: exit $? in $(( $(date +%s) - t0 )) s"
) &
wait
cd "$OUT" && tar czf found.tgz found-* 2>/dev/null; rm -rf found-*; tar czf logs.tgz *.log && rm -f *.log
log done
