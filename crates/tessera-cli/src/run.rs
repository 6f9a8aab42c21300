//! Running a node in the foreground until SIGINT/SIGTERM, telling systemd (`Type=notify`)
//! when it serves and when it stops.

use std::path::{Path, PathBuf};

use clap::Args;
use tessera_api::{PoolEntry, TlsPolicy};
use tessera_node::config::NbdTlsConfig;
use tessera_node::error::StartError;
use tessera_node::metrics_http::MetricsListener;
use tessera_node::{listener, DataDirLock, Node, NodeConfig};
use tracing::{info, warn};

use crate::error::Result;
use crate::paths;

#[derive(Args)]
pub struct UpArgs {
    /// Data directory, created if missing [default: /var/lib/tessera for root, else
    /// $XDG_DATA_HOME/tessera, i.e. ~/.local/share/tessera: where the CLI looks for
    /// the API socket without --api].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// NBD TCP address.
    #[arg(long, default_value = "127.0.0.1:10809")]
    nbd: String,
    /// Reactor cores (default: all).
    #[arg(long, default_value_t = 0)]
    cores: usize,
    /// Busy-poll instead of sleeping when idle.
    #[arg(long)]
    busy_poll: bool,
    /// Do not pin reactor i to CPU i.
    #[arg(long)]
    no_pin: bool,
    /// Microseconds a reactor keeps polling after activity before it sleeps (0 = never).
    #[arg(long, default_value_t = 50)]
    poll_us: u64,
    /// NVMe/TCP I/O port ("" = no NVMe/TCP).
    #[arg(long, default_value = "127.0.0.1:4420")]
    nvmf: String,
    /// NVMe/TCP discovery port ("" = none).
    #[arg(long, default_value = "127.0.0.1:8009")]
    nvmf_discovery: String,
    /// iSCSI portal ("" = no iSCSI).
    #[arg(long, default_value = "127.0.0.1:3260")]
    iscsi: String,
    /// Serve /metrics, /healthz and /readyz on this address (plain HTTP, read-only),
    /// e.g. 127.0.0.1:9464 (default: no metrics listener).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    #[command(flatten)]
    tls: NbdTlsArgs,
    #[command(flatten)]
    limits: ClientLimitArgs,
    #[command(flatten)]
    etcd: EtcdArgs,
}

/// Cluster membership for `up` and `node` (overrides `[cluster]`'s etcd settings).
#[derive(Args)]
pub struct EtcdArgs {
    /// Join the cluster whose state is in these etcd members (client URLs,
    /// `http://HOST:PORT` or `https://HOST:PORT`; repeat or separate with commas).
    #[arg(long, value_name = "URL", value_delimiter = ',')]
    etcd: Vec<String>,
    /// etcd TLS: the CA certificate (PEM) that signed the members' certificates.
    #[arg(long, value_name = "FILE")]
    etcd_ca: Option<PathBuf>,
    /// etcd TLS: this node's client certificate (PEM); needs --etcd-key.
    #[arg(long, value_name = "FILE", requires = "etcd_key")]
    etcd_cert: Option<PathBuf>,
    /// etcd TLS: this node's client key (PEM).
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// etcd authentication: user name; needs --etcd-password-file.
    #[arg(long, value_name = "NAME", requires = "etcd_password_file")]
    etcd_user: Option<String>,
    /// etcd authentication: file holding the password (mode 600: refused when the group
    /// or others may read it).
    #[arg(long, value_name = "FILE", requires = "etcd_user")]
    etcd_password_file: Option<PathBuf>,
}

impl EtcdArgs {
    fn apply(self, cfg: &mut NodeConfig) {
        let c = &mut cfg.cluster;
        if !self.etcd.is_empty() {
            c.etcd = self.etcd;
        }
        if self.etcd_ca.is_some() {
            c.etcd_ca = self.etcd_ca;
        }
        if self.etcd_cert.is_some() {
            c.etcd_cert = self.etcd_cert;
            c.etcd_key = self.etcd_key;
        }
        if self.etcd_user.is_some() {
            c.etcd_user = self.etcd_user;
            c.etcd_password_file = self.etcd_password_file;
        }
    }
}

