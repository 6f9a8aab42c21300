#!/usr/bin/env bash
# First writes into a fresh thin volume against rewrites of the same range (issue 11 §6).
#
# Starts `tessera up` in a fresh data directory, then runs fio over NBD twice on the same
# range of `vol0`: sequential 1 KiB writes into unallocated space (every 1 MiB unit is
# allocated by these writes), then the same writes again (rewrite of allocated units).
#
#   TESSERA=path/to/tessera SIZE=256M QD=1 bench/first-write.sh
set -euo pipefail
TESSERA=${TESSERA:-target/release/tessera}
SIZE=${SIZE:-256M}
QD=${QD:-32}
BS=${BS:-1k}
PORT=${PORT:-10899}
dir=$(mktemp -d)
"$TESSERA" up --data-dir "$dir" --nbd "127.0.0.1:$PORT" --nvmf "" --nvmf-discovery "" \
    --api "unix:$dir/api.sock" >"$dir/node.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do
    nbdinfo "nbd://127.0.0.1:$PORT/vol0" >/dev/null 2>&1 && break
    sleep 0.1
done
run() {
    fio --name="$1" --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/vol0" --rw=write \
        --bs="$BS" --iodepth="$QD" --size="$SIZE" --output-format=json --output="$dir/$1.json" >/dev/null
    python3 -c 'import json,sys; w=json.load(open(sys.argv[2]))["jobs"][0]["write"]; print("%-12s %8.1f MiB/s %9d IOPS" % (sys.argv[1], w["bw"]/1024, w["iops"]))' "$1" "$dir/$1.json"
}
run first-write
run rewrite
