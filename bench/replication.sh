#!/usr/bin/env bash
# Replicated volumes (issue 12): the cost of synchronous replication to a second node over
# loopback, through the same client (fio, ioengine=nbd) in the same run:
#   - 4 KiB randwrite QD1 latency: local volume vs 2-replica volume, and the NVMe/TCP
#     round trip to the replica alone (`tessera nvmf perf` QD1 against the peer's replica
#     subsystem), so the replicated latency can be split into its parts;
#   - 4 KiB randwrite / randread QD128 IOPS, local vs replicated;
#   - resync: the replica node is stopped (SIGSTOP) past the timeout, DIRTY MiB are
#     written, it is resumed; the bytes the resync copied against the dirty bytes, its
#     rate, and a QD1 client's IOPS on the volume while the resync runs against before.
# Both nodes use RAM pools and share this machine's CPUs (2 on the reference VM).
# Usage: bench/replication.sh   (env: SECS [5], DIRTY [256] MiB, RATE [0 = unlimited],
#   POLL_US [50] both nodes' hybrid polling window, SPECS ["randwrite:1 randwrite:128
#   randread:128 randread:1"] the fio rows, RESYNC [1] (0 ends after the fio rows and the
#   round trip: no snapshot or resync part), TESSERA [target/release/tessera] the binary,
#   e.g. from bench/ab.sh, ONLY=snapshot: only the snapshot-under-load rows,
#   SNAP_ROUNDS [2])
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${SECS:-5}
DIRTY=${DIRTY:-1024}
RATE=${RATE:-0}
CORES=${CORES:-1}   # reactor cores per node (two nodes and fio share the CPUs)
POLL_US=${POLL_US:-50}  # hybrid polling window of both nodes (the node default)
SPECS=${SPECS:-randwrite:1 randwrite:128 randread:128 randread:1}
RESYNC=${RESYNC:-1}
T=${TESSERA:-target/release/tessera}
[[ "$T" != target/release/tessera ]] || cargo build --release --bin tessera -p tessera-cli >/dev/null
command -v fio >/dev/null || { echo "fio is needed (scripts/install-deps.sh)" >&2; exit 1; }
DIR=$(mktemp -d /tmp/tessera-repl-bench.XXXXXX)
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
NBD_A=$(port); NBD_B=$(port); NVMF_A=$(port); NVMF_B=$(port)
mkdir -p "$DIR/a" "$DIR/b"
cat >"$DIR/b.toml" <<EOF
data_dir = "$DIR/b/data"
cores = $CORES
poll_us = $POLL_US
name = "node-b"
[nbd]
listen = ["127.0.0.1:$NBD_B"]
[nvmf]
listen = "127.0.0.1:$NVMF_B"
discovery = ""
EOF
cat >"$DIR/a.toml" <<EOF
data_dir = "$DIR/a/data"
cores = $CORES
poll_us = $POLL_US
name = "node-a"
[[peer]]
name = "node-b"
api = "unix:$DIR/b/data/api.sock"
[replication]
timeout_ms = 1000
resync_rate = "$RATE"
[nbd]
listen = ["127.0.0.1:$NBD_A"]
[nvmf]
listen = "127.0.0.1:$NVMF_A"
discovery = ""
EOF
$T node --config "$DIR/b.toml" >"$DIR/b.log" 2>&1 &
PB=$!
$T node --config "$DIR/a.toml" >"$DIR/a.log" 2>&1 &
PA=$!
trap 'kill -CONT $PB 2>/dev/null; kill $PA $PB 2>/dev/null; wait $PA $PB 2>/dev/null; [[ -n ${KEEP:-} ]] && echo "kept $DIR" || rm -rf "$DIR"' EXIT
for f in a b; do
  for _ in $(seq 100); do [[ -S "$DIR/$f/data/api.sock" ]] && break; sleep 0.1; done
done
A=(--api "$DIR/a/data/api.sock"); B=(--api "$DIR/b/data/api.sock")
$T "${B[@]}" pool create p ram:3G >/dev/null
$T "${A[@]}" pool create p ram:6G >/dev/null
$T "${A[@]}" volume create plain --pool p --size 1G >/dev/null
$T "${A[@]}" volume create rep --size 1G --replicas node-a:p,node-b:p >/dev/null
$T "${A[@]}" export add plain --volume plain >/dev/null
$T "${A[@]}" export add rep --volume rep >/dev/null
NQN=nqn.2026-11.io.tessera:replica:node-a:rep.node-a

fio_run() { # URI RW QD SECS -> "iops mean_us"
  timeout $(($4 + 60)) fio --name=t --ioengine=nbd "--uri=$1" "--rw=$2" --bs=4k \
    "--iodepth=$3" --size=1G --time_based "--runtime=$4" --output-format=json \
    "--output=$DIR/fio.json" 2>"$DIR/fio.err" >/dev/null ||
    { echo "fio failed: $(cat "$DIR/fio.err")" >&2; exit 1; }
  python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; k="write" if j["write"]["io_bytes"] else "read"; print("%.0f %.1f" % (j[k]["iops"], j[k]["lat_ns"]["mean"]/1000))' <"$DIR/fio.json"
}
echo "load before the run: $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) CPUs"
# Allocate both volumes fully first, so neither measures first-write allocation.
for v in plain rep; do
  timeout 300 fio --name=fill --ioengine=nbd "--uri=nbd://127.0.0.1:$NBD_A/$v" --rw=write --bs=1M \
    --iodepth=8 --size=1G >/dev/null 2>&1
