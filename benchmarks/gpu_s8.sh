#!/bin/bash
# Session 8, one GPU (torch 2.11 on the device machine), issue 14's 2.11 triage:
#   call 1: compile.aot_eager on the grad-output-mutation case that session 7's GPU gate showed and this
#           machine's 2.11 CPU does not (alone, then after the whole corpus as the gate replays it);
#           the gate over every path here with the ledger as this session left it.
#   call 2: that case's probe (benchmarks/aot_alias_probe.py) with the GPU visible and hidden;
#           graphed.compile on the gate's embedding finding (f1a75e4745), the case twice in one process,
#           before (.s8before = git archive of 196e1eb) and after the index cache stopped keeping tensors
#           made while compiling; expanded_weight_grad_adopted on the zero-bubble paths (a "not reproduced" row).
#   call 3: the gate again, after the fixes (GATE_LIMIT=590: the first try at 420 s was stopped in its fuzz phase).
# Usage (device): bash benchmarks/gpu_s8.sh call1|call2|call3   (carry .s8before for call2)
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
call2)
  python benchmarks/aot_alias_probe.py > "$OUT/probe-gpu.json" 2> "$OUT/probe-gpu.err"; log "probe gpu: exit $?"
  CUDA_VISIBLE_DEVICES= python benchmarks/aot_alias_probe.py > "$OUT/probe-nocuda.json" 2>> "$OUT/probe-gpu.err"
  log "probe hidden gpu: exit $?"
  # the gate's finding left the tree (docs/benchmarks.md), get it from the history first:
  #   git show 02e001b:benchmarks/results-s8/gpu/graphed.compile-error-f1a75e4745.json > /tmp/f1a75e4745.json
  mkdir -p /tmp/emb; F=${EMB_CASE:-/tmp/f1a75e4745.json}
  cp $F /tmp/emb/a.json && cp $F /tmp/emb/b.json
  (cd .s8before && PYTHONPATH=$PWD run emb-before 120 python -m harness replay -v --paths graphed.compile /tmp/emb/a.json /tmp/emb/b.json)
  run emb-after 120 python -m harness replay -v --paths graphed.compile /tmp/emb/a.json /tmp/emb/b.json
  run adopted 120 python -m harness replay -v --paths pipeline.InterleavedZeroBubble.stock,pipeline.InterleavedZeroBubble.ranks2.stock,pipeline.InterleavedZeroBubble.fixed cases/pipeline/expanded_weight_grad_adopted.json
  ;;
call3)
  run gate "${GATE_LIMIT:-420}" python -m harness gate --examples "${EXAMPLES:-10}" --seed 0 -n 14 --save /tmp/gate-found \
      --json "$OUT/gate.json" --markdown "$OUT/gate.md"
  tar czf "$OUT/gate-found.tgz" -C /tmp gate-found 2>/dev/null
  ;;
esac
log done
