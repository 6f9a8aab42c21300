//! NVMe/TCP on a node: the catalog the target reads the subsystem configuration
//! (`crate::nvmf`) through, the management operations the API calls, and the listeners.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use tessera_io::cast::u16_of;
use tessera_io::sync::MutexExt;

use tessera_api::{ControllerInfo, NamespaceInfo, SubsystemInfo as SubsystemReply};
use tessera_nvmf::nvme::AnaState;
use tessera_nvmf::target::{Catalog, NamespaceEntry, Port, SubsystemInfo, Target};
use tessera_pool::Volume;

use crate::error::Error;

use crate::node::Node;
use crate::nvmf::*;
use crate::target::NodeTarget;

/// The catalog the target reads: the node's subsystem configuration, resolved to live
/// volumes. Holds the node weakly (the node owns the target).
struct NodeCatalog(Weak<Node>);

impl NodeCatalog {
    fn volume(node: &Node, n: &NsRecord) -> Option<Arc<Volume>> {
        node.pools()
            .volume_by_id(&n.pool_uuid, n.volume_id)
            .filter(|v| node.replicas().blocked(v).is_none())
    }
}

impl NodeCatalog {
    /// The subsystem of a cluster volume path on this node.
    fn cluster_subsystem(node: &Node, nqn: &str) -> Option<SubsystemInfo<NodeTarget>> {
        let rec = node.nvmf.cluster_paths().get(nqn).cloned()?;
        let (nguid, uuid, eui64) = cluster_ids(&rec.volume);
        let export = rec.backing.as_ref().and_then(|(pool_uuid, id)| {
            let v = Self::volume(
                node,
                &NsRecord {
                    nsid: 1,
                    volume: rec.volume.clone(),
                    pool_uuid: pool_uuid.clone(),
                    volume_id: *id,
                },
            )?;
            Some(node.export_of(&v))
        });
        Some(SubsystemInfo {
            nqn: nqn.to_string(),
            // The same on every node: one subsystem reached through several.
            serial: format!("{:016x}", crc32c::crc32c(nqn.as_bytes())),
            allow_any_host: true,
            hosts: Vec::new(),
            auth: BTreeMap::new(),
            namespaces: vec![NamespaceEntry {
                nsid: 1,
                export,
                declared_size: rec.size,
                nguid,
                uuid,
                eui64,
            }],
        })
    }
}

impl Catalog<NodeTarget> for NodeCatalog {
    fn subsystem(&self, nqn: &str) -> Option<SubsystemInfo<NodeTarget>> {
        let node = self.0.upgrade()?;
        let rec = node
            .nvmf
            .file()
            .subsystems
            .iter()
            .find(|s| s.nqn == nqn)
            .cloned();
        let Some(rec) = rec else {
            return Self::cluster_subsystem(&node, nqn);
        };
        let namespaces = rec
            .namespaces
            .iter()
            .filter_map(|n| {
                let volume = Self::volume(&node, n)?;
                let (nguid, uuid, eui64) =
                    volume_ids(&parse_uuid(&n.pool_uuid).unwrap_or_default(), n.volume_id);
                Some(NamespaceEntry {
                    nsid: n.nsid,
                    declared_size: volume.size(),
                    export: Some(node.export_of(&volume)),
                    nguid,
                    uuid,
                    eui64,
                })
            })
            .collect();
        let auth = rec
            .host_auth
            .iter()
            .map(|(h, a)| (h.clone(), Arc::new(a.keys(&rec.nqn, h))))
            .collect();
        Some(SubsystemInfo {
            nqn: rec.nqn,
            serial: rec.serial,
            allow_any_host: rec.allow_any_host,
            hosts: rec.hosts,
            auth,
            namespaces,
        })
    }

    fn subsystem_nqns(&self) -> Vec<String> {
        self.0
            .upgrade()
            .map(|n| {
                let mut nqns: Vec<String> = n
                    .nvmf
                    .file()
                    .subsystems
                    .iter()
                    .map(|s| s.nqn.clone())
                    .collect();
                nqns.extend(n.nvmf.cluster_paths().keys().cloned());
                nqns
            })
            .unwrap_or_default()
    }

    fn generation(&self) -> u64 {
        self.0.upgrade().map_or(0, |n| {
            n.nvmf
                .file()
                .generation
                .wrapping_add(n.nvmf.cluster_generation.load(Ordering::Acquire))
        })
    }
}

