#!/bin/bash
# Session 9, one GPU (torch 2.11 + CUDA on the device machine), issue 28 item 5: the graphed canaries
# (harness/paths/graphed/canaries.py) in the self-check, each judged against graphed.fixed from a cold start.
#   selfcheck (default): gradfuzz selfcheck on the two graphed canaries, each in a process of its own,
#            the caught divergence printed under each, JSON in $OUT/selfcheck-graphed.json (exit 0: both
#            caught); then their time to detection over seeds 0..2 (gradfuzz bench, unshrunk), with
#            graphed.fixed's rate beside it, JSON in $OUT/bench-graphed.json.
#   pytest:  the -m gpu tests: each graphed canary caught (tests/cover/test_canaries.py) and the graphed
#            paths on real CUDA graphs (tests/nocover/test_graphed_gpu.py, its weak-surface test now runs
#            the packaged canary).
#   all:     the whole self-check (every canary, -n auto), as the gate runs it first.
# Usage (device, the repository checked out as the cwd): bash benchmarks/gpu_s9_graphed_canaries.sh [selfcheck|pytest|all]
set -u
OUT=${OUT:-/tmp/gradfuzz-s9}; mkdir -p "$OUT"
S=$OUT/summary.txt; log() { echo "$(date +%T) $*" | tee -a "$S"; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ! gradfuzz --help > /dev/null 2>&1; then
  pip install -q -e . --no-deps --no-build-isolation > "$OUT/install.txt" 2>&1; log "pip install -e . --no-deps: exit $?"
fi
GF=(gradfuzz); gradfuzz --help > /dev/null 2>&1 || GF=(python -m harness)  # same CLI, from the checkout
python -c "import torch; print(torch.__version__, 'cuda', torch.version.cuda,
           torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA DEVICE: the canaries will be skipped')" 2>&1 | tee -a "$S"
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; log "$name: exit $? in $(( $(date +%s) - t0 ))s"
}
CANARIES=graphed_static_grad_views,graphed_weak_input_surface
case "${1:-selfcheck}" in
selfcheck)
  run selfcheck-graphed 300 "${GF[@]}" selfcheck --canaries "$CANARIES" -n 2 --json "$OUT/selfcheck-graphed.json"
  tail -n 8 "$OUT/selfcheck-graphed.txt" | tee -a "$S"
  run bench-graphed 270 "${GF[@]}" bench --paths graphed.fixed --examples 100 --warmup 10 --canaries "$CANARIES" \
      --canary-seeds 3 --canary-budget 300 --json "$OUT/bench-graphed.json"
  tail -n 12 "$OUT/bench-graphed.txt" | tee -a "$S"
  ;;
pytest)
  run pytest-gpu 560 python -m pytest -q -p no:cacheprovider -n 0 -m gpu -rs \
      tests/cover/test_canaries.py tests/nocover/test_graphed_gpu.py
  tail -n 15 "$OUT/pytest-gpu.txt" | tee -a "$S"
  ;;
all)
  run selfcheck-all 560 "${GF[@]}" selfcheck -n auto --json "$OUT/selfcheck-all.json"
  tail -n 30 "$OUT/selfcheck-all.txt" | tee -a "$S"
  ;;
esac
log done
