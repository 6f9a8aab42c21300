#!/usr/bin/env bash
# A remote namespace as a device (tessera-remote): 4 KiB randread/randwrite through
# RemoteDevice on one reactor core (examples/remote_bench) against the same target read by
# `tessera nvmf perf`, alternated in one run, plus the target volume's local latency
# (`tessera bench --target volume` on the same kind of RAM pool, in process).
# Usage: bench/remote.sh [SECONDS]   (default $SECS or 5)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-${SECS:-5}}
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
