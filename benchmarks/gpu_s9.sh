#!/bin/bash
# Session 9, one GPU (torch 2.11 on the device machine), issue 28:
#   call1: the ledger's graphed entries recorded under signature scheme 2 (ledger --write on the graphed
#          paths; the ledger comes back as $OUT/ledger.json), then the two graphed canaries from a cold start
#          (benchmarks/gpu_s9_graphed_canaries.sh's self-check).
#   call2: the gate from a copy of the checkout at /tmp/ckA, run from its root (run twice: before the triage and after; docs/benchmarks.md has both).
#   call3: the same gate (same ledger, seed and budget) from a copy at another path, /var/tmp/elsewhere/ckB,
#          run from / (the ledger and corpus come from the installed project, not the working directory).
# Usage (device): bash benchmarks/gpu_s9.sh call1|call2|call3   [EXAMPLES=3]
set -u
S=$OUT/summary.txt; log() { echo "$(date +%T) $*" | tee -a "$S"; }
export PYTHONUNBUFFERED=1
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$S"
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; log "$name: exit $? in $(( $(date +%s) - t0 ))s"
}
gate() {  # name checkout cwd limit
  local name=$1 ck=$2 cwd=$3 limit=$4
  (cd "$cwd" && PYTHONPATH=$ck run "$name" "$limit" python -m harness gate --examples "${EXAMPLES:-3}" --seed 0 -n 14 \
      --save "/tmp/$name-found" --json "$OUT/$name.json" --markdown "$OUT/$name.md")
  tar czf "$OUT/$name-found.tgz" -C /tmp "$name-found" 2>/dev/null
}
case "${1:-call1}" in
call1)
  PYTHONPATH=$PWD run ledger 200 python -m harness ledger --write --paths graphed
  cp cases/ledger.json "$OUT/ledger.json"
  PYTHONPATH=$PWD run selfcheck-graphed 300 python -m harness selfcheck \
      --canaries graphed_static_grad_views,graphed_weak_input_surface -n 2 --json "$OUT/selfcheck-graphed.json"
  ;;
call2)
  mkdir -p /tmp/ckA && cp -r harness oracles cases pyproject.toml /tmp/ckA/
  gate gateA /tmp/ckA /tmp/ckA "${GATE_LIMIT:-400}"
  ;;
call3)
  mkdir -p /var/tmp/elsewhere/ckB && cp -r harness oracles cases pyproject.toml /var/tmp/elsewhere/ckB/
  gate gateB /var/tmp/elsewhere/ckB / "${GATE_LIMIT:-420}"
  ;;
esac
log done
