#!/bin/bash
# Session 8, one GPU (torch 2.11 on the device machine), issue 14's 2.11 triage:
#   call 1: compile.aot_eager on the grad-output-mutation case that session 7's GPU gate showed and this
#           machine's 2.11 CPU does not (alone, then after the whole corpus as the gate replays it);
#           the gate over every path here with the ledger as this session left it.
# Usage (device): bash benchmarks/gpu_s8.sh call1
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
  run aot-alone 60 python -m harness replay -v --paths compile.aot_eager cases/eager/grad_output_mutated_by_stolen_view.json
  run aot-corpus 120 python -m harness replay --paths compile.aot_eager --json "$OUT/aot-corpus.json" cases
  run gate 390 python -m harness gate --examples "${EXAMPLES:-10}" --seed 0 -n 14 --save /tmp/gate-found \
      --json "$OUT/gate.json" --markdown "$OUT/gate.md"
  tar czf "$OUT/gate-found.tgz" -C /tmp gate-found 2>/dev/null
  ;;
esac
log done
