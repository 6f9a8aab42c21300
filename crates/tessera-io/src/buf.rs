//! Aligned I/O buffers and a per-core pool of them.
//!
//! Buffers are 4 KiB aligned so they can be handed to O_DIRECT devices. The pool keeps
//! freed buffers in power-of-two size classes, so a steady workload reuses the same
//! buffers and the datapath performs no heap allocation per I/O.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// Alignment of every I/O buffer: enough for O_DIRECT on 4Kn devices.
pub const BUF_ALIGN: usize = 4096;

/// A heap buffer aligned to [`BUF_ALIGN`]. `len` is its usable capacity.
///
/// Every byte is initialised (a new buffer is zero-filled), so `as_slice` may be read
/// whatever the buffer was used for before: a short device read or a failed receive can
/// leave a buffer partly unwritten, never uninitialised.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// Allocate `cap` bytes (rounded up to the alignment), zero-filled.
    pub fn zeroed(cap: usize) -> AlignedBuf {
        let cap = cap.max(BUF_ALIGN).next_multiple_of(BUF_ALIGN);
        let layout = Layout::from_size_align(cap, BUF_ALIGN).expect("buffer layout");
        // SAFETY: layout has non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, cap }
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap bytes for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap bytes and uniquely borrowed through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.cap, BUF_ALIGN).expect("buffer layout");
        // SAFETY: allocated in zeroed() with exactly this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// Smallest size class: 4 KiB; class k holds buffers of 4 KiB << k.
const MIN_CLASS_SHIFT: u32 = 12;
const CLASSES: usize = 14; // up to 32 MiB
/// Bytes the pool keeps cached per size class before freeing returned buffers.
const CACHE_BYTES_PER_CLASS: usize = 64 << 20;

/// A per-core pool of aligned buffers in power-of-two size classes. Not thread safe on
/// purpose: each core owns one.
pub struct BufPool {
    free: [Vec<AlignedBuf>; CLASSES],
}

impl Default for BufPool {
    fn default() -> Self {
        BufPool {
            free: std::array::from_fn(|_| Vec::new()),
        }
    }
}

impl BufPool {
    fn class_of(len: usize) -> Option<usize> {
        let cap = len.max(1 << MIN_CLASS_SHIFT).next_power_of_two();
        let class = (cap.trailing_zeros() - MIN_CLASS_SHIFT) as usize;
        (class < CLASSES).then_some(class)
    }

    /// The capacity [`BufPool::get`] hands out for `len` bytes (a power-of-two class, or
    /// `len` itself past the largest class): what a request's buffer really holds, for
    /// budgets that count memory in flight.
    pub fn capacity_for(len: usize) -> usize {
        match Self::class_of(len) {
            Some(c) => 1 << (c + MIN_CLASS_SHIFT as usize),
            None => len,
        }
    }

    /// A buffer of at least `len` bytes. Reuses a cached one when possible; its contents
    /// are then whatever its last user left (initialised bytes, not zeroes).
    ///
    /// Only a cache miss allocates, and only that zero-fills: a steady workload reuses
    /// its buffers, so the fill stays off the per-I/O path (the large classes come
    /// straight from the kernel's zeroed pages).
    pub fn get(&mut self, len: usize) -> AlignedBuf {
        match Self::class_of(len) {
            Some(c) => self.free[c]
                .pop()
                .unwrap_or_else(|| AlignedBuf::zeroed(1 << (c + MIN_CLASS_SHIFT as usize))),
            None => AlignedBuf::zeroed(len),
        }
    }

    /// Return a buffer for reuse.
    pub fn put(&mut self, buf: AlignedBuf) {
        if !buf.cap.is_power_of_two() {
            return;
        }
        if let Some(c) = Self::class_of(buf.cap) {
            if (self.free[c].len() + 1) * buf.cap <= CACHE_BYTES_PER_CLASS.max(buf.cap) {
                self.free[c].push(buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_reused() {
        let mut pool = BufPool::default();
        let b = pool.get(4096);
        assert_eq!(b.as_ptr() as usize % BUF_ALIGN, 0);
        let p = b.as_ptr();
        pool.put(b);
        let b2 = pool.get(100);
        assert_eq!(b2.as_ptr(), p);
        let big = pool.get(3 << 20);
        assert_eq!(big.capacity(), 4 << 20);
    }

    #[test]
    fn new_buffers_read_as_zeroes() {
        let mut pool = BufPool::default();
        for len in [1, 4096, 100_000, 64 << 20] {
            let b = pool.get(len);
            assert!(b.capacity() >= len);
            assert!(b.as_slice().iter().all(|&x| x == 0), "len {len}");
        }
    }
}
