//! Running a node in the foreground until SIGINT/SIGTERM.

use std::path::{Path, PathBuf};

use clap::Args;
use tessera_api::PoolEntry;
use tessera_node::error::StartError;
use tessera_node::metrics_http::MetricsListener;
use tessera_node::{listener, DataDirLock, Node, NodeConfig};
use tracing::info;

use crate::error::Result;

#[derive(Args)]
pub struct UpArgs {
    /// Data directory (created if missing).
    #[arg(long, default_value = "tessera-data")]
    data_dir: PathBuf,
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
    /// Serve /metrics, /healthz and /readyz on this address (plain HTTP, read-only),
    /// e.g. 127.0.0.1:9464 (default: no metrics listener).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
}

pub fn up(a: UpArgs) -> Result<()> {
    let mut cfg = NodeConfig::embedded_default(&a.data_dir);
    cfg.nbd.listen = vec![a.nbd];
    cfg.nbd.unix = Some(a.data_dir.join("nbd.sock"));
    cfg.cores = a.cores;
    cfg.busy_poll = a.busy_poll;
    cfg.pin_cores = !a.no_pin;
    cfg.poll_us = a.poll_us;
    cfg.nvmf.enabled = !a.nvmf.is_empty();
    cfg.nvmf.listen = a.nvmf;
    cfg.nvmf.discovery = a.nvmf_discovery;
    cfg.metrics.listen = a.metrics;
    serve(cfg)
}

pub fn node_from_file(path: &Path, metrics: Option<String>) -> Result<()> {
    let mut cfg = NodeConfig::load(path)?;
    if metrics.is_some() {
        cfg.metrics.listen = metrics;
    }
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
    listener::start_api(&node)?;
    let mut addrs = Vec::new();
    for l in node.cfg.nbd.listen.clone() {
        let a = listener::start_nbd_tcp(&node, &l)?;
        addrs.push(format!("nbd://{a}"));
    }
    if let Some(p) = node.cfg.nbd.unix.clone() {
        listener::start_nbd_unix(&node, &p)?;
        addrs.push(format!("unix:{}", p.display()));
    }
    *node
        .nbd_addresses
        .write()
        .unwrap_or_else(|e| e.into_inner()) = addrs
        .iter()
        .filter(|a| a.starts_with("nbd://"))
        .cloned()
        .collect();
    // NVMe/TCP listens before the banner says ready.
    let nvmf = tessera_node::nvmf::start(&node);
    if let Some(m) = &metrics {
        m.set_serving(true);
        println!(
            "tessera: metrics: http://{0}/metrics (health: /healthz, /readyz)",
            m.local_addr()
        );
    }
    print_banner(&node, &addrs);
    for a in nvmf {
        println!("tessera: NVMe/TCP: {a}");
    }
    // Wait for SIGINT/SIGTERM, then commit every pool and leave.
    let mut sig: libc::c_int = 0;
    // SAFETY: waiting on the set blocked above.
    unsafe { libc::sigwait(&set, &mut sig) };
    info!(signal = sig, "committing metadata and stopping");
    if let Some(m) = &metrics {
        m.set_serving(false);
    }
    node.shutdown();
    let _ = std::fs::remove_file(node.cfg.api_socket());
    if let Some(p) = &node.cfg.nbd.unix {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

fn print_banner(node: &Node, addrs: &[String]) {
    let st = node.status();
    println!(
        "tessera: node up on {} core(s), data in {}",
        node.reactors.len(),
        node.cfg.data_dir.display()
    );
    println!(
        "tessera: management API: unix:{}",
        node.cfg.api_socket().display()
    );
    for p in &st.pools {
        match p {
            PoolEntry::Online(p) => println!(
                "tessera: pool {} ({}, {}) on {}",
                p.name,
                p.layout,
                p.capacity_human,
                p.devices.join(", ")
            ),
            PoolEntry::Offline(p) => {
                println!("tessera: pool {} (offline: {})", p.name, p.error)
            }
        }
    }
    for e in &st.exports {
        let name = &e.name;
        for a in addrs {
            match a.strip_prefix("unix:") {
                Some(sock) => println!("tessera: export {name}: nbd+unix:///{name}?socket={sock}"),
                None => println!("tessera: export {name}: {a}/{name}"),
            }
        }
    }
    if let Some(e) = st.exports.first() {
        if let (name, Some(a)) = (&e.name, addrs.first()) {
            println!("tessera: try: nbdinfo {a}/{name}   |   qemu-img info {a}/{name}");
            println!("tessera: ready {a}/{name}");
        }
    } else {
        println!("tessera: ready");
    }
}
