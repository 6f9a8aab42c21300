//! `tessera`: run a node (`up`, `node`), manage a running node over its API (`status`,
//! `pool`, `volume`, `export`), and benchmark the engine in-process (`bench`).

mod error;
mod manage;
mod nvmf_cmd;
mod nvmf_perf;
mod run;

use tessera_load::{bench, nbd_perf};

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::error::{exit, CliError};

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  the node refused the operation (not found, already exists, busy), or it failed
  2  usage: unknown command or flag, missing argument
  5  invalid argument value (a size, a layout, a limit)
  6  unavailable: the node cannot be reached, an I/O error, the node failed (HTTP 5xx)
  7  `pool status --check`: the pool is degraded or failed

Logs (of `up` and `node`) go to stderr; RUST_LOG sets the levels (default: info).";

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Tessera block storage engine",
    after_help = EXIT_CODES
)]
struct Cli {
    /// Management API of the node: unix:PATH, a socket path, or HOST:PORT
    /// (default: $TESSERA_API, else ./tessera-data/api.sock).
    #[arg(long, global = true)]
    api: Option<String>,
    /// Print raw JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Log line format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human lines: time, level, message and fields.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a node on the embedded default: DATA_DIR with a file-backed pool `pool0` (4160 MiB),
    /// a thin volume `vol0` and its NBD export (created on first start, reused after).
    Up(run::UpArgs),
    /// Run a node from a TOML configuration file.
    Node {
        /// The node's configuration (TOML; see docs/configuration.md).
        #[arg(long, short)]
        config: PathBuf,
        /// Serve /metrics, /healthz and /readyz on this address (plain HTTP, read-only),
        /// e.g. 127.0.0.1:9464; overrides the config's `[metrics] listen`.
        #[arg(long, value_name = "ADDR")]
        metrics: Option<String>,
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

impl Cmd {
    /// Does this command only print what it asked the node (a filter in a pipeline)?
    fn prints_replies(&self) -> bool {
        matches!(
            self,
            Cmd::Status
                | Cmd::Pool(_)
                | Cmd::Volume(_)
                | Cmd::Export(_)
                | Cmd::Group(_)
                | Cmd::Background(_)
                | Cmd::Nvmf(nvmf_cmd::NvmfCmd::Subsystem(_))
        )
    }
}

/// Leveled, timestamped log lines on stderr; `RUST_LOG` filters them (default `info`).
fn init_logging(format: LogFormat) {
    use std::io::IsTerminal as _;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// A closed stdout (`tessera volume list | head -1`) ends a management command quietly,
/// as it does a Unix filter: the default SIGPIPE action instead of the Rust runtime's
/// "ignore", which turns the next print into a panic. Only for commands that talk to the
/// node over its API and print the reply; a node (`up`) or a load generator must see
/// EPIPE on its sockets as an error, not die of it.
fn die_on_closed_stdout() {
    // SAFETY: resetting a signal's disposition to its default is async-signal-safe and
    // done before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() {
    let cli = Cli::try_parse().unwrap_or_else(|e| {
        let _ = e.print();
        std::process::exit(if e.use_stderr() {
            exit::USAGE
        } else {
            exit::OK
        })
    });
    init_logging(cli.log_format);
    if cli.cmd.prints_replies() {
        die_on_closed_stdout();
    }
    let api = manage::endpoint(cli.api.as_deref());
    let r: Result<(), CliError> = match cli.cmd {
        Cmd::Up(a) => run::up(a),
        Cmd::Node { config, metrics } => run::node_from_file(&config, metrics),
        Cmd::Status => manage::status(&api, cli.json),
        Cmd::Pool(c) => manage::pool(&api, c, cli.json),
        Cmd::Volume(c) => manage::volume(&api, c, cli.json),
        Cmd::Export(c) => manage::export(&api, c, cli.json),
        Cmd::Group(c) => manage::group(&api, c, cli.json),
        Cmd::Background(c) => manage::background(&api, c, cli.json),
        Cmd::Bench(a) => bench::run(a).map_err(CliError::from),
        Cmd::NbdPerf(a) => nbd_perf::run(a).map_err(CliError::from),
        Cmd::Nvmf(c) => nvmf_cmd::run(&api, c, cli.json),
    };
    if let Err(e) = r {
        // The operator's one line, not a log record.
        eprintln!("tessera: error: {e}");
        std::process::exit(e.exit_code());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clap_exit_codes_match_the_documented_ones() {
        let usage = Cli::try_parse_from(["tessera", "no-such-command"])
            .err()
            .expect("an unknown command is refused");
        assert_eq!(usage.exit_code(), exit::USAGE);
        let help = Cli::try_parse_from(["tessera", "--help"])
            .err()
            .expect("--help ends the parse");
        assert_eq!(help.exit_code(), exit::OK);
        assert!(help.to_string().contains("Exit codes:"));
    }

    #[test]
    fn server_errors_map_to_distinct_exit_codes() {
        let api = |status| CliError::Api {
            status,
            message: String::new(),
        };
        assert_eq!(api(404).exit_code(), exit::FAILURE);
        assert_eq!(api(409).exit_code(), exit::FAILURE);
        assert_eq!(api(400).exit_code(), exit::INVALID);
        assert_eq!(api(500).exit_code(), exit::UNAVAILABLE);
        assert_eq!(api(507).exit_code(), exit::UNAVAILABLE);
        assert_eq!(
            CliError::Degraded(String::new()).exit_code(),
            exit::DEGRADED
        );
    }
}
