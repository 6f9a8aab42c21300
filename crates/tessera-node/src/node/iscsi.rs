//! iSCSI on a node: the management operations the API calls over the target
//! configuration (`crate::iscsi`), and the listener.
//!
//! The `tessera_iscsi` target holds each LUN's export itself (not a catalog read at
//! login, as NVMe/TCP's): a volume that is a LUN therefore cannot be deleted, rolled back
//! or made replicated while its target exists (the checks that name the target are in
//! volumes.rs, snapshots.rs and replicas.rs), so the export a LUN holds never goes stale.

use std::sync::Arc;

use tessera_api::{IscsiLunInfo, IscsiTargetInfo};
use tessera_io::cast::u32_of;
use tessera_io::sync::MutexExt;

use crate::error::Error;
use crate::iscsi::{LunRecord, TargetRecord};
use crate::node::Node;

/// The crate's refusals, as the API answers them.
fn from_target(e: tessera_iscsi::target::Error) -> Error {
    use tessera_iscsi::target::Error as T;
    match e {
        T::Exists(_) => Error::already_exists(e.to_string()),
        T::InvalidName(_) | T::NoLuns(_) | T::TooManyLuns { .. } => Error::invalid(e.to_string()),
    }
}

impl Node {
    fn iscsi_info(&self, t: &TargetRecord) -> IscsiTargetInfo {
        IscsiTargetInfo {
            iqn: t.iqn.clone(),
            luns: t
                .luns
                .iter()
                .map(|l| IscsiLunInfo {
                    lun: l.lun,
                    volume: l.volume.clone(),
                })
                .collect(),
            served: self.iscsi.target().target(&t.iqn).is_some()
                && !self.iscsi.portals().is_empty(),
            portals: self.iscsi.portals(),
        }
    }

    pub fn iscsi_list(&self) -> Vec<IscsiTargetInfo> {
        let targets = self.iscsi.file().targets.clone();
        targets.iter().map(|t| self.iscsi_info(t)).collect()
    }

    pub fn iscsi_get(&self, iqn: &str) -> Result<IscsiTargetInfo, Error> {
        let t = self
            .iscsi
            .file()
            .targets
            .iter()
            .find(|t| t.iqn == iqn)
            .cloned();
        t.map(|t| self.iscsi_info(&t))
            .ok_or_else(|| Error::missing("iSCSI target", iqn))
    }

    /// Create target `iqn` with LUNs 0, 1, ... serving `volumes`: live at once, and
    /// persisted so that it is served again after a restart.
    pub fn iscsi_create(&self, iqn: &str, volumes: &[String]) -> Result<IscsiTargetInfo, Error> {
        let _g = self.admin();
        if self.iscsi.file().targets.iter().any(|t| t.iqn == iqn) {
            return Err(Error::already_exists(format!(
                "iSCSI target '{iqn}' already exists"
            )));
        }
        let mut luns = Vec::new();
        let mut exports = Vec::new();
        for (i, name) in volumes.iter().enumerate() {
            let (p, v) = self.pools().find_volume(name)?;
            let pool_uuid = p.uuid();
            if luns
                .iter()
                .any(|l: &LunRecord| l.pool_uuid == pool_uuid && l.volume_id == v.id)
            {
                return Err(Error::invalid(format!(
                    "volume '{name}' is given twice: a volume is one LUN of a target"
                )));
            }
            if let Some(why) = self.replicas().blocked(&v) {
                return Err(Error::busy(format!("volume '{name}' is not served: {why}")));
            }
            exports.push(self.export_of(&v));
            luns.push(LunRecord {
                lun: u32_of(i),
                volume: name.clone(),
                pool_uuid,
                volume_id: v.id,
            });
        }
        // The crate checks the name and the LUN count; live first, so that a refusal
        // leaves nothing persisted.
        self.iscsi
            .target()
            .add_target(iqn, exports)
            .map_err(from_target)?;
        let rec = TargetRecord {
            iqn: iqn.to_string(),
            luns,
        };
        let saved = self.iscsi.update(|f| {
            f.targets.push(rec.clone());
            Ok(())
        });
        if let Err(e) = saved {
            self.iscsi.target().remove_target(iqn);
            return Err(e);
        }
        tracing::info!(iqn, luns = rec.luns.len(), "iscsi: target created");
        Ok(self.iscsi_info(&rec))
    }

    /// Delete target `iqn`: no new login reaches it; sessions logged in keep their LUNs
    /// until they log out.
    pub fn iscsi_delete(&self, iqn: &str) -> Result<(), Error> {
        let _g = self.admin();
        self.iscsi.update(|f| {
            let before = f.targets.len();
            f.targets.retain(|t| t.iqn != iqn);
            if f.targets.len() == before {
                return Err(Error::missing("iSCSI target", iqn));
            }
            Ok(())
        })?;
        self.iscsi.target().remove_target(iqn);
        tracing::info!(iqn, "iscsi: target deleted");
        Ok(())
    }

    /// The target's LUNs from the persisted records; None (and logged) when a volume is
    /// not online: serving the others would renumber the LUNs behind a host's back.
    fn iscsi_restore(&self, t: &TargetRecord) -> Option<()> {
        let mut exports = Vec::new();
        for l in &t.luns {
            let v = self
                .pools()
                .volume_by_id(&l.pool_uuid, l.volume_id)
                .filter(|v| self.replicas().blocked(v).is_none());
            let Some(v) = v else {
                tracing::error!(
                    iqn = %t.iqn,
                    lun = l.lun,
                    volume = %l.volume,
                    "iscsi: the LUN's volume is not online; the target is not served"
                );
                return None;
            };
            exports.push(self.export_of(&v));
        }
        if let Err(e) = self.iscsi.target().add_target(&t.iqn, exports) {
            tracing::error!(iqn = %t.iqn, error = %e, "iscsi: cannot serve the target");
            return None;
        }
        Some(())
    }
}

/// Serve the persisted targets and start the listener (`[iscsi] listen`, "" = none). A
/// port that cannot be bound is reported and skipped, as NVMe/TCP's: iSCSI is then off,
/// the node serves the rest. Returns the address served.
pub fn start(node: &Arc<Node>) -> Vec<String> {
    let targets = node.iscsi.file().targets.clone();
    for t in &targets {
        let _ = node.iscsi_restore(t);
    }
    let cfg = node.cfg.iscsi.clone();
    if cfg.listen.is_empty() {
        return Vec::new();
    }
    let l = match std::net::TcpListener::bind(&cfg.listen) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(addr = %cfg.listen, error = %e, "iscsi: cannot listen; iSCSI is off");
            return Vec::new();
        }
    };
    let local = l
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or(cfg.listen.clone());
    let target = node.iscsi.target().clone();
    target.add_portal(local.clone());
    let cap = node
        .exports()
        .listener_cap("iscsi", local.clone(), cfg.max_connections);
    let budget = node.exports().buffers().clone();
    let n = node.clone();
    let spawned = std::thread::Builder::new()
        .name("tessera-iscsi-accept".into())
        .spawn(move || {
            tessera_iscsi::accept::accept_loop(l, target, cap, budget, move || n.next_reactor())
        });
    if let Err(e) = spawned {
        tracing::error!(addr = %local, error = %e, "iscsi: cannot start the accept thread");
        return Vec::new();
    }
    node.iscsi.portals.locked().push(local.clone());
    vec![format!("iscsi://{local}")]
}
