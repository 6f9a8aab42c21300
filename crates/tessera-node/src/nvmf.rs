//! NVMe/TCP on a node: the subsystem configuration (persisted in `DATA_DIR/nvmf.json`,
//! docs/format.md §6), the catalog the target reads it through, the management
//! operations the API calls, and the listeners.
//!
//! Subsystems live in the node's data directory rather than in a pool's catalog because
//! a subsystem may hold namespaces from several pools. A namespace names its volume by
//! pool UUID and volume ID (stable for the volume's life), so the NGUID/UUID a host sees
//! never changes across restarts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use serde::{Deserialize, Serialize};
use tessera_api::{ControllerInfo, NamespaceInfo, SubsystemInfo as SubsystemReply};
use tessera_nvmf::auth::{DhGroup, Hash, HostKeys, Secret};
use tessera_nvmf::target::{Catalog, NamespaceEntry, Port, SubsystemInfo, Target};
use tessera_pool::{Error, ErrorKind, Volume};

use crate::node::Node;

/// `[nvmf]` in the node configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NvmfConfig {
    /// Serve NVMe/TCP at all.
    pub enabled: bool,
    /// Address of the I/O port (NVM subsystems; discovery is served there too).
    pub listen: String,
    /// Address of the discovery port ("" = none).
    pub discovery: String,
    /// Declarative first setup: subsystems created at start when missing.
    #[serde(rename = "subsystem")]
    pub subsystems: Vec<SubsystemDecl>,
}

