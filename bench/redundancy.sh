#!/usr/bin/env bash
# What redundancy costs, in-process (`tessera bench --target pool`, no NBD, no network),
# on RAM devices. Usage:
#
#   bench/redundancy.sh                 # ~2-4 min: 19 runs of TIME s + the parity kernels
#   TIME=2 PARITY_SECS=0.1 bench/redundancy.sh   # quicker, noisier
#
# Prints four tables and the exact commands used:
#   1. 4K randread QD32, healthy and degraded (`--fail-device 1`): raid0 / raid5 / raid6 /
#      ec:4+2 over 6 RAM devices, raid1 over 2 (a 2-way mirror: fewer devices, so its
#      ratio to the 6-device raid0 is not like for like); ratio to raid0 and
#      degraded/healthy;
#   2. 4K randwrite QD32: raid0 / raid5 / raid6 / ec:4+2 (6 devices) / raid1 (2), ratio
#      to raid0;
#   3. full-stripe sequential write (bs = data chunks x chunk size: 320K for raid5 over 6
#      at 64K, 256K for raid5 over 5, raid6 and ec:4+2, 384K for raid0) against the ideal
#      raid0 x k/n (`--target pool` starts on a full stripe, so every write is a whole row);
#   4. parity kernel speed (`cargo run --release -p tessera-parity --example
#      parity_bench`), the rows of the backend it detected.
#
# Figures mean something only on a quiet machine: the load average is printed with them
# (check `uptime` first). One core drives the I/O (`--cores 1`).
#
# Environment (defaults in brackets):
#   TIME [5]             seconds per run
#   QD [32]              queue depth (all runs)
#   MEMBER_SIZE [256M]   size of each RAM device
#   CHUNK [64K]          stripe size (raid0) / chunk size (parity layouts)
#   PARITY_SECS [0.2]    seconds per parity kernel case (0 = skip the kernels)
#   TESSERA [target/release/tessera]  binary (built if the default is missing)
#   BENCH_SLACK [60]     extra seconds a run may take past TIME before it is killed
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

TIME="${TIME:-5}"
QD="${QD:-32}"
MEMBER_SIZE="${MEMBER_SIZE:-256M}"
CHUNK="${CHUNK:-64K}"
PARITY_SECS="${PARITY_SECS:-0.2}"
TESSERA="${TESSERA:-target/release/tessera}"
BENCH_SLACK="${BENCH_SLACK:-60}"

log() { printf '[redundancy] %s\n' "$*" >&2; }
die() { printf '[redundancy] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ ! -x "$TESSERA" ]]; then
  if [[ "$TESSERA" == "target/release/tessera" ]]; then
    log "building $TESSERA"
    cargo build --release -p tessera-cli >&2 || die "cargo build failed"
  else
    die "TESSERA=$TESSERA is not executable"
  fi
fi
command -v python3 >/dev/null || die "python3 is needed for the tables"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/tessera-redundancy.XXXXXX")"
CHILD_PID=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n "$CHILD_PID" ]] && kill -0 "$CHILD_PID" 2>/dev/null; then
    kill -TERM "$CHILD_PID" 2>/dev/null || true
    wait "$CHILD_PID" 2>/dev/null || true
  fi
  rm -rf -- "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg)"
COMMANDS=()
FAILURES=0
: >"$WORK/results"

# run NAME ARGS...: one `tessera bench` run, time-bounded; appends "NAME RESULT-line" to
# $WORK/results (an empty result when it failed).
run() {
  local name="$1" rc=0 line
  shift
  local cmd=("$TESSERA" bench --target pool --cores 1 --qd "$QD" --time "$TIME" "$@")
  local line_q
  printf -v line_q '%q ' "${cmd[@]}"
  COMMANDS+=("${line_q% }")
  log "$name: ${line_q% }"
  # Background + wait so a signal reaches the cleanup trap at once.
  timeout -k 10 "$((TIME + BENCH_SLACK))" "${cmd[@]}" </dev/null \
    >"$WORK/$name.out" 2>"$WORK/$name.err" &
  CHILD_PID=$!
  wait "$CHILD_PID" || rc=$?
  CHILD_PID=""
  line="$(grep -E '^RESULT( |$)' "$WORK/$name.out" | tail -n 1 || true)"
  if [[ "$rc" -ne 0 || -z "$line" ]]; then
    log "$name: FAILED (exit $rc); output:"
    sed 's/^/    /' "$WORK/$name.out" "$WORK/$name.err" >&2 || true
    FAILURES=$((FAILURES + 1))
    line=""
  else
    log "$name: $line"
  fi
  printf '%s %s\n' "$name" "$line" >>"$WORK/results"
}

