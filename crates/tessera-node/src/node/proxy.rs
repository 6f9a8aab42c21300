//! Clients follow the volume, NBD side (docs/architecture.md "Clients follow the
//! volume"): an NBD client may ask any node of the cluster for a cluster volume; a node
//! that does not own it serves the owner's export through a proxy (crate::proxy) to
//! `nvme-tcp://OWNER/nqn.2026-11.io.tessera:cluster:VOLUME`.
//!
//! Everything here runs in NBD handshake threads (crate::listener), never on a reactor:
//! etcd reads and the proxy's connection setup block.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tessera_io::sync::MutexExt;

use tessera_api::ClusterVolume;
use tessera_export::log_limit::LogLimiter;
use tessera_export::{Export, StatsRegistry, StatsSnapshot};
use tessera_nbd::handshake::{ExportCatalog, ExportInfo, PrepareError};
use tessera_remote::{RemoteConfig, RemoteDevice, RemoteSpec};
use tracing::{info, warn};

use super::{Error, Node, Result};
use crate::proxy::ProxyVolume;
use crate::target::NodeTarget;

/// The NVMe/TCP subsystem a cluster volume's owner exports it under; the same on every
/// node, so a client (or this node's proxy) needs no per-node name.
pub fn cluster_nqn(volume: &str) -> String {
    format!("nqn.2026-11.io.tessera:cluster:{volume}")
}

/// The namespace of the volume in its cluster subsystem.
const CLUSTER_NSID: u32 = 1;

/// Lookups that failed (etcd unreachable, owner gone): at most 10 lines per 10 s, since
/// every client that retries makes one.
static PROXY_LOG: LogLimiter = LogLimiter::new("nbd-proxy", 10, 10);

/// The proxies this node has open, and the figures of every volume it proxied.
#[derive(Default)]
pub struct Proxies {
    /// By volume name: the open proxy (dead once its last connection went). Each slot
    /// is locked while its proxy opens, so two clients of one volume share one proxy
    /// and a slow owner only holds up clients of its own volumes.
    open: Mutex<BTreeMap<String, Arc<Mutex<Weak<ProxyVolume>>>>>,
    /// By volume name, since the node started (proxies come and go, the counts stay).
    stats: Mutex<BTreeMap<String, Arc<StatsRegistry>>>,
}

/// One proxied volume's figures, for `/metrics`.
pub struct ProxyFigures {
    pub volume: String,
    /// The owner it is proxied to now, if a proxy is open.
    pub owner: Option<String>,
    pub stats: StatsSnapshot,
}

impl Node {
    /// Whether NBD clients may reach other nodes' volumes through this one.
    fn nbd_proxy_on(&self) -> bool {
        self.cfg.cluster.nbd_proxy && self.cluster.membership().is_some()
    }

    /// The spec of cluster volume `name` when an NBD client asking this node for it must
    /// be proxied: the proxy is on, `name` is no local export, and another node owns it.
    /// `Err` when etcd cannot say.
    pub(crate) fn proxied_spec(&self, name: &str) -> Result<Option<ClusterVolume>> {
        let Some(m) = self
            .cluster
            .membership()
            .filter(|_| self.cfg.cluster.nbd_proxy)
        else {
            return Ok(None);
        };
        if self.find_export(name).is_some() {
            return Ok(None);
        }
        let kv = m
            .etcd()
            .get(&tessera_cluster::volume_key(name))
            .map_err(|e| {
                Error::io(
                    &format!("cannot read the cluster volume \"{name}\" from etcd"),
                    e,
                )
            })?;
        let Some(kv) = kv else { return Ok(None) };
        let spec: ClusterVolume = serde_json::from_slice(&kv.value).map_err(|e| {
            Error::Corrupt(format!(
                "the spec of cluster volume \"{name}\" is unreadable: {e}"
            ))
        })?;
        Ok((spec.owner != self.cfg.node_name()).then_some(spec))
    }

    /// Every cluster volume another node owns and this node would proxy (for
    /// `NBD_OPT_LIST`); empty when etcd cannot say.
    fn proxied_specs(&self) -> Vec<ClusterVolume> {
        if !self.nbd_proxy_on() {
            return Vec::new();
        }
        let me = self.cfg.node_name();
        match self.cluster_volumes() {
            Ok(specs) => specs
                .into_iter()
                .filter(|s| s.owner != me && self.find_export(&s.name).is_none())
                .collect(),
            Err(e) => {
                if PROXY_LOG.admit() {
                    warn!(error = %e, "nbd: cannot list the cluster's volumes; listing local exports only");
                }
                Vec::new()
            }
        }
    }

