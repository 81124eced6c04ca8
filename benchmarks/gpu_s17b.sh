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
    python - "$W/gpu.jsonl" "$W/gate.log" <<'EOF'
import json, re, subprocess, sys, time
def phase():  # the gate's phase now, from its progress lines ("gradfuzz [replay ...", "[phase] fuzz ...")
    try:
        with open(sys.argv[2], "rb") as fh:
            fh.seek(0, 2); fh.seek(max(0, fh.tell() - 8192))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return "-"
    hits = re.findall(r"(?:gradfuzz \[|\[phase\] )([a-z][a-z-]*)", tail)
    return hits[-1] if hits else "-"
def q(what, fields):
    out = subprocess.run(["nvidia-smi", f"--query-{what}={fields}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
def env(pid):
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return {}
    kv = dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)
    return {k: kv[k] for k in ("GF_CHAIN", "PYTEST_XDIST_WORKER", "GRADFUZZ_SLOT") if k in kv}
t0 = time.time()
with open(sys.argv[1], "a") as fh:
    while True:
        try:
            gpus = q("gpu", "index,pci.bus_id,memory.used,memory.total")
            apps = q("compute-apps", "pid,gpu_bus_id,used_memory")
        except Exception as e:  # no nvidia-smi (DRY) or a hung query: say so once, and stop
            fh.write(json.dumps({"t": round(time.time() - t0), "error": repr(e)}) + "\n"); fh.flush()
            break
        bus = {g[1]: g[0] for g in gpus}
        fh.write(json.dumps({"t": round(time.time() - t0), "phase": phase(),
                             "gpus": {g[0]: [int(g[2]), int(g[3])] for g in gpus},
                             "apps": [[a[0], bus.get(a[1], a[1]), a[2], env(a[0])] for a in apps]}) + "\n")
        fh.flush()
        time.sleep(10)
EOF
}
spread() {  # the sampler's log in a few lines: peak memory per GPU, the gate's processes per GPU
    python - "$W/gpu.jsonl" <<'EOF'
import json, sys
from collections import Counter, defaultdict
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "gpus" in r]
if not rows:
    print("spread: no nvidia-smi samples"); sys.exit()
peak = {}
for r in rows:
    for g, (used, total) in r["gpus"].items():
        if used >= peak.get(g, (0, 0, 0))[0]:
            peak[g] = (used, total, r["t"])
print("samples", len(rows), "over", rows[-1]["t"], "s")
print("peak MiB per GPU:", ", ".join(f"GPU{g} {u}/{t} at {s}s" for g, (u, t, s) in sorted(peak.items())))
seen = sum(1 for r in rows for a in r["apps"])
named = sum(1 for r in rows for a in r["apps"] if a[3])
print(f"app samples {seen}, with environ readable {named}")
gate_gpus = defaultdict(set)  # xdist worker -> GPUs its rank processes used
per_gpu_max = defaultdict(Counter)  # gate phase -> GPU -> most gate processes there at one sample
for r in rows:
    here = Counter()
    for pid, gpu, mem, e in r["apps"]:
        if e.get("GF_CHAIN") == "gate":
            gate_gpus[e.get("PYTEST_XDIST_WORKER", "-")].add(gpu)
            here[gpu] += 1
    for g, n in here.items():
        per_gpu_max[r.get("phase", "-")][g] = max(per_gpu_max[r.get("phase", "-")][g], n)
for ph, c in per_gpu_max.items():
    print(f"gate processes per GPU in phase {ph}, most at one sample:", dict(sorted(c.items())))
print("peak MiB per GPU by gate phase:")
for ph in dict.fromkeys(r.get("phase", "-") for r in rows):
    rs = [r for r in rows if r.get("phase", "-") == ph]
    print(f"  {ph} ({rs[0]['t']}-{rs[-1]['t']} s):", ", ".join(
        f"GPU{g} {max(r['gpus'][g][0] for r in rs)}" for g in sorted(rs[0]["gpus"])))
print("gate GPUs by xdist worker ('-': not an xdist worker, e.g. replay child or self-check):")
for w, gs in sorted(gate_gpus.items()):
    print(f"  {w}: {sorted(gs)}")
chains = Counter()
for r in rows:
    for pid, gpu, mem, e in r["apps"]:
        chains[(e.get("GF_CHAIN", "?"), gpu)] = max(chains[(e.get("GF_CHAIN", "?"), gpu)], int(mem or 0))
print("largest single process MiB by (chain, GPU):", dict(sorted(chains.items())))
EOF
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
