#!/usr/bin/env bash
# Install the external tools Tessera's tests and benchmarks need.
#
# Idempotent: when every tool is already present it installs nothing and does
# not touch the network. Otherwise it runs `apt-get update` once and installs
# the Debian packages that provide the missing tools.
#
# Needed commands (Debian package in brackets):
#   fio                                   [fio]
#   qemu-img, qemu-io, qemu-nbd           [qemu-utils]
#   nbdinfo, nbdcopy                      [libnbd-bin]
#   nbdsh + the python3 nbd module        [python3-libnbd]
#   openssl (test CA and certificates)    [openssl]
#   nvme (gen-dhchap-key, for the NVMe/TCP authentication test)  [nvme-cli]
#   curl (HTTP over Unix sockets and TLS) [curl]
#   ip, nft (network namespaces and the nftables rule of the replication
#            partition test)               [iproute2, nftables]
#   nbdkit + its "memory" plugin          [nbdkit; on Debian 12 the memory
#                                          plugin ships inside nbdkit itself,
#                                          a separate nbdkit-plugin-memory
#                                          package is used if a release has one]
#   prometheus                            [prometheus; the metrics test scrapes
#                                          a node with a real server]
#   etcd (the cluster tests start their own members on free loopback ports;
#         the package's service is not used)  [etcd-server]
#   protoc (the build script of the etcd-client crate compiles etcd's
#           .proto files: needed to build Tessera at all)  [protobuf-compiler]
#   protobuf's well-known types (google/protobuf/descriptor.proto, which
#           etcd's .proto files import; protobuf-compiler only recommends
#           them, and we install without recommends)  [libprotobuf-dev]
#   iscsi-ls, iscsi-inq, iscsi-readcapacity16, iscsi-test-cu (libiscsi's
#           initiator tools, which the iSCSI target's tests drive), iscsi-perf
#           (bench/iscsi.sh)  [libiscsi-bin]
#   tgtd, tgtadm (the peer iSCSI target of bench/iscsi.sh and
#           bench/iscsi-conformance.sh; its service is not used)  [tgt]
#   libiscsi's headers and library (bench/iscsi.sh compiles its client
#           bench/iscsi-load.c, the iSCSI test tools/iscsi-blockio.c, with
#           cc ... -liscsi)  [libiscsi-dev; cc from gcc]
#
# Non-interactive: never reads stdin, works with CI=true and no TTY.
# Uses sudo (non-interactively) only when not root and sudo exists.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive

log()  { printf 'install-deps: %s\n' "$*"; }
warn() { printf 'install-deps: WARNING: %s\n' "$*" >&2; }
die()  { printf 'install-deps: ERROR: %s\n' "$*" >&2; exit 1; }

have() { command -v "$1" >/dev/null 2>&1; }

# command -> Debian package
declare -A PKG_OF=(
  [fio]=fio
  [qemu-img]=qemu-utils
  [qemu-io]=qemu-utils
  [qemu-nbd]=qemu-utils
  [nbdinfo]=libnbd-bin
  [nbdcopy]=libnbd-bin
  [nbdkit]=nbdkit
  [prometheus]=prometheus
  [nbdsh]=python3-libnbd
  [openssl]=openssl
  [nvme]=nvme-cli
  [curl]=curl
  [etcd]=etcd-server
  [ip]=iproute2
  [nft]=nftables
  [protoc]=protobuf-compiler
  [iscsi-ls]=libiscsi-bin
  [iscsi-inq]=libiscsi-bin
  [iscsi-readcapacity16]=libiscsi-bin
  [iscsi-test-cu]=libiscsi-bin
  [iscsi-perf]=libiscsi-bin
  [cc]=gcc
  [tgtd]=tgt
  [tgtadm]=tgt
)
CMDS=(fio qemu-img qemu-io qemu-nbd nbdinfo nbdcopy nbdkit prometheus nbdsh openssl nvme curl etcd ip nft protoc iscsi-ls iscsi-inq iscsi-readcapacity16 iscsi-test-cu iscsi-perf cc tgtd tgtadm)

have_libiscsi_headers() {
  [[ -f /usr/include/iscsi/iscsi.h ]]
}

have_protobuf_includes() {
  [[ -f /usr/include/google/protobuf/descriptor.proto ]]
}

have_memory_plugin() {
  have nbdkit && nbdkit memory --dump-plugin </dev/null >/dev/null 2>&1
}

