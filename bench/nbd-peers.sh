#!/usr/bin/env bash
# Compare Tessera's NBD export against two peer NBD servers on this machine,
# with the same fio job shape (ioengine=nbd) against each in turn:
#
#   tessera   `tessera up` (file-backed pool, thin volume vol0)   port 10809
#   nbdkit    memory plugin, 4G                                   port 10810
#   qemu-nbd  raw 4G file in /dev/shm                             port 10811
#
# Servers run one at a time (start, prefill, all fio runs, stop), so an idle
# server never competes for the CPU. Prints a table of IOPS and mean latency
# and Tessera's ratio to each peer, plus every command used.
#
# Environment (defaults in brackets):
#   RUNTIME [10]            seconds per fio run
#   SIZE [1G]               fio region size (prefilled before the runs)
#   BS [4k]                 block size
#   IODEPTH [128]           queue depth for PATTERNS
#   PATTERNS ["randread randwrite"]  fio rw= values run at IODEPTH
#   QD1_PATTERNS [randread] fio rw= values also run at iodepth=1 (latency); "" = none
#   JOBS [1]                fio numjobs
#   TESSERA [target/release/tessera]  binary (built if the default is missing)
#   TESSERA_PORT [10809] NBDKIT_PORT [10810] QEMU_PORT [10811]
#   TESSERA_DATA_PARENT [$TMPDIR or /tmp]  where the fresh data dir is made
#   SKIP_TESSERA / SKIP_NBDKIT / SKIP_QEMU = 1 to leave a server out
#   START_TIMEOUT [60]      seconds to wait for a server to serve
#   FIO_SLACK [60]          extra seconds a fio run may take past RUNTIME
#                           before it is killed
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

RUNTIME="${RUNTIME:-10}"
SIZE="${SIZE:-1G}"
BS="${BS:-4k}"
IODEPTH="${IODEPTH:-128}"
PATTERNS="${PATTERNS:-randread randwrite}"
QD1_PATTERNS="${QD1_PATTERNS-randread}"
JOBS="${JOBS:-1}"
TESSERA="${TESSERA:-target/release/tessera}"
TESSERA_PORT="${TESSERA_PORT:-10809}"
NBDKIT_PORT="${NBDKIT_PORT:-10810}"
QEMU_PORT="${QEMU_PORT:-10811}"
TESSERA_DATA_PARENT="${TESSERA_DATA_PARENT:-${TMPDIR:-/tmp}}"
SKIP_TESSERA="${SKIP_TESSERA:-0}"
SKIP_NBDKIT="${SKIP_NBDKIT:-0}"
SKIP_QEMU="${SKIP_QEMU:-0}"
START_TIMEOUT="${START_TIMEOUT:-60}"
FIO_SLACK="${FIO_SLACK:-60}"

log() { printf '[nbd-peers] %s\n' "$*" >&2; }
die() { printf '[nbd-peers] ERROR: %s\n' "$*" >&2; exit 1; }

for c in fio python3 timeout; do
  command -v "$c" >/dev/null 2>&1 || die "$c not found (run scripts/install-deps.sh)"
done
fio --enghelp=nbd >/dev/null 2>&1 || die "this fio has no nbd ioengine"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/tessera-nbd-peers.XXXXXX")"
RESULTS="$WORK/results.tsv"      # server  pattern  qd  iops  mean_lat_us
COMMANDS="$WORK/commands.txt"
: >"$RESULTS"
: >"$COMMANDS"

# Everything we create or start, for the EXIT trap.
SERVER_PIDS=()
TEMP_PATHS=("$WORK")
CHILD_PID=""   # the bounded foreground command (timeout + fio) running now

cleanup() {
  local rc=$? pid p
  trap - EXIT INT TERM
  if [[ -n "$CHILD_PID" ]]; then
    stop_pid "$CHILD_PID"   # timeout(1) passes the signal on to fio
  fi
  for pid in "${SERVER_PIDS[@]}"; do
    stop_pid "$pid"
  done
  for p in "${TEMP_PATHS[@]}"; do
    if [[ -n "$p" ]]; then rm -rf -- "$p"; fi
  done
  exit "$rc"
}

# Stop one server we started and forget its PID (so the EXIT trap never
# signals a PID that may since have been reused).
stop_server() {
  local pid="$1" p keep=()
  stop_pid "$pid"
  for p in "${SERVER_PIDS[@]}"; do
    if [[ "$p" != "$pid" ]]; then keep+=("$p"); fi
  done
  SERVER_PIDS=("${keep[@]}")
}

