//! Helpers shared by the pool integration tests: run block operations synchronously on a
//! private core context.

#![allow(dead_code)]

use tessera_io::{CoreIo, IoHandle, IoOp};

pub fn core() -> CoreIo {
    CoreIo::new(0, 64, None).expect("io_uring")
}

/// Submit one operation and drive the context until its completion; returns the result.
pub fn run(io: &mut CoreIo, h: &mut dyn IoHandle, op: IoOp) -> i32 {
    let mut res = None;
    h.submit(io, op, 7);
    io.run_until_idle(|_, tag, r| {
        assert_eq!(tag, 7);
        assert!(res.replace(r).is_none(), "two completions for one submit");
    });
    res.expect("no completion")
}

pub fn write(io: &mut CoreIo, h: &mut dyn IoHandle, offset: u64, data: &[u8]) -> i32 {
    run(
        io,
        h,
        IoOp::Write {
            offset,
            len: data.len() as u32,
            buf: data.as_ptr(),
        },
    )
}

pub fn read(
    io: &mut CoreIo,
    h: &mut dyn IoHandle,
    offset: u64,
    len: usize,
) -> Result<Vec<u8>, i32> {
    let mut v = vec![0xEEu8; len];
    let r = run(
        io,
        h,
        IoOp::Read {
            offset,
            len: len as u32,
            buf: v.as_mut_ptr(),
        },
    );
    if r < 0 {
        Err(r)
    } else {
        Ok(v)
    }
}

pub fn flush(io: &mut CoreIo, h: &mut dyn IoHandle) -> i32 {
    run(io, h, IoOp::Flush)
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
