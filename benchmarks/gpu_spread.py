"""GPU placement during a device call: what the four-GPU scripts
(gpu_s17.sh, gpu_s17b.sh) sample every 10 s and how they summarise it.

    python benchmarks/gpu_spread.py sample OUT.jsonl GATE.log   # until nvidia-smi fails or the call ends
    python benchmarks/gpu_spread.py summary OUT.jsonl

Each sample: every GPU's memory, and every process holding a context there
with its chain (GF_CHAIN), xdist worker and gate slot read from
/proc/PID/environ, and the gate's phase from its log.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict


def sample(out: str, gate_log: str) -> None:
    def phase():  # the gate's phase now, from its progress lines ("gradfuzz [replay ...", "[phase] fuzz ...")
        try:
            with open(gate_log, "rb") as fh:
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
    with open(out, "a") as fh:
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


def summary(out: str) -> None:
    rows = [json.loads(l) for l in open(out) if l.strip()]
    rows = [r for r in rows if "gpus" in r]
    if not rows:
        print("spread: no nvidia-smi samples"); return
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


if __name__ == "__main__":
    {"sample": lambda: sample(sys.argv[2], sys.argv[3]), "summary": lambda: summary(sys.argv[2])}[sys.argv[1]]()
