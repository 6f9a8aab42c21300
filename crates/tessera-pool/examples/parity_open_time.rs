//! Open time of a raid5 pool on files after an unclean shutdown (docs/benchmarks.md,
//! "Parity pools: free units after a power loss").
//!
//!   parity_open_time DIR prepare   # 3 files of 512 MiB, raid5, 1 MiB units; first
//!                                  # writes into 64 units; exit without a shutdown
//!   parity_open_time DIR open      # open (timed) and exit without a shutdown again,
//!                                  # so every run opens an unclean pool

// Sizes come from this file's constants.
#![allow(clippy::cast_possible_truncation)]

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use tessera_device::{BlockDevice, FileDevice};
use tessera_io::buf::AlignedBuf;
use tessera_pool::{LayoutKind, Pool, PoolOptions};
use tessera_testkit::blockio::{core, write};

const DEV_SIZE: u64 = 512 << 20;

fn devices(dir: &Path, create: bool) -> Vec<Arc<dyn BlockDevice>> {
    (0..3)
        .map(|i| {
            let size = create.then_some(DEV_SIZE);
            FileDevice::open(&dir.join(format!("d{i}")), size).expect("device file")
                as Arc<dyn BlockDevice>
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(mode)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: parity_open_time DIR prepare|open");
        std::process::exit(2);
    };
    let dir = Path::new(dir);
    match mode.as_str() {
        "prepare" => {
            let opts = PoolOptions {
                layout: LayoutKind::Raid5 { stripe: 64 << 10 },
                ..PoolOptions::default()
            };
            let pool = Pool::create("bench", devices(dir, true), opts).expect("create");
            let v = pool.create_volume("v", 64 << 20).expect("volume");
            let mut io = core();
            let mut h = v.open_handle();
            // O_DIRECT files: an aligned buffer.
            let mut data = AlignedBuf::zeroed(4096);
            data.as_mut_slice().fill(7);
            for u in 0..64u64 {
                let r = write(&mut io, &mut h, u << 20, data.as_slice());
                assert!(r >= 0, "write: {r}");
            }
            pool.commit().expect("commit");
            println!("prepared: free {} MiB", pool.status().free >> 20);
            // An unclean end: no shutdown, no clean flag.
            std::process::exit(0);
        }
        "open" => {
            let t = Instant::now();
            let pool = Pool::open(devices(dir, false)).expect("open");
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            println!("open_ms {ms:.1} clean {}", pool.opened_clean());
            std::process::exit(0);
        }
        _ => {
            eprintln!("usage: parity_open_time DIR prepare|open");
            std::process::exit(2);
        }
    }
}
