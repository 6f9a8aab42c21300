//! `tessera`: run a node (`up`, `node`), manage a running node over its API (`status`,
//! `pool`, `volume`, `export`), and benchmark the engine in-process (`bench`).

mod cluster_cmd;
mod error;
mod format;
mod iscsi_cmd;
mod manage;
mod nvmf_cmd;
mod paths;
mod pool_cmd;
mod progress;
mod run;
mod sd_notify;
mod snapshot_cmd;

use tessera_load::{bench, nbd_perf};

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::error::{exit, CliError};

const AFTER_HELP: &str = "\
Exit codes:
  0  success
  1  failed: a job ended badly (`pool rebuild start --wait`), or another failure
  2  usage: unknown command or flag, missing argument, a flag the command does not take
  3  not found: no such pool, volume, export, group or subsystem (HTTP 404)
  4  conflict: it already exists, or it is busy (exported, connected, holding volumes)
     (HTTP 409)
  5  invalid argument value (a size, a layout, a limit; HTTP 400)
  6  unavailable: the node cannot be reached, an I/O error, the node failed (HTTP 5xx,
     507 pool full)
  7  `pool show NAME --check`: the pool is degraded or failed

The API socket: --api, else $TESSERA_API, else DATA_DIR/api.sock of the default data
directory (root: /var/lib/tessera; others: $XDG_DATA_HOME/tessera, i.e.
~/.local/share/tessera), the same from every working directory.

Sizes: bytes, or K, M, G, T, P (also KiB ... PiB, KB ... PB: all binary), e.g. 4G, 1.5T.

Logs (of `up` and `node`) go to stderr; RUST_LOG sets the levels (default: info).";

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Tessera block storage engine",
    after_help = AFTER_HELP
)]
struct Cli {
    /// Management API of the node: unix:PATH, a socket path, or https://HOST:PORT
    /// (default: $TESSERA_API, else the socket in the default data directory; see below).
    #[arg(long, global = true)]
    api: Option<String>,
    /// File holding the bearer token for an https:// API (`NAME:TOKEN` or `TOKEN`; the
    /// first token line is sent). Default: $TESSERA_TOKEN holds the token itself.
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    /// PEM CA certificate that signed the https:// API's certificate (default: the
    /// system's CA bundle).
    #[arg(long, global = true)]
    ca_cert: Option<PathBuf>,
    /// Print JSON (exact bytes) instead of tables (human units).
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
    /// Runs in the foreground until Ctrl-C or SIGTERM.
    Up(run::UpArgs),
    /// Run a node from a TOML configuration file, in the foreground until SIGINT or
    /// SIGTERM (systemd: deploy/tessera.service, Type=notify).
    Node {
        /// The node's configuration (TOML; see the README's Configuration section).
        #[arg(long, short)]
        config: PathBuf,
        /// Serve /metrics, /healthz and /readyz on this address (plain HTTP, read-only),
        /// e.g. 127.0.0.1:9464; overrides the config's `[metrics] listen`.
        #[arg(long, value_name = "ADDR")]
        metrics: Option<String>,
        #[command(flatten)]
        tls: run::NbdTlsArgs,
        #[command(flatten)]
        limits: run::ClientLimitArgs,
        #[command(flatten)]
        etcd: run::EtcdArgs,
    },
    /// Node status: capacity, allocation, pools, exports.
    Status,
    /// Manage pools, their hot spares, scrubs and rebuilds.
    #[command(subcommand)]
    Pool(pool_cmd::PoolCmd),
    /// Manage thin volumes.
    #[command(subcommand)]
    Volume(manage::VolumeCmd),
    /// Snapshots of volumes (clones, rollback, changes: `tessera volume`).
    #[command(subcommand)]
    Snapshot(snapshot_cmd::SnapshotCmd),
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
    /// iSCSI: the node's targets and their LUNs.
    #[command(subcommand)]
    Iscsi(iscsi_cmd::IscsiCmd),
    /// The cluster this node is a member of (`[cluster]` in its config): nodes, volumes.
    #[command(subcommand)]
    Cluster(cluster_cmd::ClusterCmd),
}

