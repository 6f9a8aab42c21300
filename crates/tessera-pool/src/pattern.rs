//! Access-pattern detection per region of a volume (seed 004's Sequential /
//! NSIO-monotonic / NSIO spans): each core's volume handle watches the offsets of the
//! reads and writes it serves and labels every 1 GiB region of the volume by its recent
//! history, so that the datapath can decide per request whether a region is being
//! streamed (readahead pays, cache admission does not) or hit at random (no readahead;
//! reads first under QoS).
//!
//! The detector is per core and per handle: no lock, no shared write, no allocation
//! after the handle is opened. A client's stream arrives on one connection and so on
//! one core, which is where it must be seen whole; a stream split over several
//! connections looks monotonic to each core, which is what it is there.
//!
//! How one request is classified, against the region's last few streams (a stream is
//! the offset where its last request ended):
//! - **sequential** when it starts within [`SEQ_SLACK`] of where a stream ended (a queue
//!   depth above one reorders a stream a little; a small skip is still a stream);
//! - **monotonic** when it starts further on, past the most recent stream's end (an
//!   index walked in order, a sparse scan: forward, but not contiguous);
//! - **random** otherwise.
//!
//! A region's label is the majority of its last [`WINDOW`] requests (of all it has seen
//! while it has seen fewer): sequential when at least 3/4 of them were sequential,
//! monotonic when at least 3/4 were sequential or monotonic, random when neither holds,
//! and unknown before it has seen half a window.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Regions are 1 GiB spans of the volume (as the seed's table).
pub const REGION_SHIFT: u32 = 30;
/// How far from a stream's end a request may start and still continue it.
pub const SEQ_SLACK: u64 = 128 << 10;
/// Requests a region's label is decided over.
pub const WINDOW: u32 = 16;
/// Regions a handle keeps a history for at once (direct-mapped by region index; a
/// region that collides with another starts over, which costs one window of labels).
const SLOTS: usize = 64;
/// Streams a region tracks at once (interleaved sequential readers of one region): a
/// power of two, so that a stream index is masked rather than checked.
const STREAMS: usize = 4;
#[allow(clippy::cast_possible_truncation)] // 3
const STREAM_MASK: u8 = (STREAMS - 1) as u8;

/// What a region's recent requests look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Fewer than half a window of requests seen yet.
    Unknown = 0,
    Sequential = 1,
    Monotonic = 2,
    Random = 3,
}

impl Pattern {
    pub const ALL: [Pattern; 4] = [
        Pattern::Unknown,
        Pattern::Sequential,
        Pattern::Monotonic,
        Pattern::Random,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Pattern::Unknown => "unknown",
            Pattern::Sequential => "sequential",
            Pattern::Monotonic => "monotonic",
            Pattern::Random => "random",
        }
    }
}

/// One region's recent history.
#[derive(Clone, Copy)]
struct Region {
    /// Region index + 1 (0: the slot is empty).
    tag: u64,
    /// Where each tracked stream's last request ended; 0 is "no stream".
    ends: [u64; STREAMS],
    /// Which stream was used last (the monotonic test compares with it).
    last: u8,
    /// The stream to replace next when a request continues none.
    victim: u8,
    /// Requests seen, up to [`WINDOW`].
    seen: u8,
    /// The last [`WINDOW`] requests, newest in bit 0: sequential ones, and sequential or
    /// monotonic ones.
    seq_bits: u16,
    fwd_bits: u16,
}

const EMPTY: Region = Region {
    tag: 0,
    ends: [0; STREAMS],
    last: 0,
    victim: 0,
    seen: 0,
    seq_bits: 0,
    fwd_bits: 0,
};

impl Region {
    // Both functions run on every read and write, with outcomes a random workload
    // makes unpredictable: they are written without data-dependent branches (the
    // first version, with them, cost 40 ns per random 4 KiB read, 5% of the engine's
    // time per I/O; this one is within noise).

