//! Property test: a thin volume behaves exactly like a plain byte array (the model) under
//! random writes, reads, discards, zeroing and flushes — across layouts and unit sizes.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::sync::Arc;

use common::*;
use proptest::prelude::*;
use tessera_device::{BlockDevice, RamDevice};
use tessera_io::IoOp;
use tessera_pool::{LayoutKind, Pool, PoolOptions};

#[derive(Clone, Debug)]
enum Op {
    Write {
        block: u64,
        blocks: u64,
        seed: u64,
    },
    Read {
        block: u64,
        blocks: u64,
    },
    Discard {
        block: u64,
        blocks: u64,
    },
    Zero {
        block: u64,
        blocks: u64,
        no_hole: bool,
    },
    Flush,
}

const BLK: u64 = 4096;
const VOL_BLOCKS: u64 = 1024; // 4 MiB volume: 64 units of 64 KiB

fn op() -> impl Strategy<Value = Op> {
    let range = (0..VOL_BLOCKS).prop_flat_map(|b| (Just(b), 1..=(VOL_BLOCKS - b).min(48)));
    prop_oneof![
        4 => (range.clone(), any::<u64>()).prop_map(|((block, blocks), seed)| Op::Write { block, blocks, seed }),
        3 => range.clone().prop_map(|(block, blocks)| Op::Read { block, blocks }),
        1 => range.clone().prop_map(|(block, blocks)| Op::Discard { block, blocks }),
        1 => (range, any::<bool>()).prop_map(|((block, blocks), no_hole)| Op::Zero { block, blocks, no_hole }),
        1 => Just(Op::Flush),
    ]
}

fn pool(layout: LayoutKind) -> Pool {
    let devs: Vec<Arc<dyn BlockDevice>> = (0..3)
        .map(|_| RamDevice::new(16 << 20).unwrap() as Arc<dyn BlockDevice>)
        .collect();
    Pool::create(
        "p",
        devs,
        PoolOptions {
            layout,
            unit_size: 64 << 10,
            force: false,
            ..PoolOptions::default()
        },
    )
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn thin_volume_matches_model(ops in proptest::collection::vec(op(), 1..120), raid0 in any::<bool>()) {
        let layout = if raid0 { LayoutKind::Raid0 { stripe: 16384 } } else { LayoutKind::Concat };
        let pool = pool(layout);
        let vol = pool.create_volume("v", VOL_BLOCKS * BLK).unwrap();
        let mut h = vol.open_handle();
        let mut io = core();
        // Discarded ranges have undefined contents: the model tracks which bytes are known.
        let mut model = vec![0u8; (VOL_BLOCKS * BLK) as usize];
        let mut known = vec![true; VOL_BLOCKS as usize];
        for op in ops {
            match op {
                Op::Write { block, blocks, seed } => {
                    let data = pattern(seed, (blocks * BLK) as usize);
                    prop_assert!(write(&mut io, &mut h, block * BLK, &data) >= 0);
                    model[(block * BLK) as usize..((block + blocks) * BLK) as usize].copy_from_slice(&data);
                    known[block as usize..(block + blocks) as usize].fill(true);
                }
                Op::Read { block, blocks } => {
                    let got = read(&mut io, &mut h, block * BLK, (blocks * BLK) as usize).unwrap();
                    for b in 0..blocks {
                        if known[(block + b) as usize] {
                            let s = (b * BLK) as usize;
                            let m = ((block + b) * BLK) as usize;
                            prop_assert_eq!(&got[s..s + BLK as usize], &model[m..m + BLK as usize], "block {}", block + b);
                        }
                    }
                }
                Op::Discard { block, blocks } => {
                    prop_assert_eq!(run(&mut io, &mut h, IoOp::Discard { offset: block * BLK, len: blocks * BLK }), 0);
                    known[block as usize..(block + blocks) as usize].fill(false);
                }
                Op::Zero { block, blocks, no_hole } => {
                    let r = run(&mut io, &mut h, IoOp::WriteZeroes { offset: block * BLK, len: blocks * BLK, may_unmap: !no_hole });
                    prop_assert_eq!(r, 0);
                    model[(block * BLK) as usize..((block + blocks) * BLK) as usize].fill(0);
                    known[block as usize..(block + blocks) as usize].fill(true);
                }
                Op::Flush => prop_assert_eq!(flush(&mut io, &mut h), 0),
            }
        }
        // Space accounting: what the volume holds is what the pool says is allocated.
        let st = pool.status();
        prop_assert_eq!(st.allocated, vol.allocated_bytes());
        prop_assert_eq!(st.allocated + st.free, st.capacity);
    }
}

