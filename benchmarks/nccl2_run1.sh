#!/usr/bin/env bash
# issue 18, device call 1 (nvidia-h200-x2): three chains in parallel, every
# log under $W, re-tarred into $OUT/all.tgz every 20 s so a killed call
# still returns what was done.
set -u
W=/tmp/h18work; mkdir -p "$W"; S=$OUT/summary.txt
step() {  # step NAME LIMIT COMMAND...
    local name=$1 limit=$2 start=$SECONDS rc; shift 2
    echo "$(date -u +%T) start $name: $*" >>"$W/cmds.txt"
    timeout "$limit" "$@" >"$W/$name.log" 2>&1; rc=$?
    echo "$(date -u +%T) $name: exit $rc in $((SECONDS - start)) s" | tee -a "$S"
}
packer() { while :; do sleep 20; tar -czf "$OUT/.all.tgz" -C "$W" . 2>/dev/null && mv "$OUT/.all.tgz" "$OUT/all.tgz"; done; }
packer & PACK=$!
{ python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"; nproc; nvidia-smi -L; } >>"$S" 2>&1
F="--db none --progress plain --progress-every 15"
N="--dtensor-backend nccl --world-size 2"
chain_dtensor() {
    for seed in 0 1 2; do
        step nstock-$seed 200 python -m harness fuzz --paths dtensor.stock --examples 300 --seed $seed $F $N \
            --save "$W/found-nstock-$seed" --json "$W/nstock-$seed.json" &
    done
    step nfixed 260 python -m harness fuzz --paths dtensor.fixed --examples 500 --seed 1 $F $N \
        --save "$W/found-nfixed" --json "$W/nfixed.json" &
    wait
    step nreplay 120 python -m harness replay cases/dtensor -v --paths dtensor $N
    step ntorchrun 90 torchrun --nproc-per-node 2 cases/dtensor/partial_grad_transposed_to_replicate.py
}
P=""
for s in 1F1B GPipe Interleaved1F1B LoopedBFS InterleavedZeroBubble ZBVZeroBubble DualPipeV; do
    P="$P,pipeline.$s.ranks2.stock,pipeline.$s.ranks2.fixed"; done
P=${P#,}
chain_pipeline() {
    step pprobe 120 python -c "
import json, torch
from harness.paths import pipeline as pp
from harness.pool import backend_for
print('backend ws1', backend_for(1), 'ws2', backend_for(2))
for ws in (1, 2):
    print(ws, json.dumps(pp.probe(ws), default=str)[:3000])
for p in [pp.PipelinePath(s, pp.STOCK, 2) for s in ('1F1B', 'ZBVZeroBubble', 'DualPipeV')]:
    print(p.name, p.availability())
"
    step npipe 300 python -m harness fuzz --paths "$P" --examples 40 --seed 1 $F \
        --save "$W/found-npipe" --json "$W/npipe.json"
    step npreplay 100 python -m harness replay cases/pipeline -v --paths pipeline
}
chain_gate() {
    step gate 470 python -m harness gate --minutes 1 $N --save "$W/found-gate" --json "$W/gate.json" \
        --markdown "$W/gate.md" --junit "$W/gate.xml"
}
chain_dtensor & A=$!; chain_pipeline & B=$!; chain_gate & C=$!
wait $A $B $C
kill $PACK
tar -czf "$OUT/all.tgz" -C "$W" .; echo "done $(date -u +%T)" >>"$S"
