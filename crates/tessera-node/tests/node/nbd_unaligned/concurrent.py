# Overlapping unaligned and aligned writes from several connections (tessera-node/tests/node/nbd_unaligned.rs).
import nbd, random, sys, threading
uri = sys.argv[1]
CONNS, ROUNDS, PAGE, PAGES = 4, 12, 4096, 48
REGION = PAGE * PAGES
rng = random.Random(11)
def conn():
    h = nbd.NBD()
    h.set_request_block_size(False)
    h.set_strict_mode(0)
    h.connect_uri(uri)
    return h
hs = [conn() for _ in range(CONNS)]
def fill(v, n):
    return bytes([v]) * n
for r in range(ROUNDS):
    work = [[] for _ in range(CONNS)]          # (offset, data) per connection
    exact = {}                                  # offset -> value every byte must have
    either = {}                                 # offset -> set of allowed values
    for p in range(PAGES):
        base = p * PAGE
        if rng.random() < 0.5:
            # Shared page: byte-disjoint unaligned pieces from all connections, sharing blocks.
            at = base
            while at < base + PAGE:
                n = min(rng.randrange(1, 700), base + PAGE - at)
                c = rng.randrange(CONNS)
                v = (r * 37 + c * 5 + 1) % 251 + 1
                work[c].append((at, fill(v, n)))
                for i in range(at, at + n):
                    exact[i] = v
                at += n
        else:
            # Solo page: one connection writes it whole (aligned) and, in flight at the
            # same time, unaligned pieces inside it; bytes outside the pieces must hold the
            # aligned write's value.
            c = rng.randrange(CONNS)
            va = (r * 37 + c * 5 + 2) % 251 + 1
            vu = (r * 37 + c * 5 + 3) % 251 + 1
            pieces = []
            for _ in range(rng.randrange(1, 4)):
                o = base + rng.randrange(0, PAGE - 1)
                n = rng.randrange(1, min(1500, base + PAGE - o) + 1)
                pieces.append((o, fill(vu, n)))
            order = [(base, fill(va, PAGE))] + pieces
            rng.shuffle(order)
            work[c].extend(order)
            for i in range(base, base + PAGE):
                exact[i] = va
            for o, d in pieces:
                for i in range(o, o + len(d)):
                    exact.pop(i, None)
                    either[i] = {va, vu}
    for w in work:
        rng.shuffle(w)
    def run(h, w):
        for o, d in w:
            h.aio_pwrite(d, o)
        while h.aio_in_flight() > 0:
            h.poll(-1)
    ts = [threading.Thread(target=run, args=(hs[c], work[c])) for c in range(CONNS)]
    for t in ts: t.start()
    for t in ts: t.join()
    got = hs[r % CONNS].pread(REGION, 0)
    bad = [i for i, v in exact.items() if got[i] != v] + \
          [i for i, s in either.items() if got[i] not in s]
    if bad:
        i = min(bad)
        print(f"round {r}: {len(bad)} bytes wrong, first at {i}: got {got[i]} want {exact.get(i, either.get(i))}")
        sys.exit(1)
print("concurrent ok")
