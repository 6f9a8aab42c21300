#!/usr/bin/env bash
# Interleaved A/B of two tessera binaries through the same benchmark scripts, so that a
# change is compared with its parent on the same machine in the same minutes (drift on a
# shared VM is larger than most regressions).
#
#   BEFORE=/path/to/old/tessera bench/ab.sh [SCRIPT...]
#
# For each round and each SCRIPT (default: engine nbd-peers nvmf redundancy) it runs the
# script with TESSERA=$BEFORE, then with TESSERA=$AFTER (the order flips every round), and
# keeps every output in $OUT/<script>.<before|after>.<round>.log. Peers inside a script
# (nbdkit, qemu-nbd) run in each half: skip them with SKIP_NBDKIT=1 SKIP_QEMU=1.
#
# Environment (defaults in brackets):
#   BEFORE (required)              the baseline binary
#   AFTER [target/release/tessera] the binary under test
#   ROUNDS [2]                     rounds (each runs both binaries once per script)
#   OUT [a fresh mktemp dir]       where the logs go (printed at the end)
# Each script keeps its own environment knobs (TIME, RUNTIME, ...) and time bounds.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BEFORE="${BEFORE:?set BEFORE to the baseline tessera binary}"
AFTER="${AFTER:-target/release/tessera}"
ROUNDS="${ROUNDS:-2}"
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/tessera-ab.XXXXXX")}"
[[ $# -gt 0 ]] && SCRIPTS=("$@") || SCRIPTS=(engine nbd-peers nvmf redundancy)

for bin in "$BEFORE" "$AFTER"; do
  [[ -x "$bin" ]] || { echo "ab: $bin is not executable" >&2; exit 1; }
done
mkdir -p "$OUT"
echo "ab: before=$BEFORE after=$AFTER rounds=$ROUNDS logs=$OUT" >&2

for ((r = 1; r <= ROUNDS; r++)); do
  for s in "${SCRIPTS[@]}"; do
    order=(before after)
    ((r % 2 == 0)) && order=(after before)
    for side in "${order[@]}"; do
      bin="$BEFORE"
      [[ "$side" == after ]] && bin="$AFTER"
      log="$OUT/$s.$side.$r.log"
      echo "ab: round $r $s $side (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
      TESSERA="$bin" "bench/$s.sh" >"$log" 2>&1 || { echo "ab: $s $side failed, see $log" >&2; exit 1; }
    done
  done
done
echo "$OUT"
