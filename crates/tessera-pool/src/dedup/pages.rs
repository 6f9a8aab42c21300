//! The bytes of dedup map pages and refcount pages (docs/format.md §17): 4 KiB shadow
//! pages, two slots each, valid when their magic, CRC, pool uuid and number match and
//! their generation is durable.

use crate::format::{Uuid, BLOCK};

/// Map entries per page: one per 4 KiB block of a 1 MiB volume unit.
pub const MAP_ENTRIES: usize = 256;
/// Counts per refcount page.
pub const COUNTS: usize = 1000;
/// Pages (A/B pairs) per 1 MiB map or refcount unit.
pub const PAGES_PER_UNIT: u64 = 128;
/// Bytes of one A/B pair.
pub const PAIR: u64 = 2 * BLOCK as u64;

/// Map entry: absent (read through, zeros without a parent).
pub const ABSENT: u64 = 0;
/// Map entry: reads zeros, references nothing.
pub const ZERO: u64 = 1;

const MAP_MAGIC: &[u8; 8] = b"TSRMAPP1";
const REF_MAGIC: &[u8; 8] = b"TSRREFC1";
const HEADER: usize = 64;

/// What identifies a page: its kind's magic, the layer (0 for refcount pages) and the
/// volume unit or page number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageId {
    pub refcount: bool,
    pub layer: u32,
    pub number: u32,
}

fn header(b: &mut [u8; BLOCK], id: PageId, gen: u64, uuid: &Uuid) {
    b[..8].copy_from_slice(if id.refcount { REF_MAGIC } else { MAP_MAGIC });
    b[8..12].copy_from_slice(&id.layer.to_le_bytes());
    b[12..16].copy_from_slice(&id.number.to_le_bytes());
    b[16..24].copy_from_slice(&gen.to_le_bytes());
    b[24..40].copy_from_slice(uuid);
}

fn seal(b: &mut [u8; BLOCK]) {
    let crc = crc32c::crc32c(&b[..BLOCK - 4]);
    b[BLOCK - 4..].copy_from_slice(&crc.to_le_bytes());
}

/// A map page of `entries` (stored values: `PBA + 2`, [`ABSENT`] or [`ZERO`]).
pub fn encode_map(id: PageId, gen: u64, uuid: &Uuid, entries: &[u64; MAP_ENTRIES]) -> [u8; BLOCK] {
    let mut b = [0u8; BLOCK];
    header(&mut b, id, gen, uuid);
    for (i, e) in entries.iter().enumerate() {
        b[HEADER + 8 * i..HEADER + 8 * i + 8].copy_from_slice(&e.to_le_bytes());
    }
    seal(&mut b);
    b
}

/// A refcount page of `counts`.
pub fn encode_counts(id: PageId, gen: u64, uuid: &Uuid, counts: &[u32; COUNTS]) -> [u8; BLOCK] {
    let mut b = [0u8; BLOCK];
    header(&mut b, id, gen, uuid);
    for (i, c) in counts.iter().enumerate() {
        b[HEADER + 4 * i..HEADER + 4 * i + 4].copy_from_slice(&c.to_le_bytes());
    }
    seal(&mut b);
    b
}

/// The generation of slot `b` when it is a valid copy of page `id` of pool `uuid` no
/// newer than `durable` (docs/format.md §17).
pub fn valid_gen(b: &[u8], id: PageId, uuid: &Uuid, durable: u64) -> Option<u64> {
    whole_gen(b, id, uuid).filter(|&g| g <= durable)
}

/// Whether slot `b` is a whole copy of page `id` of pool `uuid` written by a commit
/// newer than `durable`: one whose journal block a power loss took. Such a slot must be
/// erased before the journal's sequence reaches its generation, which would make it
/// valid (docs/format.md §17).
pub fn is_future(b: &[u8], id: PageId, uuid: &Uuid, durable: u64) -> bool {
    whole_gen(b, id, uuid).is_some_and(|g| g > durable)
}

