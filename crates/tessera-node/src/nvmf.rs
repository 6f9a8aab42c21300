//! NVMe/TCP on a node: the subsystem configuration (persisted in `DATA_DIR/nvmf.json`,
//! docs/format.md §6) and the identities of namespaces. The catalog the target reads it
//! through, the management operations the API calls and the listeners are the node's
//! (`node/nvmf.rs`).
//!
//! Subsystems live in the node's data directory rather than in a pool's catalog because
//! a subsystem may hold namespaces from several pools. A namespace names its volume by
//! pool UUID and volume ID (stable for the volume's life), so the NGUID/UUID a host sees
//! never changes across restarts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use tessera_io::sync::MutexExt;

use crate::error::Error;
use crate::target::NodeTarget;
use serde::{Deserialize, Serialize};
use tessera_nvmf::auth::{DhGroup, Hash, HostKeys, Secret};
use tessera_nvmf::target::Target;

pub use crate::config::{default_nqn, NvmfConfig, SubsystemDecl};

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
        Secret::parse(secret).map_err(|e| Error::field("dhchap_secret", e))?;
        if let Some(c) = ctrl_secret {
            Secret::parse(c).map_err(|e| Error::field("dhchap_ctrl_secret", e))?;
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
    pub(crate) fn keys(&self, subnqn: &str, hostnqn: &str) -> HostKeys {
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

/// The version of nvmf.json this node reads and writes.
pub const NVMF_VERSION: u32 = 1;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfFile {
    pub version: u32,
    /// Bumped on every change (the discovery log's generation counter).
    pub generation: u64,
    pub subsystems: Vec<SubsystemRecord>,
}

/// The file of a node that has none yet: empty, of the current version.
impl Default for NvmfFile {
    fn default() -> NvmfFile {
        NvmfFile {
            version: NVMF_VERSION,
            generation: 0,
            subsystems: Vec::new(),
        }
    }
}

pub struct NvmfState {
    path: PathBuf,
    file: Mutex<NvmfFile>,
    pub(crate) target: OnceLock<Arc<Target<NodeTarget>>>,
    pub addresses: Mutex<Vec<String>>,
    /// This node's paths to cluster volumes, by subsystem NQN. In memory only: the
    /// cluster declares them again after a restart (whoever owns the volume then).
    pub(crate) cluster_paths: Mutex<BTreeMap<String, ClusterPathRecord>>,
    /// Bumped when `cluster_paths` changes (part of the discovery generation).
    pub(crate) cluster_generation: std::sync::atomic::AtomicU64,
}

/// The NQN every node exports cluster volume `volume` under.
pub fn cluster_nqn(volume: &str) -> String {
    format!("{CLUSTER_NQN_PREFIX}{volume}")
}

pub const CLUSTER_NQN_PREFIX: &str = "nqn.2026-11.io.tessera:cluster:";

/// One node's path to a cluster volume: namespace 1 of subsystem [`cluster_nqn`], backed
/// by the local volume on the owner, without data elsewhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClusterPathRecord {
    pub volume: String,
    /// Size in bytes every path reports.
    pub size: u64,
    /// The local volume (pool UUID, volume ID) on the owner; None elsewhere.
    pub backing: Option<(String, u32)>,
}

/// Identifiers of cluster volume `volume`'s namespace: derived from the name alone, so
/// that every node reports the same NGUID/UUID/EUI-64 and a multipath host sees one
/// namespace behind all of them.
pub fn cluster_ids(volume: &str) -> ([u8; 16], [u8; 16], [u8; 8]) {
    let mut seed = [0u8; 16];
    for (i, chunk) in seed.chunks_mut(4).enumerate() {
        let text = format!("tessera-cluster-namespace/{i}/{volume}");
        chunk.copy_from_slice(&crc32c::crc32c(text.as_bytes()).to_be_bytes());
    }
    volume_ids(&seed, 1)
}

impl NvmfState {
    pub fn load(data_dir: &Path) -> Result<NvmfState, Error> {
        let path = data_dir.join("nvmf.json");
        let file: NvmfFile = crate::registry::load_versioned(&path, NVMF_VERSION)?;
        Ok(NvmfState {
            path,
            file: Mutex::new(file),
            target: OnceLock::new(),
            addresses: Mutex::new(Vec::new()),
            cluster_paths: Mutex::new(BTreeMap::new()),
            cluster_generation: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub(crate) fn cluster_paths(
        &self,
    ) -> std::sync::MutexGuard<'_, BTreeMap<String, ClusterPathRecord>> {
        self.cluster_paths.locked()
    }

    pub(crate) fn file(&self) -> std::sync::MutexGuard<'_, NvmfFile> {
        self.file.locked()
    }

    /// Replace the file atomically (temporary file, fsync, rename, fsync directory).
    fn save(&self, f: &NvmfFile) -> Result<(), Error> {
        let text = serde_json::to_string_pretty(f).expect("nvmf config serialises");
        // Owner only: the file holds the hosts' DH-HMAC-CHAP secrets.
        crate::registry::write_atomic_mode(&self.path, text.as_bytes(), 0o600).map_err(Error::from)
    }

    /// Apply `change` to a copy, persist it, then make it live.
    pub(crate) fn update<T>(
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

    pub fn target(&self) -> Option<&Arc<Target<NodeTarget>>> {
        self.target.get()
    }

    pub(crate) fn changed(&self, nqn: &str) {
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

pub(crate) fn parse_uuid(s: &str) -> Option<[u8; 16]> {
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
