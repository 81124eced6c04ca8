#!/usr/bin/env bash
# Session 17b: ONE four-GPU device call (nvidia-h100-x4 or nvidia-h200-x4): the
# gate ALONE after 23916a1 (replay/canary children spread their NCCL groups
# over the GPUs via GRADFUZZ_SLOT), NCCL, world size 2, --examples 2, -n 32,
# wall limit 560 s (timeout -k 30 so a stopped gate can still flush); GATE_ARGS,
# GATE_N and LIMIT from the environment narrow it (a --paths subset).
#   spread    every 10 s each GPU's memory and the processes holding a context
#             there (nvidia-smi), with GF_CHAIN / xdist worker / GRADFUZZ_SLOT
#             from /proc/PID/environ, into $W/gpu.jsonl; summarised into
#             $W/spread.txt at the end (peak per GPU by gate phase)
# Outputs: $OUT/all.tgz every 20 s (logs, gate.json/md), and at the end
# $OUT/summary.txt, gate.md, spread.txt, gate-verdict.txt, gate-tail.log.
#   bash benchmarks/gpu_s17b.sh             # on the device machine, repository root
#   DRY=1 bash benchmarks/gpu_s17b.sh       # gloo, tiny budget, on a CPU machine
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
N=nccl; LIMIT=${LIMIT:-560}; GATE_EX=2; GATE_N=${GATE_N:-32}; GATE_ARGS=${GATE_ARGS:-}
if [ -n "${DRY:-}" ]; then
    N=gloo; LIMIT=${LIMIT_DRY:-150}; GATE_EX=1; GATE_N=2
    GATE_ARGS="--paths ddp.fixed --no-selfcheck"
fi
W=${W:-/tmp/s17b}; mkdir -p "$W"; S=${OUT:?}/summary.txt
. benchmarks/device_steps.sh  # packer
packer & PACK=$!
{ echo "checkout $(cat COMMIT 2>/dev/null || git log -1 --format=%H 2>/dev/null)"
  python -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
  echo "cores $(OMP_NUM_THREADS= nproc); N=$N; start $(date -u +%T)"; nvidia-smi -L 2>/dev/null; } >>"$S" 2>&1

sampler() {  # every 10 s: per-GPU memory and the processes on each GPU, with their chain
    python benchmarks/gpu_spread.py sample "$W/gpu.jsonl" "$W/gate.log"
}
spread() {  # the sampler's log in a few lines: peak memory per GPU, the gate's processes per GPU
    python benchmarks/gpu_spread.py summary "$W/gpu.jsonl"
}

sampler >"$W/sampler.log" 2>&1 & SAMP=$!
start=$SECONDS
CMD="python -m harness gate --backend $N --world-size 2 --examples $GATE_EX --seed 0 -n $GATE_N $GATE_ARGS --save $W/found-gate --json $W/gate.json --markdown $W/gate.md"
echo "$(date -u +%T) start gate: timeout -k 30 $LIMIT $CMD" >>"$W/cmds.txt"
GF_CHAIN=gate timeout -k 30 "$LIMIT" $CMD >"$W/gate.log" 2>&1; rc=$?
echo "$(date -u +%T) gate: exit $rc in $((SECONDS - start)) s" | tee -a "$S"
kill $SAMP 2>/dev/null
spread >"$W/spread.txt" 2>&1
python - "$W/gate.json" >"$W/gate-verdict.txt" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
keep = {k: d[k] for k in d if not isinstance(d[k], (list, dict)) or k in ("phases", "counts", "phase_seconds")}
print(json.dumps(keep, indent=1)[:4000])
PY
tail -c 60000 "$W/gate.log" >"$W/gate-tail.log"
kill $PACK 2>/dev/null; tar -czf "$OUT/all.tgz" -C "$W" .
cp "$W/gate.md" "$W/spread.txt" "$W/gate-verdict.txt" "$W/gate-tail.log" "$OUT/" 2>/dev/null
cat "$W/spread.txt" >>"$S"
echo "done $(date -u +%T)" >>"$S"
