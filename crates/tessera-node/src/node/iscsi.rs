//! iSCSI on a node: the management operations the API calls over the target
//! configuration (`crate::iscsi`), and the listener.
//!
//! The `tessera_iscsi` target holds each LUN's export itself (not a catalog read at
//! login, as NVMe/TCP's): a volume that is a LUN therefore cannot be deleted, rolled back
//! or made replicated while its target exists (the checks that name the target are in
//! volumes.rs, snapshots.rs and replicas.rs), so the export a LUN holds never goes stale.

use std::sync::Arc;

use tessera_api::{IscsiAuth, IscsiChap, IscsiChapInfo, IscsiLunInfo, IscsiTargetInfo};
use tessera_io::cast::u32_of;
use tessera_io::sync::MutexExt;
use tessera_iscsi::alua::{self, Alua};

use crate::error::Error;
use crate::iscsi::{LunRecord, TargetRecord};
use crate::node::Node;

/// The crate's refusals, as the API answers them.
fn from_target(e: tessera_iscsi::target::Error) -> Error {
    use tessera_iscsi::target::Error as T;
    match e {
        T::Exists(_) => Error::already_exists(e.to_string()),
        T::InvalidName(_) | T::NoLuns(_) | T::TooManyLuns { .. } | T::Access { .. } => {
            Error::invalid(e.to_string())
        }
        T::NotFound(n) => Error::missing("iSCSI target", &n),
    }
}

/// The access control an API call asks for, as the target record keeps it, checked the
/// way the target checks it (initiator names, secret lengths, distinct secrets).
fn access_record(auth: IscsiAuth) -> Result<(Vec<String>, Option<IscsiChap>), Error> {
    let chap = auth.chap;
    if let Some(c) = &chap {
        if c.mutual_user.is_some() != c.mutual_secret.is_some() {
            return Err(Error::invalid(
                "chap: mutual_user and mutual_secret go together (mutual CHAP needs both)",
            ));
        }
    }
    let rec = TargetRecord {
        allowed_initiators: auth.allowed_initiators,
        chap,
        ..TargetRecord::default()
    };
    rec.access()
        .check()
        .map_err(|e| Error::invalid(e.to_string()))?;
    Ok((rec.allowed_initiators, rec.chap))
}

