#!/usr/bin/env bash
# Session 13: ONE device call on a four-GPU machine (nvidia-h100-x4 or
# nvidia-h200-x4) for what issues 35 and 31 still need, side by side:
#   gate      the gate with every path available there: the mesh paths on all
#             four GPUs (NCCL, 4 ranks), the other process-group families on
#             NCCL at world size 2 (issue 35 item 3, issue 31 item 5)
#   mesh      mesh.* on NCCL at 4 ranks beside the same runs on gloo: fixed
#             300 examples each, stock 150; then NCCL against gloo on the same
#             cases (cases/mesh and a seed-31 draw saved in results-s13)
#   dtensor   dtensor.stock from a cold start on seeds 2, 3, 4 (seed 002 on more
#             seeds: seed 2 missed it in session 11), dtensor.fixed 500 on NCCL
#             beside gloo (issue 31 item 1, after the two refusals added since)
#   pipe      every two-rank pipeline schedule, stock and fixed, NCCL beside
#             gloo (issue 31 item 2, after the hang fix)
#   dp        ddp.* and fsdp2.* on NCCL beside gloo (issue 31 item 3: the gloo
#             run was killed in session 11)
# The two-rank chains pin their ranks to GPUs 0,1 (dp) and 2,3 (dtensor, pipe)
# with CUDA_VISIBLE_DEVICES. Every log and JSON goes to $W, re-tarred into
# $OUT/all.tgz every 20 s, so a call killed at its limit still returns what
# was done; $OUT/summary.txt has one line per step.
#
#   bash benchmarks/gpu_s13.sh              # on the device machine, from the repository root
#   DRY=1 bash benchmarks/gpu_s13.sh        # gloo on both sides, tiny budgets, on a CPU machine
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
N=nccl; G=gloo; DEADLINE=${DEADLINE:-560}
EX_MESH_FIXED=300; EX_MESH_STOCK=150; EX_DT_STOCK=300; EX_DT_FIXED=500; EX_PIPE=15; EX_DP=150; GATE_EX=2; GATE_N=16
if [ -n "${DRY:-}" ]; then
    N=gloo; DEADLINE=${DEADLINE_DRY:-300}
    EX_MESH_FIXED=4; EX_MESH_STOCK=3; EX_DT_STOCK=4; EX_DT_FIXED=4; EX_PIPE=1; EX_DP=4; GATE_EX=1; GATE_N=2
    GATE_ARGS="--paths mesh.fsdp_tp.fixed,ddp.fixed --corpus --no-selfcheck"
fi
W=${W:-/tmp/s13}; mkdir -p "$W"; S=${OUT:?}/summary.txt
SAMPLE=benchmarks/results-s13/sample
. benchmarks/device_steps.sh  # step and packer
packer & PACK=$!
{ echo "checkout $(cat COMMIT 2>/dev/null || git log -1 --format=%H 2>/dev/null)"
  python -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
  echo "cores $(OMP_NUM_THREADS= nproc); N=$N G=$G"; nvidia-smi -L 2>/dev/null; } >>"$S" 2>&1
F="--db none --progress plain --progress-every 25"
fz() {  # fz NAME LIMIT BACKEND ARGS...: gradfuzz fuzz on BACKEND, JSON in $W/NAME.json
    local name=$1 limit=$2 b=$3; shift 3
    step "$name" "$limit" python -m harness fuzz $F --backend "$b" --save "$W/found-$name" --json "$W/$name.json" "$@"
}
PIPE=$(python -c "from harness.paths.pipeline.rank import discover
print(','.join(f'pipeline.{s}.ranks2.{v}' for s in discover() for v in ('stock', 'fixed')))")
echo "pipeline ranks2 paths: $PIPE" >>"$S"
MESH_FIXED=mesh.fsdp_tp.fixed,mesh.dtensor2d.fixed; MESH_STOCK=mesh.fsdp_tp.stock,mesh.dtensor2d.stock

chain_gate() {
    step gate $((DEADLINE - 15)) python -m harness gate --backend $N --world-size 2 --examples $GATE_EX --seed 0 \
        -n $GATE_N ${GATE_ARGS:-} --save "$W/found-gate" --json "$W/gate.json" --markdown "$W/gate.md" --junit "$W/gate.xml"
}
chain_mesh() {
    fz n-mesh-fixed 240 $N --paths $MESH_FIXED --examples $EX_MESH_FIXED --seed 1 &
    fz g-mesh-fixed 240 $G --paths $MESH_FIXED --examples $EX_MESH_FIXED --seed 1 &
    fz n-mesh-stock 240 $N --paths $MESH_STOCK --examples $EX_MESH_STOCK --seed 1 &
    fz g-mesh-stock 240 $G --paths $MESH_STOCK --examples $EX_MESH_STOCK --seed 1 &
    wait
    for b in $N $G; do
        step cmp-mesh-$b 200 python benchmarks/nccl_vs_gloo.py run --backend $b --paths mesh --world-size 4 \
            --json "$W/cmp-mesh-$b.json" cases/mesh "$SAMPLE/mesh" &
    done
    wait
    step cmp-mesh-table 60 python benchmarks/nccl_vs_gloo.py compare "$W/cmp-mesh-$G.json" "$W/cmp-mesh-$N.json" \
        --markdown "$W/cmp-mesh.md"
}
chain_dtensor() {
    export CUDA_VISIBLE_DEVICES=2,3
    for seed in 2 3 4; do fz n-dtensor-stock-s$seed 220 $N --world-size 2 --paths dtensor.stock --examples $EX_DT_STOCK --seed $seed & done
    fz n-dtensor-fixed 260 $N --world-size 2 --paths dtensor.fixed --examples $EX_DT_FIXED --seed 1 &
    fz g-dtensor-fixed 260 $G --world-size 2 --paths dtensor.fixed --examples $EX_DT_FIXED --seed 1 &
    wait
}
chain_pipe() {
    export CUDA_VISIBLE_DEVICES=2,3
    fz n-pipeline 420 $N --world-size 2 --paths "$PIPE" --examples $EX_PIPE --seed 1 &
    fz g-pipeline 420 $G --world-size 2 --paths "$PIPE" --examples $EX_PIPE --seed 1 &
    wait
}
chain_dp() {
    export CUDA_VISIBLE_DEVICES=0,1
    fz n-dp 300 $N --world-size 2 --paths ddp,fsdp2 --examples $EX_DP --seed 1 &
    fz g-dp 300 $G --world-size 2 --paths ddp,fsdp2 --examples $EX_DP --seed 1 &
    wait
}
chain_gate & E=$!
chain_mesh & A=$!; chain_dtensor & B=$!; chain_pipe & C=$!; chain_dp & D=$!
wait $A $B $C $D $E
python benchmarks/nccl2_summary.py "$W" >"$W/summary.md" 2>&1
cat "$W"/cmp-*.md >>"$W/summary.md" 2>/dev/null
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" .; cp "$W/summary.md" "$W/gate.md" "$OUT/" 2>/dev/null
echo "done $(date -u +%T)" >>"$S"