SIX=()
for _ in 1 2 3 4 5 6; do SIX+=(--device "ram:$MEMBER_SIZE"); done
TWO=(--device "ram:$MEMBER_SIZE" --device "ram:$MEMBER_SIZE")
CH=(--stripe-size "$CHUNK")
CHUNK_BYTES="$(python3 -c 'import sys
s=sys.argv[1].upper(); m={"K":1<<10,"M":1<<20}
print(int(s[:-1])*m[s[-1]] if s[-1] in m else int(s))' "$CHUNK")"
kib() { echo "$(($1 * CHUNK_BYTES / 1024))K"; }

# short name -> --layout value; raid1 runs over 2 devices, the rest over 6
declare -A LAYOUT=([raid0]=raid0 [raid5]=raid5 [raid6]=raid6 [ec42]=ec:4+2 [raid1]=raid1)
devs_of() { if [[ "$1" == raid1 ]]; then echo "${TWO[*]}"; else echo "${SIX[*]}"; fi; }

# 1. 4K randread, healthy and degraded
for l in raid0 raid5 raid6 ec42 raid1; do
  # shellcheck disable=SC2046
  run "rr-$l" $(devs_of $l) --layout "${LAYOUT[$l]}" "${CH[@]}" --pattern randread --bs 4K
done
for l in raid5 raid6 ec42 raid1; do
  # shellcheck disable=SC2046
  run "rrdeg-$l" $(devs_of $l) --layout "${LAYOUT[$l]}" "${CH[@]}" --pattern randread --bs 4K --fail-device 1
done
# 2. 4K randwrite
for l in raid0 raid5 raid6 ec42 raid1; do
  # shellcheck disable=SC2046
  run "rw-$l" $(devs_of $l) --layout "${LAYOUT[$l]}" "${CH[@]}" --pattern randwrite --bs 4K
done
# 3. full-stripe sequential writes (k data chunks per row)
run "sw-raid0" "${SIX[@]}" --layout raid0 "${CH[@]}" --pattern write --bs "$(kib 6)"
run "sw-raid5" "${SIX[@]}" --layout raid5 "${CH[@]}" --pattern write --bs "$(kib 5)"
# `tessera bench --target pool` starts on a full stripe, so 320K writes on raid5 over 6
# are whole rows too; raid5 over 5 (256K rows) is kept as the 4-data-chunk case.
run "sw-raid5x5" "${SIX[@]:2}" --layout raid5 "${CH[@]}" --pattern write --bs "$(kib 4)"
run "sw-raid6" "${SIX[@]}" --layout raid6 "${CH[@]}" --pattern write --bs "$(kib 4)"
run "sw-ec42" "${SIX[@]}" --layout ec:4+2 "${CH[@]}" --pattern write --bs "$(kib 4)"

# 4. parity kernels
PARITY_CMD=(cargo run --release -q -p tessera-parity --example parity_bench -- "$PARITY_SECS")
PARITY_OK=0
if [[ "$PARITY_SECS" != "0" ]] && [[ -f crates/tessera-parity/examples/parity_bench.rs ]]; then
  printf -v line_q '%q ' "${PARITY_CMD[@]}"
  COMMANDS+=("${line_q% }")
  log "parity kernels: ${line_q% }"
  if timeout -k 10 600 "${PARITY_CMD[@]}" </dev/null >"$WORK/parity.out" 2>"$WORK/parity.err"; then
    PARITY_OK=1
  else
    log "parity_bench FAILED; output:"
    sed 's/^/    /' "$WORK/parity.out" "$WORK/parity.err" >&2 || true
    FAILURES=$((FAILURES + 1))
  fi
fi
LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg)"

# ----------------------------------------------------------------- report --
echo
echo "== tessera bench --target pool: ${TIME}s per run, QD$QD, 1 core, RAM devices of" \
  "$MEMBER_SIZE, chunk/stripe $CHUNK; $(nproc) CPUs, kernel $(uname -r)," \
  "tessera $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- crates 2>/dev/null || echo '+dirty')"
echo "== load average before: $LOAD_BEFORE, after: $LOAD_AFTER (figures are only" \
  "meaningful on a quiet machine)"
