#!/usr/bin/env bash
# Core scaling of Tessera's engine (in-process `tessera bench`) and of its NVMe/TCP
# target: IOPS and CPU per I/O at 1, 2, 4, ... cores up to all but one, for null and RAM
# devices, raid0 / raid5 / raid6 / ec 4+2, reads and writes, with the efficiency against
# linear scaling and the machine's memory-copy ceiling for RAM devices.
#
#   bench/scaling.sh                       # every row, 3 s per point
#   TIME=1 ROWS='raid5' bench/scaling.sh   # only rows whose label matches the regex
#
# Environment (defaults in brackets):
#   TIME [3]        seconds per point
#   QD [128]        queue depth per core (the engine rows)
#   CORES [1 2 4 ... nproc-1]   core counts, ascending, the first one 1 (the baseline)
#   ROWS [.]        extended regex on the row labels (e.g. 'null.*raid5|ram1')
#   SKIP_NVMF [0]   1 leaves the NVMe/TCP rows out
#   TESSERA [target/release/tessera]   binary (built if the default is missing)
#
# Output: one table per row group; every point is also printed as it finishes on stderr.
# "vs linear" is IOPS at the last core count over (that count x IOPS at 1 core); "cpu"
# is CPU nanoseconds per I/O at the last count over the same at 1 core (1.00x: adding
# cores costs nothing per I/O). docs/benchmarks.md keeps the recorded runs.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

TIME="${TIME:-3}"
QD="${QD:-128}"
ROWS="${ROWS:-.}"
SKIP_NVMF="${SKIP_NVMF:-0}"
TESSERA="${TESSERA:-target/release/tessera}"
NPROC="$(nproc)"

log() { printf '[scaling] %s\n' "$*" >&2; }
die() { printf '[scaling] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ -z "${CORES:-}" ]]; then
  top=$((NPROC > 1 ? NPROC - 1 : 1))
  CORES=""
  for ((c = 1; c < top; c *= 2)); do CORES+="$c "; done
  CORES+="$top"
fi
read -r -a CORE_LIST <<<"$CORES"
[[ "${CORE_LIST[0]}" == 1 ]] || die "CORES must start at 1 (the baseline): $CORES"

if [[ ! -x "$TESSERA" ]]; then
  if [[ "$TESSERA" == "target/release/tessera" ]]; then
    log "building $TESSERA"
    cargo build --release -p tessera-cli >&2 || die "cargo build failed"
  else
    die "TESSERA=$TESSERA is not executable"
  fi
fi
TESSERA="$(readlink -f "$TESSERA")"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/tessera-scaling.XXXXXX")"
NODE_PID=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n "$NODE_PID" ]] && kill -0 "$NODE_PID" 2>/dev/null; then
    kill -TERM "$NODE_PID" 2>/dev/null || true
    wait "$NODE_PID" 2>/dev/null || true
  fi
  rm -rf -- "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

command -v cc >/dev/null || die "a C compiler (cc) is needed for the memory-copy ceiling"
cc -O2 -pthread -o "$WORK/memcpy-ceiling" bench/memcpy-ceiling.c || die "cc failed"

# field NAME LINE: the value of NAME=... in a RESULT line.
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<" $2"; }

# point ARGS...: one engine run; prints "iops cpu_ns p50 p999" (or "- - - -"). A parity
# pool's PARITY line (what its row writes waited for) is kept in $WORK/parity, labelled
# with $POINT_LABEL.
point() {
  local out line
  out="$(timeout $((TIME + 120)) "$TESSERA" bench "$@" --qd "$QD" --time "$TIME" 2>"$WORK/err" || true)"
  line="$(grep '^RESULT' <<<"$out" | head -1 || true)"
  grep '^PARITY' <<<"$out" | head -1 | sed "s/^PARITY/${POINT_LABEL:-?}/" >>"$WORK/parity" || true
  if [[ -z "$line" || "$(field errors "$line")" != 0 ]]; then
    log "FAILED: tessera bench $* ($(tail -1 "$WORK/err" 2>/dev/null))"
    echo "- - - -"
    return
  fi
  echo "$(field iops "$line") $(field cpu_ns_per_io "$line") $(field p50_us "$line") $(field p999_us "$line")"
}