/// What one client may hold of the node, for `up` and `node` (overrides
/// `[client_buffers]` and the listeners' `max_connections`).
#[derive(Args)]
pub struct ClientLimitArgs {
    /// Bytes of request data one connection (NBD connection, NVMe/TCP queue) may hold
    /// in flight before it stops reading its socket, e.g. 64M [default: 64M].
    #[arg(long, value_name = "SIZE")]
    conn_buffers: Option<String>,
    /// Bytes of request data all connections together may hold in flight, e.g. 1G
    /// [default: 1G].
    #[arg(long, value_name = "SIZE")]
    node_buffers: Option<String>,
    /// Connections each NBD, NVMe/TCP and iSCSI listener serves at a time; more are
    /// closed right after accept [default: 256 NBD, 1024 NVMe/TCP, 1024 iSCSI].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
}

impl ClientLimitArgs {
    fn apply(self, cfg: &mut NodeConfig) {
        if let Some(v) = self.conn_buffers {
            cfg.client_buffers.per_connection = v;
        }
        if let Some(v) = self.node_buffers {
            cfg.client_buffers.per_node = v;
        }
        if let Some(n) = self.max_connections {
            cfg.nbd.max_connections = n;
            cfg.nvmf.max_connections = n;
            cfg.iscsi.max_connections = n;
        }
    }
}

/// NBD TLS (`NBD_OPT_STARTTLS`, X.509) for `up` and `node` (overrides `[nbd.tls]`).
#[derive(Args)]
pub struct NbdTlsArgs {
    /// NBD TLS: the server's certificate chain (PEM); needs --nbd-tls-key.
    #[arg(long, requires = "nbd_tls_key")]
    nbd_tls_cert: Option<PathBuf>,
    /// NBD TLS: the server's private key (PEM).
    #[arg(long, requires = "nbd_tls_cert")]
    nbd_tls_key: Option<PathBuf>,
    /// NBD TLS: require client certificates signed by this CA (PEM).
    #[arg(long, requires = "nbd_tls_cert")]
    nbd_tls_client_ca: Option<PathBuf>,
    /// NBD TLS policy of exports that set none: required (default) or optional.
    #[arg(long, requires = "nbd_tls_cert")]
    nbd_tls_default: Option<TlsPolicy>,
}

impl NbdTlsArgs {
    fn apply(self, cfg: &mut NodeConfig) {
        if let (Some(cert), Some(key)) = (self.nbd_tls_cert, self.nbd_tls_key) {
            cfg.nbd.tls = Some(NbdTlsConfig {
                cert,
                key,
                client_ca: self.nbd_tls_client_ca,
                default: self.nbd_tls_default.unwrap_or(TlsPolicy::Required),
            });
        }
    }
}

/// The old default data directory, relative to where `tessera up` was started.
const OLD_DEFAULT_DATA_DIR: &str = "tessera-data";

