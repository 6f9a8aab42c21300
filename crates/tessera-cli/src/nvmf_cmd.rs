//! `tessera nvmf`: the NVMe/TCP initiator (discover, identify, read, write, perf) and the
//! management of a node's NVMe/TCP subsystems over its API.

use std::io::{Read as _, Write as _};
use tessera_io::cast::{u32_of, usize_of};

use clap::{Args, Subcommand};
use serde_json::{json, Value};
use tessera_device::parse_size;
use tessera_http::Endpoint;

use crate::error::{CliError, HostArgError, Result};
use crate::manage::{delete, deleted, get, send, show};
use tessera_api::{AddHost, AddNamespace, CreateSubsystem, Deleted, SubsystemInfo};
use tessera_nvmf::auth::Secret;
use tessera_nvmf::initiator::{self, Controller, Options};
use tessera_nvmf::nvme;
use tessera_nvmf::pdu::{le16, le32, le64};

/// The target `--addr` names when it is not given.
const DEFAULT_ADDR: &str = "127.0.0.1:4420";

#[derive(Args, Clone, Debug)]
pub struct HostArgs {
    /// Target address HOST:PORT [default: 127.0.0.1:4420; discovery controllers usually
    /// listen on port 8009].
    #[arg(long)]
    addr: Option<String>,
    /// Host NQN (default: /etc/nvme/hostnqn, else a fixed Tessera one).
    #[arg(long)]
    pub hostnqn: Option<String>,
    /// Header digest (CRC32C).
    #[arg(long)]
    pub hdgst: bool,
    /// Data digest (CRC32C).
    #[arg(long)]
    pub ddgst: bool,
    /// This host's DH-HMAC-CHAP secret (DHHC-1:0X:<base64>:), used when the subsystem
    /// asks for authentication. Visible to other local users in the process list:
    /// prefer --dhchap-secret-file.
    #[arg(long, conflicts_with = "dhchap_secret_file")]
    pub dhchap_secret: Option<String>,
    /// Read this host's DH-HMAC-CHAP secret from a file.
    #[arg(long)]
    pub dhchap_secret_file: Option<std::path::PathBuf>,
    /// The controller's DH-HMAC-CHAP secret: authenticate the controller too
    /// (bidirectional) and refuse it when it cannot prove it holds this secret.
    #[arg(long, conflicts_with = "dhchap_ctrl_secret_file")]
    pub dhchap_ctrl_secret: Option<String>,
    /// Read the controller's DH-HMAC-CHAP secret from a file.
    #[arg(long)]
    pub dhchap_ctrl_secret_file: Option<std::path::PathBuf>,
}

/// A secret given inline or in a file (whose whitespace around it is ignored).
pub fn secret_arg(
    flag: &'static str,
    inline: &Option<String>,
    file: &Option<std::path::PathBuf>,
) -> std::result::Result<Option<String>, HostArgError> {
    match (inline, file) {
        (Some(s), _) => Ok(Some(s.trim().to_string())),
        (None, Some(p)) => std::fs::read_to_string(p)
            .map(|s| Some(s.trim().to_string()))
            .map_err(|source| HostArgError::SecretFile {
                flag,
                path: p.clone(),
                source,
            }),
        (None, None) => Ok(None),
    }
}

impl HostArgs {
    /// The target's address: `--addr`, else the default.
    pub fn addr(&self) -> &str {
        self.addr.as_deref().unwrap_or(DEFAULT_ADDR)
    }

    /// The initiator's error, saying which target it tried and, when that was the
    /// default, how to name another.
    fn error(&self, e: initiator::Error) -> CliError {
        let how = if self.addr.is_none() {
            " (the default address; pass --addr HOST:PORT to reach another target)"
        } else {
            ""
        };
        CliError::Unavailable(format!("NVMe/TCP target {}{how}: {e}", self.addr()))
    }

    pub fn options(&self) -> std::result::Result<Options, HostArgError> {
        let mut o = Options {
            hdgst: self.hdgst,
            ddgst: self.ddgst,
            ..Options::default()
        };
        if let Some(h) = &self.hostnqn {
            o.hostnqn = h.clone();
        }
        let parse = |flag: &'static str, s: Option<String>| {
            s.map(|s| Secret::parse(&s).map_err(|source| HostArgError::Secret { flag, source }))
                .transpose()
        };
        o.dhchap_secret = parse(
            "dhchap-secret",
            secret_arg(
                "dhchap-secret",
                &self.dhchap_secret,
                &self.dhchap_secret_file,
            )?,
        )?;
        o.dhchap_ctrl_secret = parse(
            "dhchap-ctrl-secret",
            secret_arg(
                "dhchap-ctrl-secret",
                &self.dhchap_ctrl_secret,
                &self.dhchap_ctrl_secret_file,
            )?,
        )?;
        if o.dhchap_ctrl_secret.is_some() && o.dhchap_secret.is_none() {
            return Err(HostArgError::CtrlSecretAlone);
        }
        Ok(o)
    }

    /// `options`, with a bad secret as an invalid-argument error.
    fn opts(&self) -> Result<Options> {
        Ok(self.options()?)
    }
}

