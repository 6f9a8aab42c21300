//! The pool's catalog: volumes and exports by name and id, their sizes against the
//! overcommit ratio, and the names and sizes the control plane may use.

use super::{human_bytes, now_secs, Pool, State, VolumeOptions};
use crate::error::{Error, ErrorKind, Result};
use crate::format::*;
use crate::volume::{UnitMap, Volume};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

impl State {
    /// Refuse `name` when a volume, snapshot or clone already has it: they share one
    /// namespace (hidden snapshots, which have no name of their own, are left out).
    pub(crate) fn name_free(&self, name: &str) -> Result<()> {
        if self
            .volumes
            .values()
            .any(|v| !v.is_hidden() && v.name == name)
        {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("a volume or snapshot named '{name}' already exists"),
            ));
        }
        Ok(())
    }

    /// Refuse a change to `vol` while an export serves it (`when`: what the message
    /// says to remove the export before).
    pub(crate) fn not_exported(&self, vol: &Volume, when: &str) -> Result<()> {
        match self.exports.iter().find(|e| e.volume_id == vol.id) {
            Some(e) => Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "volume '{}' is exported as '{}'; remove the export {when}",
                    vol.name, e.name
                ),
            )),
            None => Ok(()),
        }
    }

    pub(super) fn catalog(&self) -> Catalog {
        Catalog {
            next_volume_id: self.next_volume_id,
            volumes: self
                .volumes
                .values()
                .map(|v| VolumeRecord {
                    id: v.id,
                    size: v.size(),
                    created: v.created,
                    name: v.name.clone(),
                    qos: v.legacy_qos().unwrap_or_default(),
                    chain: v.chain_record(),
                })
                .collect(),
            exports: self.exports.clone(),
            partial: Vec::new(),
            dedup: false,
            index_buckets: 0,
        }
    }
}

impl Pool {
    /// Volumes, snapshots and clones (hidden snapshots left out).
    pub fn volumes(&self) -> Vec<Arc<Volume>> {
        self.core
            .lock()
            .volumes
            .values()
            .filter(|v| !v.is_hidden())
            .cloned()
            .collect()
    }

    pub fn volume(&self, name: &str) -> Option<Arc<Volume>> {
        self.core
            .lock()
            .volumes
            .values()
            .find(|v| v.name == name && !v.is_hidden())
            .cloned()
    }

    pub fn volume_by_id(&self, id: u32) -> Option<Arc<Volume>> {
        self.core.lock().volumes.get(&id).cloned()
    }

    /// The overcommit ratio in force (see [`DEFAULT_OVERCOMMIT`]).
    pub fn overcommit(&self) -> f64 {
        f64::from_bits(self.core.overcommit.load(Relaxed))
    }

    /// Set the overcommit ratio (the node keeps it in its registry). Volumes already
    /// beyond a lowered ratio stay; only new volumes and growth are checked.
    pub fn set_overcommit(&self, ratio: f64) -> Result<()> {
        validate_overcommit(ratio)?;
        self.core.overcommit.store(ratio.to_bits(), Relaxed);
        Ok(())
    }