/// How a target's access control reads in the log (never its secrets).
fn access_summary(t: &TargetRecord) -> String {
    let chap = match &t.chap {
        None => "no CHAP",
        Some(c) if c.mutual_user.is_some() => "mutual CHAP",
        Some(_) => "one-way CHAP",
    };
    let who = if t.allowed_initiators.is_empty() {
        "any initiator".to_string()
    } else {
        format!("{} allowed initiator(s)", t.allowed_initiators.len())
    };
    format!("{who}, {chap}")
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
            allowed_initiators: t.allowed_initiators.clone(),
            chap: t.chap.as_ref().map(|c| IscsiChapInfo {
                user: c.user.clone(),
                mutual_user: c.mutual_user.clone(),
            }),
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

    /// Create target `iqn` with LUNs 0, 1, ... serving `volumes`, open to the initiators
    /// `auth` admits: live at once, and persisted so that it is served again after a
    /// restart.
    pub fn iscsi_create(
        &self,
        iqn: &str,
        volumes: &[String],
        auth: IscsiAuth,
    ) -> Result<IscsiTargetInfo, Error> {
        let _g = self.admin();
        if iqn.starts_with(crate::iscsi::CLUSTER_IQN_PREFIX) {
            return Err(Error::invalid(format!(
                "target names starting with '{}' are the cluster's (each cluster volume is \
                 served under one on every node holding a replica)",
                crate::iscsi::CLUSTER_IQN_PREFIX
            )));
        }
        let (allowed_initiators, chap) = access_record(auth)?;
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
        let rec = TargetRecord {
            iqn: iqn.to_string(),
            luns,
            allowed_initiators,
            chap,
        };
        // The crate checks the name and the LUN count; live first (with its access
        // control from the start), so that a refusal leaves nothing persisted.
        self.iscsi
            .target()
            .add_target_with_access(iqn, exports, rec.access())
            .map_err(from_target)?;
        self.iscsi_persist_reservations(&rec);
        let saved = self.iscsi.update(|f| {
            f.targets.push(rec.clone());
            Ok(())
        });
        if let Err(e) = saved {
            self.iscsi.target().remove_target(iqn);
            return Err(e);
        }
        tracing::info!(iqn, luns = rec.luns.len(), access = %access_summary(&rec), "iscsi: target created");
        Ok(self.iscsi_info(&rec))
    }

    /// Replace who may log in to target `iqn` (initiator allowlist and CHAP). Persisted
    /// first, then live: the next login is checked against it; sessions logged in
    /// already keep going.
    pub fn iscsi_set_auth(&self, iqn: &str, auth: IscsiAuth) -> Result<IscsiTargetInfo, Error> {
        let _g = self.admin();
        let (allowed_initiators, chap) = access_record(auth)?;
        let rec = self.iscsi.update(|f| {
            let t = f
                .targets
                .iter_mut()
                .find(|t| t.iqn == iqn)
                .ok_or_else(|| Error::missing("iSCSI target", iqn))?;
            t.allowed_initiators = allowed_initiators;
            t.chap = chap;
            Ok(t.clone())
        })?;
        // Not live when a LUN's volume is offline: the record serves it when it returns.
        match self.iscsi.target().set_access(iqn, rec.access()) {
            Ok(()) | Err(tessera_iscsi::target::Error::NotFound(_)) => {}
            Err(e) => return Err(from_target(e)),
        }
        tracing::info!(iqn, access = %access_summary(&rec), "iscsi: target access control set");
        Ok(self.iscsi_info(&rec))
    }

    /// Delete target `iqn`: no new login reaches it; sessions logged in keep their LUNs
    /// until they log out.
    pub fn iscsi_delete(&self, iqn: &str) -> Result<(), Error> {
        let _g = self.admin();
        let gone = self.iscsi.update(|f| {
            let gone: Vec<TargetRecord> =
                f.targets.iter().filter(|t| t.iqn == iqn).cloned().collect();
            if gone.is_empty() {
                return Err(Error::missing("iSCSI target", iqn));
            }
            f.targets.retain(|t| t.iqn != iqn);
            Ok(gone)
        })?;
        self.iscsi.target().remove_target(iqn);
        // The LUNs' saved reservation states go with the target.
        for l in gone.iter().flat_map(|t| &t.luns) {
            let path = self
                .iscsi
                .pr_dir
                .join(format!("{}-{}.tpr", l.pool_uuid, l.volume_id));
            let _ = std::fs::remove_file(path);
        }
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
        // A record whose access control does not pass the checks (a hand edit) is not
        // served at all, rather than served open.
        if let Err(e) = self
            .iscsi
            .target()
            .add_target_with_access(&t.iqn, exports, t.access())
        {
            tracing::error!(iqn = %t.iqn, error = %e, "iscsi: cannot serve the target");
            return None;
        }
        self.iscsi_persist_reservations(t);
        Some(())
    }

    /// APTPL for the target's LUNs: each LUN's reservation state, as saved in
    /// `DATA_DIR/iscsi-pr` (one file per volume), is restored, and saved there from now
    /// on whenever it changes while APTPL is set. The save runs on the reactor core
    /// serving the PERSISTENT RESERVE OUT, before its status (rare commands, small
    /// files); a failed save fails the command and leaves the state as it was.
    fn iscsi_persist_reservations(&self, t: &TargetRecord) {
        let Some(entry) = self.iscsi.target().target(&t.iqn) else {
            return;
        };
        let dir = self.iscsi.pr_dir.clone();
        for (l, shared) in t.luns.iter().zip(&entry.shared) {
            let path = dir.join(format!("{}-{}.tpr", l.pool_uuid, l.volume_id));
            match std::fs::read(&path) {
                Ok(b) => {
                    if let Err(e) = shared.load_persisted(&b) {
                        tracing::error!(iqn = %t.iqn, lun = l.lun, path = %path.display(), error = e, "iscsi: saved reservation state not restored");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::error!(iqn = %t.iqn, lun = l.lun, path = %path.display(), error = %e, "iscsi: saved reservation state not read");
                }
            }
            let dir = dir.clone();
            shared.set_persist(Box::new(move |bytes| {
                crate::registry::create_dir_durable(&dir).map_err(|source| {
                    crate::error::SaveError {
                        path: dir.clone(),
                        source,
                    }
                })?;
                crate::registry::write_atomic_mode(&path, bytes, 0o600)?;
                Ok(())
            }));
        }
    }
}

impl Node {
    /// Whether this node serves iSCSI (`[iscsi] listen` is set): cluster volumes then
    /// get an iSCSI path here too.
    pub(super) fn iscsi_serves(&self) -> bool {
        !self.cfg.iscsi.listen.is_empty()
    }

    /// This node's iSCSI path of cluster volume `volume` (docs/iscsi.md "ALUA"): target
    /// `iqn.2026-11.io.tessera:cluster:VOLUME`, LUN 0, this node's port in target port
    /// group [`alua::group_of`] of its name. As owner, the LUN is backed by the local
    /// volume and the group is active/optimized (the data attached first); otherwise
    /// the group is standby (before the data goes) and the LUN holds no data. `size`
    /// (bytes) is the volume's, the same on every path. In memory only, like the
    /// NVMe/TCP cluster paths. Returns the target name.
    pub(super) fn set_iscsi_cluster_path(
        &self,
        volume: &str,
        owner: bool,
        size: u64,
    ) -> Result<String, Error> {
        let iqn = crate::iscsi::cluster_iqn(volume);
        if size == 0 || !size.is_multiple_of(512) {
            return Err(Error::invalid(format!(
                "a cluster path's size must be a positive multiple of 512 (got {size})"
            )));
        }
        let group = alua::group_of(&self.cfg.node_name());
        let (a, fresh) = {
            let mut m = self.iscsi.cluster.locked();
            match m.get(volume) {
                Some(a) if a.size == size => (a.clone(), false),
                _ => {
                    let a = Alua::new(group, group, size);
                    m.insert(volume.to_string(), a.clone());
                    (a, true)
                }
            }
        };
        if owner {
            if a.state() != alua::ACTIVE_OPTIMIZED || a.export().is_none() {
                let (_, v) = self.pools().find_volume(volume)?;
                if let Some(why) = self.replicas().blocked(&v) {
                    return Err(Error::busy(format!(
                        "volume '{volume}' cannot be served: {why}"
                    )));
                }
                if v.size() != size {
                    return Err(Error::invalid(format!(
                        "volume '{volume}' is {} bytes here; its other paths report {size}",
                        v.size()
                    )));
                }
                self.carry_in_reservations(volume, &a);
                a.set_active(self.export_of(&v));
                tracing::info!(volume, iqn = %iqn, group, "iscsi: cluster path active/optimized");
            }
        } else if a.state() != alua::STANDBY || a.export().is_some() {
            a.set_standby();
            tracing::info!(volume, iqn = %iqn, group, "iscsi: cluster path standby");
        }
        if fresh {
            self.carry_out_reservations(volume, &a);
            // A size change replaces the unit: sessions of the old one keep it until
            // they log out (it is standby without data, or the old volume's).
            let target = self.iscsi.target();
            if let Some(old) = target.target(&iqn).and_then(|t| t.alua.clone()) {
                old.set_standby();
                target.remove_target(&iqn);
            }
            target
                .add_alua_target(&iqn, a)
                .map_err(|e| Error::invalid(e.to_string()))?;
            tracing::info!(volume, iqn = %iqn, group, owner, size, "iscsi: cluster volume path exported");
        }
        Ok(iqn)
    }

    /// A node that becomes the owner of cluster volume `volume` takes its iSCSI
    /// reservation state from the volume's spec (`ClusterVolume::iscsi_pr`, saved there
    /// by the owners before it): registrations and the reservation follow the volume, as
    /// they would a controller failover of an array. No state there: none here either.
    /// A spec that cannot be read keeps what this node had (logged).
    fn carry_in_reservations(&self, volume: &str, a: &Alua<crate::target::NodeTarget>) {
        let Some(m) = self.cluster.membership() else {
            return;
        };
        let bytes = match self.read_spec(m, volume) {
            Ok(Some((spec, _))) => spec.iscsi_pr.as_deref().map_or(Ok(Vec::new()), from_hex),
            Ok(None) => Ok(Vec::new()),
            Err(e) => {
                tracing::error!(volume, error = %e, "iscsi: reservation state of the cluster volume not read; the local one stays");
                return;
            }
        };
        if let Err(e) = bytes.and_then(|b| a.shared.restore(&b)) {
            tracing::error!(
                volume,
                error = e,
                "iscsi: reservation state in the volume's spec not restored; none is kept"
            );
            let _ = a.shared.restore(&[]);
        }
    }

    /// Every change to cluster volume `volume`'s reservation state is saved in its spec
    /// by the owner (fenced by its epoch, `edit_owned_spec`) before the PERSISTENT
    /// RESERVE OUT completes; a save that fails (etcd unreachable, ownership lost) fails
    /// the command and changes nothing. The save runs on the reactor serving the
    /// command (one etcd round trip; the commands are rare).
    fn carry_out_reservations(&self, volume: &str, a: &Alua<crate::target::NodeTarget>) {
        let Some(node) = self.self_ref.get().cloned() else {
            return;
        };
        let volume = volume.to_string();
        a.shared.set_carried(Box::new(move |bytes| {
            let node = node.upgrade().ok_or("the node is stopping")?;
            let hex = to_hex(bytes);
            node.edit_owned_spec(&volume, |spec| spec.iscsi_pr = Some(hex.clone()))
                .map_err(|e| match e {
                    super::ownership::SpecRefusal::Lost(why)
                    | super::ownership::SpecRefusal::Unavailable(why) => why.into(),
                })
        }));
    }

    /// The other replica holders' groups of cluster volume `spec` as this node reports
    /// them: the owner's active/optimized, the others standby.
    pub(super) fn set_iscsi_groups(&self, spec: &tessera_api::ClusterVolume) {
        let Some(a) = self.iscsi.cluster.locked().get(&spec.name).cloned() else {
            return;
        };
        let me = self.cfg.node_name();
        let mut nodes: Vec<&str> = spec
            .replicas
            .iter()
            .map(|p| p.split(':').next().unwrap_or(p))
            .filter(|n| *n != me)
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        let others = nodes
            .into_iter()
            .map(|n| {
                let g = alua::group_of(n);
                alua::PortGroup {
                    id: g,
                    rel_port: g,
                    state: if n == spec.owner {
                        alua::ACTIVE_OPTIMIZED
                    } else {
                        alua::STANDBY
                    },
                }
            })
            .collect();
        a.set_other_groups(others);
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
    // The config's targets that do not exist yet (made persistent like any other).
    for d in &node.cfg.iscsi.targets {
        if node.iscsi_get(&d.iqn).is_ok() {
            continue;
        }
        let r = declared_auth(d).and_then(|auth| node.iscsi_create(&d.iqn, &d.volumes, auth));
        if let Err(e) = r {
            tracing::error!(iqn = %d.iqn, error = %e, "iscsi: cannot create the target from the config");
        }
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
    target.set_login_timeout(std::time::Duration::from_millis(
        cfg.login_timeout_ms.max(1),
    ));
    let cap = node
        .exports()
        .listener_cap("iscsi", local.clone(), cfg.max_connections);
    let budget = node.exports().buffers().clone();
    // The node and its target (which holds the LUNs' volumes) held weakly, as the NBD
    // listeners hold the node: a node dropped in process releases its pools.
    let next = node.reactor_picker();
    let target = Arc::downgrade(&target);
    let spawned = std::thread::Builder::new()
        .name("tessera-iscsi-accept".into())
        .spawn(move || tessera_iscsi::accept::accept_loop_weak(l, target, cap, budget, next));
    if let Err(e) = spawned {
        tracing::error!(addr = %local, error = %e, "iscsi: cannot start the accept thread");
        return Vec::new();
    }
    node.iscsi.portals.locked().push(local.clone());
    vec![format!("iscsi://{local}")]
}

/// What a `[[iscsi.target]]` declares about who may log in, its secrets read from their
/// files (trimmed, as the CLI reads them). The pairs are checked as the API checks them.
fn declared_auth(d: &crate::config::IscsiTargetDecl) -> Result<IscsiAuth, Error> {
    let secret = |what: &str, path: &Option<std::path::PathBuf>| -> Result<Option<String>, Error> {
        let Some(path) = path else { return Ok(None) };
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(&format!("{what} {}", path.display()), e))?;
        let text = text.trim();
        if text.is_empty() {
            return Err(Error::invalid(format!(
                "{what} {} is empty",
                path.display()
            )));
        }
        Ok(Some(text.to_string()))
    };
    let initiator = secret("chap_secret_file", &d.chap_secret_file)?;
    let mutual = secret("mutual_chap_secret_file", &d.mutual_chap_secret_file)?;
    let chap = match (&d.chap_user, initiator) {
        (None, None) if d.mutual_chap_user.is_none() && mutual.is_none() => None,
        (Some(user), Some(secret)) => Some(IscsiChap {
            user: user.clone(),
            secret,
            mutual_user: d.mutual_chap_user.clone(),
            mutual_secret: mutual,
        }),
        _ => {
            return Err(Error::invalid(
                "chap_user and chap_secret_file go together, and mutual CHAP needs them",
            ))
        }
    };
    Ok(IscsiAuth {
        allowed_initiators: d.allowed_initiators.clone(),
        chap,
    })
}

/// Lower-case hex of `bytes` (the reservation state in a volume's spec).
fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of [`to_hex`]'s text.
fn from_hex(s: &str) -> Result<Vec<u8>, &'static str> {
    if !s.len().is_multiple_of(2) {
        return Err("odd length");
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| "not hex"))
        .collect()
}
