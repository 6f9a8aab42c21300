//! Readahead on a pool without a cache tier (issue 24): a sequential reader of a slow
//! pool is served from the handle's readahead buffers, and never gets bytes older than
//! a write that completed before its read, whether the write came through its own
//! handle or through another one (which turns readahead off while it may write). A pool
//! whose devices answer at once gets none.

#![allow(clippy::cast_possible_truncation)]

use crate::common;

use common::*;
use tessera_pool::LayoutKind;

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;

/// Read `[from, to)` in 128 KiB reads, one at a time, and compare with `want`.
fn stream(
    io: &mut tessera_io::CoreIo,
    h: &mut dyn tessera_io::IoHandle,
    want: &[u8],
    from: u64,
    to: u64,
) {
    let mut at = from;
    while at < to {
        let got = read(io, h, at, (128 * KIB) as usize).unwrap();
        assert!(
            got == want[at as usize..(at + 128 * KIB) as usize],
            "bytes at {at} differ"
        );
        at += 128 * KIB;
    }
}

#[test]
fn a_sequential_reader_is_served_ahead_and_never_sees_bytes_older_than_a_write() {
    let r = rig(LayoutKind::Concat, 1, 64 * MIB, MIB);
    let mut io = core();
    let v = r.pool.create_volume("v", 32 * MIB).unwrap();
    let mut want = pattern(71, (32 * MIB) as usize);
    {
        let mut h = v.open_handle();
        assert_eq!(write(&mut io, &mut h, 0, &want), 0);
    }
    // A slow device: every completion 300 µs late.
    r.cfgs[0]
        .latency_us
        .store(300, std::sync::atomic::Ordering::Relaxed);
    let mut h = v.open_handle();
    stream(&mut io, &mut h, &want, 0, 8 * MIB);
    let (hits, bytes) = v.readahead_served();
    assert!(hits > 40, "the stream was read ahead: {hits} hits");
    assert_eq!(bytes, hits * 128 * KIB);
    // A write through the same handle just ahead of the reader, then the stream on.
    let new = pattern(72, (256 * KIB) as usize);
    assert_eq!(write(&mut io, &mut h, 8 * MIB + 128 * KIB, &new), 0);
    want[(8 * MIB + 128 * KIB) as usize..(8 * MIB + 384 * KIB) as usize].copy_from_slice(&new);
    stream(&mut io, &mut h, &want, 8 * MIB, 10 * MIB);
    // Another handle writes ahead of the reader (another connection), and goes.
    {
        let mut h2 = v.open_handle();
        let other = pattern(73, (128 * KIB) as usize);
        assert_eq!(write(&mut io, &mut h2, 11 * MIB, &other), 0);
        want[(11 * MIB) as usize..(11 * MIB + 128 * KIB) as usize].copy_from_slice(&other);
        stream(&mut io, &mut h, &want, 10 * MIB, 12 * MIB);
    }
    let other = pattern(74, (128 * KIB) as usize);
    {
        let mut h2 = v.open_handle();
        assert_eq!(write(&mut io, &mut h2, 13 * MIB, &other), 0);
    }
    want[(13 * MIB) as usize..(13 * MIB + 128 * KIB) as usize].copy_from_slice(&other);
    stream(&mut io, &mut h, &want, 12 * MIB, 16 * MIB);
    // And it reads ahead again, alone.
    let before = v.readahead_served().0;
    stream(&mut io, &mut h, &want, 16 * MIB, 24 * MIB);
    assert!(v.readahead_served().0 > before + 40);
    // Trimmed ahead of the reader: zeros, not the buffered bytes.
    assert_eq!(
        run(
            &mut io,
            &mut h,
            tessera_io::IoOp::Discard {
                offset: 25 * MIB,
                len: MIB
            }
        ),
        0
    );
    want[(25 * MIB) as usize..(26 * MIB) as usize].fill(0);
    stream(&mut io, &mut h, &want, 24 * MIB, 32 * MIB);
}

#[test]
fn a_pool_whose_devices_answer_at_once_gets_no_readahead() {
    let r = rig(LayoutKind::Concat, 1, 64 * MIB, MIB);
    let mut io = core();
    let v = r.pool.create_volume("v", 16 * MIB).unwrap();
    let want = pattern(75, (16 * MIB) as usize);
    let mut h = v.open_handle();
    assert_eq!(write(&mut io, &mut h, 0, &want), 0);
    stream(&mut io, &mut h, &want, 0, 16 * MIB);
    assert_eq!(v.readahead_served(), (0, 0));
}
