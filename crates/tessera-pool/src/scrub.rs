//! Scrub of a layout range: read every copy, find copies that differ or cannot be read,
//! and (with `repair`) make them equal again (docs/architecture.md "Scrub and resync").
//!
//! **Mirrors (raid1, raid10).** Every readable copy of each piece is read through the
//! devices' synchronous face and compared with the *first readable copy in set order*,
//! which is authoritative. Why that one: there are no per-block checksums, so nothing says
//! which copy is "right"; copies only differ after a crash between the copies of a write
//! (or after a device was written behind the pool's back), and then the write was never
//! acknowledged — its old and its new contents are both valid results, so any single
//! choice is correct as long as it is applied to every copy. The first copy is also the
//! one the pool's own synchronous reads (metadata, at open) use, so the repaired state is
//! the one the pool loaded.
//!
//! Copies are compared in 4 KiB blocks; `mismatched` counts the pool bytes of blocks in
//! which some copy differs (or cannot be read), `repaired` those that were rewritten.
//!
//! **Read errors.** A copy that fails with ENODEV (the device is gone) is marked failed,
//! like the read paths do. A copy that fails with another error while another copy of the
//! piece reads fine is a bad sector: with `repair`, the piece is rewritten on it from the
//! authoritative copy and read back; only if the rewrite or the read-back fails is the
//! device marked failed (a disk remaps a bad sector on write, so one bad sector does not
//! cost a whole copy). Without `repair` the copy is marked failed, as a client read would
//! do. When no copy can read a piece, nothing is marked failed (that would only lose the
//! rest of the data): the bytes count as `unreadable`.
//!
//! **Client writes.** A repair must never write a stale copy over a client write. The
//! scrub uses the rebuild's epoch/dirty protocol (`layout/rebuild.rs`, `rebuild_range`): while a
//! [`WriteTracking`] guard is alive every mirror write is counted in flight by epoch and
//! marks the published range dirty; each piece is compared after the writes in flight
//! have completed, and compared (and repaired) again if a write touched it meanwhile,
//! until a comparison no write disturbed (so a repair that raced a write is always
//! redone after it). A disturbed comparison is discarded, so the transient difference of
//! a write in progress is never reported. Writes issued before tracking was switched on are not
//! counted: [`Layout::track_writes`] waits [`TRACK_GRACE`] for them the first time.
//!
//! **Parity layouts** delegate to the parity module (`Layout::parity_scrub_rows`: parity
//! recomputed from the data is compared with the stored parity, whole rows); **concat and
//! raid0** are only read (unreadable ranges are counted).

use std::io;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;
use tessera_io::cast::usize_of;

use crate::layout::{error_reason, FailReason, Layout, Piece};

/// Mismatched pool ranges reported in detail (all are counted).
pub const MAX_RANGES: usize = 100;
/// Comparison granularity.
const BLOCK: usize = 4096;
/// How long [`Layout::track_writes`] waits, when it switches tracking on, for the writes
/// that were issued untracked just before.
pub const TRACK_GRACE: Duration = Duration::from_millis(200);

/// What a scrub of a range found (and did).
#[derive(Default, Debug, Clone)]
pub struct ScrubFindings {
    pub bytes_checked: u64,
    /// Pool bytes found inconsistent between copies (or unreadable on some copy).
    pub mismatched: u64,
    /// Pool bytes rewritten to make the copies equal.
    pub repaired: u64,
    /// Pool bytes that no copy could read.
    pub unreadable: u64,
    /// Pool ranges `(offset, len)` that mismatched, merged when adjacent; at most
    /// [`MAX_RANGES`].
    pub ranges: Vec<(u64, u64)>,
}

impl ScrubFindings {
    /// Record a mismatched pool range.
    pub fn note_range(&mut self, offset: u64, len: u64) {
        if let Some(last) = self.ranges.last_mut() {
            if last.0 + last.1 == offset {
                last.1 += len;
                return;
            }
        }
        if self.ranges.len() < MAX_RANGES {
            self.ranges.push((offset, len));
        }
    }