    /// Where a proxy of `spec` sends I/O: the owner's NVMe/TCP export first, then the
    /// same subsystem on every other live member (a multipath initiator follows the
    /// owner across them; the single-path one uses the first). `Err` says why there is
    /// no way to the owner.
    pub fn proxy_paths(&self, spec: &ClusterVolume) -> Result<Vec<String>> {
        let m = self
            .cluster
            .membership()
            .ok_or_else(|| Error::invalid("this node is not in a cluster"))?;
        let nodes = m
            .nodes()
            .map_err(|e| Error::io("cannot read the cluster's members from etcd", e))?;
        let name = &spec.name;
        let owner = nodes.iter().find(|n| n.name == spec.owner).ok_or_else(|| {
            Error::unavailable(format!(
                "volume \"{name}\" is owned by {}, which is not a live member of the cluster",
                spec.owner
            ))
        })?;
        let url = |addr: &str| {
            format!(
                "{}{addr}/{}?nsid={CLUSTER_NSID}",
                tessera_remote::SCHEME,
                cluster_nqn(name)
            )
        };
        let owner_addr = owner.nvmf.as_deref().ok_or_else(|| {
            Error::unavailable(format!(
                "volume \"{name}\" is owned by {}, which has no NVMe/TCP listener to proxy to",
                spec.owner
            ))
        })?;
        let mut paths = vec![url(owner_addr)];
        paths.extend(
            nodes
                .iter()
                .filter(|n| n.name != spec.owner)
                .filter_map(|n| n.nvmf.as_deref())
                .map(url),
        );
        Ok(paths)
    }

    /// The proxy of `spec`: the open one when it still goes to the spec's owner, else a
    /// new one connected now (blocking). Refused when the owner is not a live member,
    /// even while a proxy to it is open: new clients are not sent to a dead node.
    pub(crate) fn open_proxy(&self, spec: &ClusterVolume) -> Result<Arc<ProxyVolume>> {
        let paths = self.proxy_paths(spec)?;
        let slot = self
            .proxies
            .open
            .locked()
            .entry(spec.name.clone())
            .or_default()
            .clone();
        let mut slot = slot.locked();
        if let Some(p) = slot.upgrade().filter(|p| p.owner == spec.owner) {
            return Ok(p);
        }
        // Every member's path, the owner's first: the initiator uses the ANA-optimized
        // one and moves with the volume when another member takes it over.
        let remote = RemoteSpec::parse(&multipath_url(&paths))
            .map_err(|e| Error::io("the proxy's paths do not make an NVMe/TCP URL", e))?;
        let cfg = RemoteConfig {
            // Long enough to ride out a failover (the owner's lease must expire first).
            timeout: Duration::from_millis(
                self.cfg.replication.timeout_ms.max(1) + 2 * self.cfg.cluster.lease_ttl_ms,
            ),
            hostnqn: super::fencing::host_nqn(&self.cfg.node_name()),
            ..RemoteConfig::default()
        };
        let dev = RemoteDevice::open_with(remote, cfg).map_err(|e| {
            Error::io(
                &format!(
                    "volume \"{}\" is owned by {}, which cannot be reached",
                    spec.name, spec.owner
                ),
                e,
            )
        })?;
        // NBD requests are aligned to 512 bytes (crate tessera-nbd), the LBA size of
        // Tessera's targets; a larger one would refuse them.
        if dev.block_size() != 512 {
            dev.disconnect();
            return Err(Error::invalid(format!(
                "volume \"{}\": the owner's namespace has {}-byte blocks; the NBD proxy \
                 needs 512",
                spec.name,
                dev.block_size()
            )));
        }
        let stats = self
            .proxies
            .stats
            .locked()
            .entry(spec.name.clone())
            .or_default()
            .clone();
        let p = Arc::new(ProxyVolume::new(
            spec.name.clone(),
            spec.owner.clone(),
            dev,
            stats,
        ));
        info!(volume = %spec.name, owner = %spec.owner, epoch = spec.epoch, path = %p.path(),
              size = p.size(), "nbd proxy opened");
        *slot = Arc::downgrade(&p);
        Ok(p)
    }

    /// A proxy as the NBD server serves it.
    pub(crate) fn proxy_export(&self, p: Arc<ProxyVolume>) -> Export<NodeTarget> {
        Export {
            qos: p.qos().clone(),
            target: Arc::new(NodeTarget::Proxy(p)),
        }
    }

    /// Every volume this node proxied since it started, with its figures.
    pub fn proxy_figures(&self) -> Vec<ProxyFigures> {
        let stats = self.proxies.stats.locked().clone();
        let open = self.proxies.open.locked();
        stats
            .into_iter()
            .map(|(volume, reg)| {
                // `try_lock`: a proxy being opened is not open yet; /metrics does not wait.
                let owner = open
                    .get(&volume)
                    .and_then(|s| s.try_lock().ok().and_then(|w| w.upgrade()))
                    .map(|p| p.owner.clone());
                ProxyFigures {
                    volume,
                    owner,
                    stats: reg.snapshot(),
                }
            })
            .collect()
    }
}

