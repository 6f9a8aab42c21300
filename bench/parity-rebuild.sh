#!/usr/bin/env bash
# Rebuild time of a raid5 pool on files, BEFORE (a rebuild that skips free units)
# against AFTER (it zero-fills them on the rebuilt device, docs/architecture.md
# "Rebuild" of parity pools), alternated run by run. Each run: a node (1 core), raid5
# over 3 files of 1 GiB (64 KiB stripe, 1 MiB units, ~2 GiB usable), a 256 MiB volume
# written over NBD (3 s of 1 MiB random writes), then `pool rebuild --device 1 --force --wait` with the rebuild
# class unlimited, timed.
#
#   cargo build --release -p tessera-cli --bin tessera
#   BEFORE=path/to/before/tessera RUNS=3 bench/parity-rebuild.sh
set -euo pipefail
BEFORE=${BEFORE:?set BEFORE to a tessera built without the free-unit zero-fill}
AFTER=${AFTER:-target/release/tessera}
RUNS=${RUNS:-3}
PORT=${PORT:-10917}

one() {
    local bin=$1 dir
    dir=$(mktemp -d -p "${BENCH_DIR:-/var/tmp}")
    mkdir -p "$dir/data"
    cat >"$dir/node.toml" <<CONF
data_dir = "$dir/data"
cores = 1
[nbd]
listen = ["127.0.0.1:$PORT"]
[nvmf]
listen = "127.0.0.1:$((PORT + 1))"
discovery = ""
CONF
    "$bin" node --config "$dir/node.toml" >"$dir/node.log" 2>&1 &
    local pid=$!
    for _ in $(seq 100); do [[ -S "$dir/data/api.sock" ]] && break; sleep 0.1; done
    local T=("$bin" --api "unix:$dir/data/api.sock")
    "${T[@]}" pool create p --layout raid5 --stripe-size 64K \
        "$dir/a.img:1G" "$dir/b.img:1G" "$dir/c.img:1G" >/dev/null
    "${T[@]}" volume create v --pool p --size 256M >/dev/null
    "${T[@]}" export add v --volume v >/dev/null
    "$bin" nbd-perf --uri "nbd://127.0.0.1:$PORT/v" --pattern randwrite --bs 1M \
        --size 256M --time 3 >/dev/null 2>&1
    "${T[@]}" background set rebuild --bw 64G >/dev/null
    local t0 t1
    t0=$(date +%s.%N)
    "${T[@]}" pool rebuild p --device 1 --force --wait >/dev/null
    t1=$(date +%s.%N)
    kill "$pid"; wait "$pid" || true
    rm -rf "$dir"
    echo "$t0 $t1" | awk '{printf "%.2f", $2 - $1}'
}

for i in $(seq "$RUNS"); do
    b=$(one "$BEFORE")
    a=$(one "$AFTER")
    echo "run $i: before ${b} s, after ${a} s"
done
