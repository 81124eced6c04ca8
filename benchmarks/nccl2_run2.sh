#!/usr/bin/env bash
# issue 18, device call 2 (nvidia-h200-x2): the gate on the paths that finish
# in time (no pipeline ranks2, no graphed.compile), and why pipeline ranks2
# replays diverge on NCCL (divergence text, seconds per case).
set -u
W=/tmp/h18work2; mkdir -p "$W"; S=$OUT/summary.txt
step() {
    local name=$1 limit=$2 start=$SECONDS rc; shift 2
    echo "$(date -u +%T) start $name: $*" >>"$W/cmds.txt"
    timeout "$limit" "$@" >"$W/$name.log" 2>&1; rc=$?
    echo "$(date -u +%T) $name: exit $rc in $((SECONDS - start)) s" | tee -a "$S"
}
packer() { while :; do sleep 15; tar -czf "$OUT/.all.tgz" -C "$W" . 2>/dev/null && mv "$OUT/.all.tgz" "$OUT/all.tgz"; done; }
packer & PACK=$!
step gate2 185 python -m harness gate --minutes 0.5 --paths eager,split,dtensor,graphed.stock,graphed.fixed \
    --dtensor-backend nccl --world-size 2 --save "$W/found-gate2" --json "$W/gate2.json" --markdown "$W/gate2.md" &
G=$!
step pdiag 110 python -m harness replay cases/pipeline/expanded_input_grad_stolen_across_stages.json \
    cases/pipeline/frozen_first_stage_drops_weight_grads.json -v \
    --paths pipeline.GPipe.ranks2.fixed,pipeline.1F1B.ranks2.stock --json "$W/pdiag.json"
step pfuzz 60 python -m harness fuzz --paths pipeline.GPipe.ranks2.fixed --examples 8 --seed 1 --db none \
    --progress plain --progress-every 5 --save "$W/found-pfuzz" --json "$W/pfuzz.json"
wait $G
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" .; echo "done $(date -u +%T)" >>"$S"
