//! The node's TOML configuration. Every field has a default, so an empty file is a valid
//! configuration; `[[pool]]`, `[[volume]]` and `[[export]]` entries are created at start
//! when they do not exist yet (a declarative first setup), and left alone when they do.

use std::path::{Path, PathBuf};
use tessera_io::cast::DurationU64;

use crate::error::StartError;
use serde::{Deserialize, Serialize};
use tessera_api::TlsPolicy;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Where the node keeps its registry and sockets.
    pub data_dir: PathBuf,
    /// Reactor cores (0 = every CPU).
    pub cores: usize,
    /// Spin on io_uring instead of sleeping when idle (lower latency, burns a core).
    pub busy_poll: bool,
    /// Hybrid polling: after serving I/O a reactor polls its ring this many microseconds
    /// before sleeping (0 = sleep at once). Lower latency for back-to-back requests; an
    /// idle reactor still sleeps. Skipped while the core waits on a peer node on this
    /// host, and suspended while polls keep finding nothing (`tessera_io::poll`).
    pub poll_us: u64,
    /// Pin reactor i to CPU i (default). Measured on the 2-core VM: with polling, an
    /// unpinned reactor and its client end up sharing a CPU and both slow down.
    pub pin_cores: bool,
    /// A device of a redundant pool whose I/O has not completed for this many
    /// milliseconds is marked failed (default 30000, as the Linux NVMe driver).
    pub device_timeout_ms: u64,
    /// Parity pools (raid5/raid6/ec) flush each stripe-journal record before the row is
    /// written in place, and the row before the record is released (default on): this
    /// closes the write hole across a power loss, at the cost of two device flushes per
    /// group of row writes on devices that keep data (files, block devices; never RAM).
    /// Off, the hole stays closed for a process crash only.
    pub parity_journal_flush: bool,
    /// Sequential readers of volumes in pools without a cache tier are read ahead of,
    /// 4 MiB into buffers of their connection (at most 32 MiB per pool per core; only
    /// while the volume has one connection, and not on devices that answer at once).
    /// Default on.
    pub readahead: bool,
    /// Under the QoS share scheduler, a read of a region whose recent reads look random
    /// goes before its connection's writes that wait for a share round (seed 004's QoS;
    /// NBD, NVMe/TCP and iSCSI). Default on.
    pub random_reads_first: bool,
    pub api: ApiConfig,
    pub nbd: NbdConfig,
    pub nvmf: NvmfConfig,
    pub iscsi: IscsiConfig,
    pub metrics: MetricsConfig,
    pub client_buffers: ClientBuffersConfig,
    #[serde(rename = "pool")]
    pub pools: Vec<PoolDecl>,
    #[serde(rename = "volume")]
    pub volumes: Vec<VolumeDecl>,
    #[serde(rename = "export")]
    pub exports: Vec<ExportDecl>,
    /// This node's name, as replicas are placed (`--replicas NODE:POOL,...`); default the
    /// host name.
    pub name: Option<String>,
    /// Other nodes this node may place replicas on (`[[peer]]`).
    #[serde(rename = "peer")]
    pub peers: Vec<PeerDecl>,
    pub replication: ReplicationConfig,
    pub cluster: ClusterConfig,
}

