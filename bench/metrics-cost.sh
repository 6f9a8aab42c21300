#!/usr/bin/env bash
# What collecting metrics costs the datapath (issue 11 §7): two tessera binaries in
# alternation, BEFORE (without metrics) and AFTER (with its metrics listener on and
# scraped every second while the load runs, as Prometheus would).
#
#   BEFORE=/path/to/old/tessera [AFTER=target/release/tessera] [ROUNDS=3] [SECS=5] \
#     bench/metrics-cost.sh
#
# Per side and round, on a node shaped like bench/nvmf.sh's (RAM pool, 1 GiB thin volume,
# NBD and NVMe/TCP on loopback): NBD 4 KiB randread at QD32 and QD128 (`tessera nbd-perf`),
# NVMe/TCP 4 KiB randread at QD32 and QD128 (`tessera nvmf perf`), then the in-process
# engine on a thin volume (`tessera bench --device ram:1G --target volume`, QD128,
# 1 core). The load generators are BEFORE's binary on both sides, so only the server
# differs. The order flips every round. Prints one line per run (IOPS, and the node's CPU
# time per request over the four network runs) and the per-side means.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BEFORE="${BEFORE:?set BEFORE to the baseline tessera binary}"
AFTER="${AFTER:-target/release/tessera}"
ROUNDS="${ROUNDS:-3}"
SECS="${SECS:-5}"
LOADGEN="${LOADGEN:-$BEFORE}"
for b in "$BEFORE" "$AFTER" "$LOADGEN"; do
  [[ -x "$b" ]] || { echo "metrics-cost: $b is not executable" >&2; exit 1; }
done
command -v curl >/dev/null || { echo "metrics-cost: curl not found" >&2; exit 1; }

DIR=$(mktemp -d /tmp/tessera-metrics-cost.XXXXXX)
NBD=127.0.0.1:21809; NVMF=127.0.0.1:25420; DISC=127.0.0.1:29009; METRICS=127.0.0.1:29464
NQN=nqn.2024-01.io.tessera:bench
NODE=""; SCRAPER=""
stop() {
  [[ -n "$SCRAPER" ]] && { kill "$SCRAPER" 2>/dev/null || true; wait "$SCRAPER" 2>/dev/null || true; }
  [[ -n "$NODE" ]] && { kill "$NODE" 2>/dev/null || true; wait "$NODE" 2>/dev/null || true; }
  NODE=""; SCRAPER=""
}
trap 'stop; rm -rf "$DIR"' EXIT

# run NAME CMD...: one bounded measurement; prints its IOPS.
run() {
  local name=$1; shift
  if ! timeout $((SECS + 60)) "$@" >"$DIR/$name.out" 2>&1 || ! grep -q '^RESULT' "$DIR/$name.out"; then
    { echo "$name failed:"; cat "$DIR/$name.out"; tail -20 "$DIR/node.log"; } >&2
    exit 1
  fi
  grep '^RESULT' "$DIR/$name.out" | sed 's/.*iops=\([0-9]*\).*/\1/'
}

node_cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$NODE/stat"; }

# side BIN LABEL: start a node on BIN, measure, stop it.
side() {
  local bin=$1 label=$2 extra=()
  [[ "$label" == after ]] && extra=(--metrics "$METRICS")
  rm -rf "$DIR/data"
  "$bin" up --data-dir "$DIR/data" --nbd $NBD --nvmf $NVMF --nvmf-discovery $DISC "${extra[@]}" \
    >"$DIR/node.log" 2>&1 &
  NODE=$!
  for _ in $(seq 300); do grep -q "NVMe/TCP: nvme+tcp" "$DIR/node.log" && break; sleep 0.1; done
  grep -q "NVMe/TCP: nvme+tcp" "$DIR/node.log" || { cat "$DIR/node.log" >&2; exit 1; }
  for _ in $(seq 100); do [[ -S "$DIR/data/api.sock" ]] && break; sleep 0.1; done
  [[ -S "$DIR/data/api.sock" ]] || { echo "metrics-cost: no API socket" >&2; cat "$DIR/node.log" >&2; exit 1; }
  local A=(--api "$DIR/data/api.sock")
  "$bin" "${A[@]}" pool create ram0 ram:2G >/dev/null
  "$bin" "${A[@]}" volume create bench --pool ram0 --size 1G >/dev/null
  "$bin" "${A[@]}" export add bench --volume bench >/dev/null
  "$bin" "${A[@]}" nvmf subsystem add $NQN --volume bench --allow-any-host >/dev/null
  if [[ "$label" == after ]]; then
    # Scrape every second for the whole run, as Prometheus would; check it answers.
    curl -sf -o "$DIR/metrics.txt" "http://$METRICS/metrics" \
      && grep -q '^tessera_volume_ops_total' "$DIR/metrics.txt" \
      || { echo "metrics-cost: no metrics from the after node" >&2; exit 1; }
    ( while sleep 1; do curl -sf -o /dev/null "http://$METRICS/metrics" || true; done ) &
    SCRAPER=$!
  fi
  run fill "$LOADGEN" nvmf perf --addr $NVMF --nqn $NQN --pattern randwrite --qd 128 --size 1G --time 3 >/dev/null
  local r=() cpu0 cpu1
  cpu0=$(node_cpu_ticks)
  for qd in 32 128; do
    r+=("$(run nbd-$qd "$LOADGEN" nbd-perf --uri nbd://$NBD/bench --pattern randread --qd $qd --size 1G --time "$SECS")")
  done
  for qd in 32 128; do
    r+=("$(run nvmf-$qd "$LOADGEN" nvmf perf --addr $NVMF --nqn $NQN --pattern randread --qd $qd --size 1G --time "$SECS")")
  done
  cpu1=$(node_cpu_ticks)
  # The node's CPU time (user + system, every thread) per request over the four network
  # runs: less disturbed than IOPS by other load on a shared machine.
  local us_per_io
  us_per_io=$(awk -v t=$((cpu1 - cpu0)) -v hz="$(getconf CLK_TCK)" -v s="$SECS" \
    -v a="${r[0]}" -v b="${r[1]}" -v c="${r[2]}" -v d="${r[3]}" \
    'BEGIN { printf "%.2f", t / hz * 1e6 / ((a + b + c + d) * s) }')
  stop
  r+=("$(run engine "$bin" bench --device ram:1G --target volume --pattern randread --bs 4k --qd 128 --cores 1 --time "$SECS")")
  printf '%-6s %-6s %10s %10s %10s %10s %10s %10s   load %s\n' "$round" "$label" "${r[@]}" "$us_per_io" \
    "$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$DIR/table"
}

printf '%-6s %-6s %10s %10s %10s %10s %10s %10s\n' round side nbd-qd32 nbd-qd128 nvmf-qd32 nvmf-qd128 engine node-us/io
for ((round = 1; round <= ROUNDS; round++)); do
  order=(before after)
  ((round % 2 == 0)) && order=(after before)
  for s in "${order[@]}"; do
    bin=$BEFORE; [[ $s == after ]] && bin=$AFTER
    side "$bin" "$s"
  done
done
echo "means (IOPS; node CPU us per request):"
for s in before after; do
  awk -v s="$s" '$2 == s { for (i = 3; i <= 8; i++) t[i] += $i; n++ }
    END { printf "%-13s", s; for (i = 3; i <= 7; i++) printf " %10.0f", t[i] / n; printf " %10.2f\n", t[8] / n }' "$DIR/table"
done