    #[inline]
    fn label(&self) -> Pattern {
        let seen = u32::from(self.seen);
        // 3/4 of what the window holds so far, rounded up.
        let quorum = (seen * 3).div_ceil(4);
        let seq = u8::from(self.seq_bits.count_ones() >= quorum);
        let fwd = u8::from(self.fwd_bits.count_ones() >= quorum);
        let known = u8::from(seen >= WINDOW / 2);
        // Sequential 1, else monotonic 2, else random 3; unknown 0 before half a window.
        let code = known * (3 - 2 * seq - (fwd & (seq ^ 1)));
        Pattern::ALL[usize::from(code)]
    }

    /// Classify a request at `[offset, end)` and remember it.
    #[inline]
    fn observe(&mut self, offset: u64, end: u64) {
        // Bit i: the request continues stream i.
        let mut near = 0u32;
        for (i, &e) in self.ends.iter().enumerate() {
            near |= u32::from(e != 0 && offset.abs_diff(e) <= SEQ_SLACK) << i;
        }
        let seq = near != 0;
        let last = self.ends[usize::from(self.last & STREAM_MASK)];
        let fwd = seq | (last != 0 && offset > last);
        // Continue the matched stream; a forward jump moves the last one on; anything
        // else replaces the next victim.
        let stream = if seq {
            first_bit(near)
        } else if fwd {
            self.last
        } else {
            self.victim
        } & STREAM_MASK;
        self.victim = (self.victim + u8::from(!fwd)) & STREAM_MASK;
        self.ends[usize::from(stream)] = end;
        self.last = stream;
        self.seq_bits = self.seq_bits << 1 | u16::from(seq);
        self.fwd_bits = self.fwd_bits << 1 | u16::from(fwd);
        self.seen += u8::from(u32::from(self.seen) < WINDOW);
    }
}

/// The index of the lowest bit set in a non-zero stream mask (below [`STREAMS`]).
#[allow(clippy::cast_possible_truncation)] // below 32, and masked by the caller
#[inline]
fn first_bit(mask: u32) -> u8 {
    mask.trailing_zeros() as u8
}

/// One handle's detector for one kind of request (reads or writes): the regions it has
/// seen lately, by label.
pub struct Detector {
    regions: [Region; SLOTS],
}

impl Default for Detector {
    fn default() -> Self {
        Detector {
            regions: [EMPTY; SLOTS],
        }
    }
}

impl Detector {
    /// Note a request of `len` bytes at `offset`; the label of its region after it.
    #[inline]
    pub fn observe(&mut self, offset: u64, len: u64) -> Pattern {
        let index = offset >> REGION_SHIFT;
        // The low bits of the index pick the slot: neighbouring regions never collide.
        let r = &mut self.regions[usize::try_from(index % SLOTS as u64).expect("below SLOTS")];
        if r.tag != index + 1 {
            *r = EMPTY;
            r.tag = index + 1;
        }
        r.observe(offset, offset.saturating_add(len));
        r.label()
    }

    /// The label of the region that holds `offset`, without noting anything.
    pub fn label_at(&self, offset: u64) -> Pattern {
        let index = offset >> REGION_SHIFT;
        let r = &self.regions[usize::try_from(index % SLOTS as u64).expect("below SLOTS")];
        if r.tag == index + 1 {
            r.label()
        } else {
            Pattern::Unknown
        }
    }
}

/// Reads or writes (each has its own detector: a region read as a stream may be
/// written at random).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Read = 0,
    Write = 1,
}

/// A volume's requests and bytes by direction and by the label of their region when
/// they were served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PatternCounts {
    pub requests: [[u64; 4]; 2],
    pub bytes: [[u64; 4]; 2],
}

impl PatternCounts {
    pub fn requests_of(&self, d: Direction, p: Pattern) -> u64 {
        self.requests[d as usize][p as usize]
    }

    pub fn bytes_of(&self, d: Direction, p: Pattern) -> u64 {
        self.bytes[d as usize][p as usize]
    }
}

