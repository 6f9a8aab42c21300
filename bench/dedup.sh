#!/usr/bin/env bash
# Inline dedup (issue 25) in one run:
#
#   1. tessera bench, in process (RAM device, one volume, 4 KiB, QD32, one core): a plain
#      pool against a dedup pool, for random writes of unique data
#      (--dedupe-percentage 0), of 50% repeated blocks (50), random reads, and 1 MiB
#      sequential writes of unique data: IOPS (MiB/s) and the ratio dedup/plain.
#   2. fio over NBD with dedupe_percentage=0 and =50 (sequential 4 KiB writes of 256 MiB
#      each into its own volume of one dedup pool): the pool's dedup ratio against the
#      ideal one (unique non-zero 4 KiB blocks of what fio wrote, counted by reading the
#      volumes back).
#   3. A VM-image data set made here: one tree of files (text-like and binary, SIZE_MIB
#      in all), ten copies of it with 5% of the files rewritten in each (different
#      files per copy), each made into an ext4 image with `mkfs.ext4 -d` (no mount
#      needed), copied with nbdcopy into ten volumes of one dedup pool: logical and
#      stored bytes, the ratio, the ideal ratio of the same images, and the RAM the
#      index and pages take.
#
#   TESSERA=target/release/tessera RUNTIME=10 SIZE_MIB=96 bench/dedup.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TESSERA=${TESSERA:-target/release/tessera}
RUNTIME=${RUNTIME:-10}
SIZE_MIB=${SIZE_MIB:-96}
PORT=${PORT:-10898}
CORES=${CORES:-1}
dir=$(mktemp -d "${TMPDIR:-/tmp}/tessera-dedup-bench.XXXXXX")
# shellcheck source=bench/lib.sh
source bench/lib.sh

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"

# --- 1. in process ---------------------------------------------------------------
bench() {
    "$TESSERA" bench --device ram:1G --target volume --bs "$1" --qd 32 --cores 1 \
        --time "$RUNTIME" --pattern "$2" --dedupe-percentage "$3" ${4:+$4} 2>/dev/null |
        sed -n 's/^RESULT iops=\([0-9]*\) mibps=\([0-9.]*\).*cpu_ns_per_io=\([0-9.]*\).*/\1 \2 \3/p'
}
echo
echo "1. tessera bench, ram:1G, volume, QD32, 1 core, ${RUNTIME}s per point"
printf '%-34s %12s %12s %8s %14s\n' workload plain dedup ratio "CPU ns/IO d/p"
for w in "4K randwrite 0" "4K randwrite 50" "4K randread 0" "1M write 0"; do
    read -r bs pat pct <<<"$w"
    read -r pi pm pc <<<"$(bench "$bs" "$pat" "$pct")"
    read -r di dm dc <<<"$(bench "$bs" "$pat" "$pct" --dedup)"
    if [[ $bs == 1M ]]; then
        printf '%-34s %10s/s %10s/s %7.2fx %7s/%s\n' "$bs $pat, ${pct}% repeated" "${pm}M" "${dm}M" \
            "$(echo "$dm / $pm" | bc -l)" "$dc" "$pc"
    else
        printf '%-34s %12s %12s %7.2fx %7s/%s\n' "$bs $pat, ${pct}% repeated" "$pi" "$di" \
            "$(echo "$di / $pi" | bc -l)" "$dc" "$pc"
    fi
done

# --- 2 and 3 through a node ----------------------------------------------------------
start_node "$dir" "$PORT" "$CORES"
t() { "$TESSERA" --api "unix:$dir/api.sock" "$@" >/dev/null; }
show() { "$TESSERA" --api "unix:$dir/api.sock" --json pool show "$1"; }

