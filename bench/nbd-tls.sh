#!/usr/bin/env bash
# The cost of TLS on NBD: 4 KiB random reads at queue depth 128 through the same node,
# the same volume and the same client (fio's nbd engine, which is libnbd), with and
# without TLS, alternating in one run. With BEFORE set, the plain path is also compared with an older binary (tessera
# nbd-perf 4K randread QD128, alternating), to show that TLS support did not slow it.
#
#   bench/nbd-tls.sh                 # TLS vs plain on target/release/tessera
#   BEFORE=/work/before/tessera bench/nbd-tls.sh
#
# The node: one RAM pool, a 256 MiB volume filled with data, exported twice: `plain`
# (TLS optional, used without TLS) and `tls` (TLS required). The node checks no client
# certificate and fio does not verify the server's: libnbd refuses `tls-certificates=DIR`
# in a URI unless the program allows local files, which fio does not, and without it
# libnbd offers no client certificate. Certificates only matter in the handshake; the
# per-request cost measured here is the record encryption. (qemu-img bench takes no
# --object, so it cannot start TLS.)
#
# Environment (defaults in brackets):
#   TESSERA [target/release/tessera]  binary under test
#   BEFORE []                         older binary for the plain-path A/B ("" = skip)
#   ROUNDS [3]                        alternating rounds
#   SECS [8]                          seconds per fio / nbd-perf run
#   CORES [1]                         reactor cores of the node
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TESSERA="${TESSERA:-target/release/tessera}"
BEFORE="${BEFORE:-}"
ROUNDS="${ROUNDS:-3}"
SECS="${SECS:-8}"
CORES="${CORES:-1}"

for c in fio nbdcopy openssl python3 timeout; do
  command -v "$c" >/dev/null 2>&1 || { echo "nbd-tls: $c not found (scripts/install-deps.sh)" >&2; exit 1; }
done
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tessera-nbd-tls.XXXXXX")"
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  rm -rf -- "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

scripts/nbd-tls-certs.sh "$WORK/certs" >/dev/null

# start_node BIN NAME TLS(0/1) -> sets PORT
start_node() {
  local bin="$1" name="$2" tls="$3" dir="$WORK/$2" i
  PORT=$(free_port)
  mkdir -p "$dir"
  {
    echo "data_dir = \"$dir/data\""
    echo "cores = $CORES"
    echo "[nbd]"
    echo "listen = [\"127.0.0.1:$PORT\"]"
    if [[ "$tls" == 1 ]]; then
      echo "[nbd.tls]"
      echo "cert = \"$WORK/certs/server-cert.pem\""
      echo "key = \"$WORK/certs/server-key.pem\""
    fi
    echo "[nvmf]"
    echo "enabled = false"
    echo "[[pool]]"
    echo "name = \"p\""
    echo "devices = [\"ram:512M\"]"
    echo "[[volume]]"
    echo "name = \"v\""
    echo "pool = \"p\""
    echo "size = \"256M\""
    echo "[[export]]"
    echo "name = \"plain\""
    echo "volume = \"v\""
    if [[ "$tls" == 1 ]]; then
      echo "tls = \"optional\""
      echo "[[export]]"
      echo "name = \"tls\""
      echo "volume = \"v\""
      echo "tls = \"required\""
    fi
  } >"$dir/node.toml"
  "$bin" node --config "$dir/node.toml" >"$dir/out.log" 2>"$dir/err.log" &
  PIDS+=($!)
  for ((i = 0; i < 300; i++)); do
    grep -q '^tessera: ready' "$dir/out.log" 2>/dev/null && break
    sleep 0.1
  done
  grep -q '^tessera: ready' "$dir/out.log" || { cat "$dir/err.log" >&2; echo "nbd-tls: $name did not start" >&2; exit 1; }
}

# CPU ticks (user + system) the node has used so far.
node_ticks() { awk '{print $14 + $15}' "/proc/$NODE_PID/stat"; }

