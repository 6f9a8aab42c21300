//! Running a node in the foreground until SIGINT/SIGTERM.

use std::path::{Path, PathBuf};

use clap::Args;
use tessera_node::{listener, Node, NodeConfig};

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
}

pub fn up(a: UpArgs) -> Result<(), String> {
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
    serve(cfg)
}

pub fn node_from_file(path: &Path) -> Result<(), String> {
    serve(NodeConfig::load(path)?)
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

fn serve(cfg: NodeConfig) -> Result<(), String> {
    let set = block_signals();
    let node = Node::start(cfg)?;
    listener::start_api(&node).map_err(|e| e.to_string())?;
    let mut addrs = Vec::new();
    for l in node.cfg.nbd.listen.clone() {
        let a = listener::start_nbd_tcp(&node, &l).map_err(|e| e.to_string())?;
        addrs.push(format!("nbd://{a}"));
    }
    if let Some(p) = node.cfg.nbd.unix.clone() {
        listener::start_nbd_unix(&node, &p).map_err(|e| e.to_string())?;
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
    print_banner(&node, &addrs);
    for a in nvmf {
        println!("tessera: NVMe/TCP: {a}");
    }
    // Wait for SIGINT/SIGTERM, then commit every pool and leave.
    let mut sig: libc::c_int = 0;
    // SAFETY: waiting on the set blocked above.
    unsafe { libc::sigwait(&set, &mut sig) };
    eprintln!("tessera: signal {sig}: committing metadata and stopping");
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
    for p in st["pools"].as_array().into_iter().flatten() {
        println!(
            "tessera: pool {} ({}, {}) on {}",
            p["name"].as_str().unwrap_or("?"),
            p["layout"].as_str().unwrap_or("?"),
            p["capacity_human"].as_str().unwrap_or("?"),
            p["devices"]
                .as_array()
                .map(|d| d
                    .iter()
                    .filter_map(|x| x.as_str())
                    .collect::<Vec<_>>()
                    .join(", "))
                .unwrap_or_default()
        );
    }
    for e in st["exports"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().unwrap_or("?");
        for a in addrs {
            match a.strip_prefix("unix:") {
                Some(sock) => println!("tessera: export {name}: nbd+unix:///{name}?socket={sock}"),
                None => println!("tessera: export {name}: {a}/{name}"),
            }
        }
    }
    if let Some(e) = st["exports"].as_array().and_then(|a| a.first()) {
        if let (Some(name), Some(a)) = (e["name"].as_str(), addrs.first()) {
            println!("tessera: try: nbdinfo {a}/{name}   |   qemu-img info {a}/{name}");
            println!("tessera: ready {a}/{name}");
        }
    } else {
        println!("tessera: ready");
    }
}
