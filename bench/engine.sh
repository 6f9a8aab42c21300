#!/usr/bin/env bash
# In-process engine benchmarks (`tessera bench`, no NBD, no network), for the
# record. Three stacks, same job shape:
#
#   ram       one RAM device                       --target device
#   raid0     RAID0 pool over 4 RAM devices        --target pool
#   volume    thin volume on that RAID0 pool       --target volume
#
# and the ratio of raid0 and volume to the single RAM device (the cost of the
# pool and volume layers; 1.00x = free).
#
# Environment (defaults in brackets):
#   TIME [10] PATTERN [randread] BS [4k] QD [128] CORES [1]
#   RAM_SIZE [1G]        size of the single RAM device
#   MEMBER_SIZE [256M]   size of each of the 4 RAID0 members
#   TESSERA [target/release/tessera]  binary (built if the default is missing)
#   BENCH_SLACK [60]     extra seconds a run may take past TIME before it is killed
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

TIME="${TIME:-10}"
PATTERN="${PATTERN:-randread}"
BS="${BS:-4k}"
QD="${QD:-128}"
CORES="${CORES:-1}"
RAM_SIZE="${RAM_SIZE:-1G}"
MEMBER_SIZE="${MEMBER_SIZE:-256M}"
TESSERA="${TESSERA:-target/release/tessera}"
BENCH_SLACK="${BENCH_SLACK:-60}"

log() { printf '[engine] %s\n' "$*" >&2; }
die() { printf '[engine] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ ! -x "$TESSERA" ]]; then
  if [[ "$TESSERA" == "target/release/tessera" ]]; then
    log "building $TESSERA"
    cargo build --release -p tessera-cli >&2 || die "cargo build failed"
  else
    die "TESSERA=$TESSERA is not executable"
  fi
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/tessera-engine.XXXXXX")"
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

COMMON=(--pattern "$PATTERN" --bs "$BS" --qd "$QD" --cores "$CORES" --time "$TIME")
COMMANDS=()
declare -A RESULT_LINE=()
FAILURES=0

# run NAME ARGS...: one `tessera bench` run, time-bounded; stores its RESULT line.
run() {
  local name="$1" rc=0 line
  shift
  local cmd=("$TESSERA" bench "$@" "${COMMON[@]}")
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
    RESULT_LINE[$name]=""
    return 0
  fi
  log "$name: $line"
  RESULT_LINE[$name]="$line"
}

run ram --device "ram:$RAM_SIZE" --target device
RAID_DEVS=(--device "ram:$MEMBER_SIZE" --device "ram:$MEMBER_SIZE"
  --device "ram:$MEMBER_SIZE" --device "ram:$MEMBER_SIZE")
run raid0 "${RAID_DEVS[@]}" --layout raid0 --target pool
run volume "${RAID_DEVS[@]}" --layout raid0 --target volume

# ----------------------------------------------------------------- report --
echo
echo "== tessera bench: $PATTERN bs=$BS qd=$QD cores=$CORES time=${TIME}s;" \
  "$(nproc) CPUs, kernel $(uname -r), tessera $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
python3 - "${RESULT_LINE[ram]}" "${RESULT_LINE[raid0]}" "${RESULT_LINE[volume]}" <<'PY'
import sys

def parse(line):
    kv = {}
    for tok in line.split()[1:]:
        if "=" in tok:
            k, v = tok.split("=", 1)
            try:
                kv[k] = float(v)
            except ValueError:
                pass
    return kv

names = ["ram", "raid0", "volume"]
desc = {"ram": "1 RAM device", "raid0": "RAID0 over 4 RAM", "volume": "thin volume on RAID0"}
res = dict(zip(names, (parse(l) if l else None for l in sys.argv[1:4])))
base = (res["ram"] or {}).get("iops")

def f(r, k, fmt):
    return "-" if not r or k not in r else fmt % r[k]

fmt = "%-7s %-21s %11s %9s %9s %9s %12s %8s"
print(fmt % ("stack", "", "IOPS", "mean_us", "p99_us", "MiB/s", "cpu_ns/io", "vs ram"))
for n in names:
    r = res[n]
    ratio = "-"
    if r and base and "iops" in r:
        ratio = "%.2fx" % (r["iops"] / base)
    print(fmt % (n, desc[n], f(r, "iops", "%.0f"), f(r, "mean_us", "%.1f"),
                 f(r, "p99_us", "%.1f"), f(r, "mibps", "%.1f"),
                 f(r, "cpu_ns_per_io", "%.0f"), ratio))
PY
echo
echo "== Commands used"
printf '  %s\n' "${COMMANDS[@]}"
echo
echo "== Raw RESULT lines"
for n in ram raid0 volume; do
  printf '  %-7s %s\n' "$n" "${RESULT_LINE[$n]:-(none)}"
done

if ((FAILURES > 0)); then
  echo "== $FAILURES run(s) failed; see the log lines above" >&2
  exit 1
fi
