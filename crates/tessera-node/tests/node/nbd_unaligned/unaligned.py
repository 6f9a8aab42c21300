# Unaligned NBD requests against a model (run by tessera-node/tests/node/nbd_unaligned.rs with nbd:// URI).
import nbd, random, sys, threading
uri = sys.argv[1]
SPAN = 1 << 20
rng = random.Random(7)
def conn(strict=False):
    h = nbd.NBD()
    h.set_request_block_size(strict)
    h.set_strict_mode(0)
    h.connect_uri(uri)
    return h
h = conn()
model = bytearray(h.pread(SPAN, 0))
# 1-byte and odd-sized reads/writes/zeroes at odd offsets, checked against a model
for i in range(400):
    off = rng.randrange(0, SPAN - 3000)
    n = rng.choice([1, 3, 511, 513, 777, 1023, 2049, rng.randrange(1, 3000)])
    k = rng.randrange(4)
    if k == 0:
        d = bytes(rng.randrange(256) for _ in range(n))
        h.pwrite(d, off); model[off:off+n] = d
    elif k == 1:
        h.zero(n, off); model[off:off+n] = bytes(n)
    elif k == 2:
        assert h.pread(n, off) == bytes(model[off:off+n]), ("read", off, n)
    else:
        h.trim(n, off)  # advisory: partial blocks stay; whole blocks may read as anything
        a, b = (off + 511) // 512 * 512, (off + n) // 512 * 512
        if b > a:
            model[a:b] = h.pread(b - a, a)
assert h.pread(SPAN, 0) == bytes(model), "final compare"
# A client that asked for block sizes keeps getting EINVAL for unaligned requests.
s = conn(strict=True)
try:
    s.pread(1, 1); print("strict client served unaligned"); sys.exit(1)
except nbd.Error as e:
    assert e.errnum == 22, e
print("model ok")