/// The generation of slot `b` when it is a whole copy of page `id` of pool `uuid`.
fn whole_gen(b: &[u8], id: PageId, uuid: &Uuid) -> Option<u64> {
    if b.len() < BLOCK {
        return None;
    }
    let magic = if id.refcount { REF_MAGIC } else { MAP_MAGIC };
    let crc = crc32c::crc32c(&b[..BLOCK - 4]).to_le_bytes();
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    let gen = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
    (&b[..8] == magic
        && b[BLOCK - 4..BLOCK] == crc
        && u32_at(8) == id.layer
        && u32_at(12) == id.number
        && &b[24..40] == uuid)
        .then_some(gen)
}

/// Of the two slots of page `id` (`pair`: A then B), the newest valid one: whether it is
/// slot B, and its bytes. None when neither is valid.
pub fn newest<'a>(
    pair: &'a [u8],
    id: PageId,
    uuid: &Uuid,
    durable: u64,
) -> Option<(bool, &'a [u8])> {
    let (a, b) = pair.split_at(BLOCK);
    match (
        valid_gen(a, id, uuid, durable),
        valid_gen(b, id, uuid, durable),
    ) {
        (Some(ga), Some(gb)) if gb > ga => Some((true, b)),
        (Some(_), _) => Some((false, a)),
        (None, Some(_)) => Some((true, b)),
        (None, None) => None,
    }
}

/// The entries of a valid map page.
pub fn decode_map(b: &[u8]) -> Box<[u64; MAP_ENTRIES]> {
    let mut e = Box::new([ABSENT; MAP_ENTRIES]);
    for (i, v) in e.iter_mut().enumerate() {
        *v = u64::from_le_bytes(b[HEADER + 8 * i..HEADER + 8 * i + 8].try_into().expect("8"));
    }
    e
}

/// The counts of a valid refcount page.
pub fn decode_counts(b: &[u8]) -> Box<[u32; COUNTS]> {
    let mut c = Box::new([0u32; COUNTS]);
    for (i, v) in c.iter_mut().enumerate() {
        *v = u32::from_le_bytes(b[HEADER + 4 * i..HEADER + 4 * i + 4].try_into().expect("4"));
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: Uuid = [7; 16];

    fn map_id(n: u32) -> PageId {
        PageId {
            refcount: false,
            layer: 3,
            number: n,
        }
    }

    #[test]
    fn the_newer_durable_slot_wins_and_an_undurable_or_foreign_one_never_does() {
        let mut e = [ABSENT; MAP_ENTRIES];
        e[5] = 42;
        let a = encode_map(map_id(9), 10, &UUID, &e);
        e[5] = 43;
        let b = encode_map(map_id(9), 12, &UUID, &e);
        let mut pair = a.to_vec();
        pair.extend_from_slice(&b);
        let (is_b, bytes) = newest(&pair, map_id(9), &UUID, 12).expect("valid");
        assert!(is_b);
        assert_eq!(decode_map(bytes)[5], 43);
        // Slot B's commit never became durable: A is in charge.
        let (is_b, bytes) = newest(&pair, map_id(9), &UUID, 11).expect("valid");
        assert!(!is_b);
        assert_eq!(decode_map(bytes)[5], 42);
        // Another pool's page, another unit's page, a torn page: none is valid.
        assert!(newest(&pair, map_id(9), &[8; 16], 12).is_none());
        assert!(newest(&pair, map_id(10), &UUID, 12).is_none());
        pair[BLOCK + 100] ^= 1;
        assert!(!newest(&pair, map_id(9), &UUID, 12).expect("A").0);
    }

    #[test]
    fn counts_round_trip_and_are_not_map_pages() {
        let mut c = [0u32; COUNTS];
        c[999] = 7;
        let id = PageId {
            refcount: true,
            layer: 0,
            number: 4,
        };
        let b = encode_counts(id, 3, &UUID, &c);
        assert_eq!(valid_gen(&b, id, &UUID, 3), Some(3));
        assert_eq!(decode_counts(&b)[999], 7);
        assert!(valid_gen(
            &b,
            PageId {
                refcount: false,
                ..id
            },
            &UUID,
            3
        )
        .is_none());
    }
}
