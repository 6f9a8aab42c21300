#!/usr/bin/env bash
# NVMe/TCP in-band authentication (DH-HMAC-CHAP) cost, one node, alternating runs:
#  1. connection setup: `tessera nvmf identify` (process start, admin queue Connect,
#     authentication, Identify, Disconnect) for a host without a secret, one with a secret
#     and the NULL DH group, one with ffdhe2048 — ROUNDS rounds, median and spread (ms);
#  2. 4 KiB randread QD128 through `tessera nvmf perf` (2 I/O queues) for the host without
#     a secret and the host with ffdhe2048, alternating, PERF_ROUNDS rounds of SECONDS.
# Usage: bench/nvmf-auth.sh [SECONDS] (default 5; ROUNDS=20 PERF_ROUNDS=3;
# TESSERA=path runs another binary). The node is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-${SECS:-5}}
ROUNDS=${ROUNDS:-20}
PERF_ROUNDS=${PERF_ROUNDS:-3}
T=${TESSERA:-target/release/tessera}
[[ "$T" != target/release/tessera ]] || cargo build --release --bin tessera >/dev/null
DIR=$(mktemp -d /tmp/tessera-nvmf-auth.XXXXXX)
NBD=127.0.0.1:20819; NVMF=127.0.0.1:24421; DISC=127.0.0.1:28019
NQN=nqn.2024-01.io.tessera:authbench
OPEN=nqn.2024-01.io.tessera:host-open
NULLH=nqn.2024-01.io.tessera:host-null
DH=nqn.2024-01.io.tessera:host-dh
$T up --data-dir "$DIR/data" --nbd $NBD --nvmf $NVMF --nvmf-discovery $DISC >"$DIR/node.log" 2>&1 &
NODE=$!
trap 'kill $NODE 2>/dev/null; wait $NODE 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 100); do grep -q "NVMe/TCP: nvme+tcp" "$DIR/node.log" && break; sleep 0.1; done
grep -q "NVMe/TCP: nvme+tcp" "$DIR/node.log" || { echo "the node did not start:" >&2; cat "$DIR/node.log" >&2; exit 1; }
A=(--api "$DIR/data/api.sock")
$T "${A[@]}" pool create ram0 ram:2G >/dev/null
$T "${A[@]}" volume create bench --pool ram0 --size 1G >/dev/null
$T "${A[@]}" nvmf subsystem add $NQN --volume bench --host $OPEN >/dev/null
# Secrets as `nvme gen-dhchap-key --hmac=1` writes them: 32 random bytes, CRC-32, base64.
gen() { python3 -c 'import os,zlib,base64;k=os.urandom(32);print("DHHC-1:01:"+base64.b64encode(k+zlib.crc32(k).to_bytes(4,"little")).decode()+":")'; }
gen >"$DIR/null.key"; gen >"$DIR/dh.key"
$T "${A[@]}" nvmf subsystem add-host $NQN $NULLH --dhchap-secret-file "$DIR/null.key" --dhchap-dhgroup null >/dev/null
$T "${A[@]}" nvmf subsystem add-host $NQN $DH --dhchap-secret-file "$DIR/dh.key" --dhchap-dhgroup ffdhe2048 >/dev/null
echo "load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
ident() { # host [secret file]
  local h=$1; shift
  local s; s=$(date +%s%N)
  timeout 30 $T nvmf identify --addr $NVMF --nqn $NQN --hostnqn "$h" "$@" >/dev/null
  echo $(( ($(date +%s%N) - s) / 1000 ))
}
declare -a O N D
for _ in $(seq "$ROUNDS"); do
  O+=("$(ident $OPEN)")
  N+=("$(ident $NULLH --dhchap-secret-file "$DIR/null.key")")
  D+=("$(ident $DH --dhchap-secret-file "$DIR/dh.key")")
done
stats() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {printf "median %.2f ms  min %.2f  max %.2f  (n=%d)", a[int((NR+1)/2)]/1000, a[1]/1000, a[NR]/1000, NR}'; }
echo "identify, no authentication:         $(stats "${O[@]}")"
echo "identify, DH-HMAC-CHAP NULL group:   $(stats "${N[@]}")"
echo "identify, DH-HMAC-CHAP ffdhe2048:    $(stats "${D[@]}")"
perf() { # host [secret args]
  local h=$1; shift
  timeout $((SECS + 60)) $T nvmf perf --addr $NVMF --nqn $NQN --hostnqn "$h" "$@" --pattern randread --qd 128 --queues 2 --size 1G --time "$SECS" \
    2>>"$DIR/perf.err" | grep '^RESULT' | sed 's/.*iops=\([0-9]*\).*/\1/'
}
timeout 60 $T nvmf perf --addr $NVMF --nqn $NQN --hostnqn $OPEN --pattern randwrite --qd 128 --size 1G --time 3 >/dev/null 2>>"$DIR/perf.err"
for r in $(seq "$PERF_ROUNDS"); do
  a=$(perf $OPEN); b=$(perf $DH --dhchap-secret-file "$DIR/dh.key")
  echo "round $r: randread QD128 IOPS  no-auth $a  ffdhe2048-auth $b  ratio $(awk -v a="$a" -v b="$b" 'BEGIN{printf "%.3f", b/a}')"
done
echo "load after the run: $(cut -d' ' -f1-3 /proc/loadavg)"
