#!/usr/bin/env bash
# Noisy neighbour on one reactor core: volume A runs 4 KiB random writes at QD128 with no
# limit, volume B runs 4 KiB random reads at QD1. B's p99 latency is measured alone, next
# to A with no QoS, with B given a higher share weight, and with A given an IOPS limit.
# The node has one reactor core, so both volumes are served by the same core.
#
#   bench/noisy-neighbour.sh          # RUNTIME=10 A_LIMIT=50000 [B_CPU=0]
#
# The node is started here, both volumes prefilled, and the node killed by PID.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUNTIME="${RUNTIME:-10}"; A_LIMIT="${A_LIMIT:-50000}"
TESSERA="${TESSERA:-target/release/tessera}"
[[ -x "$TESSERA" ]] || cargo build --release -p tessera-cli >&2

WORK="$(mktemp -d /tmp/tessera-noisy.XXXXXX)"
PID=""
cleanup() { [[ -n "$PID" ]] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; rm -rf -- "$WORK"; }
trap cleanup EXIT
PORT=10909
cat >"$WORK/node.toml" <<TOML
data_dir = "$WORK/data"
cores = 1
[nbd]
listen = ["127.0.0.1:$PORT"]
[[pool]]
name = "p"
devices = ["ram:2G"]
[[volume]]
name = "a"
pool = "p"
size = "512M"
[[volume]]
name = "b"
pool = "p"
size = "512M"
[[export]]
name = "a"
volume = "a"
[[export]]
name = "b"
volume = "b"
TOML
"$TESSERA" node --config "$WORK/node.toml" >"$WORK/node.log" 2>&1 & PID=$!
for _ in $(seq 1 100); do [[ -S "$WORK/data/api.sock" ]] && break; sleep 0.1; done
cli() { "$TESSERA" --api "$WORK/data/api.sock" "$@" >/dev/null; }
# B's client runs SCHED_FIFO (when allowed): on a 2-CPU machine both clients share the CPU
# the reactor does not use, and B's latency would otherwise measure the kernel making B's
# client wait behind A's busy client, not the server. On separate hosts that wait does
# not exist. Set B_RT=0 to measure without it.
B_RT="${B_RT:-1}"
RT=()
if [[ $B_RT == 1 ]] && chrt -f 10 true 2>/dev/null; then RT=(chrt -f 10); fi
# Clients stay off the reactor's CPU (0): a client scheduled there time-shares the core
# with the reactor and every request waits for a scheduler slice.
PIN=()
if (( $(nproc) > 1 )); then PIN=(taskset -c "1-$(( $(nproc) - 1 ))"); fi
# B_CPU=0 puts B's client on the reactor's CPU instead (SCHED_FIFO, it preempts the
# reactor when its reply arrives): the setup where B's client does not share a CPU with
# A's load generator on a 2-CPU machine.
PIN_B=("${PIN[@]}")
if [[ -n ${B_CPU:-} ]]; then PIN_B=(taskset -c "$B_CPU"); fi
perf_b() { "${PIN_B[@]}" "${RT[@]}" "$TESSERA" nbd-perf --uri "nbd://127.0.0.1:$PORT/b" --pattern randread --qd 1 --size 256M --time "$1" 2>/dev/null | grep '^RESULT'; }
perf() { "${PIN[@]}" "$TESSERA" nbd-perf --uri "nbd://127.0.0.1:$PORT/$1" --pattern "$2" --qd "$3" --size 256M --time "$4" 2>/dev/null | grep '^RESULT'; }
field() { sed -E "s/.* $1=([0-9.]+).*/\1/" <<<"$2"; }
# Prefill: reads of written data, writes that overwrite (no allocation on the way).
"$TESSERA" nbd-perf --uri "nbd://127.0.0.1:$PORT/a" --pattern randwrite --bs 1M --qd 16 --size 256M --time 2 >/dev/null 2>&1
"$TESSERA" nbd-perf --uri "nbd://127.0.0.1:$PORT/b" --pattern randwrite --bs 1M --qd 16 --size 256M --time 2 >/dev/null 2>&1

declare -A P99 IOPS AIOPS SP99
# Server-side p99 of B from the node's own stats over 4 s in the middle of a run: from
# the batch that received a request to the batch that flushed its reply.
server_p99() {
  sleep 2
  "$TESSERA" --api "$WORK/data/api.sock" --json volume stats b --interval 4 \
    | sed -nE 's/.*"p99": *([0-9.]+).*/\1/p' | head -1
}
run_case() { # NAME [with A]
  local name=$1 a_line="" b_line
  server_p99 >"$WORK/sp99" & local spid=$!
  if [[ ${2:-} == with-a ]]; then
    perf a randwrite 128 "$((RUNTIME + 1))" >"$WORK/a.out" & local apid=$!
    sleep 0.5
    b_line=$(perf_b "$RUNTIME")
    wait "$apid"; a_line=$(cat "$WORK/a.out")
    AIOPS[$name]=$(field iops "$a_line")
  else
    AIOPS[$name]="-"
    b_line=$(perf_b "$RUNTIME")
  fi
  wait "$spid"; SP99[$name]=$(cat "$WORK/sp99")
  P99[$name]=$(field p99_us "$b_line"); IOPS[$name]=$(field iops "$b_line")
  echo "[noisy] $name: B $b_line${a_line:+ | A $a_line}" >&2
}

run_case "B alone"
run_case "A unlimited, default shares" with-a
cli volume qos b --weight 1000; cli volume qos a --weight 100
run_case "B weight 1000, A 100" with-a
cli volume qos b --clear; cli volume qos a --iops "$A_LIMIT"
run_case "A limited to $A_LIMIT IOPS" with-a

echo
echo "== Noisy neighbour on one core: B = 4K randread QD1, A = 4K randwrite QD128; ${RUNTIME}s each; $(nproc) CPUs; A's client: ${PIN[*]:-unpinned}, B's: ${PIN_B[*]:-unpinned} ${RT[*]:-normal priority}"
printf "%-28s %11s %9s %17s %9s %9s\n" case "B p99 (us)" "vs alone" "server p99 (us)" "B IOPS" "A IOPS"
for c in "B alone" "A unlimited, default shares" "B weight 1000, A 100" "A limited to $A_LIMIT IOPS"; do
  printf "%-28s %11s %8.2fx %17s %9s %9s\n" "$c" "${P99[$c]}" \
    "$(awk -v a="${P99[$c]}" -v b="${P99[B alone]}" 'BEGIN{print a/b}')" "${SP99[$c]}" \
    "${IOPS[$c]}" "${AIOPS[$c]}"
done
