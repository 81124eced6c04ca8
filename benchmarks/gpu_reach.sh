#!/usr/bin/env bash
# The wider vocabulary on the device machine (one GPU, 16 cores): every
# fixed path, then every stock family, fuzzed side by side for MIN minutes
# each from a cold start (no example database, an empty Inductor cache),
# process-group paths on gloo. Each family is one process; logs, JSON and
# shrunk finds under $W, re-tarred into $OUT/all.tgz as they come.
#   bash benchmarks/gpu_reach.sh fixed|stock     # on the device machine, repository root
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
W=${W:-/tmp/reach}; mkdir -p "$W"; S=${OUT:?}/summary.txt
. benchmarks/device_steps.sh
packer() {  # as device_steps.sh's, without the Inductor caches (too large to come back)
    while :; do sleep 20; tar -czf "$OUT/.all.tgz" -C "$W" --exclude='ind-*' . 2>/dev/null && mv "$OUT/.all.tgz" "$OUT/all.tgz"; done
}
packer & PACK=$!
PIDS=""
CALL=${1:?call fixed or stock}
MIN=${MIN:-8}
{ python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "cores $(nproc) call $CALL minutes $MIN"; } >>"$S" 2>&1
fam() {  # fam NAME PATHS: one family fuzzed MIN minutes, seed 1
    TORCHINDUCTOR_CACHE_DIR=$W/ind-$1 step "$CALL-$1" $((MIN * 60 + 60)) python -m harness fuzz --paths "$2" \
        --minutes "$MIN" --seed 1 --db none --backend gloo --progress plain --progress-every 60 \
        --save "$W/found-$CALL-$1" --json "$W/$CALL-$1.json" &
    PIDS="$PIDS $!"
}
pipes() {  # pipes SUFFIX: every schedule's path of that suffix
    local p="" s
    for s in 1F1B GPipe Interleaved1F1B LoopedBFS InterleavedZeroBubble ZBVZeroBubble DualPipeV; do p="$p,pipeline.$s.$1"; done
    echo "${p#,}"
}
case $CALL in
fixed)
    fam eager eager.accumulate,split.fixed,split.twin
    fam checkpoint checkpoint.fixed
    fam dtensor dtensor.fixed
    fam graphed graphed.fixed
    fam pipe1 "$(pipes fixed)"
    fam pipe2 "$(pipes ranks2.fixed)"
    fam dp ddp.fixed,fsdp2.fixed
    fam mesh mesh.fsdp_tp.fixed,mesh.dtensor2d.fixed,mesh.pp_dp.fixed
    fam func func.eager ;;
stock)
    fam split split.stock
    fam dtensor dtensor.stock
    fam graphed graphed.stock,graphed.compile
    fam ckr checkpoint.reentrant.stock,checkpoint.sequential.stock
    fam ckn checkpoint.nonreentrant.stock,checkpoint.nonreentrant.lax.stock,checkpoint.nonreentrant.offload.stock
    fam cks checkpoint.selective.stock,checkpoint.selective.inverse.stock
    fam aot compile.aot_eager,compile.autograd,compile.autograd.eager_forward
    fam ind compile.inductor,compile.inductor.cuda
    fam func func.grad,func.vjp,func.vmap
    fam dp ddp.stock,fsdp2.stock
    fam pipe1 "$(pipes stock)" ;;
esac
wait $PIDS  # not the packer, which runs until killed
python - "$W" "$CALL" >>"$S" 2>&1 <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/{sys.argv[2]}-*.json")):
    d = json.load(open(f))
    for n, t in d["paths"].items():
        print(f"{n:<42} {t['examples']:>6} ex {t['run']:>6} run {len(t.get('ops', ())):>4} ops")
    for n, why in d.get("unavailable", {}).items():
        print(f"{n:<42} unavailable: {why[:100]}")
    for v in d["divergences"]:
        print("  DIV", v["path"], v["signature"], v["detail"][:160])
    print("  expected", sorted(set(d.get("expected", []))))
PY
kill $PACK; tar -czf "$OUT/all.tgz" -C "$W" --exclude='ind-*' .
echo "done $(date -u +%T)" >>"$S"
