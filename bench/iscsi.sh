#!/usr/bin/env bash
# Tessera's iSCSI target against tgt (tgtd), and against Tessera's own NVMe/TCP target, on
# one machine in one run: 4 KiB random read and write at QD128 and QD1.
#
#   bench/iscsi.sh                      # defaults: 5 s per run, 2 repetitions (~3 min)
#   SECS=10 REPS=3 bench/iscsi.sh       # longer, steadier
#   SERVER_CPU=2 CLIENT_CPU=3 bench/iscsi.sh
#
# Servers: one `tessera up` node (one reactor core, a RAM pool, a SIZE volume that is
# both the LUN of `tessera iscsi target create` and an NVMe/TCP namespace) and one tgtd
# (its own control port -C $TGT_CTL, a loopback portal, LUN 1 on a SIZE file in /dev/shm,
# tgt's default rdwr backing store). Both are started under `taskset -c $SERVER_CPU`, and
# every client under `taskset -c $CLIENT_CPU`.
# Clients: bench/iscsi-load.c (compiled here; libiscsi's async API, the library
# iscsi-perf is built on, which in Debian's 1.19 cannot write) for reads and writes on
# both targets; iscsi-perf itself for the reads as a cross-check; `tessera nvmf perf`
# for NVMe/TCP (SPDK's perf is not used: not built here). At QD1 the clients busy-poll
# (BUSY_POLL_QD1=1, as bench/nvmf.sh does), so a latency is the servers' round trip and
# not the client's wake-up.
# Runs are interleaved: for each pattern and QD, REPS rounds of tessera, tgt, nvmf (the
# order reversed every other round), so drift on a shared machine hits all of them.
# For every run: IOPS, mean latency (the client's; at QD1 also 1/IOPS), and the server's
# CPU: utime+stime deltas of its process from /proc/PID/stat, per I/O and as %CPU.
# Then the ratios tessera/tgt and iSCSI/NVMe-TCP, and the issue's bar (QD128 IOPS >= 2x
# tgt, QD1 latency <= 0.7x tgt) as PASS/FAIL lines.
#
# Environment (defaults in brackets): SECS [5] seconds per run, REPS [2], SIZE [1G] (the
# LUN and the region used; filled sequentially first so reads hit written data),
# SERVER_CPU [1], CLIENT_CPU [0], TGT_CTL [61] (tgtd's control port number: pick one no
# other tgtd on the machine uses), BUSY_POLL_QD1 [1], BEFORE (another tessera binary:
# a second node, "before", run interleaved with the first for an A/B), SKIP_TGT / SKIP_NVMF / SKIP_PERF
# (=1: leave tgt, NVMe/TCP, or the iscsi-perf cross-check out), PATTERNS [randread
# randwrite], QDS [128 1] (for a quicker partial run), JOBS [1] (client sessions at once
# in each run above QD1, each at that QD; QD1 runs use one. One libiscsi session on one
# core limits the IOPS before the servers do; give CLIENT_CPU a list such as 0,2,3 to
# spread them; NVMe/TCP gets --queues JOBS),
# TESSERA (binary; the default target/release/tessera is built first), KEEP (=1 keeps the work dir).
# Every run is bounded by `timeout`; servers are stopped by PID and files removed on exit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SECS=${SECS:-5}
REPS=${REPS:-2}
SIZE=${SIZE:-1G}
SERVER_CPU=${SERVER_CPU:-1}
CLIENT_CPU=${CLIENT_CPU:-0}
TGT_CTL=${TGT_CTL:-61}
BUSY_POLL_QD1=${BUSY_POLL_QD1:-1}
SKIP_TGT=${SKIP_TGT:-0}
SKIP_NVMF=${SKIP_NVMF:-0}
SKIP_PERF=${SKIP_PERF:-0}
PATTERNS=${PATTERNS:-randread randwrite}
JOBS=${JOBS:-1}
QDS=${QDS:-128 1}
T=${TESSERA:-target/release/tessera}

log() { printf '[iscsi-bench] %s\n' "$*" >&2; }
die() { printf '[iscsi-bench] ERROR: %s\n' "$*" >&2; exit 1; }
for c in cc taskset timeout python3 iscsi-perf; do
  command -v $c >/dev/null || die "$c not found (scripts/install-deps.sh)"