done
ONLY=${ONLY:-all}   # all | snapshot (only the snapshot-under-load rows)
printf '%-22s %-20s %-20s %s\n' "test" "local iops/mean_us" "replicated" "ratio"
[[ $ONLY == snapshot ]] && SPECS=""
for spec in $SPECS; do
  set -- ${spec/:/ }
  l1=$(fio_run "nbd://127.0.0.1:$NBD_A/plain" "$1" "$2" "$SECS")
  r1=$(fio_run "nbd://127.0.0.1:$NBD_A/rep" "$1" "$2" "$SECS")
  r2=$(fio_run "nbd://127.0.0.1:$NBD_A/rep" "$1" "$2" "$SECS")
  l2=$(fio_run "nbd://127.0.0.1:$NBD_A/plain" "$1" "$2" "$SECS")
  ratio=$(python3 -c "print('%.2f' % ((${r1% *}+${r2% *})/(${l1% *}+${l2% *})))")
  printf '%-22s %-20s %-20s %s\n' "$1 QD$2" "$l1 | $l2" "$r1 | $r2" "$ratio"
done
[[ $ONLY == snapshot ]] || {
rt=$(timeout 60 $T nvmf perf --addr "127.0.0.1:$NVMF_B" --nqn "$NQN" --pattern randwrite --qd 1 \
  --size 1G --time "$SECS" 2>/dev/null | grep '^RESULT' | sed 's/.*mean_us=\([0-9.]*\).*/\1/')
echo "NVMe/TCP round trip to the replica alone (nvmf perf randwrite QD1, mean): ${rt} us"
}
if [[ $RESYNC == 0 ]]; then
  echo "load after the run: $(cut -d' ' -f1-3 /proc/loadavg)"
  exit 0
fi

# Snapshot under load (issue 14 on a replicated volume): 4 KiB randwrite QD32 for 6 s
# over the first 256 MiB (each snapshot then pins at most 256 MiB of the RAM pools),
# a snapshot created at 2 s (or none), on the plain and on the replicated volume; the
# longest client I/O (fio clat max), the create call's latency, and how long the owner
# held the replicated volume's writes (its log's paused_ms).
now_us() { date +%s%6N; }
stall_run() { # VOLUME none|snapshot ROUND -> "clat_max_us create_ms paused_ms"
  timeout 70 fio --name=s --ioengine=nbd "--uri=nbd://127.0.0.1:$NBD_A/$1" --rw=randwrite \
    --bs=4k --iodepth=32 --size=256M --time_based --runtime=6 --output-format=json \
    "--output=$DIR/stall.json" >/dev/null 2>&1 &
  local f=$! ms=- paused=-
  sleep 2
  if [[ $2 == snapshot ]]; then
    local t0 t1; t0=$(now_us)
    $T "${A[@]}" snapshot create "$1" --name "st-$1-$3" >/dev/null; t1=$(now_us)
    ms=$(python3 -c "print('%.1f' % (($t1 - $t0) / 1000))")
    paused=$(grep 'snapshots created' "$DIR/a.log" | tail -1 | sed -n 's/.*paused_ms=\([0-9.]*\).*/\1/p')
    [[ $1 == plain ]] && paused=-
  fi
  wait $f || { echo "fio failed" >&2; exit 1; }
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))["jobs"][0]["write"]; print("%.0f" % (d["clat_ns"]["max"]/1000))' "$DIR/stall.json" | tr -d '\n'
  echo " $ms ${paused:--}"
  [[ $2 == snapshot ]] && $T "${A[@]}" snapshot delete "st-$1-$3" >/dev/null
}
echo "snapshot under 4k randwrite QD32 (6 s, created at 2 s): volume kind clat_max_us create_ms paused_ms"
for r in $(seq "${SNAP_ROUNDS:-2}"); do
  for v in plain rep; do
    for kind in none snapshot; do
      echo "stall $r $v $kind $(stall_run $v $kind $r)"
    done
  done
done

[[ $ONLY == snapshot ]] && exit 0
# Resync: stop node-b past the timeout, dirty DIRTY MiB, resume it.
before=$(fio_run "nbd://127.0.0.1:$NBD_A/rep" randread 1 2)
kill -STOP $PB
timeout 60 fio --name=d --ioengine=nbd "--uri=nbd://127.0.0.1:$NBD_A/rep" --rw=write --bs=1M \
  --iodepth=4 "--size=${DIRTY}M" >/dev/null 2>&1
dirty=$($T "${A[@]}" volume show rep --json | python3 -c 'import json,sys; print([r for r in json.load(sys.stdin)["replicas"] if not r["local"]][0]["dirty_bytes"])')
state() { $T "${A[@]}" volume show rep --json | python3 -c 'import json,sys; r=[r for r in json.load(sys.stdin)["replicas"] if not r["local"]][0]; print(r["state"], r["resync_copied_bytes_total"])'; }
t0=$(date +%s.%N)
kill -CONT $PB
for _ in $(seq 300); do st=$(state); [[ ${st% *} == resyncing || ${st% *} == in_sync ]] && break; sleep 0.05; done
during=$(fio_run "nbd://127.0.0.1:$NBD_A/rep" randread 1 2)
for _ in $(seq 600); do
  st=$(state)
  [[ ${st% *} == in_sync ]] && break
  sleep 0.1
done
t1=$(date +%s.%N)
copied=${st#* }
python3 - "$dirty" "$copied" "$t0" "$t1" <<'EOF'
import sys
d, c, t0, t1 = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
print(f"resync: dirty {d/2**20:.0f} MiB, copied {c/2**20:.0f} MiB (ratio {c/max(d,1):.2f}), "
      f"{t1-t0:.2f} s from resume to in sync incl. reconnect, {c/2**20/max(t1-t0,1e-9):.0f} MiB/s")
EOF
echo "QD1 randread on the replicated volume during the resync: ${during} (iops mean_us); before: ${before}"
echo "load after the run: $(cut -d' ' -f1-3 /proc/loadavg)"
