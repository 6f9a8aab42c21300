#!/usr/bin/python3
"""NBD requests through the unaligned path against the aligned one, same client.

Usage: bench/nbd-unaligned.py URI [SECS] [QD]
Runs, for SECS seconds each (default 5) at queue depth QD (default 32), random 4 KiB
reads and writes over the first 256 MiB, aligned (offset a multiple of 4096) and
misaligned by 1 byte (offset 4096*k + 1: a read of the 8 KiB superset, a
read-modify-write of two partial blocks), plus 1-byte writes. The client is libnbd's
Python binding with no block size requested, so the server serves the unaligned ones;
Python caps the rate, so compare the lines with each other, not with fio figures.
Prints one RESULT line per case.
"""
import random, sys, time
import nbd

uri = sys.argv[1]
secs = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
qd = int(sys.argv[3]) if len(sys.argv) > 3 else 32
span = 256 << 20
h = nbd.NBD()
h.set_request_block_size(False)
h.set_strict_mode(0)
h.connect_uri(uri)
rng = random.Random(1)
data = bytearray(rng.randbytes(4096))
# Prefill so reads hit allocated space.
for off in range(0, span, 1 << 20):
    h.pwrite(bytes(1 << 20), off)

def run(name, write, size, misalign):
    bufs = [nbd.Buffer(size) for _ in range(qd)]
    wdata = bytes(data[:size])
    done = 0
    inflight = 0
    end = time.monotonic() + secs
    t0 = time.monotonic()
    def submit(i):
        off = rng.randrange(0, span // 4096 - 2) * 4096 + misalign
        if write:
            h.aio_pwrite(wdata, off)
        else:
            h.aio_pread(bufs[i], off)
    for i in range(qd):
        submit(i)
        inflight += 1
    while True:
        if h.aio_in_flight() > 0:
            h.poll(-1)
        while True:
            try:
                c = h.aio_peek_command_completed()
            except nbd.Error:
                break  # nothing in flight nor completed
            if c == 0:
                break
            h.aio_command_completed(c)
            done += 1
            inflight -= 1
            if time.monotonic() < end:
                submit(done % qd)
                inflight += 1
        if inflight == 0:
            break
    t = time.monotonic() - t0
    print(f"RESULT case={name} qd={qd} iops={done / t:.0f} MiBps={done * size / t / 2**20:.1f}")

for rep in range(2):
    run("read-4k-aligned", False, 4096, 0)
    run("read-4k-offset+1", False, 4096, 1)
    run("write-4k-aligned", True, 4096, 0)
    run("write-4k-offset+1", True, 4096, 1)
    run("write-1byte", True, 1, 1)
h.shutdown()