stop_pid() {
  local pid="$1" i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    log "pid $pid ignored SIGTERM; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# bounded SECONDS CMD...: run CMD with a hard time limit. It runs in the
# background and we `wait` for it, so a signal to this script runs the
# cleanup trap at once instead of after CMD ends.
bounded() {
  local limit="$1" rc=0
  shift
  timeout -k 10 "$limit" "$@" &
  CHILD_PID=$!
  wait "$CHILD_PID" || rc=$?
  CHILD_PID=""
  return "$rc"
}

record_cmd() {
  # Log a command exactly as run (shell-quoted).
  local line
  printf -v line '%q ' "$@"
  printf '%s\n' "${line% }" >>"$COMMANDS"
}

port_in_use() {
  # true if something accepts connections on 127.0.0.1:$1
  timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}

nbd_ready() {
  # true once an NBD handshake for this URI succeeds
  if command -v nbdinfo >/dev/null 2>&1; then
    timeout 5 nbdinfo --size "$1" >/dev/null 2>&1
  else
    local hostport="${1#nbd://}"
    hostport="${hostport%%/*}"
    port_in_use "${hostport##*:}"
  fi
}

# wait_ready PID URI LOG [READY_REGEX]: 0 once serving, 1 if the server died
# or START_TIMEOUT passed.
wait_ready() {
  local pid="$1" uri="$2" logf="$3" regex="${4:-}" deadline=$((SECONDS + START_TIMEOUT))
  while ((SECONDS < deadline)); do
    if ! kill -0 "$pid" 2>/dev/null; then
      return 1
    fi
    if [[ -n "$regex" ]] && grep -Eq "$regex" "$logf" 2>/dev/null; then
      # The ready line is printed once serving; confirm with a handshake.
      nbd_ready "$uri" && return 0
    elif nbd_ready "$uri"; then
      return 0
    fi
    sleep 0.2
  done
  return 1
}

# Start "$@" in the background with output to LOG; sets STARTED_PID.
start_bg() {
  local logf="$1"
  shift
  record_cmd "$@"
  "$@" </dev/null >"$logf" 2>&1 &
  STARTED_PID=$!
  SERVER_PIDS+=("$STARTED_PID")
}

# fio_json_summary FILE -> "iops mean_lat_us" (summed over read/write/trim,
# latency weighted by I/O count; lat_ns = submission to completion).
fio_json_summary() {
  python3 - "$1" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
start = text.find("{")
if start < 0:
    sys.exit("no JSON in fio output")
data = json.loads(text[start:])
iops = 0.0
lat_weighted = 0.0
ios = 0
for job in data["jobs"]:
    if job.get("error"):
        sys.exit("fio job error %s" % job["error"])
    for d in ("read", "write", "trim"):
        s = job.get(d) or {}
        n = s.get("total_ios", 0)
        if not n:
            continue
        iops += s.get("iops", 0.0)
        lat = s.get("lat_ns") or s.get("clat_ns") or {}
        lat_weighted += lat.get("mean", 0.0) * n
        ios += n
if ios == 0:
    sys.exit("fio did no I/O")
print("%.0f %.1f" % (iops, lat_weighted / ios / 1000.0))
PY
}

# run_fio SERVER URI PATTERN QD
run_fio() {
  local server="$1" uri="$2" rw="$3" qd="$4"
  local out="$WORK/fio-$server-$rw-qd$qd.json" summary
  local cmd=(fio --name=t --ioengine=nbd "--uri=$uri" "--rw=$rw" "--bs=$BS"
    "--iodepth=$qd" "--numjobs=$JOBS" "--size=$SIZE" --time_based
    "--runtime=$RUNTIME" --group_reporting --output-format=json "--output=$out")
  record_cmd "${cmd[@]}"
  log "$server: $rw qd=$qd (${RUNTIME}s)"
  if ! bounded "$((RUNTIME + FIO_SLACK))" "${cmd[@]}" \
      </dev/null >"$out.stdout" 2>"$out.stderr"; then
    log "$server: fio $rw qd=$qd FAILED:"
    sed 's/^/    /' "$out.stderr" "$out.stdout" >&2 || true
    printf '%s\t%s\t%s\t-\t-\n' "$server" "$rw" "$qd" >>"$RESULTS"
    FAILURES=$((FAILURES + 1))
    return 0
  fi
  if ! summary="$(fio_json_summary "$out" 2>"$out.parse")"; then
    log "$server: could not parse fio output: $(cat "$out.parse")"
    printf '%s\t%s\t%s\t-\t-\n' "$server" "$rw" "$qd" >>"$RESULTS"
    FAILURES=$((FAILURES + 1))
    return 0
  fi
  read -r iops lat <<<"$summary"
  log "$server: $rw qd=$qd -> $iops IOPS, mean ${lat} us"
  printf '%s\t%s\t%s\t%s\t%s\n' "$server" "$rw" "$qd" "$iops" "$lat" >>"$RESULTS"
}

# prefill SERVER URI: sequential 1M writes over SIZE so reads hit real data.
prefill() {
  local server="$1" uri="$2"
  local cmd=(fio --name=prefill --ioengine=nbd "--uri=$uri" --rw=write --bs=1M
    --iodepth=16 --numjobs=1 "--size=$SIZE")
  record_cmd "${cmd[@]}"
  log "$server: prefilling $SIZE"
  if ! bounded "$((RUNTIME + 300))" "${cmd[@]}" </dev/null \
      >"$WORK/prefill-$server.log" 2>&1; then
    log "$server: prefill FAILED:"
    sed 's/^/    /' "$WORK/prefill-$server.log" >&2 || true
    return 1
  fi
}

FAILURES=0

mark_failed() {
  # A server could not be benchmarked: count it, record "-" for its runs.
  FAILURES=$((FAILURES + 1))
  mark_skipped "$1"
}

mark_skipped() {
  # Record "-" for every run of a server left out.
  local server="$1" rw
  for rw in $PATTERNS; do printf '%s\t%s\t%s\t-\t-\n' "$server" "$rw" "$IODEPTH" >>"$RESULTS"; done
  for rw in $QD1_PATTERNS; do printf '%s\t%s\t1\t-\t-\n' "$server" "$rw" >>"$RESULTS"; done
}

# bench_server SERVER URI PID: prefill, all runs, stop the server.
bench_server() {
  local server="$1" uri="$2" pid="$3" rw
  if prefill "$server" "$uri"; then
    for rw in $PATTERNS; do run_fio "$server" "$uri" "$rw" "$IODEPTH"; done
    for rw in $QD1_PATTERNS; do run_fio "$server" "$uri" "$rw" 1; done
  else
    mark_failed "$server"
  fi
  stop_server "$pid"
}

check_port_free() {
  if port_in_use "$2"; then
    log "$1: port $2 is already in use by another process; skipping $1"
    mark_failed "$1"
    return 1
  fi
}

# ---------------------------------------------------------------- tessera --
bench_tessera() {
  local uri="nbd://127.0.0.1:$TESSERA_PORT/vol0" logf="$WORK/tessera.log" data
  if [[ ! -x "$TESSERA" ]]; then
    if [[ "$TESSERA" == "target/release/tessera" ]]; then
      log "building $TESSERA"
      record_cmd cargo build --release -p tessera-cli
      cargo build --release -p tessera-cli >&2 || { log "tessera build failed"; mark_failed tessera; return 0; }
    else
      log "TESSERA=$TESSERA is not executable"
      mark_failed tessera
      return 0
    fi
  fi
  check_port_free tessera "$TESSERA_PORT" || return 0
  data="$(mktemp -d "$TESSERA_DATA_PARENT/tessera-bench-data.XXXXXX")"
  TEMP_PATHS+=("$data")
  start_bg "$logf" "$TESSERA" up --data-dir "$data" --nbd "127.0.0.1:$TESSERA_PORT"
  local pid=$STARTED_PID
  if ! wait_ready "$pid" "$uri" "$logf" '^tessera: ready '; then
    if kill -0 "$pid" 2>/dev/null; then
      log "tessera did not become ready within ${START_TIMEOUT}s; its output:"
    else
      log "tessera exited before becoming ready; its output:"
    fi
    sed 's/^/    /' "$logf" >&2 || true
    stop_server "$pid"
    mark_failed tessera
    return 0
  fi
  log "tessera ready: $uri (data dir $data)"
  bench_server tessera "$uri" "$pid"
}

# ----------------------------------------------------------------- nbdkit --
bench_nbdkit() {
  local uri="nbd://127.0.0.1:$NBDKIT_PORT/" logf="$WORK/nbdkit.log"
  command -v nbdkit >/dev/null 2>&1 || { log "nbdkit not found"; mark_failed nbdkit; return 0; }
  check_port_free nbdkit "$NBDKIT_PORT" || return 0
  start_bg "$logf" nbdkit -f -i 127.0.0.1 -p "$NBDKIT_PORT" -t 4 memory 4G
  local pid=$STARTED_PID
  if ! wait_ready "$pid" "$uri" "$logf"; then
    log "nbdkit did not become ready; its output:"
    sed 's/^/    /' "$logf" >&2 || true
    stop_server "$pid"
    mark_failed nbdkit
    return 0
  fi
  log "nbdkit ready: $uri"
  bench_server nbdkit "$uri" "$pid"
}

# --------------------------------------------------------------- qemu-nbd --
bench_qemu() {
  local uri="nbd://127.0.0.1:$QEMU_PORT/" logf="$WORK/qemu-nbd.log" img mode cache aio pid=""
  command -v qemu-nbd >/dev/null 2>&1 || { log "qemu-nbd not found"; mark_failed qemu-nbd; return 0; }
  check_port_free qemu-nbd "$QEMU_PORT" || return 0
  img="$(mktemp /dev/shm/tessera-bench-q.XXXXXX.img)"
  TEMP_PATHS+=("$img")
  record_cmd truncate -s 4G "$img"
  truncate -s 4G "$img"
  # Preferred: O_DIRECT + io_uring; fall back if this kernel/build refuses.
  for mode in none:io_uring none:threads writeback:threads; do
    cache="${mode%%:*}"
    aio="${mode##*:}"
    start_bg "$logf" qemu-nbd -f raw -t -b 127.0.0.1 -p "$QEMU_PORT" -e 8 \
      "--cache=$cache" "--aio=$aio" "$img"
    pid=$STARTED_PID
    if wait_ready "$pid" "$uri" "$logf"; then
      break
    fi
    log "qemu-nbd --cache=$cache --aio=$aio failed to start: $(tr '\n' ' ' <"$logf")"
    stop_server "$pid"
    pid=""
  done
  if [[ -z "$pid" ]]; then
    mark_failed qemu-nbd
    return 0
  fi
  log "qemu-nbd ready: $uri (--cache=$cache --aio=$aio)"
  bench_server qemu-nbd "$uri" "$pid"
  rm -f -- "$img"
}

# ------------------------------------------------------------------- main --
log "runtime=${RUNTIME}s size=$SIZE bs=$BS iodepth=$IODEPTH jobs=$JOBS patterns='$PATTERNS' qd1='$QD1_PATTERNS'"
if [[ "$SKIP_TESSERA" == 1 ]]; then
  log "SKIP_TESSERA=1: skipping tessera"
  mark_skipped tessera
else
  bench_tessera
fi
if [[ "$SKIP_NBDKIT" == 1 ]]; then
  log "SKIP_NBDKIT=1: skipping nbdkit"
  mark_skipped nbdkit
else
  bench_nbdkit
fi
if [[ "$SKIP_QEMU" == 1 ]]; then
  log "SKIP_QEMU=1: skipping qemu-nbd"
  mark_skipped qemu-nbd
else
  bench_qemu
fi

# ----------------------------------------------------------------- report --
echo
echo "== NBD peers: fio ioengine=nbd, bs=$BS, numjobs=$JOBS, size=$SIZE, runtime=${RUNTIME}s, $(nproc) CPUs, kernel $(uname -r)"
echo "   fio $(fio --version 2>/dev/null)," \
  "nbdkit $(nbdkit --version 2>/dev/null | awk '{print $2}')," \
  "qemu-nbd $(qemu-nbd --version 2>/dev/null | awk 'NR==1{print $2}')," \
  "tessera $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
python3 - "$RESULTS" "$PATTERNS" "$IODEPTH" "$QD1_PATTERNS" <<'PY'
import sys
path, patterns, iodepth, qd1 = sys.argv[1:5]
res = {}
for line in open(path):
    server, rw, qd, iops, lat = line.rstrip("\n").split("\t")
    res[(server, rw, qd)] = (None if iops == "-" else float(iops),
                             None if lat == "-" else float(lat))
rows = [(rw, iodepth) for rw in patterns.split()] + [(rw, "1") for rw in qd1.split()]
servers = ["tessera", "nbdkit", "qemu-nbd"]

def get(s, rw, qd, i):
    v = res.get((s, rw, qd))
    return None if v is None else v[i]

def num(v, fmt):
    return "-" if v is None else fmt % v

def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else "%.2fx" % (a / b)

print()
print("IOPS (higher is better); ratio = tessera / peer")
hdr = ("pattern", "qd", "tessera", "nbdkit", "qemu-nbd", "tess/nbdkit", "tess/qemu")
fmt = "%-10s %4s %11s %11s %11s %12s %11s"
print(fmt % hdr)
for rw, qd in rows:
    t, n, q = (get(s, rw, qd, 0) for s in servers)
    print(fmt % (rw, qd, num(t, "%.0f"), num(n, "%.0f"), num(q, "%.0f"),
                 ratio(t, n), ratio(t, q)))

print()
print("Mean latency, us (lower is better; fio lat_ns mean); ratio = tessera / peer")
print(fmt % hdr)
for rw, qd in rows:
    t, n, q = (get(s, rw, qd, 1) for s in servers)
    print(fmt % (rw, qd, num(t, "%.1f"), num(n, "%.1f"), num(q, "%.1f"),
                 ratio(t, n), ratio(t, q)))
PY
echo
echo "== Commands used"
sed 's/^/  /' "$COMMANDS"
if ((FAILURES > 0)); then
  echo
  echo "== $FAILURES failure(s); see the log lines above" >&2
  exit 1
fi
