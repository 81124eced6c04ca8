#!/usr/bin/env bash
# Session 20: issue 34's 16-core speed-up, measured on one host with the GPU hidden
# (CUDA_VISIBLE_DEVICES=""), so 16 cores and 2 run the same paths as a CPU machine.
#   c16   README's gate at -n 16, then issue 34's table (one fuzz process per row)
#   c2    README's gate at -n 2 pinned to two cores (taskset -c 0,1)
#   bash benchmarks/gpu_s20.sh c16|c2      # on the device machine, repository root
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
W=${W:-/tmp/s20}; mkdir -p "$W"; S=${OUT:?}/summary.txt
. benchmarks/device_steps.sh  # step and packer
packer & PACK=$!
CALL=${1:?call c16 or c2}
{ python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda visible', torch.cuda.is_available())"
  echo "cores $(nproc) call $CALL"; } >>"$S" 2>&1
N=$(date +%H%M%S)
if [ "$CALL" = c16 ]; then
    step gate16-$N ${GATE_LIMIT:-360} python -m harness gate --examples 20 -n 16 --json "$W/gate16-$N.json" --save "$W/found-$N"
    [ -n "${NO_TABLE:-}" ] || step table-$N 200 python benchmarks/issue34_table.py --tree .
    [ -n "${NO_TABLE:-}" ] || cp "$W/table-$N.log" "$OUT/table.md"
else
    step gate2-$N 570 taskset -c 0,1 python -m harness gate --examples 20 -n 2 --json "$W/gate2-$N.json" --save "$W/found-$N"
fi
python - "$W" >>"$S" 2>&1 <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/gate*.json")):
    d = json.load(open(f))
    print(f.rsplit("/", 1)[1], d.get("passed"), d.get("seconds"), d.get("phases"), d.get("counts"))
PY
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" .
echo "done $(date -u +%T)" >>"$S"
