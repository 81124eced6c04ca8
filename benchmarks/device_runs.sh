#!/usr/bin/env bash
# The GPU-machine runs quoted in the closing notes of the DTensor, pipeline and
# gate issues, in the groups one device call can hold (each under 10 minutes):
#
#   bash benchmarks/device_runs.sh gate       # issue 7: gate exit 0, then 1 without a ledger entry
#   bash benchmarks/device_runs.sh dtensor    # issue 4: cold-start stock detection, then dtensor-fixed
#   bash benchmarks/device_runs.sh dtensor-fixed  # issue 4: fixed over 500, corpus replay, clip repro
#   bash benchmarks/device_runs.sh pipeline   # issue 6: the nested double count through zero bubble
#   bash benchmarks/device_runs.sh pipeline-ranks2  # issue 6: zero-bubble schedules on 2 ranks
#   bash benchmarks/device_runs.sh nccl       # issue 4 on NCCL: 2 ranks with 2 GPUs, else 1 rank
#   bash benchmarks/device_runs.sh nccl-pipeline  # issue 18: the pipeline schedules on 2 ranks over NCCL
#   bash benchmarks/device_runs.sh selfcheck  # issue 19: every canary family on this torch, and a broken one
#   bash benchmarks/device_runs.sh gate-examples  # issue 19: the deterministic gate, its Markdown summary
#   bash benchmarks/device_runs.sh compile-cuda   # issue 17: compile.inductor.cuda from a cold start
#   bash benchmarks/device_runs.sh mutation-split  # issue 20: split_fixed mutation score and the aliasing class, before/after
#   bash benchmarks/device_runs.sh mutation-graphed  # issue 20: graphed_fixed mutation score (a sample), before/after
#   bash benchmarks/device_runs.sh mutation-dtensor  # issue 20: dtensor_fixed mutation score (a sample), before/after
#   bash benchmarks/device_runs.sh mutation-pipeline # issue 20: pipeline_fixed mutation score (a sample), before/after
#
# The mutation groups need the mutants exported where mutmut is installed and the
# older checkout beside this one (both carried as ignored paths):
#   for f in split_fixed dtensor_fixed graphed_fixed; do git show <before-commit>:oracles/$f.py > /tmp/$f.py;
#       python benchmarks/mutation.py --file /tmp/$f.py --paths x --export .gradfuzz/bench/$f.json; done
#   python benchmarks/mutation.py --file oracles/graphed_fixed.py --paths x --export .gradfuzz/bench/graphed_fixed_after.json
#   git archive <before-commit> harness oracles | tar -x -C .gradfuzz/before
#
# Every command's output lands in $OUT/<step>.log and one line per step in
# $OUT/summary.txt, so a step that runs out of time still leaves the others.
set -u
OUT=${OUT:-/tmp/gradfuzz-device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}



python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())" \
    | tee -a "$OUT/summary.txt"

args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
group=${args[i]}
case $group in
gate)
    step gate-2.11 300 python -m harness gate --minutes 1 --paths eager,split,dtensor.stock,graphed.stock,graphed.fixed \
        --dtensor-backend gloo --save "$OUT/found-gate" --json "$OUT/gate-2.11.json" \
        --junit "$OUT/gate-2.11.xml" --markdown "$OUT/gate-2.11.md" --html "$OUT/gate-2.11.html"
    python - <<'EOF'
import json
ledger = json.load(open("cases/ledger.json"))
ledger["bugs"] = [b for b in ledger["bugs"] if b["id"] != "split-nested-double-count"]
json.dump(ledger, open("cases/.ledger-minus.json", "w"), indent=1)
EOF
    step gate-minus 150 python -m harness gate --minutes 0 --no-selfcheck --paths eager,split \
        --ledger cases/.ledger-minus.json --save "$OUT/found-minus" --json "$OUT/gate-minus.json"
    ;;
dtensor)
    for seed in 0 1 2; do
        step "dtensor-stock-seed$seed" 120 python -m harness fuzz --paths dtensor.stock --examples 300 --seed "$seed" --db none \
            --dtensor-backend gloo --progress none --save "$OUT/found-dstock-$seed" --json "$OUT/dtensor-stock-$seed.json"
    done
    args+=(dtensor-fixed)
    ;;
dtensor-fixed)
    step dtensor-fixed 200 python -m harness fuzz --paths dtensor.fixed --examples 500 --seed 1 --db none \
        --dtensor-backend gloo --progress none --save "$OUT/found-dfixed" --json "$OUT/dtensor-fixed.json"
    step dtensor-replay 120 python -m harness replay cases/dtensor -v --paths dtensor --dtensor-backend gloo
    step dtensor-clip-repro 60 torchrun --nproc-per-node 2 cases/dtensor/clip_foreach_partial_grad_unscaled.py
    ;;
nccl)
    # NCCL wants a GPU per rank: with one GPU the world is one rank.
    ws=$(python -c "import torch; print(min(2, torch.cuda.device_count()))")
    step nccl-stock 150 python -m harness fuzz --paths dtensor.stock --examples 300 --seed 0 --db none \
        --dtensor-backend nccl --world-size "$ws" --progress none --save "$OUT/found-nstock" --json "$OUT/nccl-stock.json"
    step nccl-fixed 200 python -m harness fuzz --paths dtensor.fixed --examples 500 --seed 1 --db none \
        --dtensor-backend nccl --world-size "$ws" --progress none --save "$OUT/found-nfixed" --json "$OUT/nccl-fixed.json"
    step nccl-replay 120 python -m harness replay cases/dtensor -v --paths dtensor --dtensor-backend nccl --world-size "$ws"
    step nccl-torchrun 120 torchrun --nproc-per-node "$ws" cases/dtensor/partial_grad_transposed_to_replicate.py
    ;;
