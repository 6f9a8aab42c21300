#!/usr/bin/env bash
# libiscsi's whole conformance suite against Tessera's iSCSI target and tgt, side by side.
#
# Usage: bench/iscsi-conformance.sh [TEST-REGEX]   (default: every test)
#   TESSERA=path   the tessera binary (default target/release/tessera, built if missing)
#   TIMEOUT=secs   the limit for one test (default 60)
#   KEEP=1         keep the per-test logs (the directory is printed)
#
# A Tessera node (`tessera up`, a 64 MiB volume on a RAM pool, one target, LUN 0) and a
# tgtd of our own (control port -C $TGT_CTL, a 64 MiB file LUN in /dev/shm, LUN 1) are
# started on loopback ports. Every test of `iscsi-test-cu --list` then runs in a process
# of its own: libiscsi's CompareAndWrite.InvalidDataOutSize installs a CDB-rewriting hook
# it never removes, which in one process breaks every later READ(16)/WRITE(16) test.
# CUnit counts a test libiscsi skipped ("[SKIPPED]", the target lacks the command) as
# passed; here a skip is reported as a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
FILTER=${1:-.}
T=${TESSERA:-target/release/tessera}
TIMEOUT=${TIMEOUT:-60}
[[ "$T" != target/release/tessera ]] || cargo build -q --release -p tessera-cli --bin tessera
for tool in iscsi-test-cu tgtd tgtadm; do
  command -v $tool >/dev/null || { echo "$tool is missing (scripts/install-deps.sh)" >&2; exit 1; }
done