# bench_fio URI -> "IOPS SERVER_CPU_US_PER_IO" (fio's nbd engine is libnbd: nbds:// URIs
# start TLS; the node's CPU time over the run, divided by the requests served, isolates
# the server's cost from the client's).
bench_fio() {
  local out t0 t1
  t0=$(node_ticks)
  out=$(timeout $((SECS + 60)) fio --name=t --ioengine=nbd --uri="$1" --rw=randread --bs=4k \
    --iodepth=128 --size=256M --runtime="$SECS" --time_based --output-format=json 2>/dev/null) \
    || { echo "nbd-tls: fio failed on $1" >&2; exit 1; }
  t1=$(node_ticks)
  # fio may print notes before the JSON.
  python3 -c 'import json,os,sys; s=sys.stdin.read(); j=json.loads(s[s.index("{"):])["jobs"][0]
if j["error"]: sys.exit("fio error %d" % j["error"])
r=j["read"]; ios=r["total_ios"]; cpu=(int(sys.argv[2])-int(sys.argv[1]))/os.sysconf("SC_CLK_TCK")
print(round(r["iops"]), "%.2f" % (cpu*1e6/max(ios,1)))' "$t0" "$t1" <<<"$out"
}

# bench_perf BIN PORT -> IOPS (tessera nbd-perf 4K randread QD128)
bench_perf() {
  local out
  out=$(timeout $((SECS + 60)) "$1" nbd-perf --uri "nbd://127.0.0.1:$2/plain" --pattern randread --qd 128 --time "$SECS" --bs 4K --size 256M 2>&1)
  sed -n 's/^RESULT.* iops=\([0-9.]*\).*/\1/p' <<<"$out" | head -1
}

start_node "$TESSERA" after 1
AFTER_PORT=$PORT
NODE_PID=${PIDS[0]}
head -c 256M /dev/urandom >"$WORK/fill.img"
nbdcopy "$WORK/fill.img" "nbd://127.0.0.1:$AFTER_PORT/plain"
rm -f "$WORK/fill.img"

PLAIN_URI="nbd://127.0.0.1:$AFTER_PORT/plain"
TLS_URI="nbds://127.0.0.1:$AFTER_PORT/tls?tls-verify-peer=false"
echo "# TLS cost: fio --ioengine=nbd --rw=randread --bs=4k --iodepth=128 --runtime=$SECS, $CORES core(s), $ROUNDS rounds"
echo "#   plain: $PLAIN_URI   tls: $TLS_URI"
echo "round plain_iops plain_node_us/io tls_iops tls_node_us/io iops_tls/plain"
for ((r = 1; r <= ROUNDS; r++)); do
  if ((r % 2)); then
    p=$(bench_fio "$PLAIN_URI"); t=$(bench_fio "$TLS_URI")
  else
    t=$(bench_fio "$TLS_URI"); p=$(bench_fio "$PLAIN_URI")
  fi
  echo "$r $p $t $(python3 -c "print(f'{${t% *}/${p% *}:.3f}')")"
done

if [[ -n "$BEFORE" ]]; then
  start_node "$BEFORE" before 0
  BEFORE_PORT=$PORT
  head -c 256M /dev/urandom >"$WORK/fill.img"
  nbdcopy "$WORK/fill.img" "nbd://127.0.0.1:$BEFORE_PORT/plain"
  rm -f "$WORK/fill.img"
  echo "# plain path: tessera nbd-perf 4K randread QD128 ${SECS}s, before=$BEFORE after=$TESSERA"
  echo "round before_iops after_iops after/before"
  for ((r = 1; r <= ROUNDS; r++)); do
    if ((r % 2)); then
      b=$(bench_perf "$TESSERA" "$BEFORE_PORT"); a=$(bench_perf "$TESSERA" "$AFTER_PORT")
    else
      a=$(bench_perf "$TESSERA" "$AFTER_PORT"); b=$(bench_perf "$TESSERA" "$BEFORE_PORT")
    fi
    echo "$r $b $a $(python3 -c "print(f'{$a/$b:.3f}')")"
  done
fi
