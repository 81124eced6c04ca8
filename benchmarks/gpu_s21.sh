#!/usr/bin/env bash
# Session 21: issue 34's 16-core gate, on one host with the GPU hidden
# (CUDA_VISIBLE_DEVICES=""), so 16 cores and 2 run the same paths as a CPU machine.
#   probe  the compile family alone at -n 16 (cold Inductor cache), with snapshots
#          of the load and py-spy stacks of the busiest processes at 40 and 90 s
#          (.whl/ carried: py-spy); once plain, once with OMP_NUM_THREADS=1
#   c16    README's gate at -n 16 (GATE_LIMIT seconds, default 420); SNAPS="30 30 ...":
#          snapshots as in probe, each that many seconds after the one before
#   c2     README's gate at -n 2 pinned to two cores (taskset -c 0,1)
#   bash benchmarks/gpu_s21.sh probe|c16|c2     # on the device machine, repository root
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
W=${W:-/tmp/s21}; mkdir -p "$W"; S=${OUT:?}/summary.txt
. benchmarks/device_steps.sh
packer() { while :; do sleep 20; tar -czf "$OUT/.all.tgz" -C "$W" --exclude='ind-*' . 2>/dev/null && mv "$OUT/.all.tgz" "$OUT/all.tgz"; done; }
packer & PACK=$!
CALL=${1:?call probe, c16 or c2}
{ python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'threads', torch.get_num_threads())"
  echo "cores $(nproc) call $CALL"; } >>"$S" 2>&1
snap() {  # snap NAME: load, process and thread counts, stacks of the four busiest python processes
    local f=$W/snap-$1.txt
    { date -u +%T; uptime; echo "threads $(ps -eLf | wc -l) python procs $(pgrep -c python)"
      ps -eo pid,ppid,nlwp,pcpu,etimes,rss,args --sort=-pcpu | cut -c1-200 | head -30
      for p in $(ps -eo pid,pcpu,comm --sort=-pcpu | awk '$3 ~ /python/ {print $1}' | head -4); do
          echo "=== py-spy $p"; timeout 20 py-spy dump --pid "$p" 2>&1 | head -60; done; } >"$f" 2>&1
}
compile16() {  # compile16 NAME [ENV=VAL...]
    local name=$1; shift
    env TORCHINDUCTOR_CACHE_DIR=$W/ind-$name "$@" timeout -k 5 ${LIMIT:-170} python -m harness fuzz --paths compile \
        --examples 20 -n 16 --seed 0 --db none --progress plain --progress-every 10 --save "$W/found-$name" \
        --json "$W/$name.json" >"$W/$name.log" 2>&1 &
    local pid=$! start=$SECONDS
    sleep 40; snap $name-40; sleep 50; snap $name-90
    wait $pid; echo "$(date -u +%T) $name: exit $? in $((SECONDS - start)) s" | tee -a "$S"
}
N=$(date +%H%M%S)
case $CALL in
probe) pip install -q --no-index .whl/py_spy-*.whl >>"$S" 2>&1
       compile16 plain; compile16 omp1 OMP_NUM_THREADS=1 ;;
c16) pip install -q --no-index .whl/py_spy-*.whl >>"$S" 2>&1
     ( for t in ${SNAPS:-}; do sleep "$t"; snap "gate-$t"; done ) &
     step gate16-$N ${GATE_LIMIT:-420} python -m harness gate --examples 20 -n 16 --json "$W/gate16-$N.json" --save "$W/found-$N" ;;
c2) step gate2-$N ${GATE_LIMIT:-570} taskset -c 0,1 python -m harness gate --examples 20 -n 2 --json "$W/gate2-$N.json" --save "$W/found-$N" ;;
esac
python - "$W" >>"$S" 2>&1 <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    print(f.rsplit("/", 1)[1], d.get("passed"), d.get("seconds"), d.get("phases"), d.get("counts") or d.get("examples"))
PY
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" --exclude='ind-*' .
echo "done $(date -u +%T)" >>"$S"
