//! Block operations run one at a time on a private core context, as the pool and device
//! tests drive their handles.

use tessera_io::cast::u32_of;
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};

/// A core context of its own for a test thread.
pub fn core() -> CoreIo {
    CoreIo::new(0, 64, None).expect("io_uring")
}

/// Submit one operation and drive the context until its completion; returns the result.
pub fn run(io: &mut CoreIo, h: &mut dyn IoHandle, op: IoOp) -> i32 {
    let mut res = None;
    // SAFETY: every caller's buffer outlives this call, which drains the completion before
    // it returns.
    unsafe { h.submit(io, op, Tag::task(0, 7)) };
    io.run_until_idle(|_, tag, r| {
        assert_eq!(tag, Tag::task(0, 7));
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
            len: u32_of(data.len()),
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
            len: u32_of(len),
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

/// Read the whole of `model.len()` back (96 KiB reads, 8 in flight) and compare; `what`
/// names the situation in a failure.
pub fn verify_all(io: &mut CoreIo, h: &mut dyn IoHandle, model: &[u8], what: &str) {
    let chunk = 96 << 10;
    let batch = 8;
    let mut bufs = vec![vec![0u8; chunk]; batch];
    for start in (0..model.len()).step_by(chunk * batch) {
        let mut n = 0;
        for (i, b) in bufs.iter_mut().enumerate() {
            let off = start + i * chunk;
            if off >= model.len() {
                break;
            }
            let len = chunk.min(model.len() - off);
            // SAFETY: each read has its own buffer in `bufs`, which outlives the drain
            // below.
            unsafe {
                h.submit(
                    io,
                    IoOp::Read {
                        offset: off as u64,
                        len: u32_of(len),
                        buf: b.as_mut_ptr(),
                    },
                    Tag::task(0, u32_of(i)),
                )
            };
            n += 1;
        }
        let mut done = 0;
        io.run_until_idle(|_, _, r| {
            assert!(r >= 0, "{what}: read failed with {r}");
            done += 1;
        });
        assert_eq!(done, n);
        for (i, b) in bufs.iter().enumerate().take(n) {
            let off = start + i * chunk;
            let len = chunk.min(model.len() - off);
            if b[..len] != model[off..off + len] {
                let at = (0..len).find(|&j| b[j] != model[off + j]).unwrap();
                panic!("{what}: data differs at {}", off + at);
            }
        }
    }
}
