#!/usr/bin/env bash
# issue 31, device call 2: the pipeline NCCL fix (a fresh pool after a failing case) replayed on both
# backends, the gate on the process-group families (NCCL, world size 2), the gate under torchrun.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
W=/tmp/nccl2b; mkdir -p $W; S=$OUT/summary.txt
step() { local name=$1 limit=$2 start=$SECONDS rc; shift 2; echo "$(date -u +%T) start $name: $*" >>$W/cmds.txt
  timeout -k 5 $limit "$@" >$W/$name.log 2>&1; rc=$?; echo "$(date -u +%T) $name: exit $rc in $((SECONDS-start)) s" | tee -a $S; }
( while :; do sleep 20; tar -czf $OUT/.a.tgz -C $W . 2>/dev/null && mv $OUT/.a.tgz $OUT/all.tgz; done ) & PACK=$!
echo "cores $(nproc); commit $(cat COMMIT)" >>$S
PIPE=$(python -c "from harness.paths.pipeline.rank import discover
print(','.join(f'pipeline.{s}.ranks2.{v}' for s in discover() for v in ('stock', 'fixed')))")
D=benchmarks/results-s11/nccl2/sample/pipeline
( step cmp-pipeline-nccl 215 python benchmarks/nccl_vs_gloo.py run --backend nccl --paths "$PIPE" --json $W/cmp-pipeline-nccl.json cases/pipeline $D
  step cmp-pipeline-gloo 60 python benchmarks/nccl_vs_gloo.py run --backend gloo --paths "$PIPE" --json $W/cmp-pipeline-gloo.json cases/pipeline $D
  python benchmarks/nccl_vs_gloo.py compare $W/cmp-pipeline-gloo.json $W/cmp-pipeline-nccl.json --markdown $W/cmp-pipeline.md >/dev/null ) & C1=$!
step gate-pg 225 python -m harness gate --backend nccl --world-size 2 --paths dtensor,ddp,fsdp2,pipeline --examples 1 --seed 0 -n 3 \
  --no-selfcheck --save $W/found-gate --json $W/gate-pg.json --markdown $W/gate-pg.md & G=$!
step torchrun-gate 150 torchrun --nproc-per-node 2 --master-port 29531 -m harness gate --paths dtensor,ddp,fsdp2 --backend nccl \
  --examples 2 --seed 0 --no-selfcheck --save $W/found-torchrun --json $W/gate-torchrun.json --markdown $W/gate-torchrun.md
wait $C1 $G
kill $PACK; tar -czf $OUT/all.tgz -C $W .; cp $W/*.md $OUT/ 2>/dev/null; echo done >>$S