/// Which of the global flags a command takes: `--api` (it talks to a node's API) and
/// `--json` (it can print JSON). A given flag a command does not take is refused, not
/// ignored.
struct Takes {
    api: bool,
    json: bool,
}

impl Cmd {
    fn takes(&self) -> (&'static str, Takes) {
        use nvmf_cmd::NvmfCmd as N;
        let (name, api, json) = match self {
            Cmd::Up(_) => ("up", false, false),
            Cmd::Node { .. } => ("node", false, false),
            Cmd::Bench(_) => ("bench", false, true),
            Cmd::NbdPerf(_) => ("nbd-perf", false, false),
            Cmd::Nvmf(N::Discover { .. }) => ("nvmf discover", false, true),
            Cmd::Nvmf(N::Identify { .. }) => ("nvmf identify", false, true),
            Cmd::Nvmf(N::Read { .. }) => ("nvmf read", false, false),
            Cmd::Nvmf(N::Write { .. }) => ("nvmf write", false, false),
            Cmd::Nvmf(N::Perf(_)) => ("nvmf perf", false, false),
            _ => ("", true, true),
        };
        (name, Takes { api, json })
    }

    /// Refuse a global flag this command would otherwise ignore.
    fn check_global_flags(&self, api: bool, json: bool) -> Result<(), CliError> {
        let (name, takes) = self.takes();
        if api && !takes.api {
            let why = match name {
                "up" | "node" => "it runs a node rather than talking to one (it prints its API socket when it starts)",
                _ => "it talks to its target directly, not to a node's management API",
            };
            return Err(CliError::Usage(format!(
                "--api does not apply to `tessera {name}`: {why}"
            )));
        }
        if json && !takes.json {
            let hint = match name {
                "up" | "node" => " (for JSON log lines: --log-format json)",
                "nbd-perf" | "nvmf perf" => " (its last line, RESULT k=v ..., is for scripts)",
                _ => "",
            };
            return Err(CliError::Usage(format!(
                "--json does not apply to `tessera {name}`{hint}"
            )));
        }
        Ok(())
    }

