#!/usr/bin/env bash
# Session 19: issue 34 on the 16-core GPU machine, warm starts (harness.workers.zygote).
#   b   README's gate at -n 16 (run twice: the first call finds Inductor's cache cold)
#   w   the same gate with GRADFUZZ_WARM_START=0 (fresh interpreters, as before)
#   c   the gate at -n 2 pinned to two cores (taskset): the 16-core speed-up
#   bash benchmarks/gpu_s19.sh b|w|c      # on the device machine, repository root
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
W=${W:-/tmp/s19}; mkdir -p "$W"; S=${OUT:?}/summary.txt
. benchmarks/device_steps.sh  # step and packer
packer & PACK=$!
CALL=${1:?call b, w or c}
{ python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
  echo "cores $(nproc) call $CALL"
  # whether a child forked from the zygote can use CUDA (else every child is a fresh interpreter)
  python -c "import os; from harness.workers import zygote; z = zygote.shared(); print('warm starts usable:', z is not None and z.usable(dict(os.environ)))"
} >>"$S" 2>&1
N=$(date +%H%M%S)
if [ "$CALL" = b ]; then
    step gate16-$N 570 python -m harness gate --examples 20 -n 16 --json "$W/gate16-$N.json" --save "$W/found-$N"
elif [ "$CALL" = w ]; then
    step gate16-fresh-$N 570 env GRADFUZZ_WARM_START=0 python -m harness gate --examples 20 -n 16 --json "$W/gate16-fresh-$N.json" --save "$W/found-$N"
else
    step gate2-$N 570 taskset -c 0,1 python -m harness gate --examples 20 -n 2 --json "$W/gate2-$N.json" --save "$W/found-$N"
fi
python - "$W" >>"$S" 2>&1 <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/gate*.json")):
    d = json.load(open(f))
    print(f.rsplit("/", 1)[1], d.get("passed"), d.get("seconds"), d.get("phases"), {k: len(v) for k, v in d.get("counts", {}).items()} if isinstance(d.get("counts"), dict) and all(isinstance(v, list) for v in d["counts"].values()) else d.get("counts"))
PY
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" .
echo "done $(date -u +%T)" >>"$S"
