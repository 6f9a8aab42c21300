//! Changes since a snapshot (incremental backup): which blocks of a volume, clone or
//! snapshot may differ from a snapshot it descends from. One computation answers the
//! API's changed extents of a whole volume ([`crate::Pool::changed_extents`]) and NBD's
//! `qemu:dirty-bitmap:SNAPSHOT` block status over a range of an export.
//!
//! A block may differ when some layer between the two wrote it: the target's own map
//! and the maps of its ancestors newer than the base, each with the presence bitmaps
//! of its partial units (docs/format.md §3.4). Nothing is kept for this: the chain is
//! the record of what changed, so a snapshot costs nothing more for being a backup base.
//! Deleting a snapshot in between keeps the answer exact: a hidden snapshot only gives
//! back units that every child has rewritten whole, so the child's layer still says so.

use std::sync::Arc;

use tessera_io::cast::u32_of;

use crate::volume::{UnitMap, Volume, HOLE};

impl Volume {
    /// The snapshots this volume (or clone, or snapshot) descends from, nearest first,
    /// deleted ones left out: the bases its changes can be asked since.
    pub fn change_bases(&self) -> Vec<String> {
        self.ancestors()
            .into_iter()
            .filter(|a| !a.is_hidden())
            .map(|a| a.name.clone())
            .collect()
    }

    /// The ancestor snapshot named `name` (not deleted) as the token
    /// [`Volume::changed_runs`] takes: its volume id, which the pool never gives again.
    pub fn change_base(&self, name: &str) -> Option<u32> {
        self.ancestors()
            .into_iter()
            .find(|a| !a.is_hidden() && a.name == name)
            .map(|a| a.id)
    }

    /// The maps of the layers between this volume and its ancestor `base` (a volume
    /// id): its own and those of the ancestors newer than `base`. `None` when `base` is
    /// not an ancestor (a deleted one still is while this volume reads through it).
    fn layers_since(&self, base: u32) -> Option<Vec<Arc<UnitMap>>> {
        let mut maps = vec![self.current_map()];
        for a in self.ancestors() {
            if a.id == base {
                return Some(maps);
            }
            maps.push(a.current_map());
        }
        None
    }

    /// Which parts of `[offset, offset+len)` may differ from ancestor `base` (a volume
    /// id, see [`Volume::change_base`]), as at most `max_runs` runs of (length, changed),
    /// clipped to the range and the volume, adjacent runs of one state merged. Changes
    /// are exact to the presence block (4 KiB at 1 MiB units). Regions no layer maps are
    /// skipped a map leaf at a time, so a sparse range of a huge volume costs one step
    /// per 4096 units and layer. No lock is taken: the answer is the chain as it was
    /// while it was read (a write landing meanwhile may or may not be in it).
    pub fn changed_runs(
        &self,
        base: u32,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Option<Vec<(u64, bool)>> {
        if let Some(d) = self.pool.dedup().filter(|_| self.block_mapped()) {
            // Blocks some layer between them has an entry of its own for.
            let mut layers = vec![self.layer()];
            for a in self.ancestors() {
                if a.id == base {
                    let end = offset.saturating_add(len).min(self.size());
                    let len = end.saturating_sub(offset);
                    if len == 0 {
                        return Some(Vec::new());
                    }
                    return Some(d.changed_runs(&layers, offset, len, max_runs));
                }
                layers.push(a.layer());
            }
            return None;
        }
        let maps = self.layers_since(base)?;
        let pres = &self.pool.presence;
        let shift = self.pool.unit_shift;
        let bshift = pres.block_shift;
        let end = offset.saturating_add(len).min(self.size());
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut own: Vec<u32> = Vec::with_capacity(maps.len());
        let mut at = offset;
        'units: while at < end {
            let u = at >> shift;
            let last = (end - 1) >> shift;
            own.clear();
            own.extend(maps.iter().map(|m| m.get(u)).filter(|&p| p != HOLE));
            if own.is_empty() {
                // Unchanged up to the first unit some layer maps.
                let next = maps
                    .iter()
                    .map(|m| m.run_from(u, last + 1).1)
                    .min()
                    .unwrap_or(last + 1);
                let run_end = if next > last { end } else { next << shift };
                if !push_run(&mut runs, run_end - at, false, max_runs) {
                    break;
                }
                at = run_end;
                continue;
            }
            let unit_end = ((u + 1) << shift).min(end);
            if own.iter().any(|&p| pres.is_full(p)) {
                if !push_run(&mut runs, unit_end - at, true, max_runs) {
                    break;
                }
                at = unit_end;
                continue;
            }
            // Partial units only: block by block.
            while at < unit_end {
                let b = u32_of((at - (u << shift)) >> bshift);
                let changed = own.iter().any(|&p| pres.present(p, b));
                let block_end = (((at >> bshift) + 1) << bshift).min(unit_end);
                if !push_run(&mut runs, block_end - at, changed, max_runs) {
                    break 'units;
                }
                at = block_end;
            }
        }
        Some(runs)
    }
}

