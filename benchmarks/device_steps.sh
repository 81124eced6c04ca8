# Sourced by the device scripts (gpu_s11.sh, gpu_s13.sh, gpu_s13b.sh, nccl2.sh):
# step NAME LIMIT COMMAND... runs a command with its log in $W/NAME.log and one
# summary line in $S; packer keeps a tarball of $W in $OUT up to date, so a
# call stopped at its limit still brings back what it had.
step() {  # step NAME LIMIT COMMAND...: its log in $W/NAME.log, one summary line
    local name=$1 limit=$2 start=$SECONDS rc; shift 2
    echo "$(date -u +%T) start $name: $*" >>"$W/cmds.txt"
    timeout -k 5 "$limit" "$@" >"$W/$name.log" 2>&1; rc=$?
    echo "$(date -u +%T) $name: exit $rc in $((SECONDS - start)) s" | tee -a "$S"
}
packer() { while :; do sleep 20; tar -czf "$OUT/.all.tgz" -C "$W" . 2>/dev/null && mv "$OUT/.all.tgz" "$OUT/all.tgz"; done; }
