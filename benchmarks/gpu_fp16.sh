#!/usr/bin/env bash
# DeepSpeed's fp16 paths (deepspeed.zero{0,1,2}.fp16) and their canary on two GPUs (NCCL). DeepSpeed and
# the wheels it needs are carried in .whl (ignored by git; pass carry: [".whl"]); a requirement the device
# already has is its own.
#   bash benchmarks/gpu_fp16.sh [EXAMPLES] [SEED]     # on the device machine, from the repository root
# Then the gate on those paths (corpus replay, fuzzing at SEED+1, each known row's fix probe) and the
# probe tests that need GPUs (pytest -m gpu).
#   N=gloo bash benchmarks/gpu_fp16.sh 4               # dry run on a CPU machine: the paths say unavailable
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/fp16}; mkdir -p "$O"; S=$O/summary.txt; SITE=${SITE:-/tmp/site}; N=${N:-nccl}
EX=${1:-60}; SEED=${2:-0}; LIMIT=${LIMIT:-300}
python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())" >>"$S" 2>&1
if ! python -c "import deepspeed" 2>/dev/null; then
    W=""
    for f in .whl/*.whl; do
        m=$(basename "$f" | cut -d- -f1 | tr A-Z a-z)
        case $m in py_cpuinfo) i=cpuinfo;; *) i=$m;; esac
        { [ "$m" = deepspeed ] || ! python -c "import $i" 2>/dev/null; } && W="$W $f"
    done
    python -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $W >>"$S" 2>&1; echo "pip rc $?" >>"$S"
    export PYTHONPATH=$SITE:.
fi
python -c "import deepspeed; print('deepspeed', deepspeed.__version__)" >>"$S" 2>&1
python -m harness paths --backend "$N" 2>/dev/null | grep -E "deepspeed.zero.\.(fp16|stock)" | cut -c1-200 >>"$S"
P=deepspeed.zero0.fp16,deepspeed.zero1.fp16,deepspeed.zero2.fp16
timeout "$LIMIT" python -m harness fuzz --paths "$P" --examples "$EX" --seed "$SEED" --db none --backend "$N" \
    --world-size 2 --progress plain --progress-every 20 --save "$O/found" --json "$O/fp16.json" >"$O/fuzz.log" 2>&1
echo "fuzz rc $?" >>"$S"; grep -E "divergence|examples|unjudged|skipped" "$O/fuzz.log" | cut -c1-400 | tail -40 >>"$S"
timeout 200 python -m harness selfcheck --canaries deepspeed_fp16_raises_scale_mid_window --json "$O/canary.json" \
    >"$O/canary.log" 2>&1
echo "canary rc $?" >>"$S"; tail -5 "$O/canary.log" | cut -c1-600 >>"$S"
timeout "$LIMIT" python -m harness gate --paths "$P" --examples "$EX" --seed $((SEED + 1)) --no-selfcheck \
    --backend "$N" --world-size 2 --save "$O/found-gate" --json "$O/gate.json" >"$O/gate.log" 2>&1
echo "gate rc $?" >>"$S"; grep -E "^ +(known|new|resembles|fixed|unavailable|NEW)|====|row|\[" "$O/gate.log" | cut -c1-300 | tail -30 >>"$S"
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/cover/test_probes.py -k "deepspeed" >"$O/pytest.log" 2>&1
echo "pytest rc $?" >>"$S"; tail -5 "$O/pytest.log" | cut -c1-400 >>"$S"
# At most 8 files come back from a device call: the summary, the logs, and one archive of the rest.
(cd "$O" && tar czf rest.tgz found found-gate ./*.json 2>/dev/null && rm -rf found found-gate ./*.json)
cat "$S"
