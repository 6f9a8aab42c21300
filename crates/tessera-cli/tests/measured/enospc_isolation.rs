//! A full thin pool: writes that need new space fail with ENOSPC, everything else on that
//! pool keeps working, other pools are unaffected, and trimming gives the space back.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::time::Instant;

use serde_json::Value;
use tessera_nbd::client::{ClientOptions, NbdClient};

const MIB: u64 = 1 << 20;

fn find<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == name)
        .unwrap_or_else(|| panic!("{name} not in {list}"))
}

fn connect(n: &TestNode, export: &str) -> NbdClient {
    NbdClient::connect_tcp(&n.addr(), export, ClientOptions::default())
        .unwrap_or_else(|e| panic!("connect to {export}: {e}"))
}

fn fill(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed ^ (i as u8).wrapping_mul(13))
        .collect()
}

fn assert_enospc(r: std::io::Result<()>, what: &str) {
    match r {
        Ok(()) => panic!("{what}: succeeded, expected ENOSPC"),
        Err(e) => assert_eq!(
            e.raw_os_error(),
            Some(28),
            "{what}: expected ENOSPC, got {e} ({:?})",
            e.raw_os_error()
        ),
    }
}

/// Write `total` bytes of 1 MiB writes at `base` and return the throughput in MiB/s.
fn throughput(c: &mut NbdClient, base: u64, total: u64) -> f64 {
    let buf = fill(0x77, MIB as usize);
    let t = Instant::now();
    let mut off = 0;
    while off < total {
        c.write(base + off, &buf, false)
            .unwrap_or_else(|e| panic!("write to the other pool at {}: {e}", base + off));
        off += MIB;
    }
    c.flush().unwrap();
    let mut back = vec![0u8; MIB as usize];
    c.read(base + total - MIB, &mut back).unwrap();
    assert!(back == buf);
    (total / MIB) as f64 / t.elapsed().as_secs_f64()
}

