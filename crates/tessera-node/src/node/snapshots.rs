//! Snapshots, clones, rollback and changed extents (issue 14; docs/format.md §3.4). A
//! snapshot and a clone are volumes of their pool, so exports, NVMe/TCP namespaces, QoS
//! and statistics take them as they take any volume; a snapshot is exported read-only.

use std::sync::Arc;

use tessera_api::{ChangedExtents, Extent, SnapshotInfo, VolumeInfo};
use tessera_pool::{Pool, Volume};

use super::{Error, Node, Result};

impl Node {
    fn find_snapshot(&self, name: &str) -> Result<(Arc<Pool>, Arc<Volume>)> {
        match self.find_volume(name) {
            Ok((p, v)) if v.is_snapshot() => Ok((p, v)),
            Ok(_) => Err(Error::invalid(format!(
                "'{name}' is a volume, not a snapshot"
            ))),
            Err(_) => Err(Error::missing("snapshot", name)),
        }
    }

    fn snapshot_info(&self, p: &Pool, name: &str) -> Result<SnapshotInfo> {
        p.snapshots()
            .into_iter()
            .find(|s| s.name == name)
            .map(|s| SnapshotInfo {
                name: s.name,
                pool: p.name().to_string(),
                id: s.id,
                created: s.created,
                size: s.size,
                parent: s.parent,
                children: s.children,
                exclusive: s.exclusive,
                shared: s.shared,
            })
            .ok_or_else(|| Error::missing("snapshot", name))
    }

    /// Snapshot `volume` as `name` (metadata only; durable when it returns).
    pub fn create_snapshot(&self, volume: &str, name: &str) -> Result<SnapshotInfo> {
        self.create_snapshot_group(&[(volume.to_string(), name.to_string())])
            .map(|mut v| v.remove(0))
    }

    /// Snapshots of several volumes at one point in time; they must share a pool (one
    /// pool's metadata makes the point atomic).
    pub fn create_snapshot_group(&self, what: &[(String, String)]) -> Result<Vec<SnapshotInfo>> {
        let _g = self.admin();
        if what.is_empty() {
            return Err(Error::invalid("no snapshot asked for"));
        }
        let mut pool: Option<Arc<Pool>> = None;
        let mut pairs = Vec::new();
        for (volume, name) in what {
            if self.find_volume(name).is_ok() {
                return Err(Error::already_exists(format!(
                    "a volume or snapshot named '{name}' already exists"
                )));
            }
            let (p, v) = self.find_volume(volume)?;
            self.refuse_replicated(&v, "snapshot")?;
            if let Some(first) = &pool {
                if !Arc::ptr_eq(first, &p) {
                    return Err(Error::invalid(format!(
                        "volumes '{}' and '{volume}' are in different pools: a group \
                         snapshot is taken in one pool",
                        what[0].0
                    )));
                }
            }
            pool = Some(p);
            pairs.push((v, name.clone()));
        }
        let p = pool.expect("at least one volume");
        let t = std::time::Instant::now();
        p.create_snapshots(&pairs)?;
        tracing::info!(pool = %p.name(), snapshots = ?what, ms = t.elapsed().as_secs_f64() * 1e3, "snapshots created");
        what.iter()
            .map(|(_, n)| self.snapshot_info(&p, n))
            .collect()
    }

    pub fn list_snapshots(&self) -> Vec<SnapshotInfo> {
        let mut out = Vec::new();
        for p in self.pools() {
            for s in p.snapshots() {
                if let Ok(i) = self.snapshot_info(&p, &s.name) {
                    out.push(i);
                }
            }
        }
        out
    }

    /// Delete a snapshot (refused while exported, like a volume). Its space comes back
    /// once no volume reads through it.
    pub fn delete_snapshot(&self, name: &str) -> Result<()> {
        self.find_snapshot(name)?;
        self.delete_volume(name)
    }

    /// A writable clone `name` of snapshot `snapshot`.
    pub fn clone_volume(&self, snapshot: &str, name: &str, force: bool) -> Result<VolumeInfo> {
        let _g = self.admin();
        if self.find_volume(name).is_ok() {
            return Err(Error::already_exists(format!(
                "volume '{name}' already exists"
            )));
        }
        let (p, s) = self.find_snapshot(snapshot)?;
        let v = p.clone_snapshot(&s, name, force)?;
        tracing::info!(pool = %p.name(), snapshot, volume = name, "clone created");
        Ok(self.volume_info(&p, &v))
    }

    /// Roll `volume` back to its snapshot `to`; refused while it is exported or open.
    pub fn rollback_volume(&self, volume: &str, to: &str) -> Result<VolumeInfo> {
        let _g = self.admin();
        let (p, v) = self.find_volume(volume)?;
        self.refuse_replicated(&v, "roll back")?;
        if let Some(nqn) = self.nvmf.subsystem_using(&p.status().uuid, v.id) {
            return Err(Error::busy(format!(
                "volume '{volume}' is a namespace of NVMe subsystem '{nqn}'; remove it before a rollback"
            )));
        }
        let (sp, s) = self.find_snapshot(to)?;
        if !Arc::ptr_eq(&p, &sp) {
            return Err(Error::invalid(format!(
                "'{to}' is not a snapshot of volume '{volume}'"
            )));
        }
        p.rollback_volume(&v, &s)?;
        tracing::info!(pool = %p.name(), volume, snapshot = to, "volume rolled back");
        Ok(self.volume_info(&p, &v))
    }

    /// The ranges of `volume` (a volume, clone or snapshot) that may differ from its
    /// older snapshot `since`.
    pub fn changed_extents(&self, volume: &str, since: &str) -> Result<ChangedExtents> {
        let (p, v) = self.find_volume(volume)?;
        let (_, s) = self.find_snapshot(since)?;
        let extents: Vec<Extent> = p
            .changed_extents(&s, &v)?
            .into_iter()
            .map(|(offset, length)| Extent { offset, length })
            .collect();
        Ok(ChangedExtents {
            volume: volume.to_string(),
            since: since.to_string(),
            size: v.size(),
            changed: extents.iter().map(|e| e.length).sum(),
            extents,
        })
    }

    /// Snapshots act on one node's copy: on a replicated volume they would make the
    /// replicas differ, so they are refused until they are taken on every replica.
    fn refuse_replicated(&self, v: &tessera_pool::Volume, what: &str) -> Result<()> {
        if self.replicated_of(v).is_some() || self.replica_blocked(v).is_some() {
            return Err(Error::invalid(format!(
                "volume '{}' is replicated: cannot {what} it (snapshots of replicated volumes \
                 are not supported yet)",
                v.name
            )));
        }
        Ok(())
    }
}