pub fn up(a: UpArgs) -> Result<()> {
    let data_dir = match a.data_dir {
        Some(d) => paths::absolute(&d),
        None => {
            if Path::new(OLD_DEFAULT_DATA_DIR).join("pools.json").exists() {
                println!(
                    "tessera: note: ./{OLD_DEFAULT_DATA_DIR} holds a node of the earlier default \
                     data directory; this one uses {} (pass --data-dir {OLD_DEFAULT_DATA_DIR} to \
                     run that one)",
                    paths::default_data_dir().display()
                );
            }
            paths::default_data_dir()
        }
    };
    let mut cfg = NodeConfig::embedded_default(&data_dir);
    cfg.nbd.listen = vec![a.nbd];
    cfg.nbd.unix = Some(data_dir.join("nbd.sock"));
    cfg.cores = a.cores;
    cfg.busy_poll = a.busy_poll;
    cfg.pin_cores = !a.no_pin;
    cfg.poll_us = a.poll_us;
    cfg.nvmf.enabled = !a.nvmf.is_empty();
    cfg.nvmf.listen = a.nvmf;
    cfg.nvmf.discovery = a.nvmf_discovery;
    cfg.iscsi.listen = a.iscsi;
    cfg.metrics.listen = a.metrics;
    a.tls.apply(&mut cfg);
    a.limits.apply(&mut cfg);
    a.etcd.apply(&mut cfg);
    serve(cfg)
}

pub fn node_from_file(
    path: &Path,
    metrics: Option<String>,
    tls: NbdTlsArgs,
    limits: ClientLimitArgs,
    etcd: EtcdArgs,
) -> Result<()> {
    let mut cfg = NodeConfig::load(path)?;
    if metrics.is_some() {
        cfg.metrics.listen = metrics;
    }
    tls.apply(&mut cfg);
    limits.apply(&mut cfg);
    etcd.apply(&mut cfg);
    serve(cfg)
}