    /// Does this command only print what it asked the node (a filter in a pipeline)?
    fn prints_replies(&self) -> bool {
        matches!(
            self,
            Cmd::Status
                | Cmd::Pool(_)
                | Cmd::Volume(_)
                | Cmd::Snapshot(_)
                | Cmd::Export(_)
                | Cmd::Group(_)
                | Cmd::Background(_)
                | Cmd::Cluster(_)
                | Cmd::Nvmf(nvmf_cmd::NvmfCmd::Subsystem(_))
                | Cmd::Iscsi(_)
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

/// The bearer token for an https:// API: the first token of `--token-file`, else
/// `$TESSERA_TOKEN`.
fn api_token(file: Option<&std::path::Path>) -> Result<Option<String>, CliError> {
    match file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                CliError::Unavailable(format!("token file {}: {e}", path.display()))
            })?;
            tessera_http::first_token(&text)
                .map(|t| Some(t.to_string()))
                .ok_or_else(|| {
                    CliError::Invalid(format!("token file {} holds no token", path.display()))
                })
        }
        None => Ok(std::env::var("TESSERA_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())),
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
    let api = match api_token(cli.token_file.as_deref()) {
        Ok(token) => manage::endpoint(cli.api.as_deref()).with_credentials(token, cli.ca_cert),
        Err(e) => {
            eprintln!("tessera: error: {e}");
            std::process::exit(e.exit_code());
        }
    };
    let r: Result<(), CliError> = match cli.cmd.check_global_flags(cli.api.is_some(), cli.json) {
        Err(e) => Err(e),
        Ok(()) => dispatch(cli.cmd, &api, cli.json),
    };
    if let Err(e) = r {
        // The operator's one line, not a log record.
        eprintln!("tessera: error: {e}");
        std::process::exit(e.exit_code());
    }
}

fn dispatch(cmd: Cmd, api: &tessera_http::Endpoint, json: bool) -> Result<(), CliError> {
    let (api, raw) = (api, json);
    match cmd {
        Cmd::Up(a) => run::up(a),
        Cmd::Node {
            config,
            metrics,
            tls,
            limits,
            etcd,
        } => run::node_from_file(&config, metrics, tls, limits, etcd),
        Cmd::Status => manage::status(api, raw),
        Cmd::Pool(c) => pool_cmd::pool(api, c, raw),
        Cmd::Volume(manage::VolumeCmd::Clone {
            snapshot,
            name,
            force,
        }) => snapshot_cmd::clone(api, snapshot, name, force, raw),
        Cmd::Volume(manage::VolumeCmd::Rollback { name, to }) => {
            snapshot_cmd::rollback(api, name, to, raw)
        }
        Cmd::Volume(manage::VolumeCmd::Changes { name, since }) => {
            snapshot_cmd::changes(api, name, since, raw)
        }
        Cmd::Volume(c) => manage::volume(api, c, raw),
        Cmd::Snapshot(c) => snapshot_cmd::snapshot(api, c, raw),
        Cmd::Export(c) => manage::export(api, c, raw),
        Cmd::Group(c) => manage::group(api, c, raw),
        Cmd::Background(c) => manage::background(api, c, raw),
        Cmd::Bench(a) => run_bench(a, raw),
        Cmd::NbdPerf(a) => nbd_perf::run(a).map_err(CliError::from),
        Cmd::Nvmf(c) => nvmf_cmd::run(api, c, raw),
        Cmd::Iscsi(c) => iscsi_cmd::run(api, c, raw),
        Cmd::Cluster(c) => cluster_cmd::cluster(api, c, raw),
    }
}

/// `tessera bench`: a progress bar on a terminal, then the human report, or with
/// `--json` one object of the figures (exact values, nothing else on stdout).
fn run_bench(a: bench::BenchArgs, json: bool) -> Result<(), CliError> {
    let mut bar: Option<progress::Bar> = None;
    let s = bench::run_with(a, &mut |t: &bench::Tick| {
        let b = bar.get_or_insert_with(|| progress::Bar::new("bench", t.total_s, "s"));
        b.set(
            t.elapsed_s,
            t.total_s,
            format!("{:.0} IOPS, {:.1} MiB/s", t.iops, t.mibps),
        );
    })?;
    drop(bar);
    if json {
        manage::print_json(&serde_json::json!({
            "target": s.target,
            "pattern": s.pattern,
            "bs": s.bs,
            "qd": s.qd,
            "cores": s.cores,
            "seconds": s.seconds,
            "ios": s.ios,
            "bytes": s.bytes,
            "iops": s.iops,
            "mibps": s.mibps,
            "latency_us": {
                "mean": s.mean_us,
                "p50": s.p50_us,
                "p99": s.p99_us,
                "p999": s.p999_us,
                "max": s.max_us,
            },
            "cpu_ns_per_io": s.cpu_ns_per_io,
            "cores_busy": s.cores_busy,
            "errors": s.errors,
            "first_error": s.first_error,
        }));
    } else {
        bench::print_summary(&s);
    }
    bench::outcome(&s).map_err(CliError::from)
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

    /// Every visible command and argument explains itself in `--help`.
    #[test]
    fn every_command_and_argument_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if arg.is_hide_set() || id == "help" || id == "version" {
                    continue;
                }
                let text = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                if text.trim().is_empty() {
                    missing.push(format!("{path} <{id}>"));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.is_hide_set() || sub.get_name() == "help" {
                    continue;
                }
                let name = format!("{path} {}", sub.get_name());
                let about = sub.get_about().map(|h| h.to_string()).unwrap_or_default();
                if about.trim().is_empty() {
                    missing.push(name.clone());
                }
                walk(sub, &name, missing);
            }
        }
        use clap::CommandFactory as _;
        let mut cmd = Cli::command();
        cmd.build();
        let mut missing = Vec::new();
        walk(&cmd, "tessera", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }

    /// The old spellings still parse (hidden aliases), and mean the new commands.
    #[test]
    fn old_spellings_still_parse() {
        for line in [
            "pool destroy p",
            "pool status p --check",
            "pool scrub p",
            "pool scrub p --status --wait",
            "pool scrub p --stop",
            "pool scrub p --no-repair --wait",
            "pool rebuild p --device 1 --force",
            "pool rebuild p --status --wait",
            "pool replace p --device 1 /new.img",
            "export add e --volume v",
            "export remove e",
            "group set g --iops 5",
            "nvmf subsystem add nqn.x --volume v",
            "nvmf subsystem remove nqn.x",
            "nvmf subsystem add-ns nqn.x --volume v",
            "nvmf subsystem remove-ns nqn.x 1",
            "nvmf subsystem add-host nqn.x nqn.h",
            "nvmf subsystem remove-host nqn.x nqn.h",
        ] {
            let args = std::iter::once("tessera").chain(line.split(' '));
            if let Err(e) = Cli::try_parse_from(args) {
                panic!("`tessera {line}` no longer parses: {e}");
            }
        }
    }

    #[test]
    fn one_verb_set() {
        for line in [
            "pool create p ram:1G",
            "pool delete p",
            "pool show p",
            "pool scrub start p --no-repair --wait",
            "pool scrub status p --wait",
            "pool scrub stop p",
            "pool rebuild start p --device 1 --force --wait",
            "pool rebuild status p",
            "pool rebuild stop p",
            "pool resync status p --wait",
            "pool replace p --device 1 --with /new.img",
            "pool spare add p /s.img",
            "pool spare remove p /s.img",
            "volume create v --pool p --size 1G",
            "volume show v",
            "volume delete v",
            "export create e --volume v",
            "export show e",
            "export delete e",
            "group create g --iops 5",
            "group show g",
            "group delete g",
            "group add g v",
            "group remove g v",
            "nvmf subsystem create nqn.x",
            "nvmf subsystem show nqn.x",
            "nvmf subsystem delete nqn.x",
            "nvmf subsystem ns add nqn.x --volume v",
            "nvmf subsystem ns remove nqn.x 1",
            "nvmf subsystem host add nqn.x nqn.h",
            "nvmf subsystem host remove nqn.x nqn.h",
        ] {
            let args = std::iter::once("tessera").chain(line.split(' '));
            if let Err(e) = Cli::try_parse_from(args) {
                panic!("`tessera {line}` does not parse: {e}");
            }
        }
        // A replacement names its device once.
        assert!(Cli::try_parse_from(
            "tessera pool replace p --device 1 --with /a.img /b.img".split(' ')
        )
        .is_err());
        assert!(Cli::try_parse_from("tessera pool replace p --device 1".split(' ')).is_err());
    }

    #[test]
    fn server_errors_map_to_distinct_exit_codes() {
        let api = |status| CliError::Api {
            status,
            message: String::new(),
        };
        assert_eq!(api(404).exit_code(), exit::NOT_FOUND);
        assert_eq!(api(409).exit_code(), exit::CONFLICT);
        assert_eq!(api(400).exit_code(), exit::INVALID);
        assert_eq!(api(500).exit_code(), exit::UNAVAILABLE);
        assert_eq!(api(507).exit_code(), exit::UNAVAILABLE);
        assert_eq!(
            CliError::Degraded(String::new()).exit_code(),
            exit::DEGRADED
        );
    }
}
