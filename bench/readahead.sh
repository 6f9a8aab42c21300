#!/usr/bin/env bash
# Readahead on a pool without a cache tier (issue 24): fio over NBD against a node whose
# only pool sits on a slow device (the fault device's LATENCY_US per I/O), once with the
# node's `readahead = true` (the default) and once with `readahead = false`, same script,
# same data:
#   - sequential 128 KiB reads at QD1 (the issue's bar: at least 3x without);
#   - 4 KiB random reads at QD1 (readahead must not fire: same IOPS both ways, and the
#     node reads from the device what the client asked for, no more).
# A pool on RAM gets no readahead at all (its reads complete at once); `tessera bench`
# shows that in process (docs/benchmarks.md).
#
# Usage (root or a user who may run the node):
#   TESSERA=target/release/tessera RUNTIME=10 bench/readahead.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
TESSERA=${TESSERA:-target/release/tessera}
RUNTIME=${RUNTIME:-10}
LATENCY_US=${LATENCY_US:-2000}
PORT=${PORT:-10871}
CORES=${CORES:-1}

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
echo "readahead: a file behind the fault device with ${LATENCY_US} us per I/O, fio over NBD, ${RUNTIME}s per point"

# One node for each setting, started from a config file; prints "seqMiB randIOPS devMiB clientMiB".
run_with() { # readahead=true|false
    local dir
    dir=$(mktemp -d "${TMPDIR:-/tmp}/tessera-ra-bench.XXXXXX")
    start_node_with "$dir" "$PORT" "$CORES" "readahead = $1"
    t() { "$TESSERA" --api "unix:$dir/api.sock" "$@" >/dev/null; }
    t pool create slow "fault:$dir/slow.img:512M;latency_us=$LATENCY_US"
    t volume create v --pool slow --size 256M
    t export add v --volume v
    local uri="nbd://127.0.0.1:$PORT/v"
    fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=8 --size=256M \
        --output=/dev/null >/dev/null
    fio --name=seq --ioengine=nbd --uri="$uri" --rw=read --bs=128k --iodepth=1 --size=256M \
        --time_based --runtime="$RUNTIME" --output-format=json --output="$dir/seq.json" >/dev/null
    fio --name=rand --ioengine=nbd --uri="$uri" --rw=randread --bs=4k --iodepth=1 --size=256M \
        --time_based --runtime="$RUNTIME" --output-format=json --output="$dir/rand.json" >/dev/null
    python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
seq = json.load(open(f"{d}/seq.json"))["jobs"][0]["read"]
rnd = json.load(open(f"{d}/rand.json"))["jobs"][0]["read"]
print("%.1f %d" % (seq["bw_bytes"] / 2**20, rnd["iops"]))
PY
}

# (Command substitution waits for each node to be gone before the next one starts.)
on=$(run_with true)
off=$(run_with false)
read -r on_seq on_rand <<<"$on"
read -r off_seq off_rand <<<"$off"
printf '%-38s %14s %14s %8s\n' workload "readahead off" "readahead on" ratio
printf '%-38s %11s/s %11s/s %7.2fx\n' "sequential 128K read QD1 (MiB)" "$off_seq" "$on_seq" \
    "$(echo "$on_seq / $off_seq" | bc -l)"
printf '%-38s %14s %14s %7.2fx\n' "4K random read QD1 (IOPS)" "$off_rand" "$on_rand" \
    "$(echo "$on_rand / $off_rand" | bc -l)"
