#!/bin/bash
set -u
S=$OUT/summary.txt; log() { echo "$(date +%T) $*" | tee -a "$S"; }
R=$PWD
C="$R/graphed.fixed-error-b4fc8c9908.json $R/graphed.stock-error-e91f92d11d.json $R/gather-b4fc.json"
for v in main wt; do
  (cd $R/$v && PYTHONPATH=. timeout 60 python -m harness replay --paths graphed.stock,graphed.fixed $C > $OUT/replay-$v.log 2>&1; log "replay $v: exit $?")
done
cd $R/wt && t0=$(date +%s); PYTHONPATH=. timeout 100 python -m harness fuzz --db none --paths graphed.fixed --examples 300 --seed 5 --save $OUT/found-gwt --json $OUT/gwt.json > $OUT/gwt.log 2>&1; log "graphed.fixed wt: exit $? in $(( $(date +%s) - t0 )) s"
cd $OUT && tar czf found.tgz found-* 2>/dev/null; rm -rf found-*; log done
