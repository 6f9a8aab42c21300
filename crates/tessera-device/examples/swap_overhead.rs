//! Cost of a [`SwappableDevice`] on the datapath: submit + complete through a NullDevice
//! handle (completes inline) bare and behind the swappable wrapper (one generation load
//! per submit), in ns per I/O; also the wrapper's handle after a swap (it reopened once).
//!
//! `cargo run --release -p tessera-device --example swap_overhead [ops] [batch]`

use std::time::Instant;

use tessera_device::{BlockDevice, NullDevice, SwappableDevice};
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};

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
    let swappable = SwappableDevice::new(dev.clone());
    let mut plain = dev.clone().open_handle();
    let mut wrapped = swappable.clone().open_handle();
    let swapped_dev = SwappableDevice::new(dev.clone());
    let mut swapped = swapped_dev.clone().open_handle();
    swapped_dev.swap(NullDevice::new(1 << 30)).expect("swap");
    let mut buf = vec![0u8; 4096];
    // Warm up, then alternate to even out noise.
    run(&mut io, &mut *plain, ops / 10, batch, &mut buf);
    run(&mut io, &mut *wrapped, ops / 10, batch, &mut buf);
    run(&mut io, &mut *swapped, ops / 10, batch, &mut buf);
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        a.push(run(&mut io, &mut *plain, ops, batch, &mut buf));
        b.push(run(&mut io, &mut *wrapped, ops, batch, &mut buf));
        c.push(run(&mut io, &mut *swapped, ops, batch, &mut buf));
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
    println!("  + swappable                  best {bb:6.1}  median {mb:6.1}");
    println!("  + swappable, after a swap    best {bc:6.1}  median {mc:6.1}");
    println!(
        "swappable overhead             best {:+6.1}  median {:+6.1}",
        bb - ba,
        mb - ma
    );
    assert_eq!(swapped_dev.generation(), 1);
}
