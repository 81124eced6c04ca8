#!/bin/bash
# Session 7, one GPU (torch 2.11 on the device machine), issue 19's GPU numbers:
#   call 1: graphed.fixed examples/s before (.s7before = git archive c0eb57a) and after, side by side;
#           the full self-check with each canary's caught divergence; the broken-canary tests;
#           the session-6 round-3 graphed findings replayed on graphed.stock/fixed; the graphed ledger check.
#   call 2: the gate over every path here with a small example budget, its JSON and Markdown;
#           where graphed.fixed's time goes (gradfuzz bench) and its rate while fuzzing, before and after.
#   call 3: call 2 again with the gate's parallel replay; graphed.fixed profiled in process.
#   call 4: graphed.fixed before/after the worker's gc.freeze, side by side; the profile again.
#   call 5: the strictly causal self-check (every canary, 8 at a time) and the broken-canary tests.
# Usage (device): bash benchmarks/gpu_s7.sh call1|call2   (carry .s7before for call1)
set -u
S=$OUT/summary.txt; log() { echo "$(date +%T) $*" | tee -a "$S"; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$S"
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; log "$name: exit $? in $(( $(date +%s) - t0 ))s"
}
case "${1:-call1}" in
call1)
  run ab 200 python benchmarks/ab_throughput.py --a .s7before --b . --paths graphed.fixed --examples 300 --rounds 2
  run selfcheck 260 python -m harness selfcheck
  run broken 90 python -m pytest -q -p no:cacheprovider -n 0 -v tests/cover/test_canaries.py -k broken
  # session 6's round-3 findings; the tarball left the tree (docs/benchmarks.md), get it from the history first:
  #   git show 02e001b:benchmarks/results-s6/gpu/call1-found.tgz > /tmp/call1-found.tgz
  mkdir -p /tmp/r3 && tar xzf "${R3_FOUND:-/tmp/call1-found.tgz}" -C /tmp/r3
  run r3 120 python -m harness replay -v --paths graphed.stock,graphed.fixed --json "$OUT/r3.json" $(ls /tmp/r3/*/graphed*.json)
  run ledger 60 python -m harness ledger --paths graphed
  ;;
call2)
  run gate 380 python -m harness gate --examples "${EXAMPLES:-10}" --seed 0 -n 8 --save /tmp/gate-found \
      --json "$OUT/gate.json" --markdown "$OUT/gate.md"
  tar czf "$OUT/gate-found.tgz" -C /tmp gate-found 2>/dev/null
  run bench 90 python -m harness bench --paths graphed.fixed --examples 200 --warmup 30 --canary-seeds 0 \
      --json "$OUT/bench.json"
  run ab 100 python benchmarks/ab_throughput.py --a .s7before --b . --paths graphed.fixed --examples 400 --rounds 1
  ;;
call3)
  run gate 420 python -m harness gate --examples "${EXAMPLES:-10}" --seed 0 -n 8 --save /tmp/gate-found \
      --json "$OUT/gate.json" --markdown "$OUT/gate.md"
  tar czf "$OUT/gate-found.tgz" -C /tmp gate-found 2>/dev/null
  pkill -f "harness" ; sleep 3  # what a timed-out gate left running would load the measurements below
  run profile 70 python benchmarks/graphed_profile.py --examples 200
  run ab 95 python benchmarks/ab_throughput.py --a .s7before --b . --paths graphed.fixed --examples 400 --rounds 1
  ;;
call4)
  run ab 300 python benchmarks/ab_throughput.py --a .s7before --b . --paths graphed.fixed --examples 600 --rounds 2
  run profile 80 python benchmarks/graphed_profile.py --examples 200
  ;;
call5)
  run selfcheck 400 python -m harness selfcheck -n 8 --json "$OUT/selfcheck.json"
  run broken 120 python -m pytest -q -p no:cacheprovider -n 0 -v tests/cover/test_canaries.py -k broken
  ;;
esac
log done
