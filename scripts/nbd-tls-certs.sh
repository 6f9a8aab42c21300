#!/usr/bin/env bash
# Make a private CA and the X.509 certificates NBD over TLS needs, with the openssl CLI.
#
#   scripts/nbd-tls-certs.sh DIR [CA_NAME]
#
# Writes into DIR (created if missing), in the file names libnbd (`nbds://...?tls-certificates=DIR`)
# and qemu (`--object tls-creds-x509,dir=DIR,endpoint=client`) look for:
#   ca-cert.pem, ca-key.pem          the CA
#   server-cert.pem, server-key.pem  for the node (SAN: 127.0.0.1, ::1, localhost, this host's name)
#   client-cert.pem, client-key.pem  for clients (when the node checks client certificates)
# Keys are ECDSA P-256. Nothing is overwritten: an existing DIR/ca-cert.pem is an error.
set -euo pipefail
dir=${1:?usage: nbd-tls-certs.sh DIR [CA_NAME]}
ca_name=${2:-Tessera test CA}
mkdir -p "$dir"
cd "$dir"
if [[ -e ca-cert.pem ]]; then
  echo "nbd-tls-certs: $dir/ca-cert.pem exists; not overwriting" >&2
  exit 1
fi
host=$(hostname 2>/dev/null || echo localhost)
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; chmod 600 "$1"; }

key ca-key.pem
openssl req -x509 -new -key ca-key.pem -days 3650 -subj "/CN=$ca_name" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out ca-cert.pem

sign() { # name cn extensions
  key "$1-key.pem"
  openssl req -new -key "$1-key.pem" -subj "/CN=$2" -out "$1.csr"
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
    -days 3650 -extfile "$1.ext" -out "$1-cert.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
sign server "$host" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost,DNS:$host"
sign client "tessera-client" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
rm -f ca-cert.srl
echo "nbd-tls-certs: CA, server and client certificates in $dir"
