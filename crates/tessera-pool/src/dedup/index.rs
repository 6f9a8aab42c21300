//! The fingerprint index of docs/format.md §17: a fixed-size hash table of 4 KiB buckets
//! on a device area and, in RAM, only each bucket's 16-bit short fingerprints (2 bytes
//! per entry). A lookup whose short fingerprint no entry of its bucket has costs no I/O;
//! one that matches reads the bucket and compares the full 128-bit fingerprints (a short
//! match whose full fingerprint differs is a *short collision*, counted).
//!
//! The index is advisory: the caller confirms a candidate by comparing the stored
//! block's bytes, so a bucket lost to a torn write (a bad CRC reads as empty) or an entry
//! left stale by an overwrite costs a missed share, never a wrong one. That is why it
//! has no journal.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use tessera_device::BlockDevice;
use tessera_io::sync::MutexExt;
use tessera_io::AlignedBuf;

/// Where the buckets live: a byte range of a device, or of a pool's index units.
pub trait BucketArea: Send + Sync {
    fn size(&self) -> u64;
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()>;
}

/// An index on a plain block device (tools, tests and the benchmark).
pub struct OnDevice(pub Arc<dyn BlockDevice>);

impl BucketArea for OnDevice {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.0.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.0.write_at(offset, buf)
    }
}

/// Bytes of a bucket.
pub const BUCKET: usize = 4096;
/// Entries a bucket holds: a 16-byte header, 24-byte entries, the CRC in the last 4 bytes.
pub const PER_BUCKET: usize = 168;
const MAGIC: &[u8; 8] = b"TSRIDXB1";
const HEADER: usize = 16;
const ENTRY: usize = 24;
/// Buckets read per request when the index is opened.
const OPEN_BATCH: u64 = 256;

/// Bucket number `b` as an index of the RAM table (checked to fit at open).
fn slot(b: u64) -> usize {
    usize::try_from(b).expect("bucket numbers fit usize")
}

/// The XXH3-128 fingerprint of a block's bytes. It is not collision resistant: a match
/// is confirmed by comparing the bytes (docs/benchmarks.md, "Issue 25 groundwork", for
/// why it is this hash).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub u128);

impl Fingerprint {
    pub fn of(block: &[u8]) -> Fingerprint {
        Fingerprint(xxhash_rust::xxh3::xxh3_128(block))
    }

    /// Its bucket among `buckets`.
    fn bucket(self, buckets: u64) -> u64 {
        u64::try_from(self.0 % u128::from(buckets)).expect("below a u64 bucket count")
    }

    /// Bits 64..79, which the bucket number does not use: what RAM keeps.
    fn short(self) -> u16 {
        u16::try_from((self.0 >> 64) & 0xFFFF).expect("16 bits")
    }
}

/// What the index did since it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub lookups: u64,
    /// Lookups answered "no" by the short fingerprints alone, with no I/O.
    pub filtered: u64,
    pub bucket_reads: u64,
    /// Lookups whose short fingerprint matched an entry whose full one did not.
    pub short_collisions: u64,
    pub inserts: u64,
    /// Entries dropped because their bucket was full (the oldest goes).
    pub dropped: u64,
    /// Buckets found torn or foreign (bad magic, number or CRC), read as empty.
    pub bad_buckets: u64,
}

#[derive(Default)]
struct Counters {
    lookups: AtomicU64,
    filtered: AtomicU64,
    bucket_reads: AtomicU64,
    short_collisions: AtomicU64,
    inserts: AtomicU64,
    dropped: AtomicU64,
    bad_buckets: AtomicU64,
}

/// One entry: a fingerprint and the store block (PBA) that had it when it was inserted.
type Entry = (Fingerprint, u64);

pub struct FingerprintIndex {
    dev: Arc<dyn BucketArea>,
    offset: u64,
    buckets: u64,
    /// Per bucket, its entries' short fingerprints in entry order. The lock also keeps
    /// two changes of one bucket from interleaving their read-modify-write.
    shorts: Vec<Mutex<Vec<u16>>>,
    counters: Counters,
}