python3 - "$WORK/results" "$CHUNK_BYTES" <<'PY'
import sys

res = {}
for line in open(sys.argv[1]):
    parts = line.split(None, 1)
    kv = {}
    if len(parts) > 1:
        for tok in parts[1].split()[1:]:
            k, _, v = tok.partition("=")
            try:
                kv[k] = float(v)
            except ValueError:
                pass
    res[parts[0]] = kv or None
chunk = int(sys.argv[2])

desc = {"raid0": "raid0, 6 dev", "raid5": "raid5, 6 dev (5+1)", "raid6": "raid6, 6 dev (4+2)",
        "ec42": "ec:4+2, 6 dev", "raid1": "raid1, 2 dev (*)", "raid5x5": "raid5, 5 dev (4+1) (+)"}
kn = {"raid0": (6, 6), "raid5": (5, 6), "raid5x5": (4, 5), "raid6": (4, 6), "ec42": (4, 6)}

def g(name, key="iops"):
    r = res.get(name)
    return None if not r or key not in r else r[key]

def num(x, fmt="%.0f"):
    return "-" if x is None else fmt % x

def ratio(a, b):
    return "-" if a is None or not b else "%.2fx" % (a / b)

print()
print("-- 4K randread QD32: IOPS, healthy and degraded (device 1 failed)")
fmt = "%-22s %10s %9s %10s %9s %12s"
print(fmt % ("layout", "healthy", "vs raid0", "degraded", "vs raid0", "deg/healthy"))
base = g("rr-raid0")
for l in ["raid0", "raid5", "raid6", "ec42", "raid1"]:
    h, d = g("rr-" + l), (g("rrdeg-" + l) if l != "raid0" else None)
    print(fmt % (desc[l], num(h), ratio(h, base), num(d) if l != "raid0" else "n/a",
                 ratio(d, base), ratio(d, h)))

print()
print("-- 4K randwrite QD32: IOPS")
fmt = "%-22s %10s %9s %10s %10s"
print(fmt % ("layout", "IOPS", "vs raid0", "mean_us", "p99_us"))
base = g("rw-raid0")
for l in ["raid0", "raid5", "raid6", "ec42", "raid1"]:
    v = g("rw-" + l)
    print(fmt % (desc[l], num(v), ratio(v, base), num(g("rw-" + l, "mean_us"), "%.1f"),
                 num(g("rw-" + l, "p99_us"), "%.1f")))

print()
print("-- full-stripe sequential write QD32: MiB/s (bs = data chunks x chunk)")
fmt = "%-22s %7s %10s %16s %14s"
print(fmt % ("layout", "bs", "MiB/s", "raid0 x k/n", "vs raid0 x k/n"))
base = g("sw-raid0", "mibps")
for l in ["raid0", "raid5", "raid5x5", "raid6", "ec42"]:
    k, n = kn[l]
    v = g("sw-" + l, "mibps")
    ideal = None if base is None else base * k / n
    print(fmt % (desc[l], "%dK" % (k * chunk // 1024), num(v, "%.1f"), num(ideal, "%.1f"),
                 ratio(v, ideal)))
print()
print("(*) raid1 is a 2-way mirror over 2 RAM devices, the others use 6: its ratios to")
print("    raid0 compare different device counts (on RAM, one core drives either).")
print("(+) raid5 over 5 devices: 4 data chunks per row like raid6 and ec 4+2; its ideal is")
print("    raid0 (6 dev) x 4/5.")
PY

if ((PARITY_OK)); then
  echo
  echo "-- parity kernels (single thread, data bytes in per second), detected backend only:"
  det="$(sed -n 's/^detected backend: \([A-Za-z0-9_]*\).*/\1/p' "$WORK/parity.out")"
  head -n 1 "$WORK/parity.out"
  sed -n '2,3p' "$WORK/parity.out"
  grep -E "^\| .*\| ${det:-NONE} +\|" "$WORK/parity.out" || true
  echo "($(grep -c ' KiB |' "$WORK/parity.out" || true) rows in the full table, every backend;" \
    "run the command below to see them)"
fi

echo
echo "== Commands used"
printf '  %s\n' "${COMMANDS[@]}"
echo
echo "== Raw RESULT lines"
sed 's/^/  /' "$WORK/results"

if ((FAILURES > 0)); then
  echo "== $FAILURES run(s) failed; see the log lines above" >&2
  exit 1
fi
