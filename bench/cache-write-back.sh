#!/usr/bin/env bash
# Write-back (issue 24): a 4 KiB random write burst on a capacity tier made slow on
# purpose, through NBD with fio, in one run:
#
#   - "fast": the same workload on a pool on a plain file like the cache's (what the
#     cache devices do alone, through the same node and client);
#   - "slow": the pool on the slow device alone (the capacity tier's speed);
#   - "wb": the slow device under a write-back cache of two mirrored files, IOPS per
#     second over RUNTIME: the burst while the cache absorbs it, then what it settles
#     to once dirty data fills it (writes that find no clean slot go to the slow
#     device; the cleaner drains in the background). The figures: the burst against
#     "fast", the lowest second and the last third against "slow" (no cliff below it).
#
# The slow device is slow on both faces: the datapath (latency_us) and the synchronous
# face the cleaner's copies and syncs use (sync_latency_us), so cleaning costs what it
# would on a real slow device.
#
# Each volume is written whole first (sequential 1 MiB writes, which bypass the cache)
# so that no allocation is measured. The node runs on one reactor core (CORES).
#
#   TESSERA=target/release/tessera LATENCY_US=2000 CACHE_MIB=128 SPAN_MIB=512 RUNTIME=30 bench/cache-write-back.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TESSERA=${TESSERA:-target/release/tessera}
LATENCY_US=${LATENCY_US:-2000}
CACHE_MIB=${CACHE_MIB:-128}
SPAN_MIB=${SPAN_MIB:-512}
RUNTIME=${RUNTIME:-30}
QD=${QD:-16}
UNIT=${UNIT:-64K}
PORT=${PORT:-10898}
CORES=${CORES:-1}
dir=$(mktemp -d "${TMPDIR:-/tmp}/tessera-wb-bench.XXXXXX")
# shellcheck source=bench/lib.sh
source bench/lib.sh
start_node "$dir" "$PORT" "$CORES"
t() { "$TESSERA" --api "unix:$dir/api.sock" "$@" >/dev/null; }
size=$((SPAN_MIB + 320))M
t pool create slow "fault:$dir/slow.img:${size};latency_us=$LATENCY_US;sync_latency_us=$LATENCY_US"
t pool create wb "fault:$dir/wb.img:${size};latency_us=$LATENCY_US;sync_latency_us=$LATENCY_US" \
    --cache "$dir/c0.img:$((CACHE_MIB + 2))M,$dir/c1.img:$((CACHE_MIB + 2))M" \
    --cache-mode write-back --cache-unit "$UNIT"
t pool create fast "$dir/fast.img:${size}"
for p in slow wb fast; do
    t volume create "v$p" --pool "$p" --size "${SPAN_MIB}M"
    t export add "v$p" --volume "v$p"
done
uri() { echo "nbd://127.0.0.1:$PORT/v$1"; }
echo "write-back: capacity tier ${LATENCY_US} us per I/O, cache ${CACHE_MIB} MiB on two mirrored files (unit $UNIT), 4 KiB random writes over ${SPAN_MIB} MiB at QD$QD"
echo "prefilling (sequential 1 MiB writes: they bypass the cache)..."
for p in slow wb fast; do
    fio --name=fill --ioengine=nbd --uri="$(uri $p)" --rw=write --bs=1M --iodepth=8 \
        --size="${SPAN_MIB}M" >/dev/null
done
# Wait for the prefill's stray dirty data (none expected) to be gone.
for _ in $(seq 100); do
    d=$("$TESSERA" --api "unix:$dir/api.sock" pool cache show wb --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["dirty_bytes"])')
    [[ "$d" == 0 ]] && break
    sleep 0.2
done

# fio randwrite on pool $1 for $2 seconds; per-second IOPS in $dir/$1_iops.1.log.
run() {
    fio --name="$1" --ioengine=nbd --uri="$(uri "$1")" --rw=randwrite --bs=4k --iodepth="$QD" \
        --size="${SPAN_MIB}M" --time_based --runtime="$2" --randrepeat=0 \
        --write_iops_log="$dir/$1" --log_avg_msec=1000 --output-format=json \
        --output="$dir/$1.json" >/dev/null
    python3 -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["jobs"][0]["write"]["iops"]))' "$dir/$1.json"
}
fast=$(run fast 10)
slow=$(run slow 10)
run wb "$RUNTIME" >/dev/null
"$TESSERA" --api "unix:$dir/api.sock" pool cache show wb --json >"$dir/wb-cache.json"
python3 - "$dir/wb_iops.1.log" "$fast" "$slow" "$dir/wb-cache.json" <<'EOF'
import json, sys
per = {}
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    sec = int(f[0]) // 1000
    per[sec] = per.get(sec, 0) + int(f[1])
series = [per[k] for k in sorted(per)]
fast, slow = int(sys.argv[2]), int(sys.argv[3])
c = json.load(open(sys.argv[4]))
burst = sum(series[:3]) / 3
third = series[len(series) * 2 // 3:]
steady = sum(third) / len(third)
low = min(series[1:])
print("per second (IOPS):", " ".join(str(x) for x in series))
print(f"fast pool (the cache's kind of device, no latency): {fast} IOPS")
print(f"slow pool alone (capacity tier):                    {slow} IOPS")
print(f"write-back burst (first 3 s):   {burst:.0f} IOPS = {burst / fast:.2f}x the fast pool, {burst / slow:.1f}x the slow pool")
print(f"write-back last third:          {steady:.0f} IOPS = {steady / slow:.2f}x the slow pool")
print(f"write-back lowest second:       {low} IOPS = {low / slow:.2f}x the slow pool")
print(json.dumps({k: c[k] for k in ("write_hits","write_misses","promotions","evictions","read_hits","errors")}))
print(f"at the end: {c['dirty_bytes'] >> 20} MiB dirty of {c['capacity'] >> 20} MiB, {c['cleaned_bytes'] >> 20} MiB cleaned, state {c['state']}")
EOF