fn valid_nqn(nqn: &str) -> Result<(), Error> {
    if nqn.len() < 5 || nqn.len() > 223 || !nqn.starts_with("nqn.") {
        return Err(Error::invalid(format!(
            "'{nqn}' is not an NQN (nqn.YYYY-MM.reverse-domain:name, at most 223 bytes)"
        )));
    }
    if nqn == tessera_nvmf::target::DISCOVERY_NQN || nqn.chars().any(|c| c.is_control() || c == '/')
    {
        return Err(Error::invalid(format!("'{nqn}' cannot name a subsystem")));
    }
    Ok(())
}

fn nf(what: &str, name: &str) -> Error {
    Error::not_found(format!("{what} '{name}' not found"))
}

impl Node {
    pub fn nvmf_subsystem_json(&self, s: &SubsystemRecord) -> SubsystemReply {
        let connected = self.nvmf.target().map_or(0, |t| t.connected(&s.nqn));
        SubsystemReply {
            nqn: s.nqn.clone(),
            serial: s.serial.clone(),
            allow_any_host: s.allow_any_host,
            hosts: s.hosts.clone(),
            host_auth: s
                .host_auth
                .iter()
                .map(|(h, a)| {
                    let how = if a.dhchap_ctrl_secret.is_some() {
                        "dh-hmac-chap (bidirectional)"
                    } else {
                        "dh-hmac-chap"
                    };
                    (h.clone(), how.to_string())
                })
                .collect(),
            namespaces: s
                .namespaces
                .iter()
                .map(|n| NamespaceInfo {
                    nsid: n.nsid,
                    volume: n.volume.clone(),
                })
                .collect(),
            controllers: connected,
            addresses: self.nvmf.addresses.locked().clone(),
        }
    }

    pub fn nvmf_list(&self) -> Vec<SubsystemReply> {
        let subs = self.nvmf.file().subsystems.clone();
        subs.iter().map(|s| self.nvmf_subsystem_json(s)).collect()
    }

    pub fn nvmf_get(&self, nqn: &str) -> Result<SubsystemReply, Error> {
        let s = self
            .nvmf
            .file()
            .subsystems
            .iter()
            .find(|s| s.nqn == nqn)
            .cloned();
        s.map(|s| self.nvmf_subsystem_json(&s))
            .ok_or_else(|| nf("subsystem", nqn))
    }

    pub fn nvmf_add_subsystem(
        &self,
        nqn: &str,
        allow_any_host: bool,
        hosts: &[String],
    ) -> Result<SubsystemReply, Error> {
        valid_nqn(nqn)?;
        if nqn.starts_with(CLUSTER_NQN_PREFIX) {
            return Err(Error::invalid(format!(
                "subsystem names starting with '{CLUSTER_NQN_PREFIX}' are the cluster's \
                 (PUT /v1/nvmf/cluster-paths/VOLUME)"
            )));
        }
        for h in hosts {
            valid_host(h)?;
        }
        let rec = self.nvmf.update(|f| {
            if f.subsystems.iter().any(|s| s.nqn == nqn) {
                return Err(Error::already_exists(format!(
                    "subsystem '{nqn}' already exists"
                )));
            }
            let serial = format!(
                "{:016x}",
                crc32c::crc32c(nqn.as_bytes()) as u64 | (f.generation << 32)
            );
            let r = SubsystemRecord {
                nqn: nqn.to_string(),
                serial,
                allow_any_host,
                hosts: hosts.to_vec(),
                host_auth: BTreeMap::new(),
                namespaces: Vec::new(),
            };
            f.subsystems.push(r.clone());
            Ok(r)
        })?;
        Ok(self.nvmf_subsystem_json(&rec))
    }

    pub fn nvmf_remove_subsystem(&self, nqn: &str) -> Result<(), Error> {
        if let Some(n) = self
            .nvmf
            .target()
            .map(|t| t.connected(nqn))
            .filter(|&n| n > 0)
        {
            return Err(Error::busy(format!(
                "subsystem '{nqn}' has {n} connected controller(s)"
            )));
        }
        self.nvmf.update(|f| {
            let before = f.subsystems.len();
            f.subsystems.retain(|s| s.nqn != nqn);
            if f.subsystems.len() == before {
                return Err(nf("subsystem", nqn));
            }
            Ok(())
        })?;
        self.nvmf.changed(nqn);
        Ok(())
    }