done
[[ $SKIP_TGT == 1 ]] || command -v tgtd >/dev/null || die "tgtd not found (Debian tgt; or SKIP_TGT=1)"
[[ -f /usr/include/iscsi/iscsi.h ]] || die "libiscsi headers not found (Debian libiscsi-dev)"
if [[ "$T" == target/release/tessera ]]; then
  log "building $T"
  cargo build --release -p tessera-cli >&2
fi
[[ -x "$T" ]] || die "$T is not executable"

DIR=$(mktemp -d "${TMPDIR:-/tmp}/tessera-iscsi-bench.XXXXXX")
LUNFILE=""
PIDS=()
cleanup() {
  local rc=$? p i
  trap - EXIT INT TERM
  for p in "${PIDS[@]}"; do
    kill -TERM "$p" 2>/dev/null || continue
    # tgtd does not always leave on SIGTERM while it serves a target.
    for i in $(seq 30); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  [[ -z "$LUNFILE" ]] || rm -f -- "$LUNFILE"
  if [[ ${KEEP:-0} == 1 ]]; then log "kept $DIR"; else rm -rf -- "$DIR"; fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SIZE_B=$(python3 -c "import sys; s=sys.argv[1]; m={'K':1<<10,'M':1<<20,'G':1<<30}; print(int(s[:-1])*m[s[-1].upper()] if s[-1].upper() in m else int(s))" "$SIZE")
LOAD=$DIR/iscsi-load
cc -O2 -o "$LOAD" bench/iscsi-load.c -liscsi || die "could not build bench/iscsi-load.c"

# ----------------------------------------------------------------- Tessera nodes --
IQN=iqn.2026-11.io.tessera:bench
NQN=nqn.2026-11.io.tessera:bench
declare -A URL PID
# start_node NAME BINARY: a node with one reactor core on SERVER_CPU, a RAM pool (the
# file-backed default would measure the disk, not the protocols) and a SIZE volume that
# is LUN 0 of an iSCSI target and an NVMe/TCP namespace.
start_node() {
  local name=$1 bin=$2 nbd nvmf iscsi i
  nbd=$(free_port); nvmf=$(free_port); iscsi=$(free_port)
  local cmd=(taskset -c "$SERVER_CPU" "$bin" up --data-dir "$DIR/$name" --cores 1 --no-pin
    --nbd "127.0.0.1:$nbd" --nvmf "127.0.0.1:$nvmf" --nvmf-discovery ""
    --iscsi "127.0.0.1:$iscsi")
  printf '%q ' "${cmd[@]}" >>"$COMMANDS"; echo >>"$COMMANDS"
  "${cmd[@]}" </dev/null >"$DIR/$name.log" 2>&1 &
  PID[$name]=$!
  PIDS+=("${PID[$name]}")
  for i in $(seq 300); do grep -q 'tessera: ready' "$DIR/$name.log" && break; kill -0 "${PID[$name]}" 2>/dev/null || break; sleep 0.1; done
  grep -q 'tessera: ready' "$DIR/$name.log" || { cat "$DIR/$name.log" >&2; die "the $name node did not start"; }
  local a=("$bin" --api "$DIR/$name/api.sock")
  "${a[@]}" pool create ram0 "ram:$((2 * SIZE_B))" >/dev/null
  "${a[@]}" volume create bench --pool ram0 --size "$SIZE_B" >/dev/null
  "${a[@]}" iscsi target create $IQN --volume bench >/dev/null
  "${a[@]}" nvmf subsystem add $NQN --volume bench --allow-any-host >/dev/null
  URL[$name]=iscsi://127.0.0.1:$iscsi/$IQN/0
  NVMF_ADDR=127.0.0.1:$nvmf
}
COMMANDS=$DIR/commands.txt
: >"$COMMANDS"
start_node tessera "$T"
NVMF_PID=${PID[tessera]}
[[ -z "${BEFORE:-}" ]] || start_node before "$BEFORE"

# ------------------------------------------------------------------------- tgtd --
TGT_PID=""
if [[ $SKIP_TGT != 1 ]]; then
  TGT_P=$(free_port)
  LUNFILE=$(mktemp /dev/shm/tessera-iscsi-bench-tgt.XXXXXX)
  truncate -s "$SIZE_B" "$LUNFILE"
  TGT_CMD=(taskset -c "$SERVER_CPU" tgtd -f -C "$TGT_CTL" --iscsi "portal=127.0.0.1:$TGT_P")
  "${TGT_CMD[@]}" </dev/null >"$DIR/tgtd.log" 2>&1 &
  TGT_PID=$!
  PIDS+=("$TGT_PID")
  TGTADM=(tgtadm -C "$TGT_CTL" --lld iscsi)
  for _ in $(seq 50); do "${TGTADM[@]}" --op show --mode target >/dev/null 2>&1 && break; sleep 0.1; done
  kill -0 $TGT_PID 2>/dev/null || { cat "$DIR/tgtd.log" >&2; die "tgtd did not start (control port $TGT_CTL taken? set TGT_CTL)"; }
  "${TGTADM[@]}" --op new --mode target --tid 1 -T iqn.2026-11.io.tessera:tgt-bench
  "${TGTADM[@]}" --op new --mode logicalunit --tid 1 --lun 1 -b "$LUNFILE"
  "${TGTADM[@]}" --op bind --mode target --tid 1 -I ALL
  URL[tgt]=iscsi://127.0.0.1:$TGT_P/iqn.2026-11.io.tessera:tgt-bench/1
  PID[tgt]=$TGT_PID
  printf '%q ' "${TGT_CMD[@]}" >>"$COMMANDS"; echo >>"$COMMANDS"
fi

# ----------------------------------------------------------------------- runs --
CLK=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
RESULTS=$DIR/results.tsv   # server client pattern qd rep iops mean_us cpu_s wall_s
: >"$RESULTS"
declare -A SEEN

# measure SERVER CLIENT PATTERN QD REP PID CMD...: run CMD on the client CPU, bounded,
# with the server's CPU ticks around it; append a row to RESULTS.
measure() {
  local server=$1 client=$2 pat=$3 qd=$4 rep=$5 pid=$6; shift 6
  local cmd=(timeout -k 5 $((SECS + 60)) taskset -c "$CLIENT_CPU" "$@")
  local out="$DIR/$server-$client-$pat-$qd-$rep.out" t0 t1 c0 c1 line iops us
  if [[ -z ${SEEN[$server-$client-$pat-$qd]:-} ]]; then
    SEEN[$server-$client-$pat-$qd]=1
    printf '%q ' "${cmd[@]}" >>"$COMMANDS"; echo >>"$COMMANDS"
  fi
  c0=$(cpu_ticks "$pid"); t0=$(date +%s.%N)
  # JOBS copies of an iSCSI client above QD1, each its own session (nvmf perf: --queues).
  local n=1 j rc=0 pids=()
  # QD1 is a latency figure: one session (busy-polling clients sharing a core would
  # measure each other).
  [[ $client == tessera-nvmf-perf || $qd == 1 ]] || n=$JOBS
  for ((j = 0; j < n; j++)); do
    "${cmd[@]}" </dev/null >"$out.$j" 2>&1 &
    pids+=($!)
  done
  for j in "${pids[@]}"; do wait "$j" || rc=1; done
  t1=$(date +%s.%N); c1=$(cpu_ticks "$pid")
  if ((rc != 0)); then
    local lf=$DIR/$server.log
    [[ $server == nvmf ]] && lf=$DIR/tessera.log
    [[ $server == tgt ]] && lf=$DIR/tgtd.log
    log "$server/$client $pat qd=$qd failed:"; sed 's/^/    /' "$out".* >&2
    tail -5 "$lf" >&2; exit 1
  fi
  iops=0 us=0
  for ((j = 0; j < n; j++)); do
    local i u
    if [[ $client == iscsi-perf ]]; then
      # Its last "iops average N" is the whole run's; it reports no latency.
      i=$(tr '\r' '\n' <"$out.$j" | grep -o 'iops average [0-9]*' | tail -1 | awk '{print $3}')
      u=-
    else
      line=$(grep '^RESULT' "$out.$j") || { log "no RESULT line:"; cat "$out.$j" >&2; exit 1; }
      i=$(sed 's/.*iops=\([0-9.]*\).*/\1/' <<<"$line")
      u=$(sed 's/.*mean_us=\([0-9.]*\).*/\1/' <<<"$line")
    fi
    [[ -n "$i" ]] || { log "$server/$client: no IOPS in its output:"; cat "$out.$j" >&2; exit 1; }
    # Sum of IOPS; latency weighted by each session's IOPS.
    us=$(awk -v a="$us" -v b="$u" -v ia="$iops" -v ib="$i" 'BEGIN{ if (b == "-") print "-"; else printf "%.1f", (a*ia + b*ib)/(ia+ib) }')
    iops=$(awk -v a="$iops" -v b="$i" 'BEGIN{printf "%.0f", a + b}')
  done
  [[ -n "$iops" ]] || { log "$server/$client: no IOPS in its output:"; cat "$out" >&2; exit 1; }
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$server" "$client" "$pat" "$qd" "$rep" "$iops" "$us" \
    "$(awk -v a="$c0" -v b="$c1" -v k="$CLK" 'BEGIN{print (b-a)/k}')" \
    "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')" >>"$RESULTS"
  log "$server/$client $pat qd=$qd rep $rep: $iops IOPS, mean $us us"
}

one() {   # one SERVER PATTERN QD REP
  local server=$1 pat=$2 qd=$3 rep=$4 w=() bp=()
  [[ $pat == randwrite ]] && w=(-w)
  [[ $qd == 1 && $BUSY_POLL_QD1 == 1 ]] && bp=(-p)
  case $server in
    nvmf)
      [[ $qd == 1 && $BUSY_POLL_QD1 == 1 ]] && bp=(--busy-poll)
      local queues=$JOBS
      [[ $qd == 1 ]] && queues=1
      measure nvmf tessera-nvmf-perf $pat $qd $rep $NVMF_PID "$T" nvmf perf --addr "$NVMF_ADDR" \
        --queues "$queues" --nqn $NQN --pattern $pat --qd $qd --bs 4K --size "$SIZE_B" --time "$SECS" "${bp[@]}" ;;
    *)
      measure $server iscsi-load $pat $qd $rep "${PID[$server]}" "$LOAD" "${w[@]}" "${bp[@]}" -q $qd -b 4K -S "$SIZE_B" -t "$SECS" "${URL[$server]}"
      if [[ $pat == randread && $SKIP_PERF != 1 ]]; then
        measure $server iscsi-perf $pat $qd $rep "${PID[$server]}" iscsi-perf -b 8 -r -m $qd -t "$SECS" "${URL[$server]}"
      fi ;;
  esac
}