devs() { # devs KIND COUNT SIZE: --device KIND:SIZE repeated
  local i out=()
  for ((i = 0; i < $2; i++)); do out+=(--device "$1:$3"); done
  echo "${out[@]}"
}

# The engine rows: label, then `tessera bench` arguments (without cores, qd, time).
ROW_LABELS=()
ROW_ARGS=()
row() { ROW_LABELS+=("$1"); shift; ROW_ARGS+=("$*"); }
for kind in null ram; do
  for pattern in randwrite randread; do
    row "${kind}1_device_$pattern" --device "$kind:1G" --pattern "$pattern"
    row "${kind}_raid0x8_volume_$pattern" $(devs "$kind" 8 256M) --target volume --layout raid0 --pattern "$pattern"
    row "${kind}_raid5x6_pool_$pattern" $(devs "$kind" 6 256M) --target pool --layout raid5 --pattern "$pattern"
    row "${kind}_raid6x6_pool_$pattern" $(devs "$kind" 6 256M) --target pool --layout raid6 --pattern "$pattern"
    row "${kind}_ec4+2x6_pool_$pattern" $(devs "$kind" 6 256M) --target pool --layout ec:4+2 --pattern "$pattern"
  done
done

echo "# Tessera core scaling: $(date -u +%FT%TZ)"
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') ($NPROC CPUs); flags: $(grep -m1 -o -w -E 'avx512f|gfni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "# kernel $(uname -r); binary $TESSERA; TIME=$TIME QD=$QD CORES='$CORES'"
echo "# engine: $TESSERA bench <row args> --cores N --qd $QD --time $TIME"
echo

header() {
  printf '| %s |' "$1"
  for c in "${CORE_LIST[@]}"; do printf ' %s |' "$c"; done
  printf ' %s |\n|---|' "$2"
  for _ in "${CORE_LIST[@]}"; do printf -- '---|'; done
  printf -- '---|\n'
}

# kilo/mega formatting of an IOPS figure.
human() { awk -v v="$1" 'BEGIN { if (v == "-") print "-"; else if (v >= 1e6) printf "%.2f M", v/1e6; else printf "%.0f K", v/1e3 }'; }

echo "## Engine: IOPS by cores (efficiency at the last count: IOPS / (cores x 1-core IOPS); CPU per I/O against 1 core; p99.9 / p50 at the last count)"
echo
header "row" "vs linear; cpu/io; p99.9/p50"
for i in "${!ROW_LABELS[@]}"; do
  label="${ROW_LABELS[$i]}"
  [[ "$label" =~ $ROWS ]] || continue
  read -r -a args <<<"${ROW_ARGS[$i]}"
  cells=()
  first_iops="" first_cpu="" last=""
  for c in "${CORE_LIST[@]}"; do
    read -r iops cpu p50 p999 <<<"$(POINT_LABEL="$label cores=$c" point "${args[@]}" --cores "$c")"
    log "$label cores=$c iops=$iops cpu_ns=$cpu p50_us=$p50 p999_us=$p999"
    cells+=("$(human "$iops")")
    [[ -z "$first_iops" ]] && { first_iops="$iops"; first_cpu="$cpu"; }
    last="$c $iops $cpu $p50 $p999"
  done
  read -r lc li lcpu lp50 lp999 <<<"$last"
  summary="$(awk -v c="$lc" -v i="$li" -v ci="$lcpu" -v i1="$first_iops" -v c1="$first_cpu" -v p50="$lp50" -v p999="$lp999" 'BEGIN {
    if (i == "-" || i1 == "-" || i1 == 0) { print "-"; exit }
    printf "%.0f%%; %.2fx (%.0f -> %.0f ns); %.1fx", 100 * i / (c * i1), ci / c1, c1, ci, (p50 > 0 ? p999 / p50 : 0) }')"
  printf '| %s |' "$label"
  for cell in "${cells[@]}"; do printf ' %s |' "$cell"; done
  printf ' %s |\n' "$summary"
done
echo

if [[ -s "$WORK/parity" ]]; then
  echo "## Parity rows: per row write, reactor rounds waited for a row lock, for journal space, and slice locks found held by another core"
  echo
  printf '| row | cores | lock waits | journal waits | slice lock contended |\n|---|---|---|---|---|\n'
  while read -r label cores rest; do
    printf '| %s | %s | %s | %s | %s |\n' "$label" "${cores#cores=}" \
      "$(field lock_waits_per_write "$rest")" "$(field journal_waits_per_write "$rest")" \
      "$(field ring_contended_per_write "$rest")"
  done <"$WORK/parity"
  echo