DIR=$(mktemp -d /tmp/tessera-iscsi-conf.XXXXXX)
LUNFILE=$(mktemp /dev/shm/tessera-iscsi-conf-tgt.XXXXXX)
NODE=; TGTD=
cleanup() {
  [[ -z "$NODE" ]] || { kill "$NODE" 2>/dev/null; wait "$NODE" 2>/dev/null || true; }
  # tgtd ignores SIGTERM while it serves a target: KILL, by its PID.
  [[ -z "$TGTD" ]] || { kill -KILL "$TGTD" 2>/dev/null; wait "$TGTD" 2>/dev/null || true; }
  rm -f "$LUNFILE"
  if [[ -n "${KEEP:-}" ]]; then echo "logs kept in $DIR"; else rm -rf "$DIR"; fi
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# The two initiator names: reservation tests register one and check the other is fenced.
INIT1=iqn.2026-11.io.tessera:conformance-1
INIT2=iqn.2026-11.io.tessera:conformance-2

# Tessera: a node of its own, its data directory in $DIR.
NBD_PORT=$(free_port); ISCSI_PORT=$(free_port)
"$T" up --data-dir "$DIR/data" --nbd 127.0.0.1:$NBD_PORT --iscsi 127.0.0.1:$ISCSI_PORT \
  >"$DIR/node.log" 2>&1 &
NODE=$!
for _ in $(seq 300); do grep -q "iSCSI: " "$DIR/node.log" && [[ -S $DIR/data/api.sock ]] && break; sleep 0.1; done
grep -q "iSCSI: " "$DIR/node.log" || { echo "the node did not start:" >&2; cat "$DIR/node.log" >&2; exit 1; }
A=(--api "$DIR/data/api.sock")
TIQN=iqn.2026-11.io.tessera:conformance
"$T" "${A[@]}" pool create ram0 ram:256M >/dev/null
"$T" "${A[@]}" volume create lun --pool ram0 --size 64M >/dev/null
"$T" "${A[@]}" iscsi target create $TIQN --volume lun >/dev/null
TESSERA_URL=iscsi://127.0.0.1:$ISCSI_PORT/$TIQN/0

# tgt: LUN 0 is tgt's controller, the disk is LUN 1.
TGT_CTL=${TGT_CTL:-$((20 + RANDOM % 80))}
TGT_PORT=$(free_port)
truncate -s 64M "$LUNFILE"
tgtd -f -C "$TGT_CTL" --iscsi portal=127.0.0.1:$TGT_PORT >"$DIR/tgtd.log" 2>&1 &
TGTD=$!
GIQN=iqn.2026-11.io.tessera:conformance-tgt
for _ in $(seq 50); do tgtadm -C "$TGT_CTL" --lld iscsi --op show --mode target >/dev/null 2>&1 && break; sleep 0.1; done
tgtadm -C "$TGT_CTL" --lld iscsi --op new --mode target --tid 1 -T $GIQN
tgtadm -C "$TGT_CTL" --lld iscsi --op new --mode logicalunit --tid 1 --lun 1 -b "$LUNFILE"
tgtadm -C "$TGT_CTL" --lld iscsi --op bind --mode target --tid 1 -I ALL
TGT_URL=iscsi://127.0.0.1:$TGT_PORT/$GIQN/1

mapfile -t TESTS < <(iscsi-test-cu --list | awk -F. 'NF == 3 && $1 == "ALL"' | grep -E -- "$FILTER")
echo "${#TESTS[@]} tests; Tessera $TESSERA_URL, tgt $TGT_URL; $TIMEOUT s each"

# test_text LOG: what the test itself printed, from its "Test: NAME ..." line to its
# "passed". libiscsi prints a "[SKIPPED] PERSISTENT RESERVE IN is not implemented" probe
# line before and after every test on a target without PR: that is not a skip.
test_text() {
  awk '/^  Test: /{on = 1} on {if (sub(/passed.*/, "passed")) {print; exit} print}' "$1"
}

# run_all NAME URL: every test against one target, one process each; writes
# $DIR/NAME.results with "TEST pass|skip|fail[: why]" lines and each test's log.
run_all() {
  local name=$1 url=$2 t log rc
  mkdir -p "$DIR/$name"
  : >"$DIR/$name.results"
  for t in "${TESTS[@]}"; do
    log="$DIR/$name/$t.log"
    rc=0
    timeout "$TIMEOUT" iscsi-test-cu --dataloss -i $INIT1 -I $INIT2 --test="$t" "$url" \
      >"$log" 2>&1 </dev/null || rc=$?
    # CUnit's "tests TOTAL RAN PASSED FAILED INACTIVE" line.
    local summary
    summary=$(awk '$1 == "tests" && NF >= 6 {print $3, $4, $5}' "$log" | tail -1)
    read -r ran passed failed <<<"${summary:-0 0 0}"
    if [[ $rc == 124 ]]; then
      echo "$t fail: timed out after $TIMEOUT s" >>"$DIR/$name.results"
    elif [[ -z "$summary" || "$ran" == 0 ]]; then
      echo "$t fail: no CUnit summary (exit $rc): $(grep -v '^\s*$' "$log" | tail -1)" >>"$DIR/$name.results"
    elif [[ "$failed" != 0 ]]; then
      echo "$t fail: $(grep -m1 -E 'FAILED|failed|Assertion' "$log" | sed 's/^\s*//' | cut -c1-160)" >>"$DIR/$name.results"
    elif test_text "$log" | grep -q -E '\[SKIPPED\]|Test not supported'; then
      echo "$t skip: $(test_text "$log" | grep -m1 -E '\[SKIPPED\]|Test not supported' | sed 's/.*\[SKIPPED\] *//; s/^\s*//' | cut -c1-160)" >>"$DIR/$name.results"
    else
      echo "$t pass" >>"$DIR/$name.results"
    fi
  done
}

# Both targets at once: each runs its tests in order, so a target sees one initiator
# process at a time (the reservation tests open their second session themselves).
run_all tessera "$TESSERA_URL" &
P1=$!
run_all tgt "$TGT_URL" &
P2=$!
wait $P1; wait $P2

report() {
  local name=$1 f=$DIR/$1.results
  printf '%-8s %4d tests: %4d passed, %4d skipped, %4d failed\n' "$name" "$(wc -l <"$f")" \
    "$(grep -c ' pass$' "$f" || true)" "$(grep -c ' skip: ' "$f" || true)" "$(grep -c ' fail' "$f" || true)"
}
echo
report tessera
report tgt
for name in tessera tgt; do
  echo; echo "$name failures:"; grep ' fail' "$DIR/$name.results" | sed 's/^/  /' || echo "  none"
  echo "$name skips:"; grep ' skip: ' "$DIR/$name.results" | sed 's/^/  /' || echo "  none"
done
echo; echo "passed on tgt, not on Tessera:"
join <(awk '{s = $2; sub(":", "", s); print $1, s}' "$DIR/tgt.results" | sort) <(awk '{s = $2; sub(":", "", s); print $1, s}' "$DIR/tessera.results" | sort) |
  awk '$2 == "pass" && $3 != "pass" {print "  " $1 " (Tessera: " $3 ")"; n++} END {if (!n) print "  none"}'
echo "passed on Tessera, not on tgt:"
join <(awk '{s = $2; sub(":", "", s); print $1, s}' "$DIR/tgt.results" | sort) <(awk '{s = $2; sub(":", "", s); print $1, s}' "$DIR/tessera.results" | sort) |
  awk '$3 == "pass" && $2 != "pass" {print "  " $1 " (tgt: " $2 ")"; n++} END {if (!n) print "  none"}'