    /// Add `volume` as a namespace (`nsid` 0 = the lowest free one).
    pub fn nvmf_add_namespace(
        &self,
        nqn: &str,
        volume: &str,
        nsid: u32,
    ) -> Result<SubsystemReply, Error> {
        let (p, v) = self.pools().find_volume(volume)?;
        let pool_uuid = p.uuid();
        let rec = self.nvmf.update(|f| {
            let s = f
                .subsystems
                .iter_mut()
                .find(|s| s.nqn == nqn)
                .ok_or_else(|| nf("subsystem", nqn))?;
            if s.namespaces
                .iter()
                .any(|n| n.pool_uuid == pool_uuid && n.volume_id == v.id)
            {
                return Err(Error::already_exists(format!(
                    "volume '{volume}' is already a namespace of '{nqn}'"
                )));
            }
            let id = if nsid == 0 {
                (1..)
                    .find(|i| !s.namespaces.iter().any(|n| n.nsid == *i))
                    .unwrap_or(1)
            } else {
                nsid
            };
            if id == 0xFFFF_FFFF || s.namespaces.iter().any(|n| n.nsid == id) {
                return Err(Error::invalid(format!(
                    "namespace ID {id} is taken or invalid"
                )));
            }
            s.namespaces.push(NsRecord {
                nsid: id,
                volume: volume.to_string(),
                pool_uuid: pool_uuid.clone(),
                volume_id: v.id,
            });
            s.namespaces.sort_by_key(|n| n.nsid);
            Ok(s.clone())
        })?;
        self.nvmf.changed(nqn);
        Ok(self.nvmf_subsystem_json(&rec))
    }

    pub fn nvmf_remove_namespace(&self, nqn: &str, nsid: u32) -> Result<(), Error> {
        self.nvmf.update(|f| {
            let s = f
                .subsystems
                .iter_mut()
                .find(|s| s.nqn == nqn)
                .ok_or_else(|| nf("subsystem", nqn))?;
            let before = s.namespaces.len();
            s.namespaces.retain(|n| n.nsid != nsid);
            if s.namespaces.len() == before {
                return Err(nf("namespace", &nsid.to_string()));
            }
            Ok(())
        })?;
        self.nvmf.changed(nqn);
        Ok(())
    }

    /// Allow host `host`; with `auth`, it must also authenticate (its settings replace
    /// any it had). Without, a host added again keeps the settings it has.
    pub fn nvmf_add_host(
        &self,
        nqn: &str,
        host: &str,
        auth: Option<HostAuthRecord>,
    ) -> Result<SubsystemReply, Error> {
        valid_host(host)?;
        let rec = self.nvmf.update(|f| {
            let s = f
                .subsystems
                .iter_mut()
                .find(|s| s.nqn == nqn)
                .ok_or_else(|| nf("subsystem", nqn))?;
            if !s.hosts.iter().any(|x| x == host) {
                s.hosts.push(host.to_string());
            }
            if let Some(a) = auth {
                s.host_auth.insert(host.to_string(), a);
            }
            Ok(s.clone())
        })?;
        // Controllers already connected keep the keys they were created with; the next
        // Connect uses these.
        Ok(self.nvmf_subsystem_json(&rec))
    }

    pub fn nvmf_set_hosts(
        &self,
        nqn: &str,
        add: Option<&str>,
        remove: Option<&str>,
        any: Option<bool>,
    ) -> Result<SubsystemReply, Error> {
        if let Some(h) = add {
            valid_host(h)?;
        }
        let rec = self.nvmf.update(|f| {
            let s = f
                .subsystems
                .iter_mut()
                .find(|s| s.nqn == nqn)
                .ok_or_else(|| nf("subsystem", nqn))?;
            if let Some(h) = add {
                if !s.hosts.iter().any(|x| x == h) {
                    s.hosts.push(h.to_string());
                }
            }
            if let Some(h) = remove {
                let before = s.hosts.len();
                s.hosts.retain(|x| x != h);
                let had_auth = s.host_auth.remove(h).is_some();
                if s.hosts.len() == before && !had_auth {
                    return Err(nf("host", h));
                }
            }
            if let Some(a) = any {
                s.allow_any_host = a;
            }
            Ok(s.clone())
        })?;
        Ok(self.nvmf_subsystem_json(&rec))
    }

    pub fn nvmf_controllers(&self) -> Vec<ControllerInfo> {
        let cs = self
            .nvmf
            .target()
            .map(|t| t.controllers())
            .unwrap_or_default();
        cs.iter()
            .map(|c| ControllerInfo {
                cntlid: c.cntlid,
                subnqn: c.subnqn.clone(),
                hostnqn: c.hostnqn.clone(),
                queues: c.queues,
                kato_ms: c.kato_ms,
            })
            .collect()
    }
}