#[test]
fn full_pool_fails_with_enospc_and_isolates_the_damage() {
    let _alone = crate::alone();
    // The device images live outside the node's own directory, whose path is only known
    // once the node runs.
    let scratch = temp_dir("enospc-devs");
    let small = scratch.path().join("s.img");
    let big = scratch.path().join("big.img");
    let extra = format!(
        r#"
[[pool]]
name = "small"
devices = ["{}:48M"]

[[pool]]
name = "big"
devices = ["{}:1G"]

[[volume]]
name = "a"
pool = "small"
size = "64M"

[[volume]]
name = "b"
pool = "small"
size = "64M"

[[volume]]
name = "vol0"
pool = "big"
size = "1G"

[[export]]
name = "a"
volume = "a"

[[export]]
name = "b"
volume = "b"

[[export]]
name = "vol0"
volume = "vol0"
"#,
        small.display(),
        big.display()
    );
    let mut n = TestNode::start_with_config("enospc", &extra);
    let pools = n.json(&["pool", "list"]);
    let cap = find(&pools, "small")["capacity"].as_u64().unwrap();
    let unit = find(&pools, "small")["unit_size"].as_u64().unwrap();
    assert_eq!(unit, MIB);
    assert!(
        cap < 64 * MIB,
        "the small pool has {cap} bytes: not overprovisioned"
    );

    // Baseline speed of the other pool.
    let mut other = connect(&n, "vol0");
    // Best of five runs, each allocating fresh units, to filter out scheduling noise.
    let before = (0..5)
        .map(|i| throughput(&mut other, i * 32 * MIB, 32 * MIB))
        .fold(0.0, f64::max);

    // b gets some space first.
    let mut b = connect(&n, "b");
    let b_data = fill(0xb0, 2 * MIB as usize);
    b.write(0, &b_data, false).expect("initial write to b");
    b.flush().unwrap();

    // Fill a, 1 MiB at a time (whole units), until ENOSPC.
    let mut a = connect(&n, "a");
    let mut written = 0u64;
    let full_at = loop {
        assert!(
            written < 64 * MIB,
            "wrote all 64 MiB of a into a {cap}-byte pool without ENOSPC"
        );
        match a.write(written, &fill(written as u8, MIB as usize), false) {
            Ok(()) => written += MIB,
            Err(e) => {
                assert_eq!(
                    e.raw_os_error(),
                    Some(28),
                    "filling a: write at {written} failed with {e}, expected ENOSPC"
                );
                break written;
            }
        }
    };
    assert_eq!(
        full_at + 2 * MIB,
        cap,
        "a got {full_at} bytes and b 2 MiB of a pool of {cap}"
    );
    // A small, partial-unit write in unallocated space: ENOSPC too, and again.
    assert_enospc(
        a.write(full_at + 4096, &[1u8; 4096], false),
        "4 KiB write to a in a new unit",
    );
    assert_enospc(
        a.write(60 * MIB, &[1u8; 512], true),
        "FUA 512 B write to a in a new unit",
    );
    assert_enospc(
        a.write(full_at, &fill(1, MIB as usize), false),
        "1 MiB write to a in a new unit, again",
    );
    // A write straddling an allocated and an unallocated unit.
    assert_enospc(
        a.write(full_at - 4096, &[2u8; 8192], false),
        "write straddling the last allocated unit of a",
    );

    let st = n.json(&["status"]);
    let sp = find(&st["pools"], "small");
    assert_eq!(sp["free"].as_u64(), Some(0), "{sp}");
    assert_eq!(sp["allocated"].as_u64(), Some(cap), "{sp}");

    // Overwrites of allocated space in a still work, with and without FUA.
    a.write(0, &fill(0xaa, 4096), false)
        .expect("overwrite of allocated space in a");
    a.write(MIB, &fill(0xab, MIB as usize), true)
        .expect("FUA overwrite of an allocated unit of a");
    a.write(full_at - MIB, &fill(0xac, 64 * 1024), false)
        .expect("overwrite of a's last allocated unit");
    a.flush().expect("flush of a on a full pool");
    // Reads of a: allocated, unallocated, and the data is right.
    let mut buf = vec![0u8; 4096];
    a.read(0, &mut buf).unwrap();
    assert!(
        buf == fill(0xaa, 4096),
        "a: overwritten block reads back wrong"
    );
    let mut ubuf = vec![0u8; MIB as usize];
    a.read(MIB, &mut ubuf).unwrap();
    assert!(
        ubuf == fill(0xab, MIB as usize),
        "a: FUA overwrite reads back wrong"
    );
    a.read(2 * MIB, &mut ubuf).unwrap();
    assert!(
        ubuf == fill((2 * MIB) as u8, MIB as usize),
        "a: data of the fill reads back wrong"
    );
    a.read(full_at, &mut ubuf).unwrap();
    assert!(
        ubuf.iter().all(|&x| x == 0),
        "a: unallocated space does not read as zeros"
    );
    // (The allocated half of the failed straddling write is unspecified by NBD; not checked.)

    // b: overwrites succeed, new space does not, reads work.
    b.write(4096, &fill(0xbb, 8192), false)
        .expect("overwrite of allocated space in b");
    b.flush().unwrap();
    let mut bb = vec![0u8; 2 * MIB as usize];
    b.read(0, &mut bb).unwrap();
    let mut expect = b_data.clone();
    expect[4096..12288].copy_from_slice(&fill(0xbb, 8192));
    assert!(bb == expect, "b reads back wrong");
    assert_enospc(
        b.write(32 * MIB, &[3u8; 4096], false),
        "b: write in a new unit",
    );
    assert_enospc(
        b.write(2 * MIB, &fill(3, MIB as usize), true),
        "b: FUA write of a whole new unit",
    );
    b.read(32 * MIB, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == 0));
    // A fresh connection to b is fine too.
    let mut b2 = connect(&n, "b");
    b2.read(0, &mut bb).unwrap();
    assert!(bb == expect);

    // The other pool is unaffected, at full speed.
    let after = (5..10)
        .map(|i| throughput(&mut other, i * 32 * MIB, 32 * MIB))
        .fold(0.0, f64::max);
    eprintln!(
        "other pool: {before:.0} MiB/s before, {after:.0} MiB/s while the small pool is full"
    );
    // Best of five against best of five: a full neighbour must not cost the other pool
    // more than scheduling noise on a busy 2-core machine (the bound was 4x, which hid a
    // halving).
    assert!(after * 1.5 >= before, "the other pool slowed down from {before:.0} to {after:.0} MiB/s while the small pool is full");
    assert!(n.is_running(), "node died on ENOSPC");

    // Trim 4 MiB of a (unit aligned), flush: new writes succeed again.
    a.trim(4 * MIB, (4 * MIB) as u32).expect("trim of a");
    a.flush().expect("flush after trim");
    a.read(4 * MIB, &mut ubuf).unwrap();
    assert!(
        ubuf.iter().all(|&x| x == 0),
        "trimmed space of a does not read as zeros"
    );
    let st = n.json(&["status"]);
    assert_eq!(
        find(&st["pools"], "small")["free"].as_u64(),
        Some(4 * MIB),
        "free space after trimming 4 MiB + flush"
    );
    for i in 0..3u64 {
        a.write(
            full_at + i * MIB,
            &fill(0x50 + i as u8, MIB as usize),
            false,
        )
        .unwrap_or_else(|e| panic!("write {i} to a after trim + flush: {e}"));
    }
    b.write(40 * MIB, &fill(0x60, 4096), false)
        .expect("b: write in a new unit after a's trim");
    // Full again.
    assert_enospc(
        a.write(full_at + 3 * MIB, &[4u8; 4096], false),
        "a: write after using up the trimmed space",
    );
    a.flush().unwrap();
    b.flush().unwrap();
    a.read(full_at + 2 * MIB, &mut ubuf).unwrap();
    assert!(ubuf == fill(0x52, MIB as usize));
    b.read(40 * MIB, &mut buf).unwrap();
    assert!(buf == fill(0x60, 4096));

    // Accounting is consistent: pool allocated == sum of its volumes.
    let vols = n.json(&["volume", "list"]);
    let sum = find(&vols, "a")["allocated"].as_u64().unwrap()
        + find(&vols, "b")["allocated"].as_u64().unwrap();
    let st = n.json(&["status"]);
    assert_eq!(
        find(&st["pools"], "small")["allocated"].as_u64(),
        Some(sum),
        "small pool allocated vs volumes a+b"
    );
    assert_eq!(sum, cap);
    assert!(n.is_running(), "node died");
}