impl FingerprintIndex {
    /// Buckets for an index of `entries` entries (one per 4 KiB block of the capacity
    /// it serves).
    pub fn buckets_for(entries: u64) -> u64 {
        entries.div_ceil(PER_BUCKET as u64).max(1)
    }

    /// Bytes an index of `buckets` buckets takes on its device.
    pub fn device_bytes(buckets: u64) -> u64 {
        buckets * BUCKET as u64
    }

    /// Open the index of `buckets` buckets at byte `offset` of `dev`: every bucket is
    /// read and its short fingerprints kept. A bucket never written, torn or foreign is
    /// empty (and rewritten whole by its next insert).
    pub fn open(dev: Arc<dyn BucketArea>, offset: u64, buckets: u64) -> io::Result<Self> {
        let end = buckets
            .checked_mul(BUCKET as u64)
            .and_then(|b| b.checked_add(offset));
        if buckets == 0 || buckets > u64::from(u32::MAX) || end.is_none_or(|e| e > dev.size()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a fingerprint index of {buckets} buckets at offset {offset} does not fit \
                     a device of {} bytes (1 to 2^32-1 buckets)",
                    dev.size()
                ),
            ));
        }
        let idx = FingerprintIndex {
            dev,
            offset,
            buckets,
            shorts: (0..buckets).map(|_| Mutex::new(Vec::new())).collect(),
            counters: Counters::default(),
        };
        let mut buf = AlignedBuf::zeroed(BUCKET * slot(OPEN_BATCH));
        let mut first = 0;
        while first < buckets {
            let n = OPEN_BATCH.min(buckets - first);
            let bytes = &mut buf.as_mut_slice()[..BUCKET * slot(n)];
            idx.dev.read_at(idx.bucket_offset(first), bytes)?;
            for (i, raw) in bytes.chunks_exact(BUCKET).enumerate() {
                let b = first + i as u64;
                let entries = idx.parse(b, raw);
                *idx.shorts[slot(b)].locked() = entries.iter().map(|e| e.0.short()).collect();
            }
            first += n;
        }
        Ok(idx)
    }

    /// The store blocks whose fingerprint was `fp` when they were inserted (usually none
    /// or one). Each is a candidate only: compare its bytes before sharing it.
    pub fn candidates(&self, fp: Fingerprint) -> io::Result<Vec<u64>> {
        self.counters.lookups.fetch_add(1, Relaxed);
        let b = fp.bucket(self.buckets);
        let shorts = self.shorts[slot(b)].locked();
        if !shorts.contains(&fp.short()) {
            self.counters.filtered.fetch_add(1, Relaxed);
            return Ok(Vec::new());
        }
        let found: Vec<u64> = self
            .read_bucket(b)?
            .into_iter()
            .filter(|e| e.0 == fp)
            .map(|e| e.1)
            .collect();
        drop(shorts);
        if found.is_empty() {
            self.counters.short_collisions.fetch_add(1, Relaxed);
        }
        Ok(found)
    }

    /// Record that store block `pba` holds content `fp`. A full bucket drops its oldest
    /// entry for it.
    pub fn insert(&self, fp: Fingerprint, pba: u64) -> io::Result<()> {
        let b = fp.bucket(self.buckets);
        let mut shorts = self.shorts[slot(b)].locked();
        let mut entries = self.read_bucket(b)?;
        if entries.contains(&(fp, pba)) {
            return Ok(());
        }
        if entries.len() == PER_BUCKET {
            entries.remove(0);
            self.counters.dropped.fetch_add(1, Relaxed);
        }
        entries.push((fp, pba));
        self.write_bucket(b, &entries)?;
        *shorts = entries.iter().map(|e| e.0.short()).collect();
        self.counters.inserts.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Record many entries: each bucket is read and written once for all of its new
    /// entries (the commit thread's batches). Entries of the same block drop the older
    /// ones of it in their bucket. Returns the first error; the entries of buckets not
    /// written are lost, which only costs shares.
    pub fn insert_batch(&self, mut new: Vec<(Fingerprint, u64)>) -> io::Result<()> {
        new.sort_unstable_by_key(|e| e.0.bucket(self.buckets));
        for group in new.chunk_by(|a, b| a.0.bucket(self.buckets) == b.0.bucket(self.buckets)) {
            let b = group[0].0.bucket(self.buckets);
            let mut shorts = self.shorts[slot(b)].locked();
            let mut entries = self.read_bucket(b)?;
            for &(fp, pba) in group {
                if entries.contains(&(fp, pba)) {
                    continue;
                }
                // A block's older contents (overwritten in place) are stale.
                entries.retain(|e| e.1 != pba);
                if entries.len() == PER_BUCKET {
                    entries.remove(0);
                    self.counters.dropped.fetch_add(1, Relaxed);
                }
                entries.push((fp, pba));
                self.counters.inserts.fetch_add(1, Relaxed);
            }
            self.write_bucket(b, &entries)?;
            *shorts = entries.iter().map(|e| e.0.short()).collect();
        }
        Ok(())
    }

    /// Buckets of the index.
    pub fn bucket_count(&self) -> u64 {
        self.buckets
    }

    /// The entries of bucket `b` as the device has them (the scrub's walk).
    pub fn bucket_entries(&self, b: u64) -> io::Result<Vec<(Fingerprint, u64)>> {
        self.read_bucket(b)
    }

    /// Forget that `pba` holds `fp` (the block was freed). Whether there was such an entry.
    pub fn remove(&self, fp: Fingerprint, pba: u64) -> io::Result<bool> {
        let b = fp.bucket(self.buckets);
        let mut shorts = self.shorts[slot(b)].locked();
        if !shorts.contains(&fp.short()) {
            return Ok(false);
        }
        let mut entries = self.read_bucket(b)?;
        let before = entries.len();
        entries.retain(|e| *e != (fp, pba));
        if entries.len() == before {
            return Ok(false);
        }
        self.write_bucket(b, &entries)?;
        *shorts = entries.iter().map(|e| e.0.short()).collect();
        Ok(true)
    }

    pub fn stats(&self) -> IndexStats {
        let c = &self.counters;
        IndexStats {
            lookups: c.lookups.load(Relaxed),
            filtered: c.filtered.load(Relaxed),
            bucket_reads: c.bucket_reads.load(Relaxed),
            short_collisions: c.short_collisions.load(Relaxed),
            inserts: c.inserts.load(Relaxed),
            dropped: c.dropped.load(Relaxed),
            bad_buckets: c.bad_buckets.load(Relaxed),
        }
    }

    /// Entries held, over every bucket.
    pub fn entries(&self) -> u64 {
        self.shorts.iter().map(|s| s.locked().len() as u64).sum()
    }

    /// RAM the index takes: the short fingerprints as allocated, and a lock and a vector
    /// header per bucket.
    pub fn ram_bytes(&self) -> u64 {
        let per_bucket = std::mem::size_of::<Mutex<Vec<u16>>>() as u64;
        self.shorts
            .iter()
            .map(|s| per_bucket + 2 * s.locked().capacity() as u64)
            .sum()
    }

    fn bucket_offset(&self, b: u64) -> u64 {
        self.offset + b * BUCKET as u64
    }

    fn read_bucket(&self, b: u64) -> io::Result<Vec<Entry>> {
        self.counters.bucket_reads.fetch_add(1, Relaxed);
        let mut buf = AlignedBuf::zeroed(BUCKET);
        self.dev
            .read_at(self.bucket_offset(b), &mut buf.as_mut_slice()[..BUCKET])?;
        Ok(self.parse(b, &buf.as_slice()[..BUCKET]))
    }

    /// The entries of bucket `b` from its bytes; none when it was never written (all
    /// zeros: not counted) or is torn or foreign (counted).
    fn parse(&self, b: u64, raw: &[u8]) -> Vec<Entry> {
        if raw.iter().all(|&x| x == 0) {
            return Vec::new();
        }
        let u32_at = |o: usize| u32::from_le_bytes(raw[o..o + 4].try_into().expect("4 bytes"));
        let crc_ok = crc32c::crc32c(&raw[..BUCKET - 4]) == u32_at(BUCKET - 4);
        let count = u32_at(12) as usize;
        if &raw[..8] != MAGIC || u64::from(u32_at(8)) != b || count > PER_BUCKET || !crc_ok {
            self.counters.bad_buckets.fetch_add(1, Relaxed);
            return Vec::new();
        }
        (0..count)
            .map(|i| {
                let e = &raw[HEADER + i * ENTRY..HEADER + (i + 1) * ENTRY];
                let fp = u128::from_le_bytes(e[..16].try_into().expect("16 bytes"));
                let pba = u64::from_le_bytes(e[16..].try_into().expect("8 bytes"));
                (Fingerprint(fp), pba)
            })
            .collect()
    }

    fn write_bucket(&self, b: u64, entries: &[Entry]) -> io::Result<()> {
        let mut buf = AlignedBuf::zeroed(BUCKET);
        let raw = &mut buf.as_mut_slice()[..BUCKET];
        raw[..8].copy_from_slice(MAGIC);
        let number = u32::try_from(b).expect("fewer than 2^32 buckets (checked at open)");
        raw[8..12].copy_from_slice(&number.to_le_bytes());
        let count = u32::try_from(entries.len()).expect("at most PER_BUCKET");
        raw[12..16].copy_from_slice(&count.to_le_bytes());
        for (i, (fp, pba)) in entries.iter().enumerate() {
            let e = &mut raw[HEADER + i * ENTRY..HEADER + (i + 1) * ENTRY];
            e[..16].copy_from_slice(&fp.0.to_le_bytes());
            e[16..].copy_from_slice(&pba.to_le_bytes());
        }
        let crc = crc32c::crc32c(&raw[..BUCKET - 4]);
        raw[BUCKET - 4..].copy_from_slice(&crc.to_le_bytes());
        self.dev.write_at(self.bucket_offset(b), raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_device::RamDevice;

    fn index(buckets: u64) -> (Arc<dyn BlockDevice>, FingerprintIndex) {
        let dev: Arc<dyn BlockDevice> =
            RamDevice::new(4096 + FingerprintIndex::device_bytes(buckets)).unwrap();
        let idx = FingerprintIndex::open(Arc::new(OnDevice(dev.clone())), 4096, buckets).unwrap();
        (dev, idx)
    }

    fn block(seed: u8) -> Vec<u8> {
        (0..4096u32)
            .map(|i| u8::try_from(i % 251).unwrap() ^ seed)
            .collect()
    }

    #[test]
    fn an_inserted_block_is_found_and_an_unknown_one_costs_no_read() {
        let (_, idx) = index(64);
        let (a, b) = (Fingerprint::of(&block(1)), Fingerprint::of(&block(2)));
        assert_ne!(a, b);
        assert!(idx.candidates(a).unwrap().is_empty());
        idx.insert(a, 77).unwrap();
        assert_eq!(idx.candidates(a).unwrap(), vec![77]);
        let reads = idx.stats().bucket_reads;
        assert!(idx.candidates(b).unwrap().is_empty());
        let s = idx.stats();
        assert_eq!(
            s.bucket_reads, reads,
            "the short fingerprints said no: {s:?}"
        );
        assert_eq!(s.filtered, 2, "{s:?}");
        assert_eq!(idx.entries(), 1);
    }

    #[test]
    fn a_forced_short_fingerprint_collision_is_resolved_by_the_full_one() {
        let (_, idx) = index(4);
        let a = Fingerprint::of(&block(9));
        // Same bucket (2^100 is a multiple of 4) and the same bits 64..79: only the full
        // fingerprint tells them apart.
        let b = Fingerprint(a.0 ^ (1 << 100));
        assert_eq!(a.bucket(4), b.bucket(4));
        assert_eq!(a.short(), b.short());
        idx.insert(a, 5).unwrap();
        let reads = idx.stats().bucket_reads;
        assert!(idx.candidates(b).unwrap().is_empty());
        let s = idx.stats();
        assert_eq!(s.short_collisions, 1, "{s:?}");
        assert_eq!(
            s.bucket_reads,
            reads + 1,
            "one bucket read settles it: {s:?}"
        );
        assert_eq!(idx.candidates(a).unwrap(), vec![5]);
        // Both inserted: each finds its own block.
        idx.insert(b, 6).unwrap();
        assert_eq!(idx.candidates(a).unwrap(), vec![5]);
        assert_eq!(idx.candidates(b).unwrap(), vec![6]);
    }

    #[test]
    fn a_full_bucket_drops_its_oldest_entry() {
        let (_, idx) = index(1);
        let fps: Vec<Fingerprint> = (0..=PER_BUCKET as u128)
            .map(|i| Fingerprint(i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)))
            .collect();
        for (i, fp) in fps.iter().enumerate() {
            idx.insert(*fp, i as u64).unwrap();
        }
        assert_eq!(idx.stats().dropped, 1);
        assert_eq!(idx.entries(), PER_BUCKET as u64);
        assert!(
            idx.candidates(fps[0]).unwrap().is_empty(),
            "the oldest went"
        );
        assert_eq!(
            idx.candidates(fps[PER_BUCKET]).unwrap(),
            vec![PER_BUCKET as u64]
        );
        // The same entry twice is kept once.
        idx.insert(fps[PER_BUCKET], PER_BUCKET as u64).unwrap();
        assert_eq!(idx.entries(), PER_BUCKET as u64);
    }

    #[test]
    fn a_reopened_index_has_its_entries_and_a_torn_bucket_reads_as_empty() {
        let (dev, idx) = index(8);
        let fps: Vec<Fingerprint> = (0..64u8).map(|i| Fingerprint::of(&block(i))).collect();
        for (i, fp) in fps.iter().enumerate() {
            idx.insert(*fp, 1000 + i as u64).unwrap();
        }
        assert!(idx.remove(fps[3], 1003).unwrap());
        assert!(!idx.remove(fps[3], 1003).unwrap(), "gone already");
        drop(idx);
        let idx = FingerprintIndex::open(Arc::new(OnDevice(dev.clone())), 4096, 8).unwrap();
        assert_eq!(idx.entries(), 63);
        for (i, fp) in fps.iter().enumerate() {
            let want = if i == 3 {
                vec![]
            } else {
                vec![1000 + i as u64]
            };
            assert_eq!(idx.candidates(*fp).unwrap(), want, "entry {i}");
        }
        // Tear the bucket of entry 0: it reads as empty, the others stay.
        let torn = fps[0].bucket(8);
        dev.write_at(4096 + torn * BUCKET as u64 + 100, &[0xAB; 8])
            .unwrap();
        let idx = FingerprintIndex::open(Arc::new(OnDevice(dev)), 4096, 8).unwrap();
        assert_eq!(idx.stats().bad_buckets, 1);
        let lost = fps.iter().filter(|f| f.bucket(8) == torn).count() as u64;
        let removed_there = u64::from(fps[3].bucket(8) == torn);
        assert_eq!(idx.entries(), 64 - 1 - (lost - removed_there));
        assert!(idx.candidates(fps[0]).unwrap().is_empty());
        // The next insert rewrites it whole.
        idx.insert(fps[0], 1000).unwrap();
        assert_eq!(idx.candidates(fps[0]).unwrap(), vec![1000]);
    }

    #[test]
    fn an_index_that_does_not_fit_its_device_is_refused() {
        let dev: Arc<dyn BlockDevice> = RamDevice::new(1 << 20).unwrap();
        let e = FingerprintIndex::open(Arc::new(OnDevice(dev.clone())), 4096, 256)
            .err()
            .unwrap();
        assert!(e.to_string().contains("does not fit"), "{e}");
        assert!(FingerprintIndex::open(Arc::new(OnDevice(dev)), 0, 0).is_err());
    }

    #[test]
    fn ram_is_two_bytes_per_entry_and_a_header_per_bucket() {
        let (_, idx) = index(16);
        for i in 0..1000u16 {
            let mut b = block(0);
            b[..2].copy_from_slice(&i.to_le_bytes());
            idx.insert(Fingerprint::of(&b), u64::from(i)).unwrap();
        }
        let ram = idx.ram_bytes();
        let headers = 16 * std::mem::size_of::<Mutex<Vec<u16>>>() as u64;
        assert!(ram >= headers + 2 * 1000, "{ram}");
        assert!(
            ram <= headers + 4 * 1000,
            "{ram}: at most twice the entries' 2 bytes"
        );
    }
}
