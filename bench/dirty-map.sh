#!/usr/bin/env bash
# Cost of NBD block status for the `qemu:dirty-bitmap:SNAP` context (incremental backup,
# issue 14) on a big thin volume: `nbdinfo --map=qemu:dirty-bitmap:s1` (the whole map of
# what changed since snapshot s1) against `nbdinfo --map` (base:allocation) on the same
# export, alternated, ROUNDS times each; then the same after many small changes.
#
#   bench/dirty-map.sh        # SIZE=64G BASE_WRITES=512 FEW=64 MANY=16384 ROUNDS=5
#
# One reactor core, a sparse 8 GiB file pool with 1 MiB units, one thin volume of SIZE:
# BASE_WRITES 4 KiB writes scattered over it, snapshot s1, then FEW more scattered
# writes ("few changes"); later MANY 4 KiB writes in the first GiB after snapshot s2
# (partial units: the per-block walk). Writes go through qemu-io. The node is started
# here and killed by PID.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SIZE="${SIZE:-64G}"; ROUNDS="${ROUNDS:-5}"
BASE_WRITES="${BASE_WRITES:-512}"; FEW="${FEW:-64}"; MANY="${MANY:-16384}"
TESSERA="${TESSERA:-target/release/tessera}"
[[ -x "$TESSERA" ]] || cargo build --release -p tessera-cli >&2

WORK="$(mktemp -d /tmp/tessera-dirtymap.XXXXXX)"
PID=""
cleanup() { [[ -n "$PID" ]] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; rm -rf -- "$WORK"; }
trap cleanup EXIT
PORT=10913
cat >"$WORK/node.toml" <<TOML
data_dir = "$WORK/data"
cores = 1
[nbd]
listen = ["127.0.0.1:$PORT"]
[[pool]]
name = "p"
devices = ["$WORK/p.img:8G"]
[[volume]]
name = "big"
pool = "p"
size = "$SIZE"
[[export]]
name = "big"
volume = "big"
TOML
"$TESSERA" node --config "$WORK/node.toml" >"$WORK/node.log" 2>&1 & PID=$!
for _ in $(seq 1 100); do [[ -S "$WORK/data/api.sock" ]] && break; sleep 0.1; done
cli() { "$TESSERA" --api "$WORK/data/api.sock" "$@"; }
URI="nbd://127.0.0.1:$PORT/big"
bytes=$(numfmt --from=iec "$SIZE")

# COUNT 4 KiB writes at random 4 KiB-aligned offsets below LIMIT bytes (seeded).
scatter() { # count limit seed
  python3 - "$@" <<'PY' >"$WORK/cmds"
import random, sys
n, limit, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
r = random.Random(seed)
for _ in range(n):
    print("write -P 0x5a %d 4k" % (r.randrange(limit // 4096) * 4096))
PY
  local args=()
  while read -r c; do args+=(-c "$c"); done <"$WORK/cmds"
  # qemu-io takes one command per -c; batches keep the argument list short.
  for ((i = 0; i < ${#args[@]}; i += 2048)); do
    qemu-io -f raw "$URI" "${args[@]:i:2048}" >/dev/null
  done
}
ms() { echo $(( $(date +%s%N) / 1000000 )); }
timed_map() { # context -> "ms extents" ("- -" when the server lacks the context, e.g.
  # an older binary given as TESSERA to compare base:allocation against)
  local t0 t1 lines
  t0=$(ms)
  if lines=$(nbdinfo --map="$1" "$URI" 2>/dev/null | wc -l) && (( lines > 0 )); then
    t1=$(ms); echo "$(( t1 - t0 )) $lines"
  else
    echo "- -"
  fi
}

scatter "$BASE_WRITES" "$bytes" 1
cli snapshot create big --name s1 >/dev/null || echo "(no snapshots in $TESSERA)"
scatter "$FEW" "$bytes" 2
echo "# $SIZE volume: $BASE_WRITES scattered 4 KiB writes, snapshot s1, $FEW more"
echo "round base:allocation_ms extents qemu:dirty-bitmap:s1_ms extents"
for ((r = 1; r <= ROUNDS; r++)); do
  read -r a an < <(timed_map base:allocation)
  read -r d dn < <(timed_map qemu:dirty-bitmap:s1)
  echo "$r $a $an $d $dn"
done
t0=$(ms)
if cli volume changes big --since s1 --json >/dev/null 2>&1; then
  t1=$(ms); echo "API: volume changes big --since s1: $(( t1 - t0 )) ms"
fi

cli snapshot create big --name s2 >/dev/null || true
scatter "$MANY" $(( 1 << 30 )) 3
echo
echo "# then snapshot s2 and $MANY 4 KiB writes in the first GiB (partial units)"
echo "round base:allocation_ms extents qemu:dirty-bitmap:s2_ms extents qemu:dirty-bitmap:s1_ms extents"
for ((r = 1; r <= ROUNDS; r++)); do
  read -r a an < <(timed_map base:allocation)
  read -r d dn < <(timed_map qemu:dirty-bitmap:s2)
  read -r e en < <(timed_map qemu:dirty-bitmap:s1)
  echo "$r $a $an $d $dn $e $en"
done
