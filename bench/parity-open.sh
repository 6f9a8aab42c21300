#!/usr/bin/env bash
# Open time of a raid5 pool on files after an unclean shutdown: BEFORE (a build without
# the allocation reserve) against AFTER (an unclean open zeroes the reserve, docs/format.md
# §3.5), alternated run by run. Each binary prepares its own pool (3 files of 512 MiB,
# 1 MiB units, 64 units written, exit without shutdown) and then opens it RUNS times,
# every open unclean again (the process exits without a shutdown).
#
#   cargo build --release -p tessera-pool --example parity_open_time
#   BEFORE=path/to/before/parity_open_time RUNS=7 bench/parity-open.sh
set -euo pipefail
BEFORE=${BEFORE:?set BEFORE to a parity_open_time built without the reserve}
AFTER=${AFTER:-target/release/examples/parity_open_time}
RUNS=${RUNS:-7}
dir=$(mktemp -d -p "${BENCH_DIR:-/var/tmp}")
trap 'rm -rf "$dir"' EXIT
mkdir "$dir/before" "$dir/after"
"$BEFORE" "$dir/before" prepare
"$AFTER" "$dir/after" prepare
for i in $(seq "$RUNS"); do
    b=$("$BEFORE" "$dir/before" open | awk '/open_ms/ {print $2}')
    a=$("$AFTER" "$dir/after" open | awk '/open_ms/ {print $2}')
    echo "run $i: before ${b} ms, after ${a} ms"
done
