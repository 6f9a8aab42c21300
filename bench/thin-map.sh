#!/usr/bin/env bash
# Thin-map memory and lookup cost (issue 11 §2), old binary against new, in one run.
#
# 1. RSS: for each binary, `tessera up` in a fresh data directory (pool0 on a 4 GiB file),
#    RSS of the idle node; after 1 GiB written to vol0 (a control: what the I/O path's
#    buffers cost); then a 1 PiB volume (`--force` where the binary has the
#    overcommit check), exported, 1 GiB written sequentially with fio over NBD, and RSS
#    again. Old binaries hold a flat map of 4 bytes per virtual MiB: expect ~4 GiB.
# 2. 4K randread IOPS and CPU per I/O on a thin volume, in-process
#    (`tessera bench --target volume`, RAM device, QD128, 1 core), alternating the
#    binaries (the order flips every round) to spread the noise of a shared machine.
#
#   BEFORE=/work/before/tessera AFTER=target/release/tessera ROUNDS=4 TIME=10 bench/thin-map.sh
#
# SKIP_RSS=1 / SKIP_IOPS=1 skip a part. Every step is time-bounded.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BEFORE=${BEFORE:?set BEFORE to the baseline tessera binary}
AFTER=${AFTER:-target/release/tessera}
ROUNDS=${ROUNDS:-4}
TIME=${TIME:-10}
PORT=${PORT:-10897}

NODE_PID=""
NODE_DIR=""
stop_node() {
    [[ -n $NODE_PID ]] && { kill "$NODE_PID" 2>/dev/null; wait "$NODE_PID" 2>/dev/null || true; }
    [[ -n $NODE_DIR ]] && rm -rf "$NODE_DIR"
    NODE_PID=""
    NODE_DIR=""
}
trap stop_node EXIT

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

rss_run() {
    local name=$1 bin=$2 dir pid force=()
    dir=$(mktemp -d)
    "$bin" up --data-dir "$dir" --nbd "127.0.0.1:$PORT" --nvmf "" --nvmf-discovery "" \
        --api "unix:$dir/api.sock" >"$dir/node.log" 2>&1 &
    pid=$!
    NODE_PID=$pid
    NODE_DIR=$dir
    for _ in $(seq 300); do
        nbdinfo "nbd://127.0.0.1:$PORT/vol0" >/dev/null 2>&1 && break
        sleep 0.1
    done
    sleep 1
    local idle control
    idle=$(rss_kib "$pid")
    # Control: 1 GiB through the same path into the 4 GiB volume vol0 (flat in either
    # binary's map at that size): what the I/O buffers and the connection cost.
    timeout 300 fio --name=ctl --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/vol0" --rw=write \
        --bs=1M --iodepth=8 --size=1G --output=/dev/null >/dev/null
    sleep 1
    control=$(rss_kib "$pid")
    "$bin" volume create --help | grep -q -- --force && force=(--force)
    timeout 120 "$bin" --api "unix:$dir/api.sock" volume create big --pool pool0 --size 1P \
        "${force[@]}" >/dev/null
    timeout 30 "$bin" --api "unix:$dir/api.sock" export add big --volume big >/dev/null
    local created
    created=$(rss_kib "$pid")
    timeout 300 fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/big" --rw=write \
        --bs=1M --iodepth=8 --size=1G --output=/dev/null >/dev/null
    sleep 1
    local written
    written=$(rss_kib "$pid")
    printf '%-7s RSS KiB: idle %d | 1 GiB into vol0 (control) %d (+%d) | 1 PiB volume created %d (+%d) | 1 GiB written to it %d (+%d; +%d over the control)\n' \
        "$name" "$idle" "$control" $((control - idle)) "$created" $((created - idle)) \
        "$written" $((written - idle)) $((written - control))
    stop_node
}

iops_run() {
    local name=$1 bin=$2 r=$3 line
    line=$(timeout $((TIME + 120)) "$bin" bench --device ram:1G --target volume --pattern randread \
        --bs 4K --qd 128 --cores 1 --time "$TIME" 2>/dev/null | grep '^RESULT')
    echo "round $r $name $line"
}

if [[ -z "${SKIP_RSS:-}" ]]; then
    echo "== RSS: 1 PiB volume, 1 GiB written (load $(cut -d' ' -f1-3 /proc/loadavg))"
    rss_run before "$BEFORE"
    rss_run after "$AFTER"
fi
if [[ -z "${SKIP_IOPS:-}" ]]; then
    echo "== 4K randread on a thin volume, ${TIME}s per run"
    for ((r = 1; r <= ROUNDS; r++)); do
        order=(before after)
        ((r % 2 == 0)) && order=(after before)
        for side in "${order[@]}"; do
            bin=$BEFORE
            [[ $side == after ]] && bin=$AFTER
            echo "load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
            iops_run "$side" "$bin" "$r"
        done
    done
fi