/// `[cluster]`: membership of a cluster whose state is in etcd (docs/architecture.md
/// "Cluster"). Without `etcd` the node runs alone, as it always did.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Client URLs of the etcd members (`http://HOST:PORT`, or `https://HOST:PORT` with
    /// `etcd_ca`); empty: no cluster.
    pub etcd: Vec<String>,
    /// The CA certificate (PEM) that signed the etcd members' certificates: needed for
    /// `https://` endpoints.
    pub etcd_ca: Option<PathBuf>,
    /// This node's client certificate and key (PEM) for members started with
    /// `--client-cert-auth`.
    pub etcd_cert: Option<PathBuf>,
    pub etcd_key: Option<PathBuf>,
    /// etcd user name (etcd's authentication); its password is read from
    /// `etcd_password_file`.
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (first line), readable by its owner only
    /// (refused otherwise); the password itself is never logged nor shown.
    pub etcd_password_file: Option<PathBuf>,
    /// Failure-domain labels (e.g. `zone = "z1"`, `rack = "r4"`): placement never puts two
    /// replicas in one zone (then rack) when the cluster allows it.
    pub labels: std::collections::BTreeMap<String, String>,
    /// How long after its last lease renewal a silent node leaves the cluster.
    pub lease_ttl_ms: u64,
    /// Time allowed for one etcd call per member.
    pub etcd_timeout_ms: u64,
    /// How other nodes reach this node's API: `unix:PATH` (nodes on one machine, the
    /// default: this node's socket) or `https://HOST:PORT` (`[api] tcp`).
    pub advertise_api: Option<String>,
    /// Bearer token file and CA certificate for the `https://` APIs of other members.
    pub peer_token_file: Option<PathBuf>,
    pub peer_ca_cert: Option<PathBuf>,
    /// Take over a volume whose owner's lease expired, when this node holds an in-sync
    /// replica of it.
    pub failover: bool,
    /// How long a lost node's replicas wait for it before they are replaced elsewhere.
    pub grace_ms: u64,
    /// Replacement copies that may run at once in the whole cluster.
    pub max_rebuilds: usize,
    /// How long an owner keeps trying to record a dropped replica in etcd (writes that
    /// need it wait meanwhile) before the write fails.
    pub fence_wait_ms: u64,
    /// An NBD client asking this node for a cluster volume another node owns is served
    /// the owner's export, proxied over NVMe/TCP (docs/architecture.md "Clients follow
    /// the volume"). Off: only this node's own exports are served.
    pub nbd_proxy: bool,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            etcd: Vec::new(),
            etcd_ca: None,
            etcd_cert: None,
            etcd_key: None,
            etcd_user: None,
            etcd_password_file: None,
            labels: Default::default(),
            lease_ttl_ms: 5000,
            etcd_timeout_ms: 2000,
            advertise_api: None,
            peer_token_file: None,
            peer_ca_cert: None,
            failover: true,
            grace_ms: 60_000,
            max_rebuilds: 2,
            fence_wait_ms: 30_000,
            nbd_proxy: true,
        }
    }
}

/// `[[peer]]`: another node, reached through its management API.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerDecl {
    pub name: String,
    /// Its API endpoint: `unix:PATH` (same machine) or `https://HOST:PORT`.
    pub api: String,
    /// Bearer token file for an `https://` API.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// CA certificate that signed the peer's API certificate.
    #[serde(default)]
    pub ca_cert: Option<PathBuf>,
}

/// `[replication]`: how replicated volumes behave.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicationConfig {
    /// Dirty-region granularity (rounded to a power of two, 64K to 1G).
    pub region_size: String,
    /// Most regions in the activity log: what the replicas may have to reconcile after
    /// the owner crashes.
    pub al_regions: u32,
    /// A replica unreachable this long is dropped out of sync (writes go on without it).
    pub timeout_ms: u64,
    /// Most bytes per second one resync copies (0: unlimited); absent: the bandwidth of
    /// the node's "resync" background class (`tessera background set resync`).
    pub resync_rate: Option<String>,
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        ReplicationConfig {
            region_size: "1M".into(),
            al_regions: 1024,
            timeout_ms: 5000,
            resync_rate: None,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// Unix socket of the management API (default: DATA_DIR/api.sock). Created with mode
    /// 0600 (0660 with `socket_group`), in a directory other users cannot write.
    pub socket: Option<PathBuf>,
    /// A group (name or number) whose members may use the Unix socket too (mode 0660).
    pub socket_group: Option<String>,
    /// Optional TCP address of the management API, e.g. "127.0.0.1:7443": served only with
    /// TLS (`tls_cert`, `tls_key`) and bearer tokens (`token_file`), else the node refuses
    /// to start.
    pub tcp: Option<String>,
    /// PEM certificate chain of the TCP API (leaf first).
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// Bearer tokens of the TCP API: one a line, `NAME:TOKEN` or `TOKEN` (at least 32
    /// characters); readable by its owner (and group) only.
    pub token_file: Option<PathBuf>,
}

