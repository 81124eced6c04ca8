#!/usr/bin/env bash
# Session 11, one device call on two GPUs (nvidia-h100-x2 or nvidia-h200-x2):
#   gate     the gate with NCCL at world size 2, after the pipeline NCCL hang fix (issue 31)
#   liger    Liger's fused linear cross-entropy under accumulation (issue 30, GPU parts)
#   stacks   DeepSpeed and Megatron-core families with NCCL at world size 2, beside ddp.fixed (issue 30)
#   pipe     every two-rank pipeline schedule on NCCL after the fix (issue 31)
#   dtfixed  the three dtensor.fixed errors seen on NCCL in call 1, replayed with their tracebacks
# The carried wheels (.whl: liger-kernel, deepspeed, megatron-core and what they need) go to /tmp/site,
# on the path of the liger and stacks chains only, so the gate runs on torch alone.
#   bash benchmarks/gpu_s11.sh                 # on the device machine, from the repository root
#   DRY=1 bash benchmarks/gpu_s11.sh           # gloo, tiny budgets, on a CPU machine
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
W=${W:-/tmp/s11}; mkdir -p "$W"; S=$OUT/summary.txt
B=nccl; GATE_EX=2; GATE_N=6; PIPE_EX=15; ST_EX=60; LIGER_N=300; DEADLINE=${DEADLINE:-470}
[ -n "${DRY:-}" ] && { B=gloo; GATE_EX=1; GATE_N=2; PIPE_EX=1; ST_EX=4; LIGER_N=0; DEADLINE=200; }
. benchmarks/device_steps.sh  # step and packer
packer & PACK=$!
{ python -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"; echo "cores $(OMP_NUM_THREADS= nproc)"; } >>"$S" 2>&1
SITE=/tmp/site
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl >>"$S" 2>&1
fi
F="--db none --progress plain --progress-every 15"

chain_gate() {
    step gate $((DEADLINE - 20)) env PYTHONPATH=. python -m harness gate --backend $B --world-size 2 --examples $GATE_EX \
        --seed 0 -n $GATE_N --json "$W/gate.json" --markdown "$W/gate.md" --save "$W/found-gate"
}
chain_liger() {
    [ "$LIGER_N" -gt 0 ] && step liger 200 env PYTHONPATH=$SITE:. CUDA_VISIBLE_DEVICES=0 python benchmarks/liger_flce_accum.py $LIGER_N 0
    for f in $(tar -tzf benchmarks/results-s11/nccl2/call1-all.tgz | grep 'found-n-dtensor-fixed/.*json$'); do
        tar -xzf benchmarks/results-s11/nccl2/call1-all.tgz -C "$W" "$f"
    done
    for f in "$W"/found-n-dtensor-fixed/*.json; do
        [ -f "$f" ] && step dtfixed-$(basename "$f" .json) 90 env PYTHONPATH=. python benchmarks/rank_traceback.py "$f" \
            dtensor.fixed $B 2
    done
}
chain_stacks() {
    step stacks-deepspeed 170 env PYTHONPATH=$SITE:. python -m harness fuzz $F --backend $B --world-size 2 \
        --paths deepspeed.zero0,deepspeed.zero3,ddp.fixed --examples $ST_EX --seed 0 --json "$W/stacks-deepspeed.json" --save "$W/found-ds"
    step stacks-megatron 120 env PYTHONPATH=$SITE:. python -m harness fuzz $F --backend $B --world-size 2 \
        --paths megatron,ddp.fixed --examples $ST_EX --seed 0 --json "$W/stacks-megatron.json" --save "$W/found-mg"
}
chain_pipe() {
    P=$(PYTHONPATH=. python -c "from harness.paths.pipeline.rank import discover
print(','.join(f'pipeline.{s}.ranks2.{v}' for s in discover() for v in ('stock', 'fixed')))")
    step pipe $((DEADLINE - 40)) env PYTHONPATH=. python -m harness fuzz $F --backend $B --world-size 2 --paths "$P" \
        --examples $PIPE_EX --seed 0 --json "$W/pipe.json" --save "$W/found-pipe"
}
chain_gate & P1=$!; chain_liger & P2=$!; chain_stacks & P3=$!; chain_pipe & P4=$!
wait $P1 $P2 $P3 $P4
kill $PACK 2>/dev/null
tar -czf "$OUT/all.tgz" -C "$W" .
cp "$S" "$W/summary.txt"