/// The volume's totals, which handles add their counts to (in batches: see
/// [`HandlePatterns`]).
#[derive(Default)]
pub struct PatternTotals {
    requests: [[AtomicU64; 4]; 2],
    bytes: [[AtomicU64; 4]; 2],
}

impl PatternTotals {
    fn add(&self, c: &PatternCounts) {
        for d in 0..2 {
            for p in 0..4 {
                if c.requests[d][p] != 0 {
                    self.requests[d][p].fetch_add(c.requests[d][p], Relaxed);
                    self.bytes[d][p].fetch_add(c.bytes[d][p], Relaxed);
                }
            }
        }
    }

    pub fn snapshot(&self) -> PatternCounts {
        let mut c = PatternCounts::default();
        for d in 0..2 {
            for p in 0..4 {
                c.requests[d][p] = self.requests[d][p].load(Relaxed);
                c.bytes[d][p] = self.bytes[d][p].load(Relaxed);
            }
        }
        c
    }
}

/// Requests a handle counts before it adds them to its volume's totals: the totals are
/// shared by every core, and one atomic add per request and counter would be the only
/// shared write on the read path. They lag by at most this many requests per open
/// handle, and a closing handle adds what it has.
pub const FLUSH_EVERY: u32 = 256;

/// One handle's detectors and the counts it has not yet added to its volume's totals.
#[derive(Default)]
pub struct HandlePatterns {
    reads: Detector,
    writes: Detector,
    pending: PatternCounts,
    unflushed: u32,
}

impl HandlePatterns {
    /// Note a request; the label of its region (for this direction) after it.
    #[inline]
    pub fn observe(
        &mut self,
        d: Direction,
        offset: u64,
        len: u64,
        totals: &PatternTotals,
    ) -> Pattern {
        let det = match d {
            Direction::Read => &mut self.reads,
            Direction::Write => &mut self.writes,
        };
        let p = det.observe(offset, len);
        self.pending.requests[d as usize][p as usize] += 1;
        self.pending.bytes[d as usize][p as usize] += len;
        self.unflushed += 1;
        if self.unflushed >= FLUSH_EVERY {
            self.flush(totals);
        }
        p
    }

    /// The label of the region at `offset` for direction `d`, without noting anything.
    pub fn label_at(&self, d: Direction, offset: u64) -> Pattern {
        match d {
            Direction::Read => self.reads.label_at(offset),
            Direction::Write => self.writes.label_at(offset),
        }
    }