pipeline)
    # The pipeline paths run on the CPU; hiding the GPU keeps the comparison with the CPU runs fair.
    step pipeline-zb 300 env CUDA_VISIBLE_DEVICES= python -m harness fuzz --paths \
        pipeline.ZBVZeroBubble.stock,pipeline.InterleavedZeroBubble.stock,pipeline.ZBVZeroBubble.fixed,pipeline.InterleavedZeroBubble.fixed \
        --examples 1500 --seed 1 --db none --progress none --save "$OUT/found-pipeline" --json "$OUT/pipeline-zb.json"
    step pipeline-replay 120 env CUDA_VISIBLE_DEVICES= python -m harness replay \
        cases/pipeline/nested_weight_double_count_zero_bubble.json -v \
        --paths pipeline.ZBVZeroBubble,pipeline.InterleavedZeroBubble
    step pipeline-repro 60 env CUDA_VISIBLE_DEVICES= python cases/pipeline/nested_weight_double_count_zero_bubble.py
    ;;
pipeline-ranks2)
    step pipeline-ranks2 240 env CUDA_VISIBLE_DEVICES= python -m harness fuzz --paths \
        pipeline.ZBVZeroBubble.ranks2.stock,pipeline.InterleavedZeroBubble.ranks2.stock,pipeline.ZBVZeroBubble.ranks2.fixed,pipeline.InterleavedZeroBubble.ranks2.fixed \
        --examples 300 --seed 1 --db none --progress none --save "$OUT/found-ranks2" --json "$OUT/pipeline-ranks2.json"
    ;;
nccl-pipeline)
    # NCCL needs a GPU per rank: two ranks on the two GPUs.
    step nccl-pipeline-replay 150 python -m harness replay cases/pipeline -v --paths \
        pipeline.GPipe.ranks2,pipeline.1F1B.ranks2,pipeline.InterleavedZeroBubble.ranks2
    step nccl-pipeline-fuzz 300 python -m harness fuzz --paths \
        pipeline.GPipe.ranks2,pipeline.1F1B.ranks2,pipeline.InterleavedZeroBubble.ranks2,pipeline.ZBVZeroBubble.ranks2 \
        --examples 60 --seed 1 --db none --progress none --save "$OUT/found-nccl-pipeline" --json "$OUT/nccl-pipeline.json"
    ;;
selfcheck)
    step selfcheck 300 python -m harness selfcheck
    step selfcheck-broken 120 python -m pytest -q -p no:cacheprovider -n 0 tests/cover/test_canaries.py -k broken
    ;;
gate-examples)
    step gate-examples 420 python -m harness gate --examples 100 --seed 0 --save "$OUT/found-gate-ex" \
        --json "$OUT/gate-examples.json" --markdown "$OUT/gate-examples.md"
    ;;
mutation-split)
    M="python benchmarks/mutation.py"
    for tree in .gradfuzz/before .; do
        tag=$([ "$tree" = . ] && echo after || echo before)
        step "split-$tag" 150 $M --file oracles/split_fixed.py --mutants .gradfuzz/bench/split_fixed.json \
            --paths split.fixed --examples 500 --jobs 15 --tree "$tree" --json "$OUT/split-$tag.json"
        step "alias-$tag" 100 $M --file oracles/split_fixed.py --mutants .gradfuzz/bench/split_alias.json \
            --paths split.fixed --examples 2000 --seeds 0,1,2,3,4 --jobs 1 --tree "$tree" --json "$OUT/alias-$tag.json"
    done
    ;;
mutation-graphed|mutation-dtensor|mutation-pipeline)
    # Each tree is judged on the mutants of its own copy of the file (the
    # reference changed between them: graphed_fixed.py learnt unused parameters).
    M="python benchmarks/mutation.py"
    fam=${group#mutation-}
    for tree in .gradfuzz/before .; do
        tag=$([ "$tree" = . ] && echo after || echo before)
        mutants=.gradfuzz/bench/${fam}_fixed.json
        [ "$tag" = after ] && [ -f .gradfuzz/bench/${fam}_fixed_after.json ] && mutants=.gradfuzz/bench/${fam}_fixed_after.json
        step "$fam-$tag" 280 $M --file oracles/${fam}_fixed.py --mutants "$mutants" --paths $fam.fixed \
            --examples 500 --sample $([ $fam = graphed ] && echo 32 || echo 24) --jobs $([ $fam = graphed ] && echo 8 || echo 7) \
            --timeout 150 --tree "$tree" --json "$OUT/$fam-$tag.json"
    done
    ;;
compile-cuda)
    step compile-cuda 330 python benchmarks/compile_fuzz.py --minutes 5 --paths compile.inductor.cuda \
        --save "$OUT/found-compile-cuda" --json "$OUT/compile-cuda.json"
    ;;
*)
    echo "unknown group '$group'; known: gate dtensor dtensor-fixed pipeline pipeline-ranks2 nccl nccl-pipeline selfcheck gate-examples compile-cuda mutation-split mutation-graphed mutation-dtensor mutation-pipeline" >&2
    exit 2
    ;;
esac
done
