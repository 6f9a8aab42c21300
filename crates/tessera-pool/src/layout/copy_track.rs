//! Copy tracking: the protocol that lets a rebuild or scrub copy (or compare) a mirror
//! range while clients keep writing to it, without losing a write.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use tessera_io::cast::usize_of;

/// Attempts at copying (or comparing) a mirror range that a client write overlapped,
/// before new writes to the range are held back for the next attempt.
const HOLD_AFTER: u32 = 4;

/// Writes in flight while a rebuild or scrub runs, and the range being copied.
pub(crate) struct CopyTracker {
    /// The pool range `[start, end)` being copied (`u64::MAX` start: none).
    start: AtomicU64,
    end: AtomicU64,
    /// Set by a write that overlaps the range being copied: the copy is redone.
    pub(crate) dirty: AtomicBool,
    /// Set after a range was found dirty `HOLD_AFTER` times: new writes to it wait until
    /// the copy is done (see `quiet_range`), so a block rewritten without pause cannot
    /// starve a rebuild or scrub.
    hold: AtomicBool,
    /// Writes in flight while a rebuild runs, by epoch parity (see `begin_write`).
    epoch: AtomicU64,
    inflight: [AtomicU64; 2],
    /// Scrub repair running (a count): writes are tracked as during a rebuild (scrub.rs).
    pub(crate) tracking: AtomicU64,
}

impl Default for CopyTracker {
    fn default() -> CopyTracker {
        CopyTracker {
            start: AtomicU64::new(u64::MAX),
            end: AtomicU64::new(0),
            dirty: AtomicBool::new(false),
            hold: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            inflight: [AtomicU64::new(0), AtomicU64::new(0)],
            tracking: AtomicU64::new(0),
        }
    }
}

impl CopyTracker {
    /// A write to pool range `[offset, offset+len)` starts while a rebuild may run: it
    /// is counted in flight under the current epoch, and marks the range being copied
    /// dirty when it overlaps it. Returns the token for `end_write`. (The epoch is
    /// re-checked after the increment so a rebuild that flips it always sees us.)
    #[inline]
    pub(crate) fn begin_write(&self, offset: u64, len: u64) -> u64 {
        let e = loop {
            let e = self.epoch.load(SeqCst);
            self.inflight[(e & 1) as usize].fetch_add(1, SeqCst);
            if self.epoch.load(SeqCst) == e {
                break e;
            }
            self.inflight[(e & 1) as usize].fetch_sub(1, SeqCst);
        };
        let s = self.start.load(SeqCst);
        if s != u64::MAX && offset < self.end.load(SeqCst) && offset + len > s {
            self.dirty.store(true, SeqCst);
        }
        e & 1
    }

    #[inline]
    pub(crate) fn end_write(&self, token: u64) {
        self.inflight[usize_of(token)].fetch_sub(1, SeqCst);
    }

    /// True while writes to `[offset, offset+len)` must wait: a rebuild or scrub holds
    /// the range it is copying (`quiet_range`).
    #[inline]
    pub(crate) fn held(&self, offset: u64, len: u64) -> bool {
        self.hold.load(SeqCst)
            && offset < self.end.load(SeqCst)
            && offset + len > self.start.load(SeqCst)
    }

    /// Run `f` (a copy or comparison of mirror range `[at, at+len)`) until it ran with no
    /// client write to the range in flight or started meanwhile: the range is published,
    /// the writes that started before are waited for, and `f` is run again when a write
    /// overlapped it. After `HOLD_AFTER` such attempts, new writes to the range wait
    /// while `f` runs (mirror handles defer them, the synchronous face yields), so the
    /// loop ends even under a client that rewrites the range without pause.
    pub(crate) fn quiet_range<T>(
        &self,
        at: u64,
        len: u64,
        mut f: impl FnMut() -> io::Result<T>,
    ) -> io::Result<T> {
        let mut attempt = 0u32;
        let r = loop {
            self.dirty.store(false, SeqCst);
            self.end.store(at + len, SeqCst);
            self.start.store(at, SeqCst);
            if attempt >= HOLD_AFTER {
                self.hold.store(true, SeqCst);
            }
            // Wait for the writes that started before the range was published.
            let old = self.epoch.fetch_add(1, SeqCst);
            while self.inflight[(old & 1) as usize].load(SeqCst) != 0 {
                std::thread::yield_now();
            }
            match f() {
                Ok(v) if !self.dirty.load(SeqCst) => break Ok(v),
                Ok(_) => attempt += 1,
                Err(e) => break Err(e),
            }
        };
        self.hold.store(false, SeqCst);
        self.start.store(u64::MAX, SeqCst);
        r
    }
}
