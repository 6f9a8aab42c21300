#!/usr/bin/env bash
# Congestion control of a remote device's queues (issue 12, seed 001): 4 KiB random writes
# through RemoteDevice on one reactor core (examples/remote_bench) with the control on and
# off, alternated in one run, on three paths to the same node: direct, through a shaping
# relay adding DELAY_US to each direction, and through one limiting each direction to
# RATE_MIBPS. Each row is ROUNDS interleaved on/off pairs; the spread is min..max.
# Usage: bench/remote-cc.sh [SECONDS]   (default $SECS or 3; ROUNDS=3, DELAY_US=1000,
#        RATE_MIBPS=40, QDS="32 128", PATTERN=randwrite)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-${SECS:-3}}
ROUNDS=${ROUNDS:-3}
DELAY_US=${DELAY_US:-1000}
RATE_MIBPS=${RATE_MIBPS:-40}
QDS=${QDS:-32 128}
PATTERN=${PATTERN:-randwrite}
T=target/release/tessera
cargo build --release --bin tessera --example remote_bench -p tessera-remote -p tessera-cli >/dev/null
RB=target/release/examples/remote_bench
DIR=$(mktemp -d /tmp/tessera-remote-cc.XXXXXX)
NBD=127.0.0.1:21819; NVMF=127.0.0.1:25430; DISC=127.0.0.1:29019
NQN=nqn.2024-01.io.tessera:remote-cc
$T up --data-dir "$DIR/data" --nbd $NBD --nvmf $NVMF --nvmf-discovery $DISC >"$DIR/node.log" 2>&1 &
NODE=$!
trap 'kill $NODE 2>/dev/null; wait $NODE 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 100); do grep -q "NVMe/TCP: nvme+tcp" "$DIR/node.log" && break; sleep 0.1; done
A=(--api "$DIR/data/api.sock")
$T "${A[@]}" pool create ram0 ram:2G >/dev/null
$T "${A[@]}" volume create bench --pool ram0 --size 1G >/dev/null
$T "${A[@]}" nvmf subsystem add $NQN --volume bench --allow-any-host >/dev/null
URL="nvme-tcp://$NVMF/$NQN?nsid=1"
echo "load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
# Fill the volume once, so reads and writes meet allocated blocks.
timeout 60 $T nvmf perf --addr $NVMF --nqn $NQN --pattern randwrite --qd 128 --size 1G --time 3 >/dev/null
# One run: prints "iops p50 p99 | window srtt_us mean_inflight mean_waiting".
run() { # cc path qd
  local env=(REMOTE_BENCH_CC=$1)
  case $2 in
    delay) env+=(REMOTE_BENCH_DELAY_US=$DELAY_US) ;;
    rate) env+=(REMOTE_BENCH_RATE_MIBPS=$RATE_MIBPS) ;;
  esac
  env "${env[@]}" timeout $((SECS + 60)) $RB "$URL" "$PATTERN" "$3" "$SECS" 4K 1G |
    awk '/^CC/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); cc[kv[1]] = kv[2] } }
         /^RESULT/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); r[kv[1]] = kv[2] } }
         END { printf "%s %s %s | %s %s %s %s\n", r["iops"], r["p50_us"], r["p99_us"],
               cc["window"], cc["srtt_us"], cc["mean_inflight"], cc["mean_waiting"] }'
}
echo "pattern $PATTERN, 4 KiB, ${SECS}s per run; each cell: iops p50_us p99_us | window srtt_us mean_inflight mean_waiting"
for path in direct delay rate; do
  for qd in $QDS; do
    for round in $(seq "$ROUNDS"); do
      order="on off"; (( round % 2 == 0 )) && order="off on"
      for cc in $order; do
        printf '%-6s QD%-4s round %s cc %-3s  %s\n' $path "$qd" "$round" $cc "$(run $cc $path "$qd")"
      done
    done
  done
done
echo "load after the run: $(cut -d' ' -f1-3 /proc/loadavg)"
