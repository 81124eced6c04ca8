#!/usr/bin/env bash
# Session 17: ONE four-GPU device call (nvidia-h100-x4 or nvidia-h200-x4) for
# what issue 35 still needs after session 13, side by side:
#   gate      the gate on all four GPUs after session 13's triage, NCCL, world
#             size 2, -n 16, no DeepSpeed/megatron wheels
#   mesh      on NCCL, 4 ranks, seed 1: mesh.pp_dp.stock,fixed 150 beside the
#             same on gloo; mesh.pp_dp.fixed alone 300; the mesh stock paths
#             (fsdp_tp, dtensor2d) 150 to completion; their fixed paths 300
#   spread    placement.first_gpu's check: every 10 s each GPU's memory and which
#             processes hold a context there (nvidia-smi), with each process's
#             chain and xdist worker read from /proc/PID/environ, into
#             $W/gpu.jsonl; summarised into $W/spread.txt at the end
# Outputs as in gpu_s13b.sh: $OUT/all.tgz every 20 s, $OUT/summary.txt.
#   bash benchmarks/gpu_s17.sh              # on the device machine, repository root
#   DRY=1 bash benchmarks/gpu_s17.sh        # gloo, tiny budgets, on a CPU machine
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
N=nccl; G=gloo; DEADLINE=${DEADLINE:-540}
EX_PPDP=150; EX_PPDP_FIXED=300; EX_MESH_STOCK=150; EX_MESH_FIXED=300; GATE_EX=2; GATE_N=16
if [ -n "${DRY:-}" ]; then
    N=gloo; DEADLINE=${DEADLINE_DRY:-240}
    EX_PPDP=2; EX_PPDP_FIXED=2; EX_MESH_STOCK=2; EX_MESH_FIXED=2; GATE_EX=1; GATE_N=2
    GATE_ARGS="--paths mesh.fsdp_tp.fixed,ddp.fixed --corpus --no-selfcheck"
fi
W=${W:-/tmp/s17}; mkdir -p "$W"; S=${OUT:?}/summary.txt
. benchmarks/device_steps.sh  # step and packer
packer & PACK=$!
{ echo "checkout $(cat COMMIT 2>/dev/null || git log -1 --format=%H 2>/dev/null)"
  python -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
  echo "cores $(OMP_NUM_THREADS= nproc); N=$N G=$G; start $(date -u +%T)"; nvidia-smi -L 2>/dev/null; } >>"$S" 2>&1
F="--db none --progress plain --progress-every 25"
fz() {  # fz NAME LIMIT BACKEND ARGS...: gradfuzz fuzz on BACKEND, JSON in $W/NAME.json
    local name=$1 limit=$2 b=$3; shift 3
    GF_CHAIN=$name step "$name" "$limit" python -m harness fuzz $F --backend "$b" --save "$W/found-$name" \
        --json "$W/$name.json" "$@"
}
PPDP=mesh.pp_dp.stock,mesh.pp_dp.fixed
MESH_FIXED=mesh.fsdp_tp.fixed,mesh.dtensor2d.fixed; MESH_STOCK=mesh.fsdp_tp.stock,mesh.dtensor2d.stock

sampler() {  # every 10 s: per-GPU memory and the processes on each GPU, with their chain
    python benchmarks/gpu_spread.py sample "$W/gpu.jsonl" "$W/gate.log"
}
spread() {  # the sampler's log in a few lines: peak memory per GPU, the gate's processes per GPU
    python benchmarks/gpu_spread.py summary "$W/gpu.jsonl"
}

chain_gate() {
    GF_CHAIN=gate step gate $((DEADLINE - 15)) python -m harness gate --backend $N --world-size 2 \
        --examples $GATE_EX --seed 0 -n $GATE_N ${GATE_ARGS:-} --save "$W/found-gate" \
        --json "$W/gate.json" --markdown "$W/gate.md" --junit "$W/gate.xml"
}
chain_mesh() {
    local L=$((DEADLINE - 20))
    fz n-ppdp $L $N --paths $PPDP --examples $EX_PPDP --seed 1 &
    fz g-ppdp $L $G --paths $PPDP --examples $EX_PPDP --seed 1 &
    fz n-ppdp-fixed $L $N --paths mesh.pp_dp.fixed --examples $EX_PPDP_FIXED --seed 1 &
    fz n-mesh-stock $L $N --paths $MESH_STOCK --examples $EX_MESH_STOCK --seed 1 &
    fz n-mesh-fixed $L $N --paths $MESH_FIXED --examples $EX_MESH_FIXED --seed 1 &
    wait
}
sampler >"$W/sampler.log" 2>&1 & SAMP=$!
chain_gate & E=$!
chain_mesh & A=$!
wait $A $E
kill $SAMP 2>/dev/null
spread >"$W/spread.txt" 2>&1
python benchmarks/nccl2_summary.py "$W" >"$W/summary.md" 2>&1
python - "$W/gate.json" >"$W/gate-verdict.txt" 2>&1 <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
keep = {k: d[k] for k in d if not isinstance(d[k], (list, dict)) or k in ("phases", "counts", "phase_seconds")}
print(json.dumps(keep, indent=1)[:4000])
EOF
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" .
cp "$W/summary.md" "$W/gate.md" "$W/spread.txt" "$W/gate-verdict.txt" "$OUT/" 2>/dev/null
cat "$W/spread.txt" >>"$S"
echo "done $(date -u +%T)" >>"$S"