SERVERS=(tessera)
[[ -z "${BEFORE:-}" ]] || SERVERS+=(before)
[[ -n "$TGT_PID" ]] && SERVERS+=(tgt)
[[ $SKIP_NVMF == 1 ]] || SERVERS+=(nvmf)
log "filling $SIZE on each iSCSI LUN (sequential 256 KiB writes) so reads hit written data"
for url in "${URL[@]}"; do
  timeout -k 5 300 taskset -c "$CLIENT_CPU" "$LOAD" -w -1 -q 16 -b 256K -S "$SIZE_B" -t 240 "$url" >"$DIR/fill.out" 2>&1 \
    || { cat "$DIR/fill.out" >&2; die "filling $url failed"; }
done
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
log "runs: ${SECS}s each, $REPS rounds, servers ${SERVERS[*]}; load average before: $LOAD0"
for pat in $PATTERNS; do
  for qd in $QDS; do
    for rep in $(seq "$REPS"); do
      order=("${SERVERS[@]}")
      if ((rep % 2 == 0)); then
        order=(); for ((i = ${#SERVERS[@]} - 1; i >= 0; i--)); do order+=("${SERVERS[i]}"); done
      fi
      for s in "${order[@]}"; do one "$s" $pat $qd "$rep"; done
    done
  done
done
LOAD1=$(cut -d' ' -f1-3 /proc/loadavg)

# --------------------------------------------------------------------- report --
echo
echo "== iSCSI: Tessera vs tgt, and vs Tessera's NVMe/TCP; 4 KiB, ${SECS}s x $REPS runs each, size $SIZE"
echo "   $(nproc) CPUs: $(lscpu | sed -n 's/^Model name: *//p'); kernel $(uname -r); servers on CPU $SERVER_CPU, clients on CPU $CLIENT_CPU; runs above QD1: $JOBS client session(s) (NVMe/TCP queues) at that QD each"
echo "   tessera $(git rev-parse --short HEAD 2>/dev/null || echo '?') ($T), tgtd $(tgtd --version 2>/dev/null | head -1 || echo '?'), libiscsi $(dpkg-query -W -f '${Version}' libiscsi7 2>/dev/null || echo '?')"
echo "   load average before the runs: $LOAD0; after: $LOAD1 (anything above ~0 means other work shared the CPUs)"
python3 - "$RESULTS" <<'PY'
import sys
from collections import defaultdict
rows = defaultdict(list)
for line in open(sys.argv[1]):
    server, client, pat, qd, rep, iops, us, cpu, wall = line.rstrip("\n").split("\t")
    rows[(server, client, pat, qd)].append((float(iops), None if us == "-" else float(us), float(cpu), float(wall)))

def stats(k):
    r = rows.get(k)
    if not r:
        return None
    iops = [x[0] for x in r]
    us = [x[1] for x in r if x[1] is not None]
    ios = sum(x[0] * x[3] for x in r)
    cpu = sum(x[2] for x in r)
    wall = sum(x[3] for x in r)
    return {
        "iops": sum(iops) / len(iops), "lo": min(iops), "hi": max(iops),
        "us": sum(us) / len(us) if us else None,
        "cpu_us": cpu / ios * 1e6 if ios else None, "pct": cpu / wall * 100,
    }

print()
print("Per server and client: mean IOPS over the runs [min-max], mean latency (client's;")
print("QD1 also 1/IOPS), server CPU per I/O (utime+stime / I/Os) and server %CPU")
fmt = "%-8s %-18s %-9s %4s %9s %17s %9s %9s %8s %6s"
print(fmt % ("server", "client", "pattern", "qd", "IOPS", "[min-max]", "lat_us", "1/IOPS_us", "cpu_us/io", "%cpu"))
order = ["tessera", "before", "tgt", "nvmf"]
keys = sorted(rows, key=lambda k: (k[2], -int(k[3]), k[1] != "iscsi-load", order.index(k[0])))
for k in keys:
    s = stats(k)
    inv = "%.1f" % (1e6 / s["iops"]) if k[3] == "1" else "-"
    print(fmt % (k[0], k[1], k[2], k[3], "%.0f" % s["iops"], "[%.0f-%.0f]" % (s["lo"], s["hi"]),
                 "-" if s["us"] is None else "%.1f" % s["us"], inv,
                 "%.2f" % s["cpu_us"] if s["cpu_us"] else "-", "%.0f" % s["pct"]))

def ratio(a, b, f):
    return "-" if a is None or b is None or not b[f] or a[f] is None else "%.2fx" % (a[f] / b[f])

print()
print("Ratios (iscsi-load rows): tessera/tgt and tessera iSCSI / tessera NVMe-TCP")
fmt = "%-9s %4s %12s %12s %12s %14s %14s"
print(fmt % ("pattern", "qd", "IOPS t/tgt", "lat t/tgt", "cpu/io t/tgt", "IOPS iscsi/nvmf", "cpu/io iscsi/nvmf"))
verdicts = []
for pat in ("randread", "randwrite"):
    for qd in ("128", "1"):
        t = stats(("tessera", "iscsi-load", pat, qd))
        g = stats(("tgt", "iscsi-load", pat, qd))
        n = stats(("nvmf", "tessera-nvmf-perf", pat, qd))
        print(fmt % (pat, qd, ratio(t, g, "iops"), ratio(t, g, "us"), ratio(t, g, "cpu_us"),
                     ratio(t, n, "iops"), ratio(t, n, "cpu_us")))
        if t and g:
            if qd == "128":
                r = t["iops"] / g["iops"]
                verdicts.append("%s %s QD128: IOPS %.2fx tgt (bar >= 2x)" % ("PASS" if r >= 2 else "FAIL", pat, r))
            else:
                r = t["us"] / g["us"]
                verdicts.append("%s %s QD1: latency %.2fx tgt (bar <= 0.7x)" % ("PASS" if r <= 0.7 else "FAIL", pat, r))
if any(k[0] == "before" for k in rows):
    print()
    print("A/B: this build (tessera) / BEFORE (before), iscsi-load rows")
    fmt2 = "%-9s %4s %10s %10s %12s"
    print(fmt2 % ("pattern", "qd", "IOPS", "lat", "cpu/io"))
    for pat in ("randread", "randwrite"):
        for qd in ("128", "1"):
            t = stats(("tessera", "iscsi-load", pat, qd))
            b = stats(("before", "iscsi-load", pat, qd))
            print(fmt2 % (pat, qd, ratio(t, b, "iops"), ratio(t, b, "us"), ratio(t, b, "cpu_us")))
pt = stats(("tessera", "iscsi-perf", "randread", "128"))
pg = stats(("tgt", "iscsi-perf", "randread", "128"))
if pt and pg:
    print("cross-check, iscsi-perf randread QD128: tessera/tgt IOPS %.2fx" % (pt["iops"] / pg["iops"]))
print()
print("The issue's bar:")
for v in verdicts:
    print("  " + v)
PY
echo
echo "== Commands (each client run under timeout; SIZE=$SIZE_B bytes)"
sed 's/^/  /' "$COMMANDS"
