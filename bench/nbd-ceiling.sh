#!/usr/bin/env bash
# Server ceiling: drive Tessera, nbdkit (memory) and qemu-nbd with `tessera nbd-perf`, a
# pipelined NBD client that uses a fraction of a core (fio's libnbd engine saturates its
# own core at ~150K IOPS on a 2-core machine, so it measures the client, not the server).
#
#   bench/nbd-ceiling.sh            # RUNTIME=10 QD=128 CONNS=1 SIZE=1G
#
# Every server is started here, prefilled over SIZE, measured, and killed by PID.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUNTIME="${RUNTIME:-10}"; QD="${QD:-128}"; CONNS="${CONNS:-1}"; SIZE="${SIZE:-1G}"
TESSERA="${TESSERA:-target/release/tessera}"
[[ -x "$TESSERA" ]] || cargo build --release -p tessera-cli >&2
scripts/install-deps.sh >/dev/null

WORK="$(mktemp -d /dev/shm/tessera-ceiling.XXXXXX)"
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf -- "$WORK"; }
trap cleanup EXIT

wait_port() { for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 never opened" >&2; return 1; }

declare -A RES
measure() { # NAME URI
  local name=$1 uri=$2
  fio --name=prefill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=8 --size="$SIZE" >/dev/null 2>&1
  for pat in randread randwrite; do
    for qd in "$QD" 1; do
      local extra=(); [[ $qd == 1 ]] && extra=(--busy-poll)
      local line
      line=$("$TESSERA" nbd-perf --uri "$uri" --pattern "$pat" --qd "$qd" --conns "$CONNS" --size "$SIZE" --time "$RUNTIME" "${extra[@]}" 2>/dev/null | grep '^RESULT')
      RES[$name,$pat,$qd]=$(sed -E 's/.*iops=([0-9]+).*/\1/' <<<"$line")
      RES[$name,$pat,$qd,lat]=$(sed -E 's/.*mean_us=([0-9.]+).*/\1/' <<<"$line")
      echo "[ceiling] $name $pat qd=$qd: $line" >&2
    done
  done
}

"$TESSERA" up --data-dir "$WORK/t" --nbd 127.0.0.1:10809 >"$WORK/t.log" 2>&1 & PIDS+=($!)
wait_port 10809; measure tessera nbd://127.0.0.1:10809/vol0; kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true

nbdkit -f -i 127.0.0.1 -p 10810 -t 4 memory 4G & PIDS+=($!)
wait_port 10810; measure nbdkit nbd://127.0.0.1:10810/; kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true

truncate -s 4G "$WORK/q.img"
qemu-nbd -f raw -t -b 127.0.0.1 -p 10811 -e 8 --cache=none --aio=io_uring "$WORK/q.img" & PIDS+=($!)
wait_port 10811; measure qemu-nbd nbd://127.0.0.1:10811/; kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true

echo
echo "== NBD server ceiling: tessera nbd-perf, bs=4k, conns=$CONNS, size=$SIZE, ${RUNTIME}s; $(nproc) CPUs"
printf '%-10s %4s %10s %10s %10s %12s %12s\n' pattern qd tessera nbdkit qemu-nbd tess/nbdkit tess/qemu
for pat in randread randwrite; do
  for qd in "$QD" 1; do
    t=${RES[tessera,$pat,$qd]}; n=${RES[nbdkit,$pat,$qd]}; q=${RES[qemu-nbd,$pat,$qd]}
    printf '%-10s %4s %10s %10s %10s %11sx %11sx\n' "$pat" "$qd" "$t" "$n" "$q" "$(awk -v a="$t" -v b="$n" 'BEGIN{printf "%.2f", a/b}')" "$(awk -v a="$t" -v b="$q" 'BEGIN{printf "%.2f", a/b}')"
  done
done
echo "QD1 mean latency (us, client busy-polls): tessera ${RES[tessera,randread,1,lat]} nbdkit ${RES[nbdkit,randread,1,lat]} qemu-nbd ${RES[qemu-nbd,randread,1,lat]} (randread)"