/// What this node is for a cluster volume (see [`Node::export_cluster_path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterPath {
    /// This node owns the volume: the namespace is the local volume, ANA Optimized.
    Owner,
    /// Another node owns it: the namespace has no data here and is ANA Inaccessible;
    /// `size` (bytes) is the volume's, so every path reports the same namespace.
    Standby { size: u64 },
}

impl Node {
    fn nvmf_target(&self) -> Result<&Arc<Target<NodeTarget>>, Error> {
        self.nvmf.target().ok_or_else(|| {
            Error::invalid("NVMe/TCP is not enabled on this node ([nvmf] enabled = true)")
        })
    }

    /// Create or update this node's path to cluster volume `volume`: subsystem
    /// `nqn.2026-11.io.tessera:cluster:<volume>` on the node's NVMe/TCP target, namespace
    /// 1 with identifiers derived from the volume name (the same on every node). As
    /// [`ClusterPath::Owner`], the namespace is backed by the local volume `volume` and
    /// ANA Optimized; as [`ClusterPath::Standby`], it holds no data and is Inaccessible.
    ///
    /// Order matters for hosts connected meanwhile: a node giving the volume up turns
    /// Inaccessible before its data goes away, and a new owner attaches the data before
    /// turning Optimized, so no I/O reaches a path without data and every refused I/O
    /// carries an ANA status that sends the host elsewhere. In memory only: after a
    /// restart the cluster declares the path again. Returns the subsystem NQN.
    pub fn export_cluster_path(&self, volume: &str, path: ClusterPath) -> Result<String, Error> {
        let nqn = cluster_nqn(volume);
        valid_nqn(&nqn)?;
        let target = self.nvmf_target()?.clone();
        let old = self.nvmf.cluster_paths().get(&nqn).cloned();
        let rec = match path {
            ClusterPath::Owner => {
                let (p, v) = self.pools().find_volume(volume)?;
                if let Some(why) = self.replicas.blocked(&v) {
                    return Err(Error::busy(format!(
                        "volume '{volume}' cannot be served: {why}"
                    )));
                }
                if let Some(o) = old.as_ref().filter(|o| o.size != v.size()) {
                    return Err(Error::invalid(format!(
                        "volume '{volume}' is {} bytes here; its other paths report {}",
                        v.size(),
                        o.size
                    )));
                }
                ClusterPathRecord {
                    volume: volume.to_string(),
                    size: v.size(),
                    backing: Some((p.uuid(), v.id)),
                }
            }
            ClusterPath::Standby { size } => {
                if size == 0 || size % 512 != 0 {
                    return Err(Error::invalid(format!(
                        "a cluster path's size must be a positive multiple of 512 (got {size})"
                    )));
                }
                ClusterPathRecord {
                    volume: volume.to_string(),
                    size,
                    backing: None,
                }
            }
        };
        if old.as_ref() == Some(&rec) {
            return Ok(nqn);
        }
        if rec.backing.is_none() {
            // Refuse I/O before the data goes.
            target.set_ana_state(&nqn, 1, AnaState::Inaccessible)?;
        }
        self.nvmf.cluster_paths().insert(nqn.clone(), rec.clone());
        self.nvmf.cluster_generation.fetch_add(1, Ordering::AcqRel);
        target.subsystem_changed(&nqn);
        if rec.backing.is_some() {
            target.set_ana_state(&nqn, 1, AnaState::Optimized)?;
        }
        tracing::info!(volume, subnqn = %nqn, owner = rec.backing.is_some(), size = rec.size,
                       "nvmf: cluster volume path exported");
        Ok(nqn)
    }

    /// Stop exporting this node's path to cluster volume `volume`.
    pub fn remove_cluster_path(&self, volume: &str) -> Result<(), Error> {
        let nqn = cluster_nqn(volume);
        let target = self.nvmf_target()?.clone();
        if !self.nvmf.cluster_paths().contains_key(&nqn) {
            return Err(nf("cluster path", volume));
        }
        let _ = target.set_ana_state(&nqn, 1, AnaState::Inaccessible);
        self.nvmf.cluster_paths().remove(&nqn);
        self.nvmf.cluster_generation.fetch_add(1, Ordering::AcqRel);
        target.subsystem_changed(&nqn);
        Ok(())
    }

