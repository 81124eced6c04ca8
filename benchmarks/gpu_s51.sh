#!/usr/bin/env bash
# The NCCL gate on two GPUs with the failed-rank abort (harness/workers/abort.py),
# then the triage runs of the GPU findings, on nvidia-h200-x2.
#   bash benchmarks/gpu_s51.sh gate     # the gate at --examples 3 --seed 0 -n 16, alone in the call
#   bash benchmarks/gpu_s51.sh final    # both in one call: the scripts, the gate, the fixed runs in what is left
#   bash benchmarks/gpu_s51.sh triage   # torch-only scripts of the graphed and pipeline findings, fixed paths
#   bash benchmarks/gpu_s51.sh second   # the gate again from a copy of the tree at another path (/tmp/ckB)
#   bash benchmarks/gpu_s51.sh cores    # the fixed references (SKIP_FIXED=1: none), then one --paths gate at -n 16 and at -n 2 on 2 cores
#   N=gloo SCALE=tiny bash benchmarks/gpu_s51.sh gate   # dry run on a CPU machine
# Logs, JSON reports and findings go to $W, re-tarred into $OUT/all.tgz every 20 s, with the pools'
# trace (GRADFUZZ_POOL_TRACE), summed into summary.txt at the end. GATE_LIMIT: the gate's seconds
# (555); LEDGER_FALLBACK: a ledger to use if the tree's does not load; SPY_AFTER: from when the
# gate's stacks are dumped, if py-spy is carried as .h51/py_spy*.whl.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
N=${N:-nccl}; SCALE=${SCALE:-full}; CALL=${1:?gate or triage}
# A fresh folder each call: a warm machine keeps the last call's, whose traces and reports would be summed in.
W=${W:-/tmp/s51}; rm -rf "$W"; mkdir -p "$W"; S=${OUT:?}/summary.txt
. benchmarks/device_steps.sh
# Where the pools' time goes: one line per group start and per request (harness/workers/trace.py),
# and the fuzz workers' status files (per path: examples, seconds) copied as they change.
export GRADFUZZ_POOL_TRACE="$W/pool"
statuses() { while :; do sleep 10; mkdir -p "$W/runs"; cp .gradfuzz/runs/*/status-*.json "$W/runs/" 2>/dev/null; done; }
# Which lines of the gate's log came when, the process tree, and (py-spy carried as .h51/py_spy*.whl)
# the gate's Python stacks from SPY_AFTER seconds on: what a phase that logs nothing is waiting for.
watcher() {
    local spy=""
    for w in .h51/py_spy*.whl; do
        [ -f "$w" ] && python -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); open('/tmp/py-spy', 'wb').write(z.read([n for n in z.namelist() if n.endswith('/py-spy')][0]))" "$w" \
            && chmod +x /tmp/py-spy && spy=/tmp/py-spy
    done
    mkdir -p "$W/ps"
    while :; do
        sleep 5
        [ -f "$W/gate.log" ] && echo "$SECONDS $(wc -l <"$W/gate.log")" >>"$W/gate.lines"
        if [ $((SECONDS % 20)) -lt 5 ]; then
            ps -eo pid,ppid,etimes,time,pcpu,rss,args --forest | cut -c1-220 >"$W/ps/$SECONDS.txt"
            local gate; gate=$(pgrep -of "^python -m harness gate --backend $N")  # not the timeout around it
            if [ -n "$spy" ] && [ -n "$gate" ] && [ $SECONDS -ge "${SPY_AFTER:-360}" ]; then
                timeout 15 "$spy" dump --nonblocking --pid "$gate" --subprocesses >"$W/ps/spy-$SECONDS.txt" 2>&1
            fi
        fi
    done
}
packer & PACK=$!
statuses & STAT=$!
watcher & WATCH=$!
{ python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
  echo "cores $(nproc) call $CALL N=$N SCALE=$SCALE"; nvidia-smi -L 2>/dev/null; } >>"$S" 2>&1
# Others edit the ledger in the same tree: a half-edited one that does not load would cost the call,
# so then the ledger in LEDGER_FALLBACK (the last committed one, carried) is used, and said so.
LEDGER=()
if ! python -c "from harness.gate import ledger; ledger.load('cases/ledger.json')" >/dev/null 2>&1 \
        && [ -f "${LEDGER_FALLBACK:-}" ]; then
    LEDGER=(--ledger "$LEDGER_FALLBACK"); echo "cases/ledger.json does not load: the gate uses $LEDGER_FALLBACK" >>"$S"
fi
if [ "$SCALE" = tiny ]; then
    GATE="--paths pipeline.ZBVZeroBubble.ranks2.stock,pipeline.DualPipeV.ranks2.stock,ddp.fixed --corpus --no-selfcheck --examples 1 -n 2"; DEADLINE=${DEADLINE:-200}
    EX_DP=4; EX_PIPE=1; FIXED_LIMIT=60
else
    GATE="--examples 3 -n 16"; EX_DP=200; EX_PIPE=25; FIXED_LIMIT=170
fi
CORE_PATHS=${CORE_PATHS:-split,eager,checkpoint,func,ddp.fixed,dtensor.fixed,compile.aot_eager}
triage_scripts() {  # the torch-only scripts of the triaged findings (TRIAGE: more, space-separated)
    for f in cases/graphed/make_graphed_callables_*.py ${TRIAGE:-}; do
        step "t-$(basename "$f" .py)" 60 python "$f"; tail -4 "$W/t-$(basename "$f" .py).log" | sed 's/^/    /' >>"$S"
    done
}
fixed_runs() {  # fixed_runs LIMIT: the fixed references on N, side by side, 0 false findings expected
    step fixed-dp $1 python -m harness fuzz --paths ddp.fixed,fsdp2.fixed --examples $EX_DP --seed 0 --db none \
        --backend "$N" --world-size 2 --progress plain --progress-every 15 --save "$W/found-fixed-dp" --json "$W/fixed-dp.json" & PIDS="$!"
    step fixed-dtensor $1 python -m harness fuzz --paths dtensor.fixed --examples $EX_DP --seed 0 --db none \
        --backend "$N" --world-size 2 --progress plain --progress-every 15 --save "$W/found-fixed-dtensor" --json "$W/fixed-dtensor.json" & PIDS="$PIDS $!"
    P=$(python -c "from harness.paths.pipeline.rank import discover
print(','.join(f'pipeline.{s}.ranks2.fixed' for s in discover()))")
    step fixed-pipe $1 python -m harness fuzz --paths "$P" --examples $EX_PIPE --seed 0 --db none \
        --backend "$N" --world-size 2 --progress plain --progress-every 15 --save "$W/found-fixed-pipe" --json "$W/fixed-pipe.json" & PIDS="$PIDS $!"
    wait $PIDS
    for j in fixed-dp fixed-dtensor fixed-pipe; do
        grep -E "DIVERGES| clean |fuzzed|no divergence|\] divergence" "$W/$j.log" | sed "s/^/$j: /" >>"$S"
    done
}
gate_summary() {
    python - "$W/gate.json" >>"$S" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("passed", d.get("passed"), "seconds", d.get("seconds"), "examples", sum((d.get("examples") or {}).values()))
print("phases", json.dumps(d.get("phases")))
print("counts", json.dumps({k: v for k, v in (d.get("counts") or {}).items() if v}))
for r in d.get("rows") or []:
    if r.get("status") in ("new", "resembles", "error", "regression", "range_wrong", "selfcheck"):
        print(" ", r.get("status"), r.get("path"), r.get("signature"), str(r.get("detail") or r.get("title") or "")[:300])
PY
}
pool_summary() {  # the pool trace, summed: per phase (replay slots, fuzz workers) and request kind
    python - "$W/pool" >>"$S" 2>&1 <<'PY'
import collections, glob, os, sys
tot = collections.defaultdict(lambda: [0, 0.0, 0, 0])  # count, seconds, failed, not ok
for f in glob.glob(os.path.join(sys.argv[1], "pool-*.tsv")):
    phase = "fuzz" if "-gw" in f else "main" if "-slot-" in f else "children"
    for line in open(f):
        t, event, backend, what, status, secs, note = (line.rstrip("\n").split("\t") + [""] * 7)[:7]
        key = (phase, event, backend, what if event in ("request", "case") else "")
        row = tot[key]
        row[0] += 1; row[1] += float(secs or 0); row[2] += "failed" in note; row[3] += event == "request" and status != "ok"
print("pool and child trace: phase / event / backend / what: count, seconds, failed, not ok")
for k, v in sorted(tot.items(), key=lambda kv: -kv[1][1])[:40]:
    print(f"  {' / '.join(k)}: {v[0]}, {v[1]:.1f} s, {v[2]}, {v[3]}")
PY
}
case $CALL in
final)  # one call: the triage scripts, the gate, then the fixed references in what time is left
    DEADLINE=${DEADLINE:-585}
    triage_scripts
    step gate $((DEADLINE - SECONDS - 25)) python -m harness gate --backend "$N" --world-size 2 --seed 0 $GATE "${LEDGER[@]}" \
        --save "$W/found-gate" --json "$W/gate.json" --markdown "$W/gate.md"
    gate_summary
    left=$((DEADLINE - SECONDS - 15))
    if [ $left -ge 45 ]; then fixed_runs $left; else echo "no time left for the fixed runs ($left s)" >>"$S"; fi ;;
gate)
    step gate ${GATE_LIMIT:-555} python -m harness gate --backend "$N" --world-size 2 --seed 0 $GATE "${LEDGER[@]}" \
        --save "$W/found-gate" --json "$W/gate.json" --markdown "$W/gate.md"
    gate_summary ;;
triage)
    triage_scripts
    fixed_runs $FIXED_LIMIT ;;
second)  # the same gate from a second checkout path: its rows must be the first's
    rm -rf /tmp/ckB && mkdir -p /tmp/ckB && tar -cf - --exclude=./.gradfuzz --exclude=./.git . | tar -xf - -C /tmp/ckB
    (cd /tmp/ckB && PYTHONPATH=/tmp/ckB step gate ${GATE_LIMIT:-555} python -m harness gate --backend "$N" --world-size 2 \
        --seed 0 $GATE "${LEDGER[@]}" --save "$W/found-gate" --json "$W/gate.json" --markdown "$W/gate.md")
    gate_summary ;;
cores)  # the fixed references, then a --paths gate at -n 16 and at -n 2 (taskset to two cores), the same rows
    [ "${SKIP_FIXED:-0}" = 1 ] || fixed_runs $FIXED_LIMIT
    for n in 16 2; do
        pin=(); [ $n = 2 ] && pin=(taskset -c 0,1)
        # Each run compiles cold in an Inductor cache of its own: sharing one, the second run
        # read what the first (or an earlier call's gate) compiled, and the ratio measured the cache.
        rm -rf "$W/inductor-n$n"
        TORCHINDUCTOR_CACHE_DIR="$W/inductor-n$n" step "cores-n$n" ${CORES_LIMIT:-180} "${pin[@]}" python -m harness gate --backend "$N" --world-size 2 --seed 0 \
            --paths "$CORE_PATHS" --examples 3 -n $n --no-selfcheck --json "$W/cores-n$n.json"
        python -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[2], d['passed'], round(d['seconds'], 1), d['phases'], {k: v for k, v in d['counts'].items() if v})" \
            "$W/cores-n$n.json" "n=$n" >>"$S" 2>&1
    done
    python -c "import json, sys; r = [sorted(json.dumps([x.get(k) for k in ('status', 'path', 'signature', 'bug')]) for x in json.load(open(f))['rows']) for f in sys.argv[1:]]; print('rows identical at -n 16 and -n 2:', r[0] == r[1], len(r[0]), len(r[1]))" \
        "$W/cores-n16.json" "$W/cores-n2.json" >>"$S" 2>&1 ;;
esac
pool_summary
kill $PACK $STAT $WATCH 2>/dev/null; tar -czf "$OUT/all.tgz" -C "$W" . 2>/dev/null
