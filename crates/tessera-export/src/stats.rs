//! Client I/O figures: one block per connection, written only by the core serving it,
//! and a registry per export target that sums them (open and closed connections).

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use tessera_io::counters::{CounterRegistry, Counters};
use tessera_io::hist::{Histogram, SharedHistogram};

/// Client I/O figures of one connection. Written only by the connection's core (plain
/// loads and stores, no atomic read-modify-write), read by the API.
#[derive(Default)]
pub struct IoStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    /// Every request that is neither a read nor a write: FLUSH, TRIM, WRITE_ZEROES,
    /// CACHE, BLOCK_STATUS (and the NVMe equivalents).
    pub others: AtomicU64,
    /// The flushes, discards (TRIM, Dataset Management) and write-zeroes among `others`.
    pub flushes: AtomicU64,
    pub discards: AtomicU64,
    pub write_zeroes: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub errors: AtomicU64,
    /// Time requests spent held back by QoS limits, nanoseconds.
    pub throttled_ns: AtomicU64,
    /// Request latency (receipt to reply queued), nanoseconds, of reads, of writes and
    /// of every other request: one histogram per class, so a request records into one.
    pub read_latency: SharedHistogram,
    pub write_latency: SharedHistogram,
    pub other_latency: SharedHistogram,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum IoClass {
    Read,
    Write,
    Flush,
    /// NBD TRIM, NVMe Dataset Management (deallocate).
    Discard,
    WriteZeroes,
    /// CACHE, BLOCK_STATUS, and any other command a client sends.
    Other,
}

impl IoStats {
    #[inline]
    pub fn record(&self, class: IoClass, bytes: u64, latency_ns: u64, ok: bool) {
        let bump = |a: &AtomicU64, by: u64| a.store(a.load(Relaxed).wrapping_add(by), Relaxed);
        let latency = match class {
            IoClass::Read => {
                bump(&self.reads, 1);
                bump(&self.read_bytes, bytes);
                &self.read_latency
            }
            IoClass::Write => {
                bump(&self.writes, 1);
                bump(&self.write_bytes, bytes);
                &self.write_latency
            }
            other => {
                bump(&self.others, 1);
                match other {
                    IoClass::Flush => bump(&self.flushes, 1),
                    IoClass::Discard => bump(&self.discards, 1),
                    IoClass::WriteZeroes => bump(&self.write_zeroes, 1),
                    _ => {}
                }
                &self.other_latency
            }
        };
        if !ok {
            bump(&self.errors, 1);
        }
        latency.record_single_writer(latency_ns);
    }

    #[inline]
    pub fn add_throttled(&self, ns: u64) {
        self.throttled_ns
            .store(self.throttled_ns.load(Relaxed).wrapping_add(ns), Relaxed);
    }
}

impl Counters for IoStats {
    type Totals = StatsSnapshot;

    fn add_to(&self, t: &mut StatsSnapshot) {
        t.throttled_ns += self.throttled_ns.load(Relaxed);
        t.reads += self.reads.load(Relaxed);
        t.writes += self.writes.load(Relaxed);
        t.others += self.others.load(Relaxed);
        t.flushes += self.flushes.load(Relaxed);
        t.discards += self.discards.load(Relaxed);
        t.write_zeroes += self.write_zeroes.load(Relaxed);
        t.read_bytes += self.read_bytes.load(Relaxed);
        t.write_bytes += self.write_bytes.load(Relaxed);
        t.errors += self.errors.load(Relaxed);
        let mut read = Histogram::default();
        let mut write = Histogram::default();
        self.read_latency.snapshot_into(&mut read);
        self.write_latency.snapshot_into(&mut write);
        self.other_latency.snapshot_into(&mut t.latency);
        t.latency.merge(&read);
        t.latency.merge(&write);
        t.read_latency.merge(&read);
        t.write_latency.merge(&write);
    }
}

/// An export target's cumulative client I/O figures since the node started.
#[derive(Clone, Default)]
pub struct StatsSnapshot {
    pub reads: u64,
    pub writes: u64,
    pub others: u64,
    pub flushes: u64,
    pub discards: u64,
    pub write_zeroes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    pub throttled_ns: u64,
    /// Every request's latency (nanoseconds), and the reads' and writes' alone.
    pub latency: Histogram,
    pub read_latency: Histogram,
    pub write_latency: Histogram,
}

/// The stats blocks of one target's connections. Control plane only: connections
/// register when they open and unregister when they close, never per I/O.
pub type StatsRegistry = CounterRegistry<IoStats>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_connections_keep_counting() {
        let reg = StatsRegistry::default();
        let a = reg.register();
        let b = reg.register();
        a.record(IoClass::Read, 4096, 10, true);
        b.record(IoClass::Write, 512, 10, false);
        reg.unregister(&a);
        b.record(IoClass::Other, 0, 10, true);
        b.record(IoClass::Flush, 0, 10, true);
        let s = reg.snapshot();
        assert_eq!((s.reads, s.writes, s.others, s.errors), (1, 1, 2, 1));
        assert_eq!((s.flushes, s.discards, s.write_zeroes), (1, 0, 0));
        assert_eq!((s.read_bytes, s.write_bytes), (4096, 512));
        assert_eq!(s.latency.count(), 4);
        assert_eq!((s.read_latency.count(), s.write_latency.count()), (1, 1));
    }
}