/// The metrics listener (docs/metrics.md): plain HTTP, read-only, no authentication, so
/// it belongs on loopback or a monitoring network. It exposes names and figures, never a
/// secret.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// TCP address serving `/metrics`, `/healthz` and `/readyz`, e.g. "127.0.0.1:9464"
    /// (Prometheus' conventional port for storage exporters). None: no listener.
    pub listen: Option<String>,
}

/// `[client_buffers]`: how many bytes of client request data (READ replies, WRITE
/// payloads) the node holds in flight, NBD and NVMe/TCP together; past it a connection
/// stops reading its socket until its replies leave (back-pressure, never an error).
/// Replies a client does not read keep counting. See `tessera_export::budget`.
///
/// Defaults: 64 MiB per connection lets a client keep 64 requests of 1 MiB (or two of
/// NBD's largest, 32 MiB) in flight at full speed; 1 GiB per node is 16 such clients at
/// full window on a node that also caches buffers per core. A connection holding nothing
/// is always given one request, so the node's ceiling is this plus one request per open
/// connection (bounded by `max_connections` of each listener).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientBuffersConfig {
    /// Per connection (an NBD connection, an NVMe/TCP queue), e.g. "64M".
    pub per_connection: String,
    /// Every connection of the node together, e.g. "1G".
    pub per_node: String,
}

impl Default for ClientBuffersConfig {
    fn default() -> Self {
        ClientBuffersConfig {
            per_connection: "64M".into(),
            per_node: "1G".into(),
        }
    }
}

/// Connections an NBD listener serves at a time by default (handshakes included): far
/// more than NBD clients open, few enough that one request each stays bounded (256 x 32
/// MiB).
pub const NBD_MAX_CONNECTIONS: usize = 256;
/// Connections (queues) an NVMe/TCP listener serves at a time by default: a host opens
/// an admin queue and up to 64 I/O queues, so this is 15 hosts at full width (each
/// request is at most 1 MiB).
pub const NVMF_MAX_CONNECTIONS: usize = 1024;
/// Connections (sessions: this target runs one connection per session) an iSCSI
/// listener serves at a time by default; each request is bounded by the negotiated
/// burst, as NVMe/TCP's are.
pub const ISCSI_MAX_CONNECTIONS: usize = 1024;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NbdConfig {
    /// TCP addresses to serve NBD on.
    pub listen: Vec<String>,
    /// Optional Unix socket to serve NBD on.
    pub unix: Option<PathBuf>,
    /// TLS (`NBD_OPT_STARTTLS`) on every NBD listener; absent: no TLS.
    pub tls: Option<NbdTlsConfig>,
    /// Connections each NBD listener serves at a time; past it a new connection is
    /// closed right after accept (logged, counted in metrics).
    pub max_connections: usize,
}

impl Default for NbdConfig {
    fn default() -> Self {
        NbdConfig {
            listen: vec!["127.0.0.1:10809".into()],
            unix: None,
            tls: None,
            max_connections: NBD_MAX_CONNECTIONS,
        }
    }
}

/// `[nbd.tls]`: the server's X.509 identity and who may connect.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NbdTlsConfig {
    /// The server's certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// With a CA (PEM): clients must present a certificate it signed.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
    /// The policy of exports that set none: "required" (default) or "optional".
    #[serde(default = "tls_required")]
    pub default: TlsPolicy,
}

