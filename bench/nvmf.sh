#!/usr/bin/env bash
# NVMe/TCP vs Tessera's own NBD export, one node, one run: 4 KiB randread and randwrite at
# QD128 and QD1 through `tessera nvmf perf` and `tessera nbd-perf`, then the ratios.
# Usage: bench/nvmf.sh [SECONDS]   (default $SECS or 10; the node is stopped at the end;
# TESSERA=path runs another binary, e.g. from bench/ab.sh)
# Each run is bounded by `timeout`; a failed run stops the script with its output.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-${SECS:-10}}
T=${TESSERA:-target/release/tessera}   # the binary under test (server and load generator)
[[ "$T" != target/release/tessera ]] || cargo build --release --bin tessera >/dev/null
DIR=$(mktemp -d /tmp/tessera-nvmf-bench.XXXXXX)
NBD=127.0.0.1:20809; NVMF=127.0.0.1:24420; DISC=127.0.0.1:28009
# The measured volume lives on a RAM pool (like SPDK's Malloc bdev in the reference
# figures): the file-backed default pool would measure the disk, not the protocols.
NQN=nqn.2024-01.io.tessera:bench
$T up --data-dir "$DIR/data" --nbd $NBD --nvmf $NVMF --nvmf-discovery $DISC >"$DIR/node.log" 2>&1 &
NODE=$!
trap 'kill $NODE 2>/dev/null; wait $NODE 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 100); do grep -q "NVMe/TCP: nvme+tcp" "$DIR/node.log" && break; sleep 0.1; done
grep -q "NVMe/TCP: nvme+tcp" "$DIR/node.log" || { echo "the node did not start:" >&2; cat "$DIR/node.log" >&2; exit 1; }
A=(--api "$DIR/data/api.sock")
$T "${A[@]}" pool create ram0 ram:2G >/dev/null
$T "${A[@]}" volume create bench --pool ram0 --size 1G >/dev/null
$T "${A[@]}" export add bench --volume bench >/dev/null
$T "${A[@]}" nvmf subsystem add $NQN --volume bench --allow-any-host >/dev/null
echo "load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
# run NAME CMD...: run one measurement (bounded in time), print "IOPS MEAN_US" from its
# RESULT line; a failure prints its output and the node's log and stops the script.
run() {
  local name=$1; shift
  if ! timeout $((SECS + 60)) "$@" >"$DIR/$name.out" 2>&1 || ! grep -q '^RESULT' "$DIR/$name.out"; then
    { echo "$name failed:"; cat "$DIR/$name.out"; echo "node log:"; tail -20 "$DIR/node.log"; } >&2
    return 1
  fi
  grep '^RESULT' "$DIR/$name.out" | sed 's/.*iops=\([0-9]*\).*mean_us=\([0-9.]*\).*/\1 \2/'
}
# Fill the range used so reads hit allocated space on both protocols.
run fill $T nvmf perf --addr $NVMF --nqn $NQN --pattern randwrite --qd 128 --size 1G --time 3 >/dev/null
declare -A R
for pat in randread randwrite; do
  for qd in 128 1; do
    # At QD1 the clients busy-poll (as SPDK's perf does): a client's own wake-up on this
    # kind of VM costs more than the server's whole round trip.
    BP=(); [[ $qd == 1 ]] && BP=(--busy-poll)
    R[nvmf-$pat-$qd]=$(run nvmf-$pat-$qd $T nvmf perf --addr $NVMF --nqn $NQN --pattern $pat --qd $qd --size 1G --time "$SECS" "${BP[@]}")
    R[nbd-$pat-$qd]=$(run nbd-$pat-$qd $T nbd-perf --uri nbd://$NBD/bench --pattern $pat --qd $qd --size 1G --time "$SECS" "${BP[@]}")
  done
done
printf '%-10s %4s %12s %10s %12s %10s %7s\n' pattern qd nvmf-iops nvmf-us nbd-iops nbd-us ratio
for pat in randread randwrite; do
  for qd in 128 1; do
    read -r a am <<<"${R[nvmf-$pat-$qd]}"; read -r b bm <<<"${R[nbd-$pat-$qd]}"
    printf '%-10s %4s %12s %10s %12s %10s %7.2f\n' $pat $qd "$a" "$am" "$b" "$bm" "$(awk -v a="$a" -v b="$b" 'BEGIN{print a/b}')"
  done
done
echo "load after the run: $(cut -d' ' -f1-3 /proc/loadavg)"