# The ideal ratio of a set of images: non-zero 4 KiB blocks / distinct non-zero blocks.
ideal() {
    python3 - "$@" <<'EOF'
import hashlib, sys
seen, total = set(), 0
for path in sys.argv[1:]:
    with open(path, 'rb') as f:
        while True:
            b = f.read(4096)
            if not b:
                break
            if b.count(0) == len(b):
                continue
            total += 1
            seen.add(hashlib.blake2b(b, digest_size=16).digest())
print(f"{total} {len(seen)} {total / max(1, len(seen)):.3f}")
EOF
}
ratio_line() {
    local what=$1 json=$2 ideal_line=$3
    read -r total distinct ideal_ratio <<<"$ideal_line"
    python3 - "$what" "$total" "$distinct" "$ideal_ratio" <<EOF
import json, sys
d = json.loads('''$json''')["dedup"]
what, total, distinct, ideal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
print(f"{what:<28} logical {d['logical_bytes'] / 2**20:8.1f} MiB  stored {d['physical_bytes'] / 2**20:8.1f} MiB"
      f"  ratio {d['ratio']:.3f}  ideal {ideal:.3f} ({total} blocks, {distinct} distinct)"
      f"  = {d['ratio'] / ideal * 100:.1f}% of ideal; index RAM {d['index_ram_bytes'] / 1024:.0f} KiB,"
      f" pages RAM {d['page_ram_bytes'] / 1024:.0f} KiB, skipped {d['skipped_blocks']}")
EOF
}

echo
echo "2. fio over NBD, sequential 4 KiB writes of 256 MiB, one dedup pool per run"
for pct in 0 50; do
    t pool create "f$pct" "$dir/f$pct.img:1G" --dedup
    t volume create "f$pct" --pool "f$pct" --size 256M
    t export add "f$pct" --volume "f$pct"
    fio --name=d --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/f$pct" --rw=write --bs=4k \
        --iodepth=16 --size=256M --dedupe_percentage="$pct" --output=/dev/null
    nbdcopy "nbd://127.0.0.1:$PORT/f$pct" "$dir/f$pct.out"
    ratio_line "fio dedupe_percentage=$pct" "$(show "f$pct")" "$(ideal "$dir/f$pct.out")"
    rm -f "$dir/f$pct.out"
done

echo
echo "3. ten VM-like ext4 images (${SIZE_MIB} MiB of files each, 5% of the files changed per image)"
python3 - "$dir/tree" "$SIZE_MIB" <<'EOF'
import os, random, sys
root, size_mib = sys.argv[1], int(sys.argv[2])
rng = random.Random(25)
words = [''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rng.randint(2, 10))) for _ in range(5000)]
total, i = 0, 0
while total < size_mib << 20:
    d = os.path.join(root, f"usr/lib/pkg{i // 50}")
    os.makedirs(d, exist_ok=True)
    n = int(rng.lognormvariate(9.5, 1.5)) + 1
    n = min(n, 4 << 20)
    if i % 3 == 0:  # binaries: random bytes
        data = rng.randbytes(n)
    else:  # text: words
        data = ' '.join(rng.choice(words) for _ in range(n // 6)).encode()[:n]
    with open(os.path.join(d, f"f{i}"), 'wb') as f:
        f.write(data)
    total += n
    i += 1
EOF
files=$(find "$dir/tree" -type f | sort)
nfiles=$(wc -l <<<"$files")
t pool create vms "$dir/vms.img:$((SIZE_MIB * 14))M" --dedup
imgs=()
for v in $(seq 0 9); do
    rm -rf "$dir/copy" && cp -a "$dir/tree" "$dir/copy"
    # 5% of the files, a different pick per image, rewritten (an update, a log, a config).
    python3 - "$dir/copy" "$v" <<'EOF'
import os, random, sys
root, seed = sys.argv[1], int(sys.argv[2])
paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
rng = random.Random(1000 + seed)
for p in rng.sample(paths, max(1, len(paths) // 20)):
    n = os.path.getsize(p)
    with open(p, 'wb') as f:
        f.write(rng.randbytes(n))
EOF
    img="$dir/vm$v.img"
    mkfs.ext4 -q -F -d "$dir/copy" -b 4096 "$img" "$((SIZE_MIB * 3 / 2))M" >/dev/null 2>&1
    t volume create "vm$v" --pool vms --size "$((SIZE_MIB * 3 / 2))M"
    t export add "vm$v" --volume "vm$v"
    nbdcopy --flush "$img" "nbd://127.0.0.1:$PORT/vm$v"
    imgs+=("$img")
done
rm -rf "$dir/copy"
echo "(files: $nfiles)"
ratio_line "ten ext4 images" "$(show vms)" "$(ideal "${imgs[@]}")"