fn tls_required() -> TlsPolicy {
    TlsPolicy::Required
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolDecl {
    pub name: String,
    pub devices: Vec<String>,
    #[serde(default = "default_layout")]
    pub layout: String,
    pub stripe_size: Option<String>,
    pub unit_size: Option<String>,
    /// A cache tier (one device, or two mirrored), given when the pool is created.
    #[serde(default)]
    pub cache: Vec<String>,
    /// write-through (default), write-around, pass-through or write-back.
    pub cache_mode: Option<String>,
    /// The cache unit, 16K..1M (default 1M).
    pub cache_unit: Option<String>,
    /// Misses a unit needs before the full cache admits it (default 1: the first).
    pub cache_admit_hits: Option<u8>,
    /// Deduplicate the pool's volumes (docs/format.md §17).
    #[serde(default)]
    pub dedup: bool,
}

fn default_layout() -> String {
    "concat".into()
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeDecl {
    pub name: String,
    pub pool: String,
    pub size: String,
    /// `false` opts a volume of a dedup pool out (a plain volume); absent: as its pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedup: Option<bool>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportDecl {
    pub name: String,
    pub volume: String,
    #[serde(default)]
    pub read_only: bool,
    /// NBD TLS policy ("required" / "optional"); absent: `[nbd.tls] default`.
    #[serde(default)]
    pub tls: Option<TlsPolicy>,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            data_dir: PathBuf::from("tessera-data"),
            cores: 0,
            busy_poll: false,
            poll_us: 50,
            pin_cores: true,
            device_timeout_ms: tessera_pool::layout::DEFAULT_DEVICE_TIMEOUT.millis_u64(),
            parity_journal_flush: true,
            readahead: true,
            random_reads_first: true,
            api: ApiConfig::default(),
            nbd: NbdConfig::default(),
            nvmf: NvmfConfig::default(),
            iscsi: IscsiConfig::default(),
            metrics: MetricsConfig::default(),
            client_buffers: ClientBuffersConfig::default(),
            pools: Vec::new(),
            volumes: Vec::new(),
            exports: Vec::new(),
            name: None,
            peers: Vec::new(),
            replication: ReplicationConfig::default(),
            cluster: ClusterConfig::default(),
        }
    }
}

impl NodeConfig {
    pub fn load(path: &Path) -> Result<NodeConfig, StartError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            StartError::Config(format!("cannot read config {}: {e}", path.display()))
        })?;
        let cfg: NodeConfig = toml::from_str(&text)
            .map_err(|e| StartError::Config(format!("config {}: {e}", path.display())))?;
        if let Some([first, last]) = cfg.nvmf.cntlid_range {
            if first == 0 || first > last || last > 0xFFEF {
                return Err(StartError::Config(format!(
                    "config {}: [nvmf] cntlid_range = [{first}, {last}] must be \
                     [first, last] with 1 <= first <= last <= 65519",
                    path.display()
                )));
            }
        }
        Ok(cfg)
    }

    /// The embedded default: a file-backed pool with room for a fully written 4 GiB thin
    /// volume `vol0` plus the pool's metadata, and its NBD export, all under `data_dir`.
    pub fn embedded_default(data_dir: &Path) -> NodeConfig {
        let img = data_dir.join("pool0.img");
        NodeConfig {
            data_dir: data_dir.to_path_buf(),
            pools: vec![PoolDecl {
                name: "pool0".into(),
                devices: vec![format!("{}:4160M", img.display())],
                layout: "concat".into(),
                stripe_size: None,
                unit_size: None,
                cache: Vec::new(),
                cache_mode: None,
                cache_unit: None,
                cache_admit_hits: None,
                dedup: false,
            }],
            volumes: vec![VolumeDecl {
                name: "vol0".into(),
                pool: "pool0".into(),
                size: "4G".into(),
                dedup: None,
            }],
            exports: vec![ExportDecl {
                name: "vol0".into(),
                volume: "vol0".into(),
                read_only: false,
                tls: None,
            }],
            nvmf: NvmfConfig {
                subsystems: vec![SubsystemDecl {
                    nqn: default_nqn("vol0"),
                    volumes: vec!["vol0".into()],
                    allow_any_host: true,
                    hosts: Vec::new(),
                }],
                ..Default::default()
            },
            // Served when `tessera up` listens for iSCSI (it does by default).
            iscsi: IscsiConfig {
                targets: vec![IscsiTargetDecl {
                    iqn: default_iqn("vol0"),
                    volumes: vec!["vol0".into()],
                    allowed_initiators: Vec::new(),
                    chap_user: None,
                    chap_secret_file: None,
                    mutual_chap_user: None,
                    mutual_chap_secret_file: None,
                }],
                ..Default::default()
            },
            ..NodeConfig::default()
        }
    }

    pub fn api_socket(&self) -> PathBuf {
        self.api
            .socket
            .clone()
            .unwrap_or_else(|| self.data_dir.join("api.sock"))
    }

    /// This node's name: `name`, else the host name.
    pub fn node_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "localhost".into())
        })
    }

    pub fn core_count(&self) -> usize {
        if self.cores > 0 {
            self.cores
        } else {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        }
    }
}