/// Add `len` bytes of state `changed` to `runs`, merged into the last run when it has
/// that state; false when that needs a run beyond `max_runs`.
fn push_run(runs: &mut Vec<(u64, bool)>, len: u64, changed: bool, max_runs: usize) -> bool {
    if let Some(r) = runs.last_mut().filter(|r| r.1 == changed) {
        r.0 += len;
    } else if runs.len() < max_runs {
        runs.push((len, changed));
    } else {
        return false;
    }
    true
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tessera_device::{BlockDevice, RamDevice};
    use tessera_testkit::blockio::{core, write};

    use crate::{Pool, PoolOptions, DEFAULT_UNIT_SIZE};

    /// Changes over a range: block-exact inside partial units, whole units for units
    /// written whole, clipped, capped at `max_runs`, and still answered after the base
    /// and a snapshot in between are deleted.
    #[test]
    fn changed_runs_follow_the_chain() {
        let unit = DEFAULT_UNIT_SIZE;
        let dev: Arc<dyn BlockDevice> = RamDevice::new(256 << 20).unwrap();
        let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
        let v = pool.create_volume("v", 64 * unit).unwrap();
        let mut io = core();
        let mut put = |off: u64, len: u64| {
            let mut h = v.open_handle();
            let data = vec![0xABu8; usize::try_from(len).unwrap()];
            assert!(write(&mut io, &mut h, off, &data) >= 0);
        };
        put(0, 8192);
        let s1 = pool.create_snapshot(&v, "s1").unwrap();
        assert_eq!(v.change_bases(), vec!["s1".to_string()]);
        let base = v.change_base("s1").unwrap();
        assert_eq!(v.change_base("nosuch"), None);
        assert_eq!(
            v.changed_runs(base, 0, 64 * unit, 100).unwrap(),
            vec![(64 * unit, false)]
        );
        // A 4 KiB write after the snapshot: one block of a partial unit.
        put(4096, 4096);
        // A unit written whole where the chain has nothing: a plain unit.
        put(10 * unit, unit);
        let s2 = pool.create_snapshot(&v, "s2").unwrap();
        // 512 bytes inside block 10 of unit 0, which the chain has data for: partial.
        put(40960, 512);
        assert_eq!(v.change_bases(), vec!["s2".to_string(), "s1".to_string()]);
        let since_s1 = v.changed_runs(base, 0, 64 * unit, 100).unwrap();
        assert_eq!(
            since_s1,
            vec![
                (4096, false),
                (4096, true),
                (32768, false),
                (4096, true),
                (10 * unit - 45056, false),
                (unit, true),
                (53 * unit, false),
            ]
        );
        // Since s2 only the last write; s2 since s1 the two before it.
        let b2 = v.change_base("s2").unwrap();
        assert_eq!(
            v.changed_runs(b2, 0, unit, 100).unwrap(),
            vec![(40960, false), (4096, true), (unit - 45056, false)]
        );
        assert_eq!(
            s2.changed_runs(base, 0, 11 * unit, 100).unwrap(),
            vec![
                (4096, false),
                (4096, true),
                (10 * unit - 8192, false),
                (unit, true)
            ]
        );
        // Clipped to the range; capped at max_runs (the last run stays in the range).
        assert_eq!(
            v.changed_runs(base, 6144, 4096, 100).unwrap(),
            vec![(2048, true), (2048, false)]
        );
        assert_eq!(
            v.changed_runs(base, 0, 64 * unit, 1).unwrap(),
            vec![(4096, false)]
        );
        // Not an ancestor: no answer.
        assert_eq!(s1.changed_runs(b2, 0, unit, 10), None);
        assert_eq!(v.changed_runs(v.id, 0, unit, 10), None);
        // v rewrites unit 10 whole, so deleting s2 (hidden: v reads through it) frees
        // s2's copy of it; then s1 goes too. The answer stays the same, though neither
        // is offered as a base any more.
        put(10 * unit, unit);
        let allocated = s2.allocated_bytes();
        pool.delete_volume(&s2).unwrap();
        assert_eq!(s2.allocated_bytes(), allocated - unit);
        assert_eq!(v.change_bases(), vec!["s1".to_string()]);
        assert_eq!(v.changed_runs(base, 0, 64 * unit, 100).unwrap(), since_s1);
        pool.delete_volume(&s1).unwrap();
        assert!(v.change_bases().is_empty());
        assert_eq!(v.changed_runs(base, 0, 64 * unit, 100).unwrap(), since_s1);
    }
}
