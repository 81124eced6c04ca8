#!/usr/bin/env bash
# Issue 31: every process-group family on two GPUs with NCCL (world size 2),
# each beside the same run on gloo in the same call, NCCL against gloo on the
# same cases, and the gate, in ONE device call (nvidia-h100-x2 or
# nvidia-h200-x2). Five chains run side by side; every log and JSON goes to
# $W and is re-tarred into $OUT/all.tgz every 20 s, so a call killed at its
# limit still returns what was done. $OUT/summary.txt has one line per step.
#
#   bash benchmarks/nccl2.sh                  # on the device machine, from the repository root
#   N=gloo SCALE=tiny bash benchmarks/nccl2.sh  # a dry run on a CPU machine (both sides gloo, tiny budgets)
#
# N: the backend under test (nccl); G: the one beside it (gloo). SCALE=tiny
# divides every budget, to test this script on a CPU before a device call.
# Every step has its own limit; no chain runs past DEADLINE s (default 500),
# the gate's limit being DEADLINE - 20. GATE_ARGS: more gate flags.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
N=${N:-nccl}; G=${G:-gloo}; SCALE=${SCALE:-full}; DEADLINE=${DEADLINE:-500}
W=${W:-/tmp/nccl2}; mkdir -p "$W"; S=$OUT/summary.txt
# The fixed-seed draw replayed on both backends: saved by
# `nccl_vs_gloo.py draw ... --seed 31` (24 dtensor, 24 ddp/fsdp2, 14 pipeline
# ranks2 cases); drawn here when the folder is not there.
SAMPLE=${SAMPLE:-benchmarks/results-s11/nccl2/sample}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}  # some 20 harness processes side by side
if [ "$SCALE" = tiny ]; then
    EX_STOCK=6; EX_FIXED=8; EX_PIPE=2; EX_DP=6; DRAW_D=2; DRAW_P=2; DRAW_PP=1; GATE_EX=1; GATE_N=2
    GATE_ARGS=${GATE_ARGS:---paths ddp.fixed,dtensor.fixed --corpus --no-selfcheck}; SAMPLE=${SAMPLE:-/nonexistent}
else
    EX_STOCK=300; EX_FIXED=500; EX_PIPE=15; EX_DP=150; DRAW_D=24; DRAW_P=24; DRAW_PP=14; GATE_EX=2; GATE_N=8
fi
. benchmarks/device_steps.sh  # step and packer
packer & PACK=$!
{ git log -1 --format='checkout %H' 2>/dev/null || echo "checkout: not a git tree ($(cat COMMIT 2>/dev/null))"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
  echo "cores $(nproc); N=$N G=$G SCALE=$SCALE"; nvidia-smi -L 2>/dev/null; } >>"$S" 2>&1
