#!/usr/bin/env bash
# Session 13, second four-GPU call (nvidia-h100-x4 or nvidia-h200-x4), after
# the triage of the first (benchmarks/gpu_s13.sh), side by side:
#   gate      the gate on all four GPUs with the carried DeepSpeed and
#             megatron-core wheels on its path (.whl -> /tmp/site), so the
#             stack paths and their canaries run on NCCL too
#   dp        ddp/fsdp2 on NCCL, seed 1, the run in which one FSDP2 case broke
#             the GPU and later cases failed on the same ranks: now the
#             ranks are replaced (ddp.fixed and fsdp2.fixed must be clean);
#             the new corpus case replayed on NCCL for its signature there
#   mesh      mesh.* fixed on NCCL after the torch-2.11 refusal, and the
#             pipeline x data-parallel paths (mesh.pp_dp.*) on NCCL beside gloo
#   pipe      every two-rank schedule on NCCL with one process per schedule
#             (-n 7: shrinking a raising stock case restarts NCCL ranks each time)
# Outputs as in gpu_s13.sh: $OUT/all.tgz every 20 s, $OUT/summary.txt.
#   bash benchmarks/gpu_s13b.sh             # on the device machine
#   DRY=1 bash benchmarks/gpu_s13b.sh       # gloo, tiny budgets, on a CPU machine
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
N=nccl; G=gloo; DEADLINE=${DEADLINE:-540}
EX_MESH=300; EX_PPDP=150; EX_PIPE=15; EX_DP=150; GATE_EX=2; GATE_N=32; PIPE_N=7
if [ -n "${DRY:-}" ]; then
    N=gloo; DEADLINE=300; EX_MESH=3; EX_PPDP=3; EX_PIPE=1; EX_DP=3; GATE_EX=1; GATE_N=2; PIPE_N=2
    GATE_ARGS="--paths mesh.fsdp_tp.fixed,ddp.fixed --corpus --no-selfcheck"
fi
W=${W:-/tmp/s13b}; mkdir -p "$W"; S=${OUT:?}/summary.txt; SITE=/tmp/site
. benchmarks/device_steps.sh  # step and packer
packer & PACK=$!
{ echo "checkout $(cat COMMIT 2>/dev/null || git log -1 --format=%H 2>/dev/null)"
  python -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
  echo "cores $(OMP_NUM_THREADS= nproc); N=$N G=$G"; } >>"$S" 2>&1
if [ -d .whl ] && [ -z "${DRY:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE .whl/*.whl >>"$S" 2>&1
    echo "wheels: $(ls .whl | tr '\n' ' ')" >>"$S"
fi
F="--db none --progress plain --progress-every 25"
fz() { local name=$1 limit=$2 b=$3; shift 3
    step "$name" "$limit" python -m harness fuzz $F --backend "$b" --save "$W/found-$name" --json "$W/$name.json" "$@"; }
PIPE=$(python -c "from harness.paths.pipeline.rank import discover
print(','.join(f'pipeline.{s}.ranks2.{v}' for s in discover() for v in ('stock', 'fixed')))")
PPDP=$(python -c "from harness.paths import resolve
print(','.join(p.name for p in resolve('mesh') if p.name.startswith('mesh.pp')))" 2>/dev/null)
echo "pp_dp paths: ${PPDP:-none}" >>"$S"

chain_gate() {
    step gate $((DEADLINE - 15)) env PYTHONPATH=$SITE:. DS_ACCELERATOR=cuda python -m harness gate --backend $N \
        --world-size 2 --examples $GATE_EX --seed 0 -n $GATE_N ${GATE_ARGS:-} --save "$W/found-gate" \
        --json "$W/gate.json" --markdown "$W/gate.md" --junit "$W/gate.xml"
}
chain_dp() {
    export CUDA_VISIBLE_DEVICES=0,1
    fz n-dp 300 $N --world-size 2 --paths ddp,fsdp2 --examples $EX_DP --seed 1
    step n-replay-fsdp2-view 90 python -m harness replay cases/parallel/fsdp2_unit_returns_param_view.json -v \
        --paths ddp,fsdp2 --backend $N --world-size 2
}
chain_mesh() {
    fz n-mesh-fixed 200 $N --paths mesh.fsdp_tp.fixed,mesh.dtensor2d.fixed --examples $EX_MESH --seed 1 &
    if [ -n "$PPDP" ]; then
        fz n-ppdp 300 $N --paths "$PPDP" --examples $EX_PPDP --seed 1 &
        fz g-ppdp 300 $G --paths "$PPDP" --examples $EX_PPDP --seed 1 &
    fi
    wait
}
chain_pipe() {
    export CUDA_VISIBLE_DEVICES=2,3
    fz n-pipeline 420 $N --world-size 2 --paths "$PIPE" --examples $EX_PIPE --seed 1 -n $PIPE_N
}
chain_gate & E=$!
chain_dp & A=$!; chain_mesh & B=$!; chain_pipe & C=$!
wait $A $B $C $E
python benchmarks/nccl2_summary.py "$W" >"$W/summary.md" 2>&1
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" .; cp "$W/summary.md" "$W/gate.md" "$OUT/" 2>/dev/null
echo "done $(date -u +%T)" >>"$S"
