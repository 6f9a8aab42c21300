#!/usr/bin/env bash
# A pool's cache tier (issue 24) on a capacity tier made slow on purpose, through NBD with
# fio, in one run:
#
#   1. zipf(1.1) 4 KiB random reads over a working set four times the cache, QD16: the
#      slow pool alone, then the same pool with a RAM cache (write-through) after a
#      warm-up of the same workload; IOPS and the ratio.
#   2. hit latency: QD1 4 KiB random reads of a 16 MiB range the cache holds, against the
#      same reads on a pool whose only device is a RAM device like the cache's.
#   3. a 4 KiB random-read pass over a hot range, then a sequential scan of four times the
#      cache, then the hot range again: the cache's hit ratio before and after the scan
#      (the scan is bypassed: the access-pattern detector calls it sequential).
#   4. sequential 128 KiB reads at QD1: the slow pool alone, and with the cache, which
#      reads ahead of the stream; and the zipf run's read amplification (bytes read from
#      the slow device per byte the client read: readahead must not fire on random I/O).
#
# The zipf run is made with the default 1 MiB cache unit and with UNIT (16K by default):
# fio's zipf scatters its hot blocks (it hashes the ranks), so 1 MiB units hold many
# cold blocks for each hot one.
#
# The node runs on one reactor core (CORES): on a 2-core machine fio needs the other,
# and a second reactor sharing fio's core adds its scheduling to every figure.
#
#   TESSERA=target/release/tessera LATENCY_US=2000 CACHE_MIB=128 UNIT=16K RUNTIME=20 bench/cache-tier.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TESSERA=${TESSERA:-target/release/tessera}
LATENCY_US=${LATENCY_US:-2000}
CACHE_MIB=${CACHE_MIB:-128}
RUNTIME=${RUNTIME:-20}
PORT=${PORT:-10897}
UNIT=${UNIT:-16K}
CORES=${CORES:-1}
WS_MIB=$((CACHE_MIB * 4))
dir=$(mktemp -d "${TMPDIR:-/tmp}/tessera-cache-bench.XXXXXX")
# The node's iSCSI and NVMe/TCP listeners are not used here.
# shellcheck source=bench/lib.sh
source bench/lib.sh
start_node "$dir" "$PORT" "$CORES"
t() { "$TESSERA" --api "unix:$dir/api.sock" "$@" >/dev/null; }
size=$((WS_MIB + 320))M
t pool create slow "fault:$dir/slow.img:${size};latency_us=$LATENCY_US"
t pool create cached "fault:$dir/cached.img:${size};latency_us=$LATENCY_US" \
    --cache "ram:$((CACHE_MIB + 1))M"
t pool create small "fault:$dir/small.img:${size};latency_us=$LATENCY_US" \
    --cache "ram:$((CACHE_MIB + 1))M" --cache-unit "$UNIT"
t pool create fast "ram:${size}"
for p in slow cached small fast; do
    t volume create "v$p" --pool "$p" --size "${WS_MIB}M"
    t export add "v$p" --volume "v$p"
done
for p in slow cached; do
    t volume create "s$p" --pool "$p" --size 256M
    t export add "s$p" --volume "s$p"
done

# fio over NBD; prints "IOPS mean_us"
fio_run() { # name uri extra...
    local name=$1 uri=$2
    shift 2
    fio --name="$name" --ioengine=nbd --uri="$uri" --bs=4k --output-format=json \
        --output="$dir/$name.json" "$@" >/dev/null
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]["read"]; print("%d %.1f" % (j["iops"], j["clat_ns"]["mean"]/1000))' "$dir/$name.json"
}
uri() { echo "nbd://127.0.0.1:$PORT/v$1"; }
hits() { "$TESSERA" --api "unix:$dir/api.sock" pool cache show "${1:-cached}" --json |
    python3 -c 'import json,sys; c=json.load(sys.stdin); print(c["read_hits"], c["read_misses"], *([c["read_hit_bytes"], c["read_miss_bytes"], c["prefetch_bytes"]] if len(sys.argv) > 1 else []))' ${2:-}; }

echo "cache-tier: capacity tier ${LATENCY_US} us per I/O, cache ${CACHE_MIB} MiB (RAM), working set ${WS_MIB} MiB"
echo "prefilling (sequential 1 MiB writes: bypass the cache)..."
for p in sslow scached; do
    fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$p" --rw=write --bs=1M --iodepth=8 \
        --size=256M >/dev/null
done
for p in slow cached small fast; do
    fio --name=fill --ioengine=nbd --uri="$(uri $p)" --rw=write --bs=1M --iodepth=8 \
        --size="${WS_MIB}M" >/dev/null
done

zipf=(--rw=randread --random_distribution=zipf:1.1 --iodepth=16 --size="${WS_MIB}M"
    --time_based --runtime="$RUNTIME")