#[derive(Subcommand)]
pub enum NvmfCmd {
    /// List the subsystems the discovery controller offers this host.
    Discover {
        #[command(flatten)]
        host: HostArgs,
    },
    /// Connect and print Identify Controller and Identify Namespace (JSON).
    Identify {
        #[command(flatten)]
        host: HostArgs,
        /// NQN of the subsystem to connect to.
        #[arg(long)]
        nqn: String,
    },
    /// Read bytes from a namespace to stdout (or --output).
    Read {
        #[command(flatten)]
        host: HostArgs,
        /// NQN of the subsystem to connect to.
        #[arg(long)]
        nqn: String,
        /// Namespace ID.
        #[arg(long, default_value_t = 1)]
        nsid: u32,
        /// Byte offset (a multiple of the LBA size), e.g. 1M.
        #[arg(long, default_value = "0")]
        offset: String,
        /// Bytes to read (a multiple of the LBA size), e.g. 8K.
        #[arg(long, default_value = "4K")]
        length: String,
        /// Write the data to this file instead of stdout.
        #[arg(long)]
        output: Option<std::path::PathBuf>,
    },
    /// Write stdin (or --input) to a namespace.
    Write {
        #[command(flatten)]
        host: HostArgs,
        /// NQN of the subsystem to connect to.
        #[arg(long)]
        nqn: String,
        /// Namespace ID.
        #[arg(long, default_value_t = 1)]
        nsid: u32,
        /// Byte offset (a multiple of the LBA size), e.g. 1M.
        #[arg(long, default_value = "0")]
        offset: String,
        /// Read the data from this file instead of stdin.
        #[arg(long)]
        input: Option<std::path::PathBuf>,
    },
    /// Pipelined load generator (measures the target, not the client).
    Perf(NvmfPerfArgs),
    /// Manage the node's subsystems (over the API).
    #[command(subcommand)]
    Subsystem(SubsystemCmd),
}

/// `nvmf subsystem create` (and its old spelling `add`).
#[derive(Args, Debug)]
pub struct SubsystemCreateArgs {
    /// NQN of the new subsystem, e.g. nqn.2024-01.io.tessera:db.
    nqn: String,
    /// Volumes to add as namespaces 1, 2, ...
    #[arg(long = "volume")]
    volumes: Vec<String>,
    /// Let every host connect (otherwise only --host ones).
    #[arg(long)]
    allow_any_host: bool,
    /// Host NQN allowed to connect (repeat for several).
    #[arg(long = "host")]
    hosts: Vec<String>,
}

/// The subsystem a command acts on.
#[derive(Args, Debug)]
pub struct SubsystemName {
    /// NQN of the subsystem.
    nqn: String,
}

/// `nvmf subsystem host add` (and its old spelling `add-host`). Per-host options go here.
#[derive(Args, Debug)]
pub struct HostAddArgs {
    /// NQN of the subsystem.
    nqn: String,
    /// Host NQN to allow; with --dhchap-secret it must also authenticate (DH-HMAC-CHAP).
    host: String,
    /// The host's secret (DHHC-1:0X:<base64>:, e.g. from `nvme gen-dhchap-key`).
    /// Visible in the process list: prefer --dhchap-secret-file.
    #[arg(long, conflicts_with = "dhchap_secret_file")]
    dhchap_secret: Option<String>,
    /// Read the host's secret from a file.
    #[arg(long)]
    dhchap_secret_file: Option<std::path::PathBuf>,
    /// The controller's secret, for bidirectional authentication.
    #[arg(long, conflicts_with = "dhchap_ctrl_secret_file")]
    dhchap_ctrl_secret: Option<String>,
    /// Read the controller's secret from a file.
    #[arg(long)]
    dhchap_ctrl_secret_file: Option<std::path::PathBuf>,
    /// Hash the controller prefers: sha256 (default), sha384, sha512.
    #[arg(long)]
    dhchap_hash: Option<String>,
    /// DH group the controller requires: null, ffdhe2048 (default), ffdhe3072,
    /// ffdhe4096, ffdhe6144, ffdhe8192.
    #[arg(long)]
    dhchap_dhgroup: Option<String>,
}