    /// Fold `o` (a later range's findings) into these.
    pub fn add(&mut self, o: &ScrubFindings) {
        self.bytes_checked += o.bytes_checked;
        self.mismatched += o.mismatched;
        self.repaired += o.repaired;
        self.unreadable += o.unreadable;
        for &(a, l) in &o.ranges {
            self.note_range(a, l);
        }
    }
}

/// Client writes are tracked (epoch/dirty protocol) while this lives.
pub struct WriteTracking<'a> {
    layout: &'a Layout,
}

impl Drop for WriteTracking<'_> {
    fn drop(&mut self) {
        self.layout.copy.tracking.fetch_sub(1, SeqCst);
    }
}

impl Layout {
    /// Track client writes (as during a rebuild) until the guard is dropped: a scrub job
    /// holds one for its whole pass. Switching tracking on waits [`TRACK_GRACE`] for the
    /// writes that were issued untracked.
    pub fn track_writes(&self) -> WriteTracking<'_> {
        if self.copy.tracking.fetch_add(1, SeqCst) == 0 {
            std::thread::sleep(TRACK_GRACE);
        }
        WriteTracking { layout: self }
    }

    /// Scrub pool range `[offset, offset+len)`: see the module documentation.
    pub fn scrub_range(&self, offset: u64, len: u64, repair: bool) -> io::Result<ScrubFindings> {
        self.check(offset, len)?;
        let mut f = ScrubFindings::default();
        if len == 0 {
            return Ok(f);
        }
        if self.kind.is_parity() {
            // The parity layouts' row scrub (`layout/parity_sync.rs`): parity recomputed from the data
            // must match the stored parity; `repair` rewrites wrong parity.
            let r = self.parity_scrub_rows(offset, len, repair)?;
            f.bytes_checked = r.checked;
            f.mismatched = r.mismatched;
            f.repaired = r.repaired;
            f.unreadable = r.unreadable;
            for (o, l) in r.ranges {
                f.note_range(o, l);
            }
            if f.repaired > 0 {
                self.sync()?;
            }
            return Ok(f);
        }
        if !self.kind.is_mirror() {
            // Read in requests of at most `READ` bytes: a failing one is counted whole.
            const READ: u64 = 64 << 10;
            let mut buf = vec![0u8; len.min(READ) as usize];
            for p in self.pieces(offset, len) {
                let mut off = 0;
                while off < p.len {
                    let n = (p.len - off).min(READ);
                    let b = &mut buf[..n as usize];
                    if self.devices[p.dev].read_at(p.dev_offset + off, b).is_err() {
                        f.unreadable += n;
                    }
                    off += n;
                }
                f.bytes_checked += p.len;
            }
            return Ok(f);
        }
        if self.health.rebuilding.load(SeqCst) != 0 {
            return Err(io::Error::other(
                "a rebuild is running on this pool: scrub after it completes",
            ));
        }
        let _track = self.track_writes();
        let mut bufs: Vec<Vec<u8>> = Vec::new();
        for p in self.pieces(offset, len) {
            self.scrub_piece(offset + p.range_offset, p, repair, &mut bufs, &mut f)?;
            f.bytes_checked += p.len;
        }
        if f.repaired > 0 {
            // A repair is durable before the range counts as repaired: a client may read
            // the repaired value now, and if the copy it came from failed later, a power
            // loss must not bring back what the repaired copy held before (soak finding
            // 7: the resync after an unclean open, then a device loss, then a power loss).
            self.sync()?;
        }
        Ok(f)
    }

    /// Compare (and repair) the copies of one mirror piece at pool offset `at`.
    fn scrub_piece(
        &self,
        at: u64,
        p: Piece,
        repair: bool,
        bufs: &mut Vec<Vec<u8>>,
        f: &mut ScrubFindings,
    ) -> io::Result<()> {
        let n = usize_of(p.len);
        let set = self.set_of(p.dev);
        bufs.resize_with(set.len(), Vec::new);
        for b in bufs.iter_mut() {
            b.resize(n, 0);
        }
        let blocks = n.div_ceil(BLOCK);
        // The rebuild's protocol (`layout/copy_track.rs`, `quiet_range`): compared again until no write
        // overlapped the comparison.
        let piece = self.copy.quiet_range(at, p.len, || {
            let mut piece = ScrubFindings::default();
            self.compare_piece(at, p, repair, bufs, blocks, &mut piece)?;
            Ok(piece)
        })?;
        f.add(&piece);
        Ok(())
    }

    fn compare_piece(
        &self,
        at: u64,
        p: Piece,
        repair: bool,
        bufs: &mut [Vec<u8>],
        blocks: usize,
        f: &mut ScrubFindings,
    ) -> io::Result<()> {
        let n = usize_of(p.len);
        let set = self.set_of(p.dev);
        // Per copy: read it (Some(ok)) or not readable (None).
        let mut read: Vec<Option<bool>> = vec![None; set.len()];
        for (k, d) in set.clone().enumerate() {
            if !self.is_readable(d) {
                continue;
            }
            match self.devices[d].read_at(p.dev_offset, &mut bufs[k]) {
                Ok(()) => read[k] = Some(true),
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {
                    self.mark_failed(d, FailReason::Gone)
                }
                Err(_) => read[k] = Some(false),
            }
        }
        let Some(auth) = read.iter().position(|r| *r == Some(true)) else {
            // No copy could read the piece: nothing to repair from, nothing failed.
            if read.iter().any(Option::is_some) {
                f.unreadable += p.len;
            }
            return Ok(());
        };
        // Blocks in which some copy differs from the authoritative one, per copy.
        let mut bad = vec![false; blocks];
        let mut differs: Vec<Vec<bool>> = vec![vec![false; blocks]; set.len()];
        for k in 0..set.len() {
            match read[k] {
                Some(true) if k != auth => {
                    differs[k] = (0..blocks)
                        .map(|b| {
                            let r = b * BLOCK..((b + 1) * BLOCK).min(n);
                            bufs[k][r.clone()] != bufs[auth][r]
                        })
                        .collect();
                }
                Some(false) => differs[k] = vec![true; blocks],
                _ => continue,
            }
            for (x, &d) in bad.iter_mut().zip(&differs[k]) {
                *x |= d;
            }
        }
        if !bad.contains(&true) || self.copy.dirty.load(SeqCst) {
            // Consistent, or a write is changing the piece: compare again after it.
            return Ok(());
        }
        // Blocks left inconsistent on some copy (no repair, or its rewrite failed).
        let mut unfixed = vec![false; blocks];
        let src = &bufs[auth];
        let mut scratch = Vec::new();
        for (k, d) in set.clone().enumerate() {
            if !differs[k].contains(&true) {
                continue;
            }
            let unreadable_copy = read[k] == Some(false);
            let mut ok = repair;
            if !repair && unreadable_copy {
                self.mark_failed(d, FailReason::Read);
            }
            if repair {
                for (s, e) in runs(&differs[k]) {
                    let r = s * BLOCK..(e * BLOCK).min(n);
                    if let Err(err) =
                        self.devices[d].write_at(p.dev_offset + r.start as u64, &src[r])
                    {
                        self.mark_failed(d, error_reason(&err, FailReason::Write));
                        ok = false;
                        break;
                    }
                }
            }
            if ok && unreadable_copy {
                // A bad sector counts as repaired only if it reads back now (a disk
                // remaps a bad sector when it is written).
                scratch.resize(n, 0);
                if let Err(err) = self.devices[d].read_at(p.dev_offset, &mut scratch) {
                    self.mark_failed(d, error_reason(&err, FailReason::Read));
                    ok = false;
                }
            }
            if !ok {
                for (x, &y) in unfixed.iter_mut().zip(&differs[k]) {
                    *x |= y;
                }
            }
        }
        for (b, &x) in bad.iter().enumerate() {
            if x {
                let len = BLOCK.min(n - b * BLOCK) as u64;
                f.mismatched += len;
                if !unfixed[b] {
                    f.repaired += len;
                }
            }
        }
        for (s, e) in runs(&bad) {
            let start = (s * BLOCK) as u64;
            let end = (e * BLOCK).min(n) as u64;
            f.note_range(at + start, end - start);
        }
        Ok(())
    }
}

