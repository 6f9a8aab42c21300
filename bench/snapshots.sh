#!/usr/bin/env bash
# Snapshots (issue 14): create latency and the longest client stall under 4 KiB random
# writes at QD32; first-write IOPS right after a snapshot against the same writes on a
# volume without one, and the steady state after every block was rewritten; 4 KiB random
# reads on a clone ten levels deep against a plain volume; node memory per snapshot.
#
#   bench/snapshots.sh        # SIZE=256M ROUNDS=3 [TESSERA=target/release/tessera]
#
# ONLY=writes runs only the first-write / steady-state rounds (for `bench/ab.sh
# snapshots`). STEADY_RUNTIME=S measures the steady state as STEADY_PASSES [3] pairs of
# S-second time-based passes, plain and snapshotted volume interleaved (and prints a
# `steady` line per pair), instead of one random pass each. DEVICE [ram:2G] is the
# pool's device spec.
#
# One reactor core, a 2 GiB RAM pool with 1 MiB units, fio's nbd engine as the client
# (one pass of 4 KiB random writes covers every block of SIZE exactly once: fio's random
# map). Rounds alternate the plain and the snapshot runs, so drift shows as spread. The
# node is started here and killed by PID.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SIZE="${SIZE:-256M}"; ROUNDS="${ROUNDS:-3}"
ONLY="${ONLY:-all}"; STEADY_RUNTIME="${STEADY_RUNTIME:-}"; STEADY_PASSES="${STEADY_PASSES:-3}"
DEVICE="${DEVICE:-ram:2G}"
TESSERA="${TESSERA:-target/release/tessera}"
[[ -x "$TESSERA" ]] || cargo build --release -p tessera-cli >&2

WORK="$(mktemp -d /tmp/tessera-snap.XXXXXX)"
PID=""
cleanup() { [[ -n "$PID" ]] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; rm -rf -- "$WORK"; }
trap cleanup EXIT
PORT=10911
cat >"$WORK/node.toml" <<TOML
data_dir = "$WORK/data"
cores = 1
[nbd]
listen = ["127.0.0.1:$PORT"]
[[pool]]
name = "p"
devices = ["$DEVICE"]
[[volume]]
name = "plain"
pool = "p"
size = "$SIZE"
[[volume]]
name = "a"
pool = "p"
size = "$SIZE"
[[export]]
name = "plain"
volume = "plain"
[[export]]
name = "a"
volume = "a"
TOML
"$TESSERA" node --config "$WORK/node.toml" >"$WORK/node.log" 2>&1 & PID=$!
for _ in $(seq 1 100); do [[ -S "$WORK/data/api.sock" ]] && break; sleep 0.1; done
cli() { "$TESSERA" --api "$WORK/data/api.sock" "$@"; }
PIN=()
if (( $(nproc) > 1 )); then PIN=(taskset -c "1-$(( $(nproc) - 1 ))"); fi

# fio over NBD; prints "IOPS CLAT_MAX_US".
fio_run() { # export rw extra...
  local export=$1 rw=$2; shift 2
  "${PIN[@]}" fio --name=j --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$export" --rw="$rw" \
    --bs=4k --iodepth=32 --size="$SIZE" "$@" --output-format=json --output="$WORK/fio.json" >/dev/null
  python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
d = j["write"] if j["write"]["total_ios"] else j["read"]
print("%.0f %.0f" % (d["iops"], d["clat_ns"]["max"] / 1000))' "$WORK/fio.json"
}
now_us() { echo $(( $(date +%s%N) / 1000 )); }

# Prefill both volumes (every unit allocated).
for v in plain a; do
  "${PIN[@]}" fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$v" --rw=write \
    --bs=1M --iodepth=8 --size="$SIZE" >/dev/null
done

echo "round plain_iops first_write_iops steady_iops create_ms(idle)"
for ((r = 1; r <= ROUNDS; r++)); do
  read -r base _ < <(fio_run plain randwrite)
  t0=$(now_us); cli snapshot create a --name "r$r" >/dev/null; t1=$(now_us)
  read -r first _ < <(fio_run a randwrite)
  if [[ -n "$STEADY_RUNTIME" ]]; then
    # Every block of 'a' was rewritten by the first pass: interleaved timed passes.
    for ((k = 1; k <= STEADY_PASSES; k++)); do
      read -r sp _ < <(fio_run plain randwrite --time_based --runtime="$STEADY_RUNTIME")
      read -r sa _ < <(fio_run a randwrite --time_based --runtime="$STEADY_RUNTIME")
      echo "steady $r $k plain $sp snap $sa"
    done
    steady=-
  else
    read -r steady _ < <(fio_run a randwrite)
  fi
  printf "%d %s %s %s %.1f\n" "$r" "$base" "$first" "$steady" "$(( t1 - t0 ))e-3"
  # The previous round's snapshot goes (hidden until nothing reads it).
  (( r > 1 )) && cli snapshot delete "r$((r - 1))" >/dev/null
done
[[ "$ONLY" == writes ]] && exit 0

echo
echo "stall: 4k randwrite QD32 for 6 s on 'a', snapshot created at 2 s (or not)"
echo "run clat_max_us create_ms"
for ((r = 1; r <= ROUNDS; r++)); do
  for kind in none snapshot; do
    fio_run a randwrite --time_based --runtime=6 >"$WORK/stall.out" &
    fpid=$!
    sleep 2
    ms="-"
    if [[ $kind == snapshot ]]; then
      t0=$(now_us); cli snapshot create a --name "stall$r" >/dev/null; t1=$(now_us)
      ms=$(printf "%.1f" "$(( t1 - t0 ))e-3")
    fi
    wait "$fpid"
    read -r _ max <"$WORK/stall.out"
    echo "$kind $max $ms"
  done
  cli snapshot delete "stall$r" >/dev/null
done

echo
echo "4k randread QD32, 5 s: plain volume vs a clone 10 levels deep (data in the deepest)"
cli snapshot create a --name d0 >/dev/null
prev=d0
for i in $(seq 1 10); do
  cli volume clone "$prev" --name "c$i" >/dev/null
  if (( i < 10 )); then cli snapshot create "c$i" --name "d$i" >/dev/null; prev="d$i"; fi
done
cli export add c10 --volume c10 >/dev/null
echo "round plain_iops clone10_iops"
for ((r = 1; r <= ROUNDS; r++)); do
  read -r p _ < <(fio_run plain randread --time_based --runtime=5)
  read -r c _ < <(fio_run c10 randread --time_based --runtime=5)
  echo "$r $p $c"
done

echo
rss() { awk '/VmRSS/ {print $2}' "/proc/$PID/status"; }
before=$(rss)
for i in $(seq 1 100); do cli snapshot create a --name "m$i" >/dev/null; done
after=$(rss)
echo "node RSS: $before KiB before 100 snapshots of a $SIZE volume, $after KiB after ($(( (after - before) * 1024 / 100 )) bytes per snapshot)"