    /// Add the pending counts to `totals`.
    pub fn flush(&mut self, totals: &PatternTotals) {
        if self.unflushed != 0 {
            totals.add(&self.pending);
            self.pending = PatternCounts::default();
            self.unflushed = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K4: u64 = 4096;

    fn run(d: &mut Detector, offsets: impl IntoIterator<Item = u64>, len: u64) -> Pattern {
        let mut p = Pattern::Unknown;
        for o in offsets {
            p = d.observe(o, len);
        }
        p
    }

    /// A small deterministic generator (xorshift) for random offsets.
    fn randoms(seed: u64, n: usize, span: u64) -> Vec<u64> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % (span / K4)) * K4
            })
            .collect()
    }

    #[test]
    fn a_stream_is_sequential_after_half_a_window() {
        let mut d = Detector::default();
        for i in 0..u64::from(WINDOW / 2 - 1) {
            assert_eq!(d.observe(i * K4, K4), Pattern::Unknown, "request {i}");
        }
        // The first request continues no stream; the next 7 all do.
        assert_eq!(d.observe(7 * K4, K4), Pattern::Sequential);
        for i in 8..64 {
            assert_eq!(d.observe(i * K4, K4), Pattern::Sequential, "request {i}");
        }
        assert_eq!(d.label_at(0), Pattern::Sequential);
        assert_eq!(d.label_at(1 << REGION_SHIFT), Pattern::Unknown);
    }

    #[test]
    fn random_offsets_are_random_and_forward_gaps_are_monotonic() {
        let mut d = Detector::default();
        assert_eq!(run(&mut d, randoms(7, 64, 1 << 30), K4), Pattern::Random);
        // An ordered walk with gaps far beyond the slack (an index read in key order).
        let mut d = Detector::default();
        assert_eq!(
            run(&mut d, (0..64).map(|i| i * (4 << 20)), K4),
            Pattern::Monotonic
        );
        // The same walk backwards is not forward.
        let mut d = Detector::default();
        assert_eq!(
            run(&mut d, (0..64).rev().map(|i| i * (4 << 20)), K4),
            Pattern::Random
        );
    }

    #[test]
    fn interleaved_streams_and_reordering_stay_sequential() {
        // Four readers of one region, in turn.
        let mut d = Detector::default();
        let bases = [0, 100 << 20, 300 << 20, 700 << 20];
        let offs = (0..32).flat_map(|i| bases.map(|b| b + i * (64 << 10)));
        assert_eq!(run(&mut d, offs, 64 << 10), Pattern::Sequential);
        // A queue depth of 8 lets requests of one stream arrive out of order.
        let mut d = Detector::default();
        let offs = (0..64u64).map(|i| (i ^ 3) * K4);
        assert_eq!(run(&mut d, offs, K4), Pattern::Sequential);
    }

    #[test]
    fn counts_reach_the_totals_in_batches_and_on_flush() {
        let totals = PatternTotals::default();
        let mut h = HandlePatterns::default();
        for i in 0..u64::from(FLUSH_EVERY) - 1 {
            h.observe(Direction::Read, i * K4, K4, &totals);
        }
        assert_eq!(
            totals.snapshot(),
            PatternCounts::default(),
            "nothing shared yet"
        );
        h.observe(Direction::Read, 10 * K4, K4, &totals);
        let c = totals.snapshot();
        let reads: u64 = Pattern::ALL
            .iter()
            .map(|&p| c.requests_of(Direction::Read, p))
            .sum();
        assert_eq!(reads, u64::from(FLUSH_EVERY));
        assert_eq!(
            c.requests_of(Direction::Read, Pattern::Unknown),
            u64::from(WINDOW / 2 - 1)
        );
        assert!(
            c.requests_of(Direction::Read, Pattern::Sequential) > 200,
            "{c:?}"
        );
        assert_eq!(
            c.bytes_of(Direction::Read, Pattern::Sequential),
            c.requests_of(Direction::Read, Pattern::Sequential) * K4
        );
        h.observe(Direction::Write, 0, 512, &totals);
        h.flush(&totals);
        assert_eq!(
            totals
                .snapshot()
                .requests_of(Direction::Write, Pattern::Unknown),
            1
        );
        assert_eq!(h.label_at(Direction::Read, 0), Pattern::Sequential);
        assert_eq!(h.label_at(Direction::Write, 0), Pattern::Unknown);
    }

    #[test]
    fn a_region_changes_label_with_its_workload_and_regions_are_separate() {
        let mut d = Detector::default();
        let g = 1u64 << REGION_SHIFT;
        assert_eq!(
            run(&mut d, (0..64).map(|i| i * K4), K4),
            Pattern::Sequential
        );
        assert_eq!(
            run(&mut d, randoms(3, 64, g).into_iter().map(|o| g + o), K4),
            Pattern::Random
        );
        // Region 0 is still a stream; a random burst then turns it random within a window.
        assert_eq!(d.label_at(0), Pattern::Sequential);
        assert_eq!(
            run(&mut d, randoms(5, WINDOW.try_into().unwrap(), g), K4),
            Pattern::Random
        );
        // Regions 64 apart share a slot: the newer one starts over.
        assert_eq!(
            run(&mut d, (0..4).map(|i| 64 * g + i * K4), K4),
            Pattern::Unknown
        );
        assert_eq!(d.label_at(0), Pattern::Unknown);
    }
}
