//! One copy of a mirror damaged behind the node's back, and the checks that a repair (a
//! scrub's, or the resync after an unclean shutdown) undid it the right way. Offsets are
//! the device files' own: a pool's data area starts at [`DEV_DATA_START`].

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use serde_json::Value;

const MIB: u64 = 1 << 20;
/// Device offset of the pool's data area (docs/format.md §1).
pub const DEV_DATA_START: u64 = MIB;

/// Flip 4 KiB of `file` at every MiB of its data area (metadata and data units alike);
/// returns where, and what it wrote there.
pub fn corrupt_every_mib(file: &str) -> Vec<(u64, Vec<u8>)> {
    let mut spots = Vec::new();
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    for k in 0..60u64 {
        let at = DEV_DATA_START + k * MIB + 8192;
        let mut b = vec![0u8; 4096];
        f.seek(SeekFrom::Start(at)).unwrap();
        f.read_exact(&mut b).unwrap();
        for x in &mut b {
            *x ^= 0x5A;
        }
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(&b).unwrap();
        spots.push((at, b));
    }
    f.sync_all().unwrap();
    spots
}

/// A repair went the right way: where the status `v` (a scrub's or a resync's) reports a
/// repaired mismatch, no copy holds the bytes the corruption wrote (a repair from the
/// corrupted copy to the good one would leave them in both, equal). Corrupted spots
/// outside any report are in units no volume owns, which neither a scrub nor a resync
/// reads.
pub fn corruption_gone(v: &Value, spots: &[(u64, Vec<u8>)], files: &[&str]) {
    let ranges: Vec<(u64, u64)> = v["mismatched_ranges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let o = DEV_DATA_START + r["offset"].as_u64().unwrap();
            (o, o + r["len"].as_u64().unwrap())
        })
        .collect();
    let repaired: Vec<&(u64, Vec<u8>)> = spots
        .iter()
        .filter(|(at, _)| ranges.iter().any(|&(a, b)| a <= *at && *at < b))
        .collect();
    assert!(!repaired.is_empty(), "no corrupted spot was reported: {v}");
    for file in files {
        for (at, bad) in &repaired {
            assert!(
                read_file(file, *at, bad.len() as u64) != *bad,
                "{file} holds the corrupted bytes at {at}: repaired from the wrong copy"
            );
        }
    }
}

/// `len` bytes of `file` at `at`.
pub fn read_file(file: &str, at: u64, len: u64) -> Vec<u8> {
    let mut f = std::fs::File::open(Path::new(file)).unwrap();
    let mut b = vec![0u8; usize::try_from(len).unwrap()];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut b).unwrap();
    b
}

/// Every mismatched range a status reports is equal in both files now.
pub fn ranges_equal(v: &Value, a: &str, b: &str) {
    let ranges = v["mismatched_ranges"].as_array().unwrap();
    assert!(!ranges.is_empty(), "{v}");
    for r in ranges {
        let (o, l) = (r["offset"].as_u64().unwrap(), r["len"].as_u64().unwrap());
        assert_eq!(
            read_file(a, DEV_DATA_START + o, l),
            read_file(b, DEV_DATA_START + o, l),
            "range {r} still differs"
        );
    }
}
