#!/bin/bash
set -u
S=$OUT/summary.txt; log() { echo "$(date +%T) $*" | tee -a "$S"; }
R=$PWD
python -c "import torch;print(torch.__version__, torch.cuda.get_device_name())" >> $S
( cd $R/main && t0=$(date +%s); PYTHONPATH=. timeout 150 python -m harness fuzz --db none --paths graphed.fixed --examples 300 --seed 5 --save $OUT/found-gmain --json $OUT/gmain.json > $OUT/gmain.log 2>&1; log "graphed.fixed main: exit $? in $(( $(date +%s) - t0 )) s" )
( cd $R/wt && t0=$(date +%s); PYTHONPATH=. timeout 150 python -m harness fuzz --db none --paths graphed.fixed --examples 300 --seed 5 --save $OUT/found-gwt --json $OUT/gwt.json > $OUT/gwt.log 2>&1; log "graphed.fixed wt: exit $? in $(( $(date +%s) - t0 )) s" )
cd $R/wt && export PYTHONPATH=.
timeout 60 python -m harness replay --paths graphed $R/graphed.fixed-error-b4fc8c9908.json $R/graphed.stock-error-e91f92d11d.json > $OUT/greplay.log 2>&1; log "graphed replay wt: exit $?"
cd $OUT && tar czf found.tgz found-* 2>/dev/null; rm -rf found-*; tar czf logs.tgz *.log && rm -f *.log; log done