/// `[iscsi]` in the node configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IscsiConfig {
    /// Address of the iSCSI portal ("" = no iSCSI listener). Off unless set in a config
    /// file: `tessera node` runs many nodes per host in tests and clusters, and a fixed
    /// default port would have them fight over it; `tessera up` turns it on at
    /// 127.0.0.1:3260 (`--iscsi`).
    pub listen: String,
    /// Connections the portal serves at a time; past it a new connection is closed
    /// right after accept (logged, counted in metrics).
    pub max_connections: usize,
    /// A connection that has not completed its login this many milliseconds after it
    /// was accepted is closed. Besides, at most a quarter of `max_connections` (4 to
    /// 64) may be logging in at once: a newer one closes the oldest.
    pub login_timeout_ms: u64,
    /// Declarative first setup (`[[iscsi.target]]`): targets created at start when
    /// missing. A target that exists is left as it is (changes go through the API).
    #[serde(rename = "target", skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<IscsiTargetDecl>,
}

impl Default for IscsiConfig {
    fn default() -> Self {
        IscsiConfig {
            listen: String::new(),
            max_connections: ISCSI_MAX_CONNECTIONS,
            login_timeout_ms: u64::try_from(
                tessera_iscsi::target::DEFAULT_LOGIN_TIMEOUT.as_millis(),
            )
            .unwrap_or(15_000),
            targets: Vec::new(),
        }
    }
}

/// `[[iscsi.target]]`: a target and its LUNs. CHAP secrets are named by file (readable
/// by the node's user only, as a config file often is not), never written inline.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IscsiTargetDecl {
    pub iqn: String,
    /// Volumes, as LUNs 0, 1, ...
    pub volumes: Vec<String>,
    /// Initiator IQNs allowed to log in (empty: any).
    #[serde(default)]
    pub allowed_initiators: Vec<String>,
    /// CHAP: the name initiators log in with, and the file holding their secret.
    pub chap_user: Option<String>,
    pub chap_secret_file: Option<PathBuf>,
    /// Mutual CHAP: the name the target answers with, and the file of its secret.
    pub mutual_chap_user: Option<String>,
    pub mutual_chap_secret_file: Option<PathBuf>,
}

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
    /// Controller IDs this node hands out, `[first, last]` within 1..=65519 (default the
    /// whole range). Nodes serving one cluster subsystem to a Linux multipath host need
    /// disjoint ranges: the host refuses two controllers of one subsystem with one ID.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cntlid_range: Option<[u16; 2]>,
    /// Connections (queues) each NVMe/TCP port serves at a time; past it a new
    /// connection is closed right after accept (logged, counted in metrics).
    pub max_connections: usize,
}

impl Default for NvmfConfig {
    fn default() -> Self {
        NvmfConfig {
            enabled: true,
            listen: "127.0.0.1:4420".into(),
            discovery: "127.0.0.1:8009".into(),
            subsystems: Vec::new(),
            cntlid_range: None,
            max_connections: NVMF_MAX_CONNECTIONS,
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

/// The iSCSI target name `tessera up` serves `vol` under (as LUN 0).
pub fn default_iqn(vol: &str) -> String {
    format!("iqn.2026-11.io.tessera:{vol}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_is_valid_and_unknown_keys_are_refused() {
        let c: NodeConfig = toml::from_str("").unwrap();
        assert_eq!(c.nbd.listen, vec!["127.0.0.1:10809".to_string()]);
        assert!(toml::from_str::<NodeConfig>("cores = 2\nbogus = 1\n").is_err());
        let c: NodeConfig = toml::from_str(
            "data_dir = '/tmp/x'\n[nbd]\nlisten = []\n[[pool]]\nname = 'p'\ndevices = ['ram:1G']\nlayout = 'raid0'\nstripe_size = '64K'\n",
        )
        .unwrap();
        assert_eq!(c.pools[0].layout, "raid0");
        assert!(c.nbd.listen.is_empty());
        assert!(c.metrics.listen.is_none());
        let c: NodeConfig = toml::from_str("[metrics]\nlisten = '127.0.0.1:9464'\n").unwrap();
        assert_eq!(c.metrics.listen.as_deref(), Some("127.0.0.1:9464"));
    }
}
