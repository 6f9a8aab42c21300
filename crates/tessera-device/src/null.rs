//! A null device: accepts every write and discards it; reads leave the buffer untouched on
//! the datapath (like SPDK's null bdev) and return zeros on the synchronous face.

use std::io;
use std::sync::Arc;

use crate::{check_range, out_of_range, BlockDevice, CoreIo, IoHandle, IoOp, Tag};

pub struct NullDevice {
    size: u64,
}

impl NullDevice {
    pub fn new(size: u64) -> Arc<NullDevice> {
        Arc::new(NullDevice { size })
    }
}

struct NullHandle(u64);

impl IoHandle for NullHandle {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let r = match op {
            IoOp::Read { offset, len, .. } | IoOp::Write { offset, len, .. } => {
                check_range(self.0, offset, len as u64).map(|_| len as i32)
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => {
                check_range(self.0, offset, len).map(|_| 0)
            }
            IoOp::Flush => Ok(0),
        };
        io.complete(tag, r.unwrap_or_else(|e| e));
    }
    fn size(&self) -> u64 {
        self.0
    }
}

impl BlockDevice for NullDevice {
    fn describe(&self) -> String {
        format!("null:{}", crate::format_size(self.size))
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
            .map_err(|_| out_of_range("null", offset, buf.len() as u64, self.size))?;
        buf.fill(0);
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        check_range(self.size, offset, buf.len() as u64)
            .map_err(|_| out_of_range("null", offset, buf.len() as u64, self.size))
    }
    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size, offset, len)
            .map_err(|_| out_of_range("null", offset, len, self.size))
    }
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle> {
        Box::new(NullHandle(self.size))
    }
}
