//! A RAM device: anonymous memory, completing every operation inline.

use std::io;
use std::sync::Arc;
use tessera_io::cast::usize_of;

use crate::{check_range, out_of_range, BlockDevice, CoreIo, IoHandle, IoOp, Tag};

/// Anonymous memory mapped once at creation. Pages are faulted in on first touch, so a
/// large RAM device costs nothing until written.
pub struct RamDevice {
    base: *mut u8,
    size: u64,
    name: String,
}

// SAFETY: the mapping is valid for the device's lifetime and accessed only through raw
// copies at offsets the callers own (concurrent clients writing the same block race as
// they would on any disk; no Rust reference to the memory is ever formed across threads).
unsafe impl Send for RamDevice {}
// SAFETY: see above.
unsafe impl Sync for RamDevice {}

impl RamDevice {
    pub fn new(size: u64) -> io::Result<Arc<RamDevice>> {
        Self::named(size, format!("ram:{}", crate::format_size(size)))
    }

    pub fn named(size: u64, name: String) -> io::Result<Arc<RamDevice>> {
        if size == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a RAM device needs a non-zero size",
            ));
        }
        // SAFETY: anonymous private mapping; checked for MAP_FAILED below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                usize_of(size),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Arc::new(RamDevice {
            base: p as *mut u8,
            size,
            name,
        }))
    }

    /// A RAM device holding a copy of `image` (used to restart from a simulated crash).
    pub fn from_image(image: &[u8]) -> io::Result<Arc<RamDevice>> {
        let d = Self::new(image.len() as u64)?;
        d.write_at(0, image)?;
        Ok(d)
    }

    /// Read the whole device into a vector.
    pub fn image(&self) -> Vec<u8> {
        let mut v = vec![0u8; usize_of(self.size)];
        // SAFETY: base is valid for size bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.base, v.as_mut_ptr(), v.len()) };
        v
    }

    #[inline]
    fn exec(&self, op: IoOp) -> i32 {
        match op {
            IoOp::Read { offset, len, buf } => {
                if let Err(e) = check_range(self.size, offset, len as u64) {
                    return e;
                }
                // SAFETY: range checked; the submitter guarantees buf holds len bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.base.add(usize_of(offset)),
                        buf,
                        len as usize,
                    )
                };
                len as i32
            }
            IoOp::Write { offset, len, buf } => {
                if let Err(e) = check_range(self.size, offset, len as u64) {
                    return e;
                }
                // SAFETY: as above.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        buf,
                        self.base.add(usize_of(offset)),
                        len as usize,
                    )
                };
                len as i32
            }
            IoOp::Flush => 0,
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => {
                if let Err(e) = check_range(self.size, offset, len) {
                    return e;
                }
                // SAFETY: range checked.
                unsafe { std::ptr::write_bytes(self.base.add(usize_of(offset)), 0, usize_of(len)) };
                0
            }
        }
    }
}

impl Drop for RamDevice {
    fn drop(&mut self) {
        // SAFETY: unmapping the region mapped in new().
        unsafe { libc::munmap(self.base as *mut libc::c_void, usize_of(self.size)) };
    }
}

struct RamHandle(Arc<RamDevice>);

impl IoHandle for RamHandle {
    #[inline]
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let r = self.0.exec(op);
        io.complete(tag, r);
    }
    fn size(&self) -> u64 {
        self.0.size
    }
}

impl BlockDevice for RamDevice {
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn alignment(&self) -> u32 {
        1
    }
    fn is_volatile(&self) -> bool {
        true
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range(self.size, offset, buf.len() as u64)
            .map_err(|_| out_of_range(&self.name, offset, buf.len() as u64, self.size))?;
        // SAFETY: range checked.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.add(usize_of(offset)),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        check_range(self.size, offset, buf.len() as u64)
            .map_err(|_| out_of_range(&self.name, offset, buf.len() as u64, self.size))?;
        // SAFETY: range checked.
        unsafe {
            std::ptr::copy_nonoverlapping(buf.as_ptr(), self.base.add(usize_of(offset)), buf.len())
        };
        Ok(())
    }
    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size, offset, len)
            .map_err(|_| out_of_range(&self.name, offset, len, self.size))?;
        // SAFETY: range checked.
        unsafe { std::ptr::write_bytes(self.base.add(usize_of(offset)), 0, usize_of(len)) };
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle> {
        Box::new(RamHandle(self))
    }
}