fn block_signals() -> libc::sigset_t {
    // SAFETY: building a signal set and blocking it for this thread (inherited by every
    // thread spawned after), so that only sigwait below receives SIGINT/SIGTERM.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn serve(cfg: NodeConfig) -> Result<()> {
    let set = block_signals();
    // First claim the data directory, then check the addresses: a second node on the same
    // directory, or one whose ports are taken, stops here having opened nothing.
    let dir_lock = DataDirLock::acquire(&cfg)?;
    listener::check_api_config(&cfg)?;
    listener::check_addresses(&cfg).map_err(StartError::Listen)?;
    // The metrics listener comes next, so /readyz says "starting" while pools open.
    let metrics = match &cfg.metrics.listen {
        Some(l) => Some(MetricsListener::start(l)?),
        None => None,
    };
    let node = Node::start(cfg, dir_lock)?;
    if let Some(m) = &metrics {
        m.attach(node.clone());
    }
    let api_tcp = listener::start_api(&node)?;
    let mut addrs = Vec::new();
    for l in node.cfg.nbd.listen.clone() {
        let a = listener::start_nbd_tcp(&node, &l)?;
        addrs.push(format!("nbd://{a}"));
    }
    if let Some(p) = node.cfg.nbd.unix.clone() {
        listener::start_nbd_unix(&node, &p)?;
        addrs.push(format!("unix:{}", paths::absolute(&p).display()));
    }
    node.exports().set_nbd_addresses(
        addrs
            .iter()
            .filter(|a| a.starts_with("nbd://"))
            .cloned()
            .collect(),
    );
    // NVMe/TCP listens before the banner says ready.
    let mut nvmf = tessera_node::node::nvmf::start(&node);
    // iSCSI too: the banner lists its portal with the NVMe/TCP ports.
    nvmf.extend(tessera_node::node::iscsi::start(&node));
    // Join the cluster last: the record published says where every listener is.
    node.join_cluster()
        .map_err(|e| crate::error::CliError::Failed(format!("cannot join the cluster: {e}")))?;
    if let Some(m) = node.cluster().membership() {
        println!(
            "tessera: cluster member '{}' (etcd {})",
            m.name,
            node.cfg.cluster.etcd.join(",")
        );
    }
    if let Some(m) = &metrics {
        m.set_serving(true);
        println!(
            "tessera: metrics: http://{0}/metrics (health: /healthz, /readyz)",
            m.local_addr()
        );
    }
    if let Some(a) = api_tcp {
        println!("tessera: management API: https://{a} (TLS, bearer tokens)");
    }
    print_banner(&node, &addrs, &nvmf);
    let pid = std::process::id();
    if let Err(e) = crate::sd_notify::notify(&format!(
        "READY=1\nMAINPID={pid}\nSTATUS=serving {} export(s)",
        node.status().exports.len()
    )) {
        warn!(error = %e, "cannot tell the service manager the node is ready");
    }
    // Wait for SIGINT/SIGTERM, then commit every pool and leave.
    let mut sig: libc::c_int = 0;
    // SAFETY: waiting on the set blocked above.
    unsafe { libc::sigwait(&set, &mut sig) };
    info!(signal = sig, "committing metadata and stopping");
    if let Some(m) = &metrics {
        m.set_serving(false);
    }
    if let Err(e) = crate::sd_notify::notify("STOPPING=1\nSTATUS=committing metadata") {
        warn!(error = %e, "cannot tell the service manager the node is stopping");
    }
    node.shutdown();
    let _ = std::fs::remove_file(node.cfg.api_socket());
    if let Some(p) = &node.cfg.nbd.unix {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

fn print_banner(node: &Node, addrs: &[String], nvmf: &[String]) {
    let st = node.status();
    println!(
        "tessera: node up on {} core(s), data in {}",
        node.reactors.len(),
        paths::absolute(&node.cfg.data_dir).display()
    );
    let api = format!("unix:{}", paths::absolute(&node.cfg.api_socket()).display());
    println!("tessera: management API: {api}");
    if api == paths::default_api() {
        println!("tessera: manage it with: tessera status   (tessera --help for every command)");
    } else {
        println!(
            "tessera: manage it with: tessera --api {api} status   (or export TESSERA_API={api})"
        );
    }
    for p in &st.pools {
        match p {
            PoolEntry::Online(p) => println!(
                "tessera: pool {} ({}, {}) on {}",
                p.name,
                p.layout,
                crate::format::bytes(p.capacity),
                p.devices.join(", ")
            ),
            PoolEntry::Offline(p) => {
                println!("tessera: pool {} (offline: {})", p.name, p.error)
            }
        }
    }
    // A TLS-only export is reached with nbds:// (nbd+unix:// becomes nbds+unix://).
    let scheme = |a: &str, tls: bool| match a.strip_prefix("nbd://") {
        Some(host) if tls => format!("nbds://{host}"),
        _ => a.to_string(),
    };
    for e in &st.exports {
        let name = &e.name;
        let s = if e.tls_required { "nbds" } else { "nbd" };
        for a in addrs {
            match a.strip_prefix("unix:") {
                Some(sock) => println!("tessera: export {name}: {s}+unix:///{name}?socket={sock}"),
                None => println!(
                    "tessera: export {name}: {}/{name}",
                    scheme(a, e.tls_required)
                ),
            }
        }
    }
    for a in nvmf {
        if a.starts_with("iscsi://") {
            println!("tessera: iSCSI: {a}");
            for t in node.iscsi_list() {
                println!("tessera: iSCSI target {}: {a}/{}/0", t.iqn, t.iqn);
            }
        } else {
            println!("tessera: NVMe/TCP: {a}");
        }
    }
    println!(
        "tessera: stop it with Ctrl-C or `kill {}` (SIGTERM): it commits metadata, then exits",
        std::process::id()
    );
    match (
        st.exports.first(),
        addrs.iter().find(|a| a.starts_with("nbd://")),
    ) {
        (Some(e), Some(a)) => {
            let name = &e.name;
            let a = scheme(a, e.tls_required);
            if e.tls_required {
                println!(
                    "tessera: try: nbdinfo '{a}/{name}?tls-certificates=DIR'   (DIR: ca-cert.pem, client-cert.pem, client-key.pem)"
                );
            } else {
                println!("tessera: try: nbdinfo {a}/{name}   |   qemu-img info {a}/{name}");
            }
            println!("tessera: ready {a}/{name}");
        }
        _ => println!("tessera: ready"),
    }
}