impl Default for NvmfConfig {
    fn default() -> Self {
        NvmfConfig {
            enabled: true,
            listen: "127.0.0.1:4420".into(),
            discovery: "127.0.0.1:8009".into(),
            subsystems: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubsystemDecl {
    pub nqn: String,
    /// Volumes, as namespaces 1, 2, ...
    #[serde(default)]
    pub volumes: Vec<String>,
    #[serde(default)]
    pub allow_any_host: bool,
    #[serde(default)]
    pub hosts: Vec<String>,
}

/// The NQN `tessera up` exports `vol` under.
pub fn default_nqn(vol: &str) -> String {
    format!("nqn.2024-01.io.tessera:{vol}")
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NsRecord {
    pub nsid: u32,
    /// Volume name at the time it was added (for people; lookups use the IDs).
    pub volume: String,
    pub pool_uuid: String,
    pub volume_id: u32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SubsystemRecord {
    pub nqn: String,
    pub serial: String,
    pub allow_any_host: bool,
    pub hosts: Vec<String>,
    /// Hosts that must authenticate (DH-HMAC-CHAP), by host NQN.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub host_auth: BTreeMap<String, HostAuthRecord>,
    pub namespaces: Vec<NsRecord>,
}

/// A host's DH-HMAC-CHAP settings in a subsystem (docs/format.md §6).
#[derive(Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct HostAuthRecord {
    pub dhchap_secret: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_ctrl_secret: Option<String>,
    pub hash: String,
    pub dhgroup: String,
}

impl std::fmt::Debug for HostAuthRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAuthRecord")
            .field("bidirectional", &self.dhchap_ctrl_secret.is_some())
            .field("hash", &self.hash)
            .field("dhgroup", &self.dhgroup)
            .finish_non_exhaustive()
    }
}

impl HostAuthRecord {
    /// Validate what an API call gives and fill in the defaults.
    pub fn new(
        secret: &str,
        ctrl_secret: Option<&str>,
        hash: Option<&str>,
        dhgroup: Option<&str>,
    ) -> Result<HostAuthRecord, Error> {
        Secret::parse(secret).map_err(|e| Error::invalid(format!("dhchap_secret: {e}")))?;
        if let Some(c) = ctrl_secret {
            Secret::parse(c).map_err(|e| Error::invalid(format!("dhchap_ctrl_secret: {e}")))?;
            if c.trim() == secret.trim() {
                return Err(Error::invalid(
                    "dhchap_ctrl_secret must differ from dhchap_secret (one secret for both \
                     would let anyone who learns it impersonate either end)",
                ));
            }
        }
        let hash = Hash::from_name(hash.unwrap_or("sha256")).ok_or_else(|| {
            Error::invalid("dhchap_hash must be sha256, sha384 or sha512".to_string())
        })?;
        let group = DhGroup::from_name(dhgroup.unwrap_or("ffdhe2048")).ok_or_else(|| {
            Error::invalid(
                "dhchap_dhgroup must be null, ffdhe2048, ffdhe3072, ffdhe4096, ffdhe6144 or \
                 ffdhe8192"
                    .to_string(),
            )
        })?;
        Ok(HostAuthRecord {
            dhchap_secret: secret.trim().to_string(),
            dhchap_ctrl_secret: ctrl_secret.map(|c| c.trim().to_string()),
            hash: hash.name().to_string(),
            dhgroup: group.name().to_string(),
        })
    }

    /// The keys the target uses. A record that does not parse (a hand edit) fails closed:
    /// a random secret nobody holds, so that host cannot get in until it is fixed.
    fn keys(&self, subnqn: &str, hostnqn: &str) -> HostKeys {
        let parsed = Secret::parse(&self.dhchap_secret).and_then(|h| {
            let c = self
                .dhchap_ctrl_secret
                .as_deref()
                .map(Secret::parse)
                .transpose()?;
            Ok((h, c))
        });
        let (host, ctrl) = parsed.unwrap_or_else(|e| {
            tracing::error!(
                subnqn,
                hostnqn,
                error = %e,
                "nvmf: the host's DH-HMAC-CHAP secret in nvmf.json does not parse; the host \
                 cannot authenticate until it is set again"
            );
            (Secret::generate(None, 32), None)
        });
        HostKeys {
            host,
            ctrl,
            hash: Hash::from_name(&self.hash).unwrap_or(Hash::Sha256),
            group: DhGroup::from_name(&self.dhgroup).unwrap_or(DhGroup::Ffdhe2048),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfFile {
    pub version: u32,
    /// Bumped on every change (the discovery log's generation counter).
    pub generation: u64,
    pub subsystems: Vec<SubsystemRecord>,
}

pub struct NvmfState {
    path: PathBuf,
    file: Mutex<NvmfFile>,
    target: OnceLock<Arc<Target<Volume>>>,
    pub addresses: Mutex<Vec<String>>,
}

fn io_err(e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Io, e.to_string())
}

impl NvmfState {
    pub fn load(data_dir: &Path) -> Result<NvmfState, String> {
        let path = data_dir.join("nvmf.json");
        let file = match std::fs::read_to_string(&path) {
            Ok(t) => {
                let f: NvmfFile =
                    serde_json::from_str(&t).map_err(|e| format!("{}: {e}", path.display()))?;
                if f.version != 1 {
                    return Err(format!(
                        "{}: version {} is not supported (this node reads version 1)",
                        path.display(),
                        f.version
                    ));
                }
                f
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => NvmfFile {
                version: 1,
                ..NvmfFile::default()
            },
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        Ok(NvmfState {
            path,
            file: Mutex::new(file),
            target: OnceLock::new(),
            addresses: Mutex::new(Vec::new()),
        })
    }

    fn file(&self) -> std::sync::MutexGuard<'_, NvmfFile> {
        self.file.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replace the file atomically (temporary file, fsync, rename, fsync directory).
    fn save(&self, f: &NvmfFile) -> Result<(), Error> {
        let text = serde_json::to_string_pretty(f).expect("nvmf config serialises");
        // Owner only: the file holds the hosts' DH-HMAC-CHAP secrets.
        crate::registry::write_atomic_mode(&self.path, text.as_bytes(), 0o600).map_err(io_err)
    }

    /// Apply `change` to a copy, persist it, then make it live.
    fn update<T>(
        &self,
        change: impl FnOnce(&mut NvmfFile) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut f = self.file();
        let mut next = f.clone();
        let r = change(&mut next)?;
        next.generation += 1;
        self.save(&next)?;
        *f = next;
        Ok(r)
    }

    /// The subsystem that holds volume `pool_uuid`/`id` as a namespace, if any.
    pub fn subsystem_using(&self, pool_uuid: &str, id: u32) -> Option<String> {
        self.file()
            .subsystems
            .iter()
            .find(|s| {
                s.namespaces
                    .iter()
                    .any(|n| n.pool_uuid == pool_uuid && n.volume_id == id)
            })
            .map(|s| s.nqn.clone())
    }

    pub fn target(&self) -> Option<&Arc<Target<Volume>>> {
        self.target.get()
    }

    fn changed(&self, nqn: &str) {
        if let Some(t) = self.target.get() {
            t.subsystem_changed(nqn);
        }
    }
}

/// Stable identifiers of a volume: NGUID from the pool UUID and the volume ID, a UUID
/// from the same bytes with the RFC 4122 version/variant bits, an EUI-64 from their CRC.
pub fn volume_ids(pool_uuid: &[u8; 16], volume_id: u32) -> ([u8; 16], [u8; 16], [u8; 8]) {
    let mut nguid = *pool_uuid;
    for (i, b) in volume_id.to_be_bytes().iter().enumerate() {
        nguid[12 + i] ^= b;
    }
    nguid[0] ^= 0x5A; // differ from the pool's own UUID
    let mut uuid = nguid;
    uuid[6] = (uuid[6] & 0x0F) | 0x40;
    uuid[8] = (uuid[8] & 0x3F) | 0x80;
    let a = crc32c::crc32c(&nguid).to_be_bytes();
    let b = crc32c::crc32c(&uuid).to_be_bytes();
    let mut eui = [0u8; 8];
    eui[..4].copy_from_slice(&a);
    eui[4..].copy_from_slice(&b);
    (nguid, uuid, eui)
}

fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: String = s.chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut u = [0u8; 16];
    for (i, x) in u.iter_mut().enumerate() {
        *x = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(u)
}

/// The catalog the target reads: the node's subsystem configuration, resolved to live
/// volumes. Holds the node weakly (the node owns the target).
struct NodeCatalog(Weak<Node>);

impl NodeCatalog {
    fn volume(node: &Node, n: &NsRecord) -> Option<Arc<Volume>> {
        node.pools()
            .into_iter()
            .find(|p| p.status().uuid == n.pool_uuid)
            .and_then(|p| p.volume_by_id(n.volume_id))
    }
}

impl Catalog<Volume> for NodeCatalog {
    fn subsystem(&self, nqn: &str) -> Option<SubsystemInfo<Volume>> {
        let node = self.0.upgrade()?;
        let rec = node
            .nvmf
            .file()
            .subsystems
            .iter()
            .find(|s| s.nqn == nqn)
            .cloned()?;
        let namespaces = rec
            .namespaces
            .iter()
            .filter_map(|n| {
                let volume = Self::volume(&node, n)?;
                let (nguid, uuid, eui64) =
                    volume_ids(&parse_uuid(&n.pool_uuid).unwrap_or_default(), n.volume_id);
                Some(NamespaceEntry {
                    nsid: n.nsid,
                    export: node.export_of(&volume),
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
                n.nvmf
                    .file()
                    .subsystems
                    .iter()
                    .map(|s| s.nqn.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn generation(&self) -> u64 {
        self.0.upgrade().map_or(0, |n| n.nvmf.file().generation)
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
    Error::new(ErrorKind::NotFound, format!("{what} '{name}' not found"))
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
            addresses: self
                .nvmf
                .addresses
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
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
        for h in hosts {
            valid_host(h)?;
        }
        let rec = self.nvmf.update(|f| {
            if f.subsystems.iter().any(|s| s.nqn == nqn) {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("subsystem '{nqn}' already exists"),
                ));
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
            return Err(Error::new(
                ErrorKind::Busy,
                format!("subsystem '{nqn}' has {n} connected controller(s)"),
            ));
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
        let (p, v) = self.find_volume(volume)?;
        let pool_uuid = p.status().uuid;
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
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("volume '{volume}' is already a namespace of '{nqn}'"),
                ));
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
            portid: i as u16 + 1,
            io,
        });
        let n = node.clone();
        let t = target.clone();
        let spawned = std::thread::Builder::new()
            .name("tessera-nvmf-accept".into())
            .spawn(move || tessera_nvmf::target::accept_loop(l, t, move || n.next_reactor()));
        if let Err(e) = spawned {
            tracing::error!(addr = %local, error = %e, "nvmf: cannot start the accept thread");
            continue;
        }
        addrs.push(format!(
            "nvme+tcp://{local}{}",
            if io { "" } else { " (discovery)" }
        ));
    }
    *node
        .nvmf
        .addresses
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = addrs.clone();
    addrs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_ids_are_stable_and_distinct() {
        let p = [7u8; 16];
        let a = volume_ids(&p, 1);
        assert_eq!(a, volume_ids(&p, 1));
        assert_ne!(a.0, volume_ids(&p, 2).0);
        assert_eq!(a.1[6] >> 4, 4);
        assert_eq!(
            parse_uuid("00112233-4455-6677-8899-aabbccddeeff").unwrap()[15],
            0xff
        );
    }
}