/// `nvmf subsystem host remove` (and its old spelling `remove-host`).
#[derive(Args, Debug)]
pub struct HostRemoveArgs {
    /// NQN of the subsystem.
    nqn: String,
    /// Host NQN to disallow.
    host: String,
}

/// `nvmf subsystem ns add` (and its old spelling `add-ns`).
#[derive(Args, Debug)]
pub struct NsAddArgs {
    /// NQN of the subsystem.
    nqn: String,
    /// Volume to add as a namespace.
    #[arg(long)]
    volume: String,
    /// Namespace ID (0: the lowest free one).
    #[arg(long, default_value_t = 0)]
    nsid: u32,
}

/// `nvmf subsystem ns remove` (and its old spelling `remove-ns`).
#[derive(Args, Debug)]
pub struct NsRemoveArgs {
    /// NQN of the subsystem.
    nqn: String,
    /// Namespace ID to remove.
    nsid: u32,
}

#[derive(Subcommand, Debug)]
pub enum SubsystemCmd {
    /// Create a subsystem.
    Create(SubsystemCreateArgs),
    /// Old spelling of `create`.
    #[command(hide = true)]
    Add(SubsystemCreateArgs),
    /// List the subsystems, their namespaces, hosts and controllers.
    List,
    /// Show one subsystem: namespaces, hosts, controllers.
    #[command(visible_alias = "status")]
    Show(SubsystemName),
    /// Delete a subsystem (refused while hosts are connected).
    #[command(alias = "remove")]
    Delete(SubsystemName),
    /// Hosts allowed to connect: add, remove.
    #[command(subcommand)]
    Host(HostCmd),
    /// Namespaces (volumes) of a subsystem: add, remove.
    #[command(subcommand, visible_alias = "namespace")]
    Ns(NsCmd),
    /// Old spelling of `ns add`.
    #[command(hide = true)]
    AddNs(NsAddArgs),
    /// Old spelling of `ns remove`.
    #[command(hide = true)]
    RemoveNs(NsRemoveArgs),
    /// Old spelling of `host add`.
    #[command(hide = true)]
    AddHost(HostAddArgs),
    /// Old spelling of `host remove`.
    #[command(hide = true)]
    RemoveHost(HostRemoveArgs),
}

#[derive(Subcommand, Debug)]
pub enum HostCmd {
    /// Allow a host NQN.
    Add(HostAddArgs),
    /// Disallow a host NQN.
    Remove(HostRemoveArgs),
}

#[derive(Subcommand, Debug)]
pub enum NsCmd {
    /// Add a volume as a namespace.
    Add(NsAddArgs),
    /// Remove a namespace (by its ID).
    Remove(NsRemoveArgs),
}

fn print_subsystems(v: &[SubsystemInfo]) {
    for s in v {
        let ns: Vec<String> = s
            .namespaces
            .iter()
            .map(|n| format!("{}={}", n.nsid, n.volume))
            .collect();
        let with_auth: Vec<String> = s
            .hosts
            .iter()
            .map(|h| match s.host_auth.get(h) {
                Some(how) => format!("{h} (auth: {how})"),
                None => h.clone(),
            })
            .collect();
        let hosts = if s.allow_any_host {
            if with_auth.iter().any(|h| h.contains("(auth:")) {
                format!("any host; hosts: {with_auth:?}")
            } else {
                "any host".to_string()
            }
        } else {
            format!("hosts: {with_auth:?}")
        };
        println!(
            "{}  namespaces: {}  {}  controllers: {}",
            s.nqn,
            if ns.is_empty() {
                "-".into()
            } else {
                ns.join(",")
            },
            hosts,
            s.controllers
        );
    }
}

fn ascii(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .trim_end_matches([' ', '\0'])
        .to_string()
}

