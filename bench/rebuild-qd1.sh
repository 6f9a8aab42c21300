#!/usr/bin/env bash
# Rebuild rate with no client load, then how many IOPS a QD1 4 KiB randread client keeps
# while a rebuild runs at a class rate of BW (default 256M, the class's default). A node on 1 reactor core,
# a pool on RAM devices, a 3 GiB volume with ~1.8 GiB allocated, NBD on loopback.
#
#   LAYOUT=raid1 DEVS="ram:2G ram:2G" bench/rebuild-qd1.sh
#   LAYOUT=raid5 DEVS="ram:1G ram:1G ram:1G ram:1G" bench/rebuild-qd1.sh
#
# Bounded: about 40 s. Meaningful only on a quiet machine (prints the load average).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x target/release/tessera ] || cargo build --release -q -p tessera-cli
B=$PWD/target/release/tessera
LAYOUT=${LAYOUT:-raid1}
DEVS=${DEVS:-ram:2G ram:2G}
PORT=${PORT:-10899}
DIR=$(mktemp -d)
trap 'kill $NODE 2>/dev/null; wait $NODE 2>/dev/null; rm -rf "$DIR"' EXIT
cat > "$DIR/tessera.toml" <<CFG
data_dir = "$DIR/data"
cores = 1
[nbd]
listen = ["127.0.0.1:$PORT"]
CFG
T="$B --api unix:$DIR/data/api.sock"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
$B node --config "$DIR/tessera.toml" > "$DIR/node.log" 2>&1 &
NODE=$!
for _ in $(seq 100); do [ -S "$DIR/data/api.sock" ] && break; sleep 0.1; done
# shellcheck disable=SC2086
$T pool create m --layout "$LAYOUT" $DEVS >/dev/null
$T volume create v --pool m --size 3G >/dev/null
$T export add v --volume v >/dev/null
P="$B nbd-perf --uri nbd://127.0.0.1:$PORT/v --size 1900M"
echo "+ $P --pattern randwrite --bs 1M --qd 8 --time 6   (allocate)"
$P --pattern randwrite --bs 1M --qd 8 --time 6 >/dev/null 2>&1
$T background set rebuild --bw 64G >/dev/null
for rep in 1 2; do
  $T pool rebuild m --device 1 --force --wait >/dev/null 2>&1
  echo "no client load, rep $rep: $(grep 'rebuild of' "$DIR/node.log" | tail -1)"
done
$T background set rebuild --bw "${BW:-256M}" >/dev/null
for rep in 1 2; do
  before=$($P --bs 4K --pattern randread --qd 1 --time 3 2>&1 | grep -o "iops=[0-9]*" | cut -d= -f2)
  ($P --bs 4K --pattern randread --qd 1 --time 4 2>&1 | grep -o "iops=[0-9]*" | cut -d= -f2 > "$DIR/during") &
  C=$!
  sleep 0.5
  $T pool rebuild m --device 1 --force >/dev/null
  wait $C
  during=$(cat "$DIR/during")
  $T pool rebuild m --status --wait >/dev/null 2>&1 || true
  echo "QD1 rep $rep: before $before, during rebuild $during, kept $(( during * 100 / before ))%; $(grep 'rebuild of' "$DIR/node.log" | tail -1)"
done
