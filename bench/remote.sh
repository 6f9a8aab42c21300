#!/usr/bin/env bash
# A remote namespace as a device (tessera-remote): 4 KiB randread/randwrite through
# RemoteDevice on one reactor core (examples/remote_bench) against the same target read by
# `tessera nvmf perf`, alternated in one run, plus the target volume's local latency
# (`tessera bench --target volume` on the same kind of RAM pool, in process).
# PART=cc instead measures the queues' congestion control (issue 12, seed 001): 4 KiB
# random writes through RemoteDevice with the control on and off, alternated, on three
# paths to the same node: direct, through a shaping relay adding DELAY_US to each
# direction, and through one limiting each direction to RATE_MIBPS. Each row is ROUNDS
# interleaved on/off pairs (which goes first alternates).
# Usage: [PART=base|cc] bench/remote.sh [SECONDS]   (default $SECS or 5; for PART=cc:
#        ROUNDS=3, DELAY_US=1000, RATE_MIBPS=40, QDS="32 128", PATTERN=randwrite,
#        PATHS="direct delay rate")
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-${SECS:-5}}
PART=${PART:-base}
T=target/release/tessera
cargo build --release --bin tessera --example remote_bench -p tessera-remote -p tessera-cli >/dev/null
RB=target/release/examples/remote_bench
DIR=$(mktemp -d /tmp/tessera-remote-bench.XXXXXX)
NBD=127.0.0.1:21809; NVMF=127.0.0.1:25420; DISC=127.0.0.1:29009
NQN=nqn.2024-01.io.tessera:remote-bench
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
res() { grep '^RESULT' | sed 's/.*iops=\([0-9]*\).*mean_us=\([0-9.]*\) p50_us=\([0-9.]*\) p99_us=\([0-9.]*\).*/\1 \2 \3 \4/'; }
timeout 60 $T nvmf perf --addr $NVMF --nqn $NQN --pattern randwrite --qd 128 --size 1G --time 3 >/dev/null
if [[ $PART == cc ]]; then
  ROUNDS=${ROUNDS:-3}; DELAY_US=${DELAY_US:-1000}; RATE_MIBPS=${RATE_MIBPS:-40}
  QDS=${QDS:-32 128}; PATTERN=${PATTERN:-randwrite}; PATHS=${PATHS:-direct delay rate}
  # One run: prints "iops p50 p99 | window min_rtt_us srtt_us mean_inflight mean_waiting".
  run() { # cc path qd
    local env=(REMOTE_BENCH_CC=$1)
    case $2 in
      delay) env+=(REMOTE_BENCH_DELAY_US=$DELAY_US) ;;
      rate) env+=(REMOTE_BENCH_RATE_MIBPS=$RATE_MIBPS) ;;
    esac
    env "${env[@]}" timeout $((SECS + 60)) $RB "$URL" "$PATTERN" "$3" "$SECS" 4K 1G |
      awk '/^CC/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); cc[kv[1]] = kv[2] } }
           /^RESULT/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); r[kv[1]] = kv[2] } }
           END { printf "%s %s %s | %s %s %s %s %s\n", r["iops"], r["p50_us"], r["p99_us"],
                 cc["window"], cc["min_rtt_us"], cc["srtt_us"], cc["mean_inflight"], cc["mean_waiting"] }'
  }
  echo "pattern $PATTERN, 4 KiB, ${SECS}s per run; each cell: iops p50_us p99_us | window min_rtt_us srtt_us mean_inflight mean_waiting"
  for path in $PATHS; do
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
  exit 0
fi
printf '%-10s %4s | %-34s | %-34s\n' pattern qd "RemoteDevice iops mean p50 p99 (us)" "nvmf perf iops mean p50 p99 (us)"
for pat in randread randwrite; do
  for qd in 1 32 128; do
    BP=(); [[ $qd == 1 ]] && BP=(--busy-poll)
    r=$(timeout $((SECS + 60)) $RB "$URL" $pat $qd "$SECS" 4K 1G | res)
    n=$(timeout $((SECS + 60)) $T nvmf perf --addr $NVMF --nqn $NQN --pattern $pat --qd $qd --size 1G --time "$SECS" "${BP[@]}" 2>/dev/null | res)
    printf '%-10s %4s | %-34s | %-34s\n' $pat $qd "$r" "$n"
  done
done
for pat in randread randwrite; do
  l=$(timeout $((SECS + 60)) $T bench --device ram:2G --target volume --pattern $pat --qd 1 --time "$SECS" 2>/dev/null | res)
  echo "local volume (tessera bench --target volume, ram:2G) $pat QD1: iops mean p50 p99 = $l"
done
echo "load after the run: $(cut -d' ' -f1-3 /proc/loadavg)"