#[test]
fn unwritten_ranges_read_zero_and_need_no_space() {
    let pool = pool(LayoutKind::Concat);
    // Larger than the pool (thin), and than the default overcommit ratio allows.
    let vol = pool
        .create_volume_opts(
            "v",
            1 << 30,
            tessera_pool::VolumeOptions {
                force: true,
                ..Default::default()
            },
        )
        .unwrap();
    let mut h = vol.open_handle();
    let mut io = core();
    assert!(read(&mut io, &mut h, 512 << 20, 65536)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    assert_eq!(vol.allocated_bytes(), 0);
    assert!(write(&mut io, &mut h, 4096, &[9u8; 4096]) >= 0);
    assert_eq!(vol.allocated_bytes(), 64 << 10);
    let back = read(&mut io, &mut h, 0, 3 * 4096).unwrap();
    assert!(
        back[..4096].iter().all(|&b| b == 0),
        "rest of a new unit reads zero"
    );
    assert!(back[4096..8192].iter().all(|&b| b == 9));
}

#[test]
fn out_of_range_requests_fail_cleanly() {
    let pool = pool(LayoutKind::Concat);
    let vol = pool.create_volume("v", 1 << 20).unwrap();
    let mut h = vol.open_handle();
    let mut io = core();
    assert_eq!(
        write(&mut io, &mut h, (1 << 20) - 512, &[1u8; 1024]),
        -libc::EINVAL
    );
    assert_eq!(
        read(&mut io, &mut h, u64::MAX - 10, 512),
        Err(-libc::EINVAL)
    );
}

#[test]
fn enospc_only_for_writes_that_need_space() {
    let devs: Vec<Arc<dyn BlockDevice>> = vec![RamDevice::new(24 << 20).unwrap()];
    let pool = Pool::create(
        "small",
        devs,
        PoolOptions {
            unit_size: 1 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    let cap = pool.status().capacity;
    let a = pool.create_volume("a", 64 << 20).unwrap();
    let b = pool.create_volume("b", 64 << 20).unwrap();
    let (mut ha, mut hb) = (a.open_handle(), b.open_handle());
    let mut io = core();
    let unit = vec![5u8; 1 << 20];
    let mut written = 0;
    while written < cap {
        assert!(write(&mut io, &mut ha, written, &unit) >= 0);
        written += 1 << 20;
    }
    // Full: a write to a new unit fails with ENOSPC, on either volume.
    assert_eq!(write(&mut io, &mut ha, written, &unit), -libc::ENOSPC);
    assert_eq!(write(&mut io, &mut hb, 0, &[1u8; 4096]), -libc::ENOSPC);
    // Everything else keeps working: overwrites, reads, flush.
    assert!(write(&mut io, &mut ha, 0, &[7u8; 4096]) >= 0);
    assert_eq!(read(&mut io, &mut ha, 0, 4096).unwrap(), vec![7u8; 4096]);
    assert!(read(&mut io, &mut hb, 0, 4096)
        .unwrap()
        .iter()
        .all(|&x| x == 0));
    assert_eq!(flush(&mut io, &mut ha), 0);
    // Trim gives whole units back; once committed they can be used again.
    assert_eq!(
        run(
            &mut io,
            &mut ha,
            IoOp::Discard {
                offset: 0,
                len: 2 << 20
            }
        ),
        0
    );
    assert_eq!(flush(&mut io, &mut ha), 0);
    assert!(write(&mut io, &mut hb, 0, &[1u8; 4096]) >= 0);
}