# --- privilege helper -------------------------------------------------------
SUDO=()
if [[ "$(id -u)" -ne 0 ]]; then
  if have sudo; then
    # -n: never prompt (there is no stdin in CI); fail instead.
    SUDO=(sudo -n env DEBIAN_FRONTEND=noninteractive)
  else
    SUDO=(__no_privilege__)
  fi
fi

APT_OPTS=(
  -y -q
  -o Dpkg::Options::=--force-confdef
  -o Dpkg::Options::=--force-confold
  -o DPkg::Lock::Timeout=300
)

updated=0
apt_update_once() {
  if [[ "$updated" -eq 1 ]]; then return 0; fi
  log "running apt-get update"
  "${SUDO[@]}" apt-get "${APT_OPTS[@]}" update </dev/null \
    || die "apt-get update failed"
  updated=1
}

apt_install() {
  [[ "$#" -gt 0 ]] || return 0
  apt_update_once
  log "installing: $*"
  "${SUDO[@]}" apt-get "${APT_OPTS[@]}" install --no-install-recommends "$@" </dev/null \
    || die "apt-get install $* failed"
}

# --- find what is missing ---------------------------------------------------
missing_cmds=()
declare -A want_pkgs=()
for c in "${CMDS[@]}"; do
  if ! have "$c"; then
    missing_cmds+=("$c")
    want_pkgs[${PKG_OF[$c]}]=1
  fi
done
need_memory_plugin=0
if ! have_memory_plugin; then
  need_memory_plugin=1
  want_pkgs[nbdkit]=1
fi
need_headers=0
if ! have_libiscsi_headers; then
  need_headers=1
  want_pkgs[libiscsi-dev]=1
fi

need_protos=0
if ! have_protobuf_includes; then
  need_protos=1
  want_pkgs[libprotobuf-dev]=1
fi

if [[ "${#missing_cmds[@]}" -eq 0 && "$need_memory_plugin" -eq 0 && "$need_headers" -eq 0 && "$need_protos" -eq 0 ]]; then
  log "all tools present: ${CMDS[*]} + nbdkit memory plugin + libiscsi headers + protobuf includes"
else
  if [[ "${#missing_cmds[@]}" -gt 0 ]]; then
    log "missing commands: ${missing_cmds[*]}"
  fi
  if [[ "$need_memory_plugin" -eq 1 ]]; then
    log "missing: nbdkit memory plugin"
  fi
  if [[ "$need_headers" -eq 1 ]]; then
    log "missing: libiscsi headers"
  fi
  if [[ "$need_protos" -eq 1 ]]; then
    log "missing: protobuf's well-known .proto files"
  fi

  if ! have apt-get; then
    die "apt-get not found; install these by hand: ${missing_cmds[*]} (and the nbdkit memory plugin)"
  fi
  if [[ "${SUDO[0]:-}" == "__no_privilege__" ]]; then
    die "not root and sudo is not installed; cannot install: ${!want_pkgs[*]}"
  fi

  # shellcheck disable=SC2207  # package names contain no whitespace
  pkgs=($(printf '%s\n' "${!want_pkgs[@]}" | sort))
  apt_install "${pkgs[@]}"

  # Some Debian/Ubuntu releases split nbdkit plugins into their own packages.
  # If the memory plugin still is not loadable, install the package that
  # provides it (if the archive has one).
  if ! have_memory_plugin; then
    if apt-cache show nbdkit-plugin-memory >/dev/null 2>&1; then
      apt_install nbdkit-plugin-memory
    fi
  fi
fi

# --- verify -----------------------------------------------------------------
still_missing=()
for c in "${CMDS[@]}"; do
  have "$c" || still_missing+=("$c")
done
have_memory_plugin || still_missing+=("nbdkit-memory-plugin")
have_libiscsi_headers || still_missing+=("libiscsi-dev")
have_protobuf_includes || still_missing+=("libprotobuf-dev")
if [[ "${#still_missing[@]}" -gt 0 ]]; then
  die "still missing after install: ${still_missing[*]}"
fi

if fio --enghelp=nbd </dev/null >/dev/null 2>&1; then
  log "fio $(fio --version 2>/dev/null) has the nbd ioengine"
else
  warn "fio ($(fio --version 2>/dev/null || echo unknown)) was built WITHOUT the nbd ioengine"
  warn "  (needs libnbd at fio build time); NBD fio tests and bench/nbd-peers.sh will not work."
fi

if ! have python3; then
  warn "python3 not found; bench/nbd-peers.sh needs it to parse fio JSON."
fi

log "ok"