/// The exports one NBD handshake sees: the node's own, then the cluster volumes other
/// nodes own (when the proxy is on). It holds the proxy a client prepared (INFO, GO)
/// until the connection takes it over, so the proxy stays open in between.
pub struct ExportSession<'a> {
    node: &'a Node,
    /// Specs read by `list`, reused by the lookups that follow it in one handshake.
    listed: Mutex<BTreeMap<String, ClusterVolume>>,
    prepared: Mutex<Option<Arc<ProxyVolume>>>,
}

impl<'a> ExportSession<'a> {
    pub fn new(node: &'a Node) -> ExportSession<'a> {
        ExportSession {
            node,
            listed: Mutex::new(BTreeMap::new()),
            prepared: Mutex::new(None),
        }
    }

    /// The proxy prepared for export `name`, for the connection that negotiated it.
    pub fn take_proxy(&self, name: &str) -> Option<Arc<ProxyVolume>> {
        self.prepared.locked().take().filter(|p| p.name == name)
    }

    fn spec(&self, name: &str) -> Result<Option<ClusterVolume>> {
        if let Some(s) = self.listed.locked().get(name) {
            return Ok(Some(s.clone()));
        }
        self.node.proxied_spec(name)
    }

    fn proxy_info(&self, spec: &ClusterVolume, size: u64) -> ExportInfo {
        ExportInfo {
            size,
            read_only: false,
            description: format!(
                "Tessera cluster volume {}, served by {} (proxied over NVMe/TCP)",
                spec.name, spec.owner
            ),
            // The node's default policy: a proxied volume has no export record here.
            tls_required: self
                .node
                .cfg
                .nbd
                .tls
                .as_ref()
                .is_some_and(|t| t.default.is_required()),
        }
    }
}

impl ExportCatalog for ExportSession<'_> {
    fn list(&self) -> Vec<String> {
        let mut names = ExportCatalog::list(self.node);
        let specs = self.node.proxied_specs();
        let mut listed = self.listed.locked();
        for s in specs {
            names.push(s.name.clone());
            listed.insert(s.name.clone(), s);
        }
        names
    }

    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        if let Some(info) = ExportCatalog::lookup(self.node, name) {
            return Some(info);
        }
        match self.spec(name) {
            Ok(Some(spec)) => Some(self.proxy_info(&spec, spec.size)),
            Ok(None) => None,
            Err(e) => {
                if PROXY_LOG.admit() {
                    warn!(export = %name, error = %e, "nbd: cannot look the export up in the cluster");
                }
                None
            }
        }
    }

    fn dirty_bitmaps(&self, name: &str) -> Vec<String> {
        ExportCatalog::dirty_bitmaps(self.node, name)
    }

    fn prepare(
        &self,
        name: &str,
        info: ExportInfo,
    ) -> std::result::Result<ExportInfo, PrepareError> {
        if self.node.find_export(name).is_some() {
            return Ok(info);
        }
        // The handshake answers the client with the error's text.
        let unavailable = |e: Error| PrepareError::Unavailable(Box::new(e));
        let spec = self
            .spec(name)
            .map_err(unavailable)?
            .ok_or_else(|| PrepareError::NoSuchExport(name.to_string()))?;
        let proxy = self.node.open_proxy(&spec).inspect_err(|e| {
            if PROXY_LOG.admit() {
                warn!(export = %name, owner = %spec.owner, error = %e, "nbd: cannot proxy the volume to its owner");
            }
        })
        .map_err(unavailable)?;
        let info = self.proxy_info(&spec, proxy.size());
        *self.prepared.locked() = Some(proxy);
        Ok(info)
    }
}

/// One multipath URL (`nvme-tcp://A:P,B:Q/NQN?nsid=1`) from single-path URLs of one
/// subsystem.
fn multipath_url(paths: &[String]) -> String {
    let split = |u: &str| -> (String, String) {
        let rest = u.strip_prefix("nvme-tcp://").unwrap_or(u);
        match rest.split_once('/') {
            Some((addr, tail)) => (addr.to_string(), tail.to_string()),
            None => (rest.to_string(), String::new()),
        }
    };
    let tail = paths.first().map(|p| split(p).1).unwrap_or_default();
    let addrs: Vec<String> = paths.iter().map(|p| split(p).0).collect();
    format!("nvme-tcp://{}/{tail}", addrs.join(","))
}

#[cfg(test)]
mod tests {
    #[test]
    fn multipath_url_joins_the_addresses_of_one_subsystem() {
        let p = [
            "nvme-tcp://10.0.0.1:4420/nqn.x:cluster:db?nsid=1".to_string(),
            "nvme-tcp://10.0.0.2:4421/nqn.x:cluster:db?nsid=1".to_string(),
        ];
        assert_eq!(
            super::multipath_url(&p),
            "nvme-tcp://10.0.0.1:4420,10.0.0.2:4421/nqn.x:cluster:db?nsid=1"
        );
    }
}
