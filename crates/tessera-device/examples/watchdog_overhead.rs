//! Cost of the hang watchdog on the datapath: submit + complete through a NullDevice
//! handle (completes inline), with and without `Watchdog::wrap`, in ns per I/O.
//!
//! `cargo run --release -p tessera-device --example watchdog_overhead [ops] [batch]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_device::{BlockDevice, NullDevice, Watchdog};
use tessera_io::{Continuation, CoreIo, IoHandle, IoOp, Tag};

/// For comparison: the least a wrapper that sees completions costs (a tracked join
/// through a hook that only passes the result on).
struct JoinOnly {
    inner: Box<dyn IoHandle>,
    hook: u32,
}

struct PassOn;

impl Continuation for PassOn {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, _: IoOp, _: u64, res: i32) {
        io.complete(parent, res)
    }
}

impl IoHandle for JoinOnly {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        if self.hook == u32::MAX {
            self.hook = io.register_hook(std::rc::Rc::new(PassOn));
        }
        let t = io.tracked(tag, 1, self.hook, 0);
        // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
        unsafe { self.inner.submit(io, op, t) }
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
}

/// Submit `ops` reads in batches of `batch`, draining after each batch; ns per I/O.
fn run(io: &mut CoreIo, h: &mut dyn IoHandle, ops: usize, batch: usize, buf: &mut [u8]) -> f64 {
    let mut done = 0usize;
    let t = Instant::now();
    for _ in 0..ops / batch {
        for i in 0..batch {
            let op = IoOp::Read {
                offset: (i as u64) * 4096,
                len: 4096,
                buf: buf.as_mut_ptr(),
            };
            let tag = Tag::task(0, u32::try_from(i).expect("a batch is far below 2^32"));
            // SAFETY: `buf` outlives the drain below; the concurrent reads into it are its
            // only users (a benchmark: nobody reads the bytes).
            unsafe { h.submit(io, op, tag) };
        }
        io.run_until_idle(|_, _, _| done += 1);
    }
    assert_eq!(done, ops / batch * batch);
    t.elapsed().as_nanos() as f64 / done as f64
}

fn main() {
    let mut args = std::env::args().skip(1);
    let ops: usize = args.next().map_or(5_000_000, |a| a.parse().expect("ops"));
    let batch: usize = args.next().map_or(32, |a| a.parse().expect("batch"));
    let mut io = CoreIo::new(0, 256, None).expect("io_uring");
    let dev = NullDevice::new(1 << 30);
    let dog = Watchdog::new(
        Duration::from_secs(30),
        Arc::new(|d| panic!("device {d} hung")),
    );
    let mut plain = dev.clone().open_handle();
    let mut watched = dog.wrap(0, dev.clone().open_handle());
    let mut joined = JoinOnly {
        inner: dev.clone().open_handle(),
        hook: u32::MAX,
    };
    let mut buf = vec![0u8; 4096];
    // Warm up (slab, joins, ready queue reach their size), then alternate to even out noise.
    run(&mut io, &mut *plain, ops / 10, batch, &mut buf);
    run(&mut io, &mut *watched, ops / 10, batch, &mut buf);
    run(&mut io, &mut joined, ops / 10, batch, &mut buf);
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        a.push(run(&mut io, &mut *plain, ops, batch, &mut buf));
        b.push(run(&mut io, &mut *watched, ops, batch, &mut buf));
        c.push(run(&mut io, &mut joined, ops, batch, &mut buf));
    }
    let best = |v: &[f64]| v.iter().cloned().fold(f64::MAX, f64::min);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|x, y| x.partial_cmp(y).unwrap());
        v[v.len() / 2]
    };
    let (ba, bb, bc) = (best(&a), best(&b), best(&c));
    let (ma, mb, mc) = (median(&mut a), median(&mut b), median(&mut c));
    println!("ops={ops} batch={batch} (5 runs each; ns per submit+complete)");
    println!("null device                    best {ba:6.1}  median {ma:6.1}");
    println!("  + bare tracked join (floor)  best {bc:6.1}  median {mc:6.1}");
    println!("  + watchdog                   best {bb:6.1}  median {mb:6.1}");
    println!(
        "watchdog overhead              best {:+6.1}  median {:+6.1}",
        bb - ba,
        mb - ma
    );
    println!(
        "  of which the join            best {:+6.1}  median {:+6.1}",
        bc - ba,
        mc - ma
    );
    assert_eq!(dog.hangs(), 0);
}
