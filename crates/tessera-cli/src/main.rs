//! `tessera`: run a node (`up`, `node`), manage a running node over its API (`status`,
//! `pool`, `volume`, `export`), and benchmark the engine in-process (`bench`).

mod manage;
mod nvmf_cmd;
mod nvmf_perf;
mod run;

use tessera_load::{bench, nbd_perf};

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "tessera", version, about = "Tessera block storage engine")]
struct Cli {
    /// Management API of the node: unix:PATH, a socket path, or HOST:PORT
    /// (default: $TESSERA_API, else ./tessera-data/api.sock).
    #[arg(long, global = true)]
    api: Option<String>,
    /// Print raw JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a node on the embedded default: DATA_DIR with a file-backed pool `pool0` (4160 MiB),
    /// a thin volume `vol0` and its NBD export (created on first start, reused after).
    Up(run::UpArgs),
    /// Run a node from a TOML configuration file.
    Node {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Node status: capacity, allocation, pools, exports.
    Status,
    /// Manage pools.
    #[command(subcommand)]
    Pool(manage::PoolCmd),
    /// Manage thin volumes.
    #[command(subcommand)]
    Volume(manage::VolumeCmd),
    /// Manage NBD exports.
    #[command(subcommand)]
    Export(manage::ExportCmd),
    /// QoS groups (tenants): volumes sharing one limit, with a stepped burst.
    #[command(subcommand)]
    Group(manage::GroupCmd),
    /// Background classes (scrub, rebuild, resync): limits and feedback throttling.
    #[command(subcommand)]
    Background(manage::BackgroundCmd),
    /// In-process benchmark of a device, pool or volume (like SPDK's bdevperf).
    Bench(bench::BenchArgs),
    /// Pipelined NBD load generator (measures the server, not the client).
    NbdPerf(nbd_perf::NbdPerfArgs),
    /// NVMe/TCP: initiator (discover, identify, read, write, perf) and subsystems.
    #[command(subcommand)]
    Nvmf(nvmf_cmd::NvmfCmd),
}

fn main() {
    let cli = Cli::parse();
    let api = manage::endpoint(cli.api.as_deref());
    let r = match cli.cmd {
        Cmd::Up(a) => run::up(a),
        Cmd::Node { config } => run::node_from_file(&config),
        Cmd::Status => manage::status(&api, cli.json),
        Cmd::Pool(c) => manage::pool(&api, c, cli.json),
        Cmd::Volume(c) => manage::volume(&api, c, cli.json),
        Cmd::Export(c) => manage::export(&api, c, cli.json),
        Cmd::Group(c) => manage::group(&api, c, cli.json),
        Cmd::Background(c) => manage::background(&api, c, cli.json),
        Cmd::Bench(a) => bench::run(a),
        Cmd::NbdPerf(a) => nbd_perf::run(a),
        Cmd::Nvmf(c) => nvmf_cmd::run(&api, c, cli.json),
    };
    if let Err(e) = r {
        eprintln!("tessera: error: {e}");
        std::process::exit(1);
    }
}