    /// Refuse to bring the volumes' virtual sizes, now `provisioned`, to `provisioned +
    /// more` if that exceeds the overcommit ratio, unless `force`.
    pub(crate) fn check_overcommit(
        &self,
        s: &State,
        what: &str,
        more: u64,
        force: bool,
    ) -> Result<()> {
        let ratio = self.overcommit();
        let sb = &self.core.meta.sb;
        let capacity = (sb.total_units - sb.meta_units) * self.core.unit_size();
        let total = provisioned(s).saturating_add(more);
        let limit = ratio * capacity as f64;
        if force || total as f64 <= limit {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "{what} would bring the volumes of pool '{}' to {} ({total} bytes) on {} of \
                 capacity ({capacity} bytes), {:.1}x; the pool allows {ratio}x ({}); use \
                 --force (API: \"force\": true) to overcommit anyway, or raise the ratio \
                 (`pool update {} --overcommit N`)",
                self.core.name,
                human_bytes(total),
                human_bytes(capacity),
                total as f64 / capacity.max(1) as f64,
                human_bytes(saturating_bytes(limit)),
                self.core.name,
            ),
        ))
    }

    /// Create a thin volume of `size` bytes (a multiple of 512). No space is taken yet.
    /// Refused beyond the pool's overcommit ratio.
    pub fn create_volume(&self, name: &str, size: u64) -> Result<Arc<Volume>> {
        self.create_volume_opts(name, size, VolumeOptions::default())
    }

    /// [`Pool::create_volume`] with options: beyond the overcommit ratio, and whether it
    /// deduplicates.
    pub fn create_volume_opts(
        &self,
        name: &str,
        size: u64,
        opts: VolumeOptions,
    ) -> Result<Arc<Volume>> {
        validate_name("volume", name)?;
        validate_volume_size(size, self.core.unit_size())?;
        let dedup_on = self.dedup_enabled();
        let block_mapped = match opts.dedup {
            None => dedup_on,
            Some(false) => false,
            Some(true) if dedup_on => true,
            Some(true) => {
                return Err(Error::invalid(format!(
                    "pool '{}' does not deduplicate; turn dedup on first (`tessera pool \
                     update {} --dedup on`)",
                    self.core.name, self.core.name
                )))
            }
        };
        let vol = {
            let mut s = self.core.lock();
            s.name_free(name)?;
            self.check_overcommit(
                &s,
                &format!("volume '{name}' of {}", human_bytes(size)),
                size,
                opts.force,
            )?;
            let id = s.next_volume_id;
            s.next_volume_id += 1;
            let vol = Volume::new(
                self.core.clone(),
                id,
                name.to_string(),
                size,
                now_secs(),
                UnitMap::new(size.div_ceil(self.core.unit_size())),
                Default::default(),
            );
            if block_mapped {
                // A dedup volume's blocks are references (docs/format.md §17).
                let mut chain = crate::format::ChainRecord::plain(id);
                chain.flags |= crate::format::CHAIN_BLOCK_MAPPED;
                vol.set_chain(chain, None);
            }
            s.volumes.insert(id, vol.clone());
            vol
        };
        if let Some(d) = self.core.dedup().filter(|_| block_mapped) {
            // After the pool lock: the dedup lock is always taken first.
            d.add_layer(vol.id, None);
        }
        if let Err(e) = self.core.checkpoint() {
            self.core.lock().volumes.remove(&vol.id);
            return Err(e);
        }
        Ok(vol)
    }

    /// Grow a volume. Shrinking is refused: it would silently drop data. Growing beyond
    /// the pool's overcommit ratio is refused.
    pub fn resize_volume(&self, vol: &Arc<Volume>, new_size: u64) -> Result<()> {
        self.resize_volume_opts(vol, new_size, false)
    }

    /// [`Pool::resize_volume`]; `force` grows it beyond the overcommit ratio.
    pub fn resize_volume_opts(&self, vol: &Arc<Volume>, new_size: u64, force: bool) -> Result<()> {
        validate_volume_size(new_size, self.core.unit_size())?;
        if vol.is_snapshot() {
            return Err(Error::invalid(format!(
                "'{}' is a snapshot: its size is the volume's when it was taken",
                vol.name
            )));
        }
        let old = vol.size();
        if new_size < old {
            return Err(Error::invalid(format!(
                "volume '{}' is {old} bytes; shrinking to {new_size} is not supported",
                vol.name
            )));
        }
        if new_size == old {
            return Ok(());
        }
        {
            let s = self.core.lock();
            self.check_overcommit(
                &s,
                &format!("growing volume '{}' to {}", vol.name, human_bytes(new_size)),
                new_size - old,
                force,
            )?;
            vol.grow(new_size, new_size.div_ceil(self.core.unit_size()));
        }
        self.core.checkpoint()
    }

    /// Delete a volume and give all its space back. Refused while clients hold it open.
    pub fn delete_volume(&self, vol: &Arc<Volume>) -> Result<()> {
        let open = vol.open_handles();
        if open > 0 {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("volume '{}' is busy: {open} open connection(s)", vol.name),
            ));
        }
        self.core.change_then_checkpoint(
            || (),
            |s| {
                s.not_exported(vol, "first")?;
                // A snapshot that other volumes read through is hidden, not removed; a
                // volume's removal may free hidden snapshots it was the last reader of.
                self.delete_in_chain(s, vol);
                Ok(())
            },
            // A dedup layer's references go (blocks no other layer shares are freed
            // once the checkpoint is durable), then its map units.
            |()| self.core.apply_layer_chores(),
        )
    }

    pub fn exports(&self) -> Vec<ExportRecord> {
        self.core.lock().exports.clone()
    }

    pub fn add_export(&self, e: ExportRecord) -> Result<()> {
        validate_name("export", &e.name)?;
        {
            let mut s = self.core.lock();
            if !s.volumes.contains_key(&e.volume_id) {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    "volume not found in this pool",
                ));
            }
            s.exports.push(e.clone());
        }
        if let Err(err) = self.core.checkpoint() {
            self.core.lock().exports.retain(|x| x.name != e.name);
            return Err(err);
        }
        Ok(())
    }

    pub fn remove_export(&self, name: &str) -> Result<()> {
        self.core.lock().exports.retain(|x| x.name != name);
        self.core.checkpoint()
    }
}

/// A byte count computed in floating point (a ratio of a capacity), saturated into u64.
#[allow(clippy::cast_possible_truncation)] // `as` saturates; the fraction of a byte goes
pub(super) fn saturating_bytes(x: f64) -> u64 {
    x as u64
}

/// Names are what users type on command lines and in NBD URIs: keep them plain.
pub fn validate_name(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!("bad {what} name '{name}': use 1-64 characters from A-Z a-z 0-9 - _ . (not starting with '.')")))
    }
}

/// Sum of the virtual sizes of the pool's volumes (snapshots promise no new space: they
/// only keep what their volume had).
pub(super) fn provisioned(s: &State) -> u64 {
    s.volumes
        .values()
        .filter(|v| !v.is_snapshot())
        .map(|v| v.size())
        .sum()
}

pub fn validate_overcommit(ratio: f64) -> Result<()> {
    if ratio.is_finite() && ratio > 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "overcommit ratio {ratio} must be a number above 0 (e.g. 1 for none, 20)"
        )))
    }
}

pub(super) fn validate_volume_size(size: u64, unit: u64) -> Result<()> {
    if size == 0 || !size.is_multiple_of(512) {
        return Err(Error::invalid(format!(
            "volume size {size} must be a non-zero multiple of 512 bytes"
        )));
    }
    if size.div_ceil(unit) >= u32::MAX as u64 {
        return Err(Error::invalid(
            "volume too large for this pool's allocation unit",
        ));
    }
    Ok(())
}
