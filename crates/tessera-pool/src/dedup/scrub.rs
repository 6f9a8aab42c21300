//! The scrub of a dedup pool's metadata (docs/format.md §17, "Scrub"): the reference
//! counts against the maps, and every fingerprint index entry against the bytes of the
//! block it names. Runs on the scrub job's thread while the pool serves I/O.

use tessera_api::DedupScrubInfo;
use tessera_io::AlignedBuf;

use super::store::DedupCore;
use super::Fingerprint;
use crate::format::BLOCK;

impl DedupCore {
    /// Check (and with `repair`, fix) the counts, then walk the index bucket by bucket
    /// until `stop` says so. An index entry whose block is free or holds other bytes now
    /// is stale: harmless, since every candidate is compared before it is shared, but it
    /// costs a read per lookup that finds it, so a repairing scrub removes it. The
    /// findings are the count errors (damage; stale entries are not).
    pub(crate) fn scrub(
        &self,
        repair: bool,
        stop: &dyn Fn() -> bool,
    ) -> (DedupScrubInfo, Vec<String>) {
        let (findings, repaired) = self.scrub_counts(repair);
        let mut info = DedupScrubInfo {
            count_errors: findings.len() as u64,
            counts_repaired: repaired,
            ..DedupScrubInfo::default()
        };
        let mut block = AlignedBuf::zeroed(BLOCK);
        let mut errors = Vec::new();
        for b in 0..self.index.bucket_count() {
            if stop() {
                break;
            }
            let entries = match self.index.bucket_entries(b) {
                Ok(e) => e,
                Err(e) => {
                    errors.push(format!("dedup index bucket {b} unreadable: {e}"));
                    continue;
                }
            };
            for (fp, pba) in entries {
                info.index_entries_checked += 1;
                if !self.stale(fp, pba, &mut block) {
                    continue;
                }
                info.stale_index_entries += 1;
                if repair && matches!(self.index.remove(fp, pba), Ok(true)) {
                    info.index_entries_removed += 1;
                }
            }
            info.index_buckets_checked += 1;
        }
        let mut all = findings;
        all.extend(errors);
        (info, all)
    }

    /// Whether index entry (`fp`, `pba`) is stale. The block is read without the lock
    /// first (most entries match, and readers are not held up); a mismatch is read again
    /// under it, where the block cannot change.
    fn stale(&self, fp: Fingerprint, pba: u64, block: &mut AlignedBuf) -> bool {
        let Some(at) = self.live_offset(pba) else {
            return true;
        };
        let buf = &mut block.as_mut_slice()[..BLOCK];
        if self.layout.read_at(at, buf).is_ok() && Fingerprint::of(buf) == fp {
            return false;
        }
        self.holds(pba, fp, block) == Some(false)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tessera_device::{BlockDevice, RamDevice};
    use tessera_testkit::blockio::{core, write};
    use tessera_testkit::data::pattern;

    use tessera_io::AlignedBuf;

    use crate::dedup::store::Placement;
    use crate::dedup::Fingerprint;
    use crate::format::BLOCK;
    use crate::{Pool, PoolOptions};

    fn dedup_pool() -> Pool {
        let dev: Arc<dyn BlockDevice> = RamDevice::new(64 << 20).unwrap();
        let opts = PoolOptions {
            dedup: true,
            ..PoolOptions::default()
        };
        Pool::create("p", vec![dev], opts).unwrap()
    }

    /// Counts set wrong (a leak, an undercount, a referenced block on the free list)
    /// are reported, left alone without repair, set right with it; a clean pool reports
    /// nothing; a block overwritten in place leaves a stale index entry, which a
    /// repairing scrub removes.
    #[test]
    fn the_scrub_finds_and_repairs_wrong_counts_and_stale_index_entries() {
        let pool = dedup_pool();
        let d = pool.core.dedup().unwrap().clone();
        let mut io = core();
        let data = pattern(5, 64 << 10);
        let (a, b) = (
            pool.create_volume("a", 4 << 20).unwrap(),
            pool.create_volume("b", 4 << 20).unwrap(),
        );
        let (mut ha, mut hb) = (a.open_handle(), b.open_handle());
        assert_eq!(write(&mut io, &mut ha, 0, &data), 0);
        assert_eq!(write(&mut io, &mut hb, 0, &data), 0);
        assert_eq!(write(&mut io, &mut ha, 1 << 20, &pattern(6, 8192)), 0);
        pool.commit().unwrap();
        let never = || false;
        let (info, found) = pool.scrub_dedup(true, &never).unwrap();
        assert!(found.is_empty(), "{found:?}");
        assert_eq!(
            (info.index_entries_checked, info.stale_index_entries),
            (18, 0)
        );

        // Overwritten in place (a's own block): its old entry is stale.
        assert_eq!(write(&mut io, &mut ha, 1 << 20, &pattern(7, 4096)), 0);
        pool.commit().unwrap();
        let (info, found) = pool.scrub_dedup(false, &never).unwrap();
        assert!(found.is_empty(), "{found:?}");
        assert_eq!(
            (info.stale_index_entries, info.index_entries_removed),
            (1, 0)
        );
        let (info, _) = pool.scrub_dedup(true, &never).unwrap();
        assert_eq!(
            (info.stale_index_entries, info.index_entries_removed),
            (1, 1)
        );
        let (info, _) = pool.scrub_dedup(true, &never).unwrap();
        assert_eq!(info.stale_index_entries, 0);

        // A reference a write in flight took (shared, not yet in a map) is no damage.
        let first = &data[..BLOCK];
        let mut scratch = AlignedBuf::zeroed(BLOCK);
        let pba = d.share(Fingerprint::of(first), first, &mut scratch);
        let pba = pba.expect("the block is stored");
        let (info, found) = pool.scrub_dedup(false, &never).unwrap();
        assert_eq!(info.count_errors, 0, "{found:?}");
        d.unshare(&[Placement::Shared(pba)]);
        let (info, found) = pool.scrub_dedup(false, &never).unwrap();
        assert_eq!(info.count_errors, 0, "{found:?}");

        let layer = a.layer();
        let shared = d.damage_count(layer, 0, 3); // referenced twice
        let under = d.damage_count(layer, 1, 1); // twice too
        let freed = d.damage_count(layer, 2, 0); // twice, and on the free list
        let (info, found) = pool.scrub_dedup(false, &never).unwrap();
        assert_eq!(
            (info.count_errors, info.counts_repaired),
            (3, 0),
            "{found:?}"
        );
        assert!(
            found.iter().any(|f| f.contains(&format!(
                "block {shared}: reference count 3, referenced 2 times"
            ))),
            "{found:?}"
        );
        assert!(
            found
                .iter()
                .any(|f| f.contains(&format!("block {under}: reference count 1"))),
            "{found:?}"
        );
        assert!(!pool.verify_dedup().is_empty());
        let (info, _) = pool.scrub_dedup(true, &never).unwrap();
        assert_eq!((info.count_errors, info.counts_repaired), (3, 3));
        assert!(pool.verify_dedup().is_empty(), "{:?}", pool.verify_dedup());
        assert!(
            !d.is_free(freed),
            "a referenced block stays off the free lists"
        );
        let (info, found) = pool.scrub_dedup(true, &never).unwrap();
        assert_eq!(info.count_errors, 0, "{found:?}");
        // A stop request ends the index walk early.
        let (info, _) = pool.scrub_dedup(false, &|| true).unwrap();
        assert_eq!(info.index_buckets_checked, 0);
    }
}