F="--db none --progress plain --progress-every 15"
fz() {  # fz NAME LIMIT BACKEND ARGS...: gradfuzz fuzz at world size 2 on BACKEND, JSON in $W/NAME.json
    local name=$1 limit=$2 b=$3; shift 3
    step "$name" "$limit" python -m harness fuzz $F --backend "$b" --world-size 2 --save "$W/found-$name" \
        --json "$W/$name.json" "$@"
}
PIPE=$(python -c "from harness.paths.pipeline.rank import discover
print(','.join(f'pipeline.{s}.ranks2.{v}' for s in discover() for v in ('stock', 'fixed')))")
echo "pipeline ranks2 paths: $PIPE" >>"$S"

chain_dtensor() {  # seed 002 cold on 3 seeds, stock beside gloo, fixed 500 on both, the corpus
    for seed in 0 1 2; do fz n-dtensor-stock-s$seed 220 $N --paths dtensor.stock --examples $EX_STOCK --seed $seed & done
    fz g-dtensor-stock-s0 220 $G --paths dtensor.stock --examples $EX_STOCK --seed 0 &
    fz n-dtensor-fixed 260 $N --paths dtensor.fixed --examples $EX_FIXED --seed 1 &
    fz g-dtensor-fixed 260 $G --paths dtensor.fixed --examples $EX_FIXED --seed 1 &
    wait
    step n-dtensor-replay 120 python -m harness replay cases/dtensor -v --paths dtensor --backend $N --world-size 2
}
chain_pipeline() {  # every schedule on two ranks, stock and fixed; issue 18's two NCCL timeouts again
    step n-pipe-issue18 120 python -m harness replay cases/pipeline/expanded_input_grad_stolen_across_stages.json \
        cases/pipeline/frozen_first_stage_drops_weight_grads.json -v --backend $N --world-size 2 \
        --paths pipeline.GPipe.ranks2.fixed,pipeline.1F1B.ranks2.stock
    fz n-pipeline 330 $N --paths "$PIPE" --examples $EX_PIPE --seed 1 &
    fz g-pipeline 330 $G --paths "$PIPE" --examples $EX_PIPE --seed 1 &
    wait
}
chain_dp() {  # ddp and fsdp2, stock and fixed, with the switches the family draws
    fz n-dp 260 $N --paths ddp,fsdp2 --examples $EX_DP --seed 1 &
    fz g-dp 260 $G --paths ddp,fsdp2 --examples $EX_DP --seed 1 &
    wait
    # The gate as a CI job under torchrun, one rank per GPU (docs/multi-gpu.md):
    # the process-group families join the launcher's group (pipeline is not offered there).
    step torchrun-gate 200 torchrun --nproc-per-node 2 --master-port 29531 -m harness gate --paths dtensor,ddp,fsdp2 \
        --backend $N --examples $GATE_EX --seed 0 --save "$W/found-torchrun-gate" --json "$W/gate-torchrun.json" \
        --markdown "$W/gate-torchrun.md"
}
chain_compare() {  # the corpus and a fixed-seed draw per family, replayed on both backends
    local d=$SAMPLE
    if [ ! -d "$d/pipeline" ]; then  # no saved draw: draw one here (the pipeline draw takes minutes on 2 cores)
        d=$W/sample
        step draw 150 bash -c "python benchmarks/nccl_vs_gloo.py draw --paths dtensor --cases $DRAW_D --seed 31 --out $d/dtensor \
            && python benchmarks/nccl_vs_gloo.py draw --paths ddp,fsdp2 --cases $DRAW_P --seed 31 --out $d/parallel \
            && python benchmarks/nccl_vs_gloo.py draw --paths $PIPE --cases $DRAW_PP --seed 31 --out $d/pipeline"
    fi
    for b in $N $G; do
        step cmp-dtensor-$b 280 python benchmarks/nccl_vs_gloo.py run --backend $b --paths dtensor \
            --json "$W/cmp-dtensor-$b.json" cases/dtensor "$d/dtensor" &
        step cmp-parallel-$b 280 python benchmarks/nccl_vs_gloo.py run --backend $b --paths ddp,fsdp2 \
            --json "$W/cmp-parallel-$b.json" cases/parallel "$d/parallel" &
        step cmp-pipeline-$b 300 python benchmarks/nccl_vs_gloo.py run --backend $b --paths "$PIPE" \
            --json "$W/cmp-pipeline-$b.json" cases/pipeline "$d/pipeline" &
    done
    wait
    for fam in dtensor parallel pipeline; do
        step cmp-$fam-table 60 python benchmarks/nccl_vs_gloo.py compare "$W/cmp-$fam-$G.json" "$W/cmp-$fam-$N.json" \
            --markdown "$W/cmp-$fam.md"
    done
}
chain_gate() {  # every path available here, process groups on $N at world size 2
    step gate $((DEADLINE - 20)) python -m harness gate --backend $N --world-size 2 --examples $GATE_EX --seed 0 \
        -n $GATE_N ${GATE_ARGS:-} --save "$W/found-gate" --json "$W/gate.json" --markdown "$W/gate.md" --junit "$W/gate.xml"
}
chain_gate & E=$!
chain_dtensor & A=$!; chain_pipeline & B=$!; chain_dp & C=$!; chain_compare & D=$!
wait $A $B $C $D $E
python benchmarks/nccl2_summary.py "$W" >"$W/summary.md" 2>&1
cat "$W"/cmp-*.md >>"$W/summary.md" 2>/dev/null
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" .; cp "$W/summary.md" "$OUT/" 2>/dev/null
echo "done $(date -u +%T)" >>"$S"