/// Runs `[start, end)` of `true` in `v`.
fn runs(v: &[bool]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < v.len() {
        if v[i] {
            let s = i;
            while i < v.len() && v[i] {
                i += 1;
            }
            out.push((s, i));
        } else {
            i += 1;
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test data patterns wrap on purpose
mod tests {
    use super::*;
    use crate::format::DEV_DATA_START;
    use crate::layout::LayoutKind;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use tessera_device::{BlockDevice, RamDevice};

    fn raid1(n: u32, size: u64) -> Layout {
        let devs = (0..n)
            .map(|_| RamDevice::new(size).unwrap() as Arc<dyn BlockDevice>)
            .collect();
        Layout::new(LayoutKind::Raid1 { copies: n }, devs).unwrap()
    }

    #[test]
    fn finds_exact_blocks_and_third_copy_follows_the_first() {
        let l = raid1(3, 2 << 20);
        l.write_at(0, &vec![7u8; 64 << 10]).unwrap();
        l.devices[2]
            .write_at(DEV_DATA_START + 8192, &[1u8; 100])
            .unwrap();
        let f = l.scrub_range(0, 64 << 10, false).unwrap();
        assert_eq!((f.mismatched, f.repaired), (4096, 0));
        assert_eq!(f.ranges, vec![(8192, 4096)]);
        let f = l.scrub_range(0, 64 << 10, true).unwrap();
        assert_eq!((f.mismatched, f.repaired), (4096, 4096));
        let mut b = vec![0u8; 64 << 10];
        l.devices[2].read_at(DEV_DATA_START, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 7));
        assert_eq!(l.scrub_range(0, 64 << 10, true).unwrap().mismatched, 0);
    }

    /// A writer hammers a small range while one copy is corrupted and the range is
    /// scrubbed with repair over and over: after every pass the copies are equal — no
    /// client write is lost to a repair that wrote what it read before the write.
    #[test]
    fn scrub_repair_never_overwrites_concurrent_writes() {
        let l = Arc::new(raid1(2, 2 << 20));
        let span = 32 << 10;
        let _t = l.track_writes();
        for pass in 0..60u64 {
            let stop = Arc::new(AtomicBool::new(false));
            let w = {
                let (l, stop) = (l.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    // Bounded: a writer that never pauses would keep the scrub redoing
                    // the range (debug builds on 2 CPUs took minutes).
                    while !stop.load(SeqCst) && i < 20_000 {
                        let b = vec![(pass * 31 + i) as u8; 4096];
                        l.write_at((i % 8) * 4096, &b).unwrap();
                        i += 1;
                    }
                })
            };
            l.devices[1]
                .write_at(DEV_DATA_START + (pass % 8) * 4096, &[0xEE; 4096])
                .unwrap();
            for _ in 0..4 {
                l.scrub_range(0, span, true).unwrap();
            }
            stop.store(true, SeqCst);
            w.join().unwrap();
            let (mut a, mut b) = (vec![0u8; span as usize], vec![0u8; span as usize]);
            l.devices[0].read_at(DEV_DATA_START, &mut a).unwrap();
            l.devices[1].read_at(DEV_DATA_START, &mut b).unwrap();
            assert!(a == b, "pass {pass}: a repair overwrote a client write");
        }
    }
}
