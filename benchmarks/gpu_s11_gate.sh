#!/usr/bin/env bash
# Session 11, second two-GPU call: the gate alone with NCCL at world size 2
# (its self-check ran in the first call, benchmarks/gpu_s11.sh), and rank
# tracebacks of the two dtensor.fixed errors issue 31's call 1 saw on NCCL.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
W=/tmp/s11g; mkdir -p "$W"
( timeout -k 5 ${GATE_LIMIT:-330} python -m harness gate --backend nccl --world-size 2 --examples 2 --seed 0 -n 8 \
    --no-selfcheck --json "$W/gate.json" --markdown "$W/gate.md" --save "$W/found-gate" >"$W/gate.log" 2>&1
  echo "gate: exit $?" >>"$W/summary.txt" ) &
for f in benchmarks/results-s11/gpu/dtensor.fixed-error-*.json; do
    timeout 90 python benchmarks/rank_traceback.py "$f" dtensor.fixed nccl 2 >"$W/tb-$(basename "$f" .json).log" 2>&1
done
wait
cp "$W"/gate.md "$W"/summary.txt "$W"/tb-*.log "$OUT"/ 2>/dev/null; tail -c 20000 "$W/gate.log" >"$OUT/gate.log"
tar -czf "$OUT/found-gate.tgz" -C "$W" found-gate gate.json 2>/dev/null
