#!/usr/bin/env bash
# What exclusive ownership costs at start, and how fast a second node is refused
# (docs/architecture.md "Exclusive ownership"). For each binary, ROUNDS times, alternating:
#   ready_ms   `tessera up` on a fresh data directory until it prints "tessera: ready"
#   second_ms  a second `tessera up` on that same directory, until it exits
#   exit       the second one's exit code, and the first words of its error
#
#   BEFORE=/path/to/old/tessera bench/ownership.sh
# Environment: BEFORE (required), AFTER [target/release/tessera], ROUNDS [5].
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BEFORE="${BEFORE:?set BEFORE to the baseline tessera binary}"
AFTER="${AFTER:-target/release/tessera}"
ROUNDS="${ROUNDS:-5}"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }

one() {
  local side=$1 bin=$2 dir pid t0 ready second code p1 p2
  dir=$(mktemp -d "${TMPDIR:-/tmp}/tessera-own.XXXXXX")
  p1=$(port); p2=$(port)
  t0=$(date +%s%N)
  "$bin" up --data-dir "$dir/data" --nbd "127.0.0.1:$p1" --nvmf "" --cores 1 \
    >"$dir/a.out" 2>"$dir/a.err" &
  pid=$!
  for _ in $(seq 1 1000); do grep -q "tessera: ready" "$dir/a.out" 2>/dev/null && break; sleep 0.005; done
  ready=$(ms "$t0")
  t0=$(date +%s%N)
  code=0
  timeout 10 "$bin" up --data-dir "$dir/data" --nbd "127.0.0.1:$p2" --nvmf "" --cores 1 \
    >/dev/null 2>"$dir/b.err" || code=$?
  second=$(ms "$t0")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$side ready_ms=$ready second_ms=$second exit=$code error: $(grep -o 'error: .\{0,50\}' "$dir/b.err" | head -1)"
  rm -rf "$dir"
}

for ((r = 1; r <= ROUNDS; r++)); do
  if ((r % 2)); then one before "$BEFORE"; one after "$AFTER"
  else one after "$AFTER"; one before "$BEFORE"; fi
done
