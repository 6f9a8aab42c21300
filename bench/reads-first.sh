#!/usr/bin/env bash
# Random reads first under the QoS share scheduler (issue 24, seed 004's QoS): one
# reactor core serves two volumes. Volume A takes 4 KiB random writes at QD128 (A_QD)
# with share weight 1000 (A_WEIGHT); volume B, weight 100, a mixed client: 4 KiB random
# reads and writes, 50% reads (B_MIX), at QD32 (B_QD). While A is backlogged B may
# dispatch one unit per round, so the share scheduler defers part of B's requests every
# round. With `random_reads_first = true` (the default) B's reads, which its handle's
# detector labels random, pass B's writes waiting for a round; with `false` they wait in
# arrival order. The same script runs a node with each setting and prints B's read and
# write latencies (fio's completion latency) and both volumes' IOPS.
#
# Usage (root or a user who may run the node):
#   TESSERA=target/release/tessera RUNTIME=10 bench/reads-first.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
TESSERA=${TESSERA:-target/release/tessera}
RUNTIME=${RUNTIME:-10}
PORT=${PORT:-10873}
A_QD=${A_QD:-128}; B_QD=${B_QD:-32}; B_MIX=${B_MIX:-50}; A_WEIGHT=${A_WEIGHT:-1000}

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) CPUs"
echo "reads first: node on 1 core, RAM pool; A = 4K randwrite QD$A_QD weight $A_WEIGHT (tessera nbd-perf), B = 4K randrw $B_MIX% reads QD$B_QD weight 100 (fio), NBD, ${RUNTIME}s"

# Clients stay off the reactor's CPU (0) where there is another.
PIN=()
if (( $(nproc) > 1 )); then PIN=(taskset -c "1-$(( $(nproc) - 1 ))"); fi

# One node per setting; prints "B_read_p50 B_read_p99 B_write_p50 B_write_p99 B_iops A_iops" (us, IOPS).
run_with() { # random_reads_first=true|false
    local dir
    dir=$(mktemp -d "${TMPDIR:-/tmp}/tessera-rf-bench.XXXXXX")
    start_node_with "$dir" "$PORT" 1 "random_reads_first = $1"
    t() { "$TESSERA" --api "unix:$dir/api.sock" "$@" >/dev/null; }
    t pool create p ram:2G
    for v in a b; do
        t volume create "$v" --pool p --size 512M
        t export add "$v" --volume "$v"
        fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$v" --rw=write --bs=1M \
            --iodepth=8 --size=512M --output=/dev/null >/dev/null
    done
    # A from Tessera's own load generator (one thread keeps QD128 going; fio's NBD engine
    # would need the client CPU B needs), B from fio, whose report splits reads and writes.
    t volume qos a --weight "$A_WEIGHT"
    "${PIN[@]}" "$TESSERA" nbd-perf --uri "nbd://127.0.0.1:$PORT/a" --pattern randwrite \
        --qd "$A_QD" --size 512M --time "$((RUNTIME + 1))" 2>/dev/null | grep '^RESULT' >"$dir/a.out" &
    local apid=$!
    sleep 0.5
    "${PIN[@]}" fio --output-format=json --output="$dir/out.json" --ioengine=nbd --bs=4k \
        --time_based --runtime="$RUNTIME" --size=512M --randrepeat=0 \
        --name=b --uri="nbd://127.0.0.1:$PORT/b" --rw=randrw --rwmixread="$B_MIX" --iodepth="$B_QD" \
        >/dev/null
    wait "$apid"
    python3 - "$dir/out.json" "$dir/a.out" <<'PY'
import json, sys
import re
b = json.load(open(sys.argv[1]))["jobs"][0]
a_iops = float(re.search(r"iops=([0-9.]+)", open(sys.argv[2]).read()).group(1))
def pct(side, p):
    return side["clat_ns"]["percentile"][p] / 1000
print("%.1f %.1f %.1f %.1f %d %d" % (
    pct(b["read"], "50.000000"), pct(b["read"], "99.000000"),
    pct(b["write"], "50.000000"), pct(b["write"], "99.000000"),
    b["read"]["iops"] + b["write"]["iops"], a_iops))
PY
}

# (Command substitution waits for each node to be gone before the next one starts.)
# FIRST=false runs the arrival-order node first (to tell the order of the runs apart
# from the setting).
if [[ ${FIRST:-true} == false ]]; then
    off=$(run_with false)
    on=$(run_with true)
else
    on=$(run_with true)
    off=$(run_with false)
fi
read -r on_r50 on_r99 on_w50 on_w99 on_b on_a <<<"$on"
read -r off_r50 off_r99 off_w50 off_w99 off_b off_a <<<"$off"
printf '%-24s %12s %12s %8s\n' "B (mixed client)" "reads first" "arrival order" "ratio"
row() { printf '%-24s %12s %12s %7.2fx\n' "$1" "$2" "$3" "$(echo "$2 / $3" | bc -l)"; }
row "read p50 (us)" "$on_r50" "$off_r50"
row "read p99 (us)" "$on_r99" "$off_r99"
row "write p50 (us)" "$on_w50" "$off_w50"
row "write p99 (us)" "$on_w99" "$off_w99"
row "B IOPS" "$on_b" "$off_b"
row "A IOPS" "$on_a" "$off_a"