    /// The other nodes' NVMe/TCP I/O listeners (`HOST:PORT`) serving cluster volume
    /// `volume`: this node's discovery log lists them with its own port, so a host asking
    /// any node learns every path. Replaces the list set before.
    pub fn set_discovery_paths(&self, volume: &str, addrs: &[String]) -> Result<(), Error> {
        let nqn = cluster_nqn(volume);
        valid_nqn(&nqn)?;
        let mut paths = Vec::with_capacity(addrs.len());
        for a in addrs {
            let (host, port) = a
                .rsplit_once(':')
                .filter(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
                .ok_or_else(|| Error::invalid(format!("'{a}' is not HOST:PORT")))?;
            paths.push((host.trim_matches(['[', ']']).to_string(), port.to_string()));
        }
        self.nvmf_target()?.set_other_paths(&nqn, paths);
        Ok(())
    }

    /// This node's cluster volume paths: (volume, owner, size).
    pub fn cluster_paths(&self) -> Vec<(String, bool, u64)> {
        self.nvmf
            .cluster_paths()
            .values()
            .map(|r| (r.volume.clone(), r.backing.is_some(), r.size))
            .collect()
    }
}

fn valid_host(h: &str) -> Result<(), Error> {
    if !h.starts_with("nqn.") || h.len() > 223 {
        return Err(Error::invalid(format!("'{h}' is not a host NQN")));
    }
    Ok(())
}

/// Create the declared subsystems, start the target and its listeners. A port that
/// cannot be bound is reported and skipped: NVMe/TCP is then off on it, the node serves
/// the rest. Returns the addresses served.
pub fn start(node: &Arc<Node>) -> Vec<String> {
    let cfg = node.cfg.nvmf.clone();
    if !cfg.enabled {
        return Vec::new();
    }
    for d in &cfg.subsystems {
        if node.nvmf_get(&d.nqn).is_ok() {
            continue;
        }
        let r = node
            .nvmf_add_subsystem(&d.nqn, d.allow_any_host, &d.hosts)
            .and_then(|_| {
                d.volumes
                    .iter()
                    .try_for_each(|v| node.nvmf_add_namespace(&d.nqn, v, 0).map(|_| ()))
            });
        if let Err(e) = r {
            tracing::error!(subnqn = %d.nqn, error = %e, "nvmf: cannot create the subsystem from the config");
        }
    }
    let target = Target::new(Arc::new(NodeCatalog(Arc::downgrade(node))));
    if let Some([first, last]) = cfg.cntlid_range {
        // Checked when the configuration was loaded.
        if let Err(e) = target.set_cntlid_range(first, last) {
            tracing::error!(error = %e, "nvmf: [nvmf] cntlid_range ignored");
        }
    }
    let _ = node.nvmf.target.set(target.clone());
    let mut addrs = Vec::new();
    let mut ports: BTreeMap<String, bool> = BTreeMap::new();
    if !cfg.listen.is_empty() {
        ports.insert(cfg.listen.clone(), true);
    }
    if !cfg.discovery.is_empty() {
        ports.entry(cfg.discovery.clone()).or_insert(false);
    }
    for (i, (addr, io)) in ports.into_iter().enumerate() {
        let l = match std::net::TcpListener::bind(&addr) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(addr = %addr, error = %e, "nvmf: cannot listen; NVMe/TCP is off there");
                continue;
            }
        };
        let local = l.local_addr().map(|a| a.to_string()).unwrap_or(addr);
        let (host, port) = local.rsplit_once(':').unwrap_or((&local, "4420"));
        target.add_port(Port {
            traddr: host.trim_matches(['[', ']']).to_string(),
            trsvcid: port.to_string(),
            portid: u16_of(i + 1),
            io,
        });
        let next = node.reactor_picker();
        let t = target.clone();
        let cap = node
            .exports()
            .listener_cap("nvme-tcp", local.clone(), cfg.max_connections);
        let budget = node.exports().buffers().clone();
        let spawned = std::thread::Builder::new()
            .name("tessera-nvmf-accept".into())
            .spawn(move || tessera_nvmf::accept::accept_loop(l, t, cap, budget, next));
        if let Err(e) = spawned {
            tracing::error!(addr = %local, error = %e, "nvmf: cannot start the accept thread");
            continue;
        }
        addrs.push(format!(
            "nvme+tcp://{local}{}",
            if io { "" } else { " (discovery)" }
        ));
    }
    *node.nvmf.addresses.locked() = addrs.clone();
    addrs
}
