#!/usr/bin/env bash
# The failed-rank abort on NCCL, on and off, on the two-rank target the gate waits on longest
# (pipeline.DualPipeV.ranks2: its stock path raises and shrinks), then the repro of what its
# stock path raised (the gate's new row) on stock and on the fixed stage. nvidia-h200-x2; `N=gloo LIMIT=20 bash ...` dry-runs on CPU.
#   bash benchmarks/gpu_s51_abort.sh        # writes $OUT/summary.txt and $OUT/abort.tgz
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
N=${N:-nccl}; LIMIT=${LIMIT:-75}; W=${W:-/tmp/s51a}; mkdir -p "$W"; S=${OUT:?}/summary.txt
for a in 1 0; do  # GRADFUZZ_NCCL_ABORT=0: wait out the grace and restart the ranks after each raising case
    GRADFUZZ_NCCL_ABORT=$a GRADFUZZ_POOL_TRACE="$W/trace$a" timeout -k 5 "$LIMIT" python -m harness fuzz \
        --paths pipeline.DualPipeV.ranks2.stock,pipeline.DualPipeV.ranks2.fixed --examples 3 --seed 0 --db none \
        --backend "$N" --world-size 2 --progress plain --progress-every 10 --save "$W/found$a" >"$W/fuzz$a.log" 2>&1
    rc=$?
    t=$(cat "$W"/trace$a/*.tsv 2>/dev/null)
    echo "abort=$a: exit $rc (limit $LIMIT s); $(grep -c '	request	' <<<"$t") requests, $(grep -c '	start	' <<<"$t") group starts; $(grep -E 'fuzzed|examples' "$W/fuzz$a.log" | tail -1 | cut -c1-200)" >>"$S"
done
# The gate's new row on DualPipeV: its shrunk case again, on stock and on the fixed stage.
for f in "$W"/found1/pipeline.stock-error-*.json; do
    [ -f "$f" ] || continue
    echo "== repro $f" >>"$W/repro.log"
    timeout 60 python -m harness repro "$f" --paths pipeline.DualPipeV.ranks2.stock,pipeline.DualPipeV.ranks2.fixed \
        --backend "$N" >>"$W/repro.log" 2>&1
    echo "repro $(basename "$f"): exit $?; $(grep -E '^pipeline' "$W/repro.log" | tail -2 | cut -c1-160 | tr '\n' ' ')" >>"$S"
done
tar -czf "$OUT/abort.tgz" -C "$W" .