fi

echo "## Memory-copy ceiling: 4 KiB random copies into (write) or out of (read) a 1 GiB region, per second"
echo "## (bench/memcpy-ceiling.c; what RAM-device I/O cannot exceed, one copy per device I/O)"
echo
header "copies" "vs linear"
for dir in write read; do
  cells=() first="" lastc="" lastv=""
  for c in "${CORE_LIST[@]}"; do
    v="$(field copies_per_s "$("$WORK/memcpy-ceiling" "$c" "$dir" "$TIME")")"
    log "memcpy $dir threads=$c copies_per_s=$v"
    cells+=("$(human "$v")")
    [[ -z "$first" ]] && first="$v"
    lastc="$c" lastv="$v"
  done
  printf '| memcpy_4k_%s |' "$dir"
  for cell in "${cells[@]}"; do printf ' %s |' "$cell"; done
  awk -v c="$lastc" -v v="$lastv" -v f="$first" 'BEGIN { printf " %.0f%% |\n", 100 * v / (c * f) }'
done
echo

if [[ "$SKIP_NVMF" == 1 ]] || ! [[ "nvmf" =~ $ROWS || "$ROWS" == . ]]; then
  exit 0
fi

# NVMe/TCP: the node on the first half of the CPUs with N reactor cores, the initiator
# (`tessera nvmf perf`, one queue per initiator CPU) on the other half, so that they do
# not take each other's CPUs.
half=$((NPROC / 2 > 0 ? NPROC / 2 : 1))
node_cpus="0-$((half - 1))"
init_cpus="$half-$((NPROC - 1))"
[[ "$NPROC" -lt 2 ]] && init_cpus="0"
queues=$((NPROC - half > 0 ? NPROC - half : 1))
port=$((24420 + RANDOM % 1000))
nqn="nqn.2026-11.io.tessera:scaling"
echo "## NVMe/TCP: node on CPUs $node_cpus with N reactor cores, 'tessera nvmf perf' on CPUs $init_cpus ($queues queue(s) x QD 64), RAM pool"
echo
printf '| pattern | node cores | IOPS | p50 us | p99.9 us |\n|---|---|---|---|---|\n'
for c in "${CORE_LIST[@]}"; do
  ((c <= half)) || continue
  d="$WORK/node-$c"
  mkdir -p "$d"
  taskset -c "$node_cpus" "$TESSERA" up --data-dir "$d/data" --cores "$c" --nbd "127.0.0.1:$((port + 1))" \
    --nvmf "127.0.0.1:$port" --nvmf-discovery "" >"$d/node.log" 2>&1 &
  NODE_PID=$!
  for _ in $(seq 400); do grep -q "tessera: ready" "$d/node.log" && break; sleep 0.05; done
  api=(--api "$d/data/api.sock")
  if ! { "$TESSERA" "${api[@]}" pool create ram0 ram:2G &&
    "$TESSERA" "${api[@]}" volume create bench --pool ram0 --size 1G &&
    "$TESSERA" "${api[@]}" nvmf subsystem add "$nqn" --volume bench --allow-any-host; } >"$d/setup.log" 2>&1; then
    log "node setup failed at $c cores: $(tail -2 "$d/setup.log") $(tail -2 "$d/node.log")"
  else
    perf() {
      timeout $((TIME + 60)) taskset -c "$init_cpus" "$TESSERA" nvmf perf --addr "127.0.0.1:$port" \
        --nqn "$nqn" --queues "$queues" --qd 64 --time "$TIME" "$@" 2>/dev/null | grep '^RESULT' | head -1 || true
    }
    perf --pattern randwrite --bs 1M --qd 8 >/dev/null # write every block once: reads hit data
    for pattern in randread randwrite; do
      line="$(perf --pattern "$pattern")"
      log "nvmf $pattern node_cores=$c $line"
      printf '| %s | %s | %s | %s | %s |\n' "$pattern" "$c" "$(human "$(field iops "$line")")" \
        "$(field p50_us "$line")" "$(field p999_us "$line")"
    done
  fi
  kill -TERM "$NODE_PID" 2>/dev/null || true
  wait "$NODE_PID" 2>/dev/null || true
  NODE_PID=""
done