pub fn run(ep: &Endpoint, c: NvmfCmd, raw: bool) -> Result<()> {
    match c {
        NvmfCmd::Discover { host } => {
            let e = initiator::discover(host.addr(), &host.opts()?).map_err(|e| host.error(e))?;
            if raw {
                let v: Vec<Value> = e
                    .iter()
                    .map(|x| json!({"subnqn": x.subnqn, "traddr": x.traddr, "trsvcid": x.trsvcid, "portid": x.portid, "subtype": x.subtype}))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else if e.is_empty() {
                println!("no subsystems for this host");
            } else {
                for x in e {
                    println!(
                        "{}  tcp {}:{}  (port {})",
                        x.subnqn, x.traddr, x.trsvcid, x.portid
                    );
                }
            }
        }
        NvmfCmd::Identify { host, nqn } => {
            let mut c = Controller::connect(host.addr(), &nqn, &host.opts()?, 0)
                .map_err(|e| host.error(e))?;
            let id = c
                .identify(nvme::CNS_CONTROLLER, 0)
                .map_err(|e| host.error(e))?;
            let mut out = json!({
                "cntlid": le16(&id, 78), "serial": ascii(&id[4..24]), "model": ascii(&id[24..64]),
                "firmware": ascii(&id[64..72]), "subnqn": ascii(&id[768..1024]),
                "mdts": id[77], "nn": le32(&id, 516), "ioccsz": le32(&id, 1792),
            });
            // Asymmetric Namespace Access: each namespace's state through this path.
            let ana = if id[76] & (1 << 3) != 0 {
                c.ana_log(false).map_err(|e| host.error(e))?.1
            } else {
                Vec::new()
            };
            let mut nss = Vec::new();
            for nsid in c.namespaces().map_err(|e| host.error(e))? {
                let n = c
                    .identify(nvme::CNS_NAMESPACE, nsid)
                    .map_err(|e| host.error(e))?;
                let lba = 1u64 << n[130];
                let nguid: String = n[104..120].iter().map(|b| format!("{b:02x}")).collect();
                let mut ns = json!({"nsid": nsid, "blocks": le64(&n, 0), "lba_size": lba,
                    "size": le64(&n, 0) * lba, "used_blocks": le64(&n, 16), "nguid": nguid});
                if let Some(g) = ana.iter().find(|g| g.nsids.contains(&nsid)) {
                    ns["ana_group"] = json!(g.grpid);
                    ns["ana_state"] = json!(g.state.name());
                }
                nss.push(ns);
            }
            out["namespaces"] = Value::Array(nss);
            c.disconnect();
            println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
        }
        NvmfCmd::Read {
            host,
            nqn,
            nsid,
            offset,
            length,
            output,
        } => {
            let off =
                parse_size(&offset).map_err(|e| CliError::Invalid(format!("--offset: {e}")))?;
            let len =
                parse_size(&length).map_err(|e| CliError::Invalid(format!("--length: {e}")))?;
            let mut c = Controller::connect(host.addr(), &nqn, &host.opts()?, 1)
                .map_err(|e| host.error(e))?;
            let (_, lba) = c.namespace_size(nsid).map_err(|e| host.error(e))?;
            let lba64 = lba as u64;
            if off % lba64 != 0 || len % lba64 != 0 || len == 0 {
                return Err(CliError::Invalid(format!(
                    "--offset and --length must be multiples of the {lba}-byte LBA"
                )));
            }
            let mut data = Vec::with_capacity(usize_of(len));
            let chunk = 256 * lba64;
            let mut at = off;
            while at < off + len {
                let n = chunk.min(off + len - at);
                let d = c
                    .read(0, nsid, at / lba64, u32_of(n / lba64), lba)
                    .map_err(|e| host.error(e))?;
                data.extend_from_slice(&d);
                at += n;
            }
            c.disconnect();
            match output {
                Some(p) => std::fs::write(&p, &data)
                    .map_err(|e| CliError::Unavailable(format!("{}: {e}", p.display())))?,
                None => std::io::stdout().write_all(&data)?,
            }
        }
        NvmfCmd::Write {
            host,
            nqn,
            nsid,
            offset,
            input,
        } => {
            let off =
                parse_size(&offset).map_err(|e| CliError::Invalid(format!("--offset: {e}")))?;
            let mut data = Vec::new();
            match input {
                Some(p) => {
                    data = std::fs::read(&p)
                        .map_err(|e| CliError::Unavailable(format!("{}: {e}", p.display())))?
                }
                None => {
                    std::io::stdin().read_to_end(&mut data)?;
                }
            }
            let mut c = Controller::connect(host.addr(), &nqn, &host.opts()?, 1)
                .map_err(|e| host.error(e))?;
            let (_, lba) = c.namespace_size(nsid).map_err(|e| host.error(e))?;
            let l = lba as usize;
            if off % lba as u64 != 0 || data.is_empty() || data.len() % l != 0 {
                return Err(CliError::Invalid(format!(
                    "the offset and the data length must be multiples of the {lba}-byte LBA"
                )));
            }
            for (i, chunk) in data.chunks(256 * l).enumerate() {
                let slba = off / lba as u64 + (i * 256) as u64;
                c.write(0, nsid, slba, chunk, lba)
                    .map_err(|e| host.error(e))?;
            }
            c.flush(0, nsid).map_err(|e| host.error(e))?;
            c.disconnect();
            eprintln!("wrote {} bytes at offset {off}", data.len());
        }
        NvmfCmd::Perf(a) => perf(a)?,
        NvmfCmd::Subsystem(s) => subsystem(ep, s, raw)?,
    }
    Ok(())
}

fn subsystem(ep: &Endpoint, c: SubsystemCmd, raw: bool) -> Result<()> {
    let path = |nqn: &str| format!("/v1/nvmf/subsystems/{nqn}");
    let one = |v: &SubsystemInfo| print_subsystems(std::slice::from_ref(v));
    let v: SubsystemInfo = match c {
        SubsystemCmd::Create(a) | SubsystemCmd::Add(a) => {
            let body = CreateSubsystem {
                nqn: a.nqn.clone(),
                allow_any_host: a.allow_any_host,
                hosts: Some(a.hosts),
            };
            let mut v: SubsystemInfo = send(ep, "POST", "/v1/nvmf/subsystems", &body)?;
            for volume in a.volumes {
                let body = AddNamespace { volume, nsid: 0 };
                v = send(ep, "POST", &format!("{}/namespaces", path(&a.nqn)), &body)?;
            }
            v
        }
        SubsystemCmd::List => {
            let v: Vec<SubsystemInfo> = get(ep, "/v1/nvmf/subsystems")?;
            show(&v[..], raw, print_subsystems);
            return Ok(());
        }
        SubsystemCmd::Show(SubsystemName { nqn }) => get(ep, &path(&nqn))?,
        SubsystemCmd::Delete(SubsystemName { nqn }) => {
            let v: Deleted = delete(ep, &path(&nqn))?;
            deleted(&v, raw, &format!("subsystem {nqn}"));
            return Ok(());
        }
        SubsystemCmd::Ns(NsCmd::Add(a)) | SubsystemCmd::AddNs(a) => {
            let body = AddNamespace {
                volume: a.volume,
                nsid: a.nsid.into(),
            };
            send(ep, "POST", &format!("{}/namespaces", path(&a.nqn)), &body)?
        }
        SubsystemCmd::Ns(NsCmd::Remove(a)) | SubsystemCmd::RemoveNs(a) => {
            let nsid = a.nsid;
            let v: Deleted<u32> = delete(ep, &format!("{}/namespaces/{nsid}", path(&a.nqn)))?;
            deleted(&v, raw, &format!("namespace {nsid} of {}", a.nqn));
            return Ok(());
        }
        SubsystemCmd::Host(HostCmd::Add(a)) | SubsystemCmd::AddHost(a) => {
            let body = AddHost {
                nqn: a.host,
                dhchap_secret: secret_arg(
                    "dhchap-secret",
                    &a.dhchap_secret,
                    &a.dhchap_secret_file,
                )?,
                dhchap_ctrl_secret: secret_arg(
                    "dhchap-ctrl-secret",
                    &a.dhchap_ctrl_secret,
                    &a.dhchap_ctrl_secret_file,
                )?,
                dhchap_hash: a.dhchap_hash,
                dhchap_dhgroup: a.dhchap_dhgroup,
            };
            send(ep, "POST", &format!("{}/hosts", path(&a.nqn)), &body)?
        }
        SubsystemCmd::Host(HostCmd::Remove(a)) | SubsystemCmd::RemoveHost(a) => {
            delete(ep, &format!("{}/hosts/{}", path(&a.nqn), a.host))?
        }
    };
    show(&v, raw, one);
    Ok(())
}

/// `tessera nvmf perf`: the initiator's host options plus the load generator's workload
/// (`tessera_load::nvmf_perf`).
#[derive(Args, Clone, Debug)]
pub struct NvmfPerfArgs {
    #[command(flatten)]
    host: HostArgs,
    #[command(flatten)]
    load: tessera_load::nvmf_perf::NvmfPerfArgs,
}

fn perf(a: NvmfPerfArgs) -> std::result::Result<(), CliError> {
    let options = a.host.options()?;
    Ok(tessera_load::nvmf_perf::run(
        a.host.addr(),
        options,
        a.load,
    )?)
}