read -r slow_iops slow_lat < <(fio_run zipf-slow "$(uri slow)" "${zipf[@]}")
fio_run zipf-warm "$(uri cached)" "${zipf[@]}" >/dev/null
read -r h0 m0 hb0 mb0 pb0 < <(hits cached bytes)
read -r cached_iops cached_lat < <(fio_run zipf-cached "$(uri cached)" "${zipf[@]}")
read -r h1 m1 hb1 mb1 pb1 < <(hits cached bytes)
ratio=$(python3 -c "print('%.2f' % ($cached_iops / max($slow_iops, 1)))")
hit=$(python3 -c "print('%.1f' % (100 * ($h1 - $h0) / max(1, $h1 - $h0 + $m1 - $m0)))")
echo "zipf(1.1) randread QD16: slow pool ${slow_iops} IOPS (${slow_lat} us), with cache (1M units) ${cached_iops} IOPS (${cached_lat} us, ${hit}% hits): ${ratio}x"
amp=$(python3 -c "print('%.3f' % (($mb1 - $mb0 + $pb1 - $pb0) / max(1, $hb1 - $hb0 + $mb1 - $mb0)))")
echo "zipf(1.1) randread: bytes read from the slow device per byte read by the client: ${amp} (misses only; $((pb1 - pb0)) bytes read ahead)"
fio_run zipf-warm-small "$(uri small)" "${zipf[@]}" >/dev/null
read -r h0 m0 < <(hits small)
read -r small_iops small_lat < <(fio_run zipf-small "$(uri small)" "${zipf[@]}")
read -r h1 m1 < <(hits small)
ratio=$(python3 -c "print('%.2f' % ($small_iops / max($slow_iops, 1)))")
hit=$(python3 -c "print('%.1f' % (100 * ($h1 - $h0) / max(1, $h1 - $h0 + $m1 - $m0)))")
echo "zipf(1.1) randread QD16: with cache ($UNIT units) ${small_iops} IOPS (${small_lat} us, ${hit}% hits): ${ratio}x"

hot=(--rw=randread --iodepth=1 --size=16M --time_based --runtime="$RUNTIME")
# Warm: every block of the range once (fio's random map), at QD16.
fio --name=hot-warm --ioengine=nbd --uri="$(uri cached)" --rw=randread --bs=4k --iodepth=16 \
    --size=16M >/dev/null
read -r w0 x0 < <(hits)
read -r hc_iops hc_lat < <(fio_run hot-cached "$(uri cached)" "${hot[@]}")
read -r hf_iops hf_lat < <(fio_run hot-fast "$(uri fast)" "${hot[@]}")
read -r w1 x1 < <(hits)
lr=$(python3 -c "print('%.2f' % ($hc_lat / $hf_lat))")
echo "hit latency QD1: cached pool ${hc_lat} us (${hc_iops} IOPS, $((x1 - x0)) misses), RAM pool alone ${hf_lat} us (${hf_iops} IOPS): ${lr}x"

# Scan resistance: a hot 32 MiB read at random, a sequential scan of 4x the cache, the hot
# range again.
hotset=(--rw=randread --iodepth=16 --offset=64M --size=32M --time_based --runtime=5)
fio_run hot1 "$(uri cached)" "${hotset[@]}" >/dev/null
read -r a0 b0 < <(hits)
fio_run hot2 "$(uri cached)" "${hotset[@]}" >/dev/null
read -r a1 b1 < <(hits)
fio --name=scan --ioengine=nbd --uri="$(uri cached)" --rw=read --bs=128k --iodepth=4 \
    --size="${WS_MIB}M" >/dev/null
read -r a2 b2 < <(hits)
fio_run hot3 "$(uri cached)" "${hotset[@]}" >/dev/null
read -r a3 b3 < <(hits)
python3 - "$a0" "$b0" "$a1" "$b1" "$a2" "$b2" "$a3" "$b3" <<'EOF'
import sys
a0, b0, a1, b1, a2, b2, a3, b3 = map(int, sys.argv[1:])
before = (a1 - a0) / max(1, a1 - a0 + b1 - b0)
after = (a3 - a2) / max(1, a3 - a2 + b3 - b2)
print("scan resistance: hot-set hit ratio %.3f before a %s scan, %.3f after (%.2fx)"
      % (before, "4x-cache", after, after / max(before, 1e-9)))
EOF
seq=(--rw=read --bs=128k --iodepth=1 --size=256M --time_based --runtime="$RUNTIME")
read -r sq_slow _ < <(fio_run seq-slow "nbd://127.0.0.1:$PORT/sslow" "${seq[@]}")
read -r sq_cached _ < <(fio_run seq-cached "nbd://127.0.0.1:$PORT/scached" "${seq[@]}")
python3 -c "print('sequential 128K read QD1: slow pool %.1f MiB/s, with cache and readahead %.1f MiB/s: %.2fx' % ($sq_slow / 8, $sq_cached / 8, $sq_cached / max($sq_slow, 1)))"
"$TESSERA" --api "unix:$dir/api.sock" pool cache show cached
"$TESSERA" --api "unix:$dir/api.sock" pool cache show small
