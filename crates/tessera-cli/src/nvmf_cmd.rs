//! `tessera nvmf`: the NVMe/TCP initiator (discover, identify, read, write, perf) and the
//! management of a node's NVMe/TCP subsystems over its API.

use std::io::{Read as _, Write as _};

use clap::{Args, Subcommand};
use serde_json::{json, Value};
use tessera_device::parse_size;
use tessera_http::Endpoint;

use crate::error::{CliError, Result};
use crate::manage::{delete, get, print_json, send};
use tessera_api::{AddHost, AddNamespace, CreateSubsystem, Deleted, SubsystemInfo};
use tessera_nvmf::auth::Secret;
use tessera_nvmf::initiator::{self, Controller, Options};
use tessera_nvmf::nvme;
use tessera_nvmf::pdu::{le16, le32, le64};

#[derive(Args, Clone, Debug)]
pub struct HostArgs {
    /// Target address HOST:PORT.
    #[arg(long, default_value = "127.0.0.1:4420")]
    pub addr: String,
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
    flag: &str,
    inline: &Option<String>,
    file: &Option<std::path::PathBuf>,
) -> std::result::Result<Option<String>, String> {
    match (inline, file) {
        (Some(s), _) => Ok(Some(s.trim().to_string())),
        (None, Some(p)) => std::fs::read_to_string(p)
            .map(|s| Some(s.trim().to_string()))
            .map_err(|e| format!("--{flag}-file {}: {e}", p.display())),
        (None, None) => Ok(None),
    }
}

impl HostArgs {
    pub fn options(&self) -> std::result::Result<Options, String> {
        let mut o = Options {
            hdgst: self.hdgst,
            ddgst: self.ddgst,
            ..Options::default()
        };
        if let Some(h) = &self.hostnqn {
            o.hostnqn = h.clone();
        }
        let parse = |flag: &str, s: Option<String>| {
            s.map(|s| Secret::parse(&s).map_err(|e| format!("--{flag}: {e}")))
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
            return Err("--dhchap-ctrl-secret needs --dhchap-secret".into());
        }
        Ok(o)
    }

    fn opts(&self) -> Result<Options> {
        self.options().map_err(CliError::Invalid)
    }
}

#[derive(Subcommand)]
pub enum NvmfCmd {
    /// List the subsystems the discovery controller offers this host.
    Discover {
        #[command(flatten)]
        host: HostArgs,
    },
    /// Connect and print Identify Controller and Identify Namespace.
    Identify {
        #[command(flatten)]
        host: HostArgs,
        #[arg(long)]
        nqn: String,
    },
    /// Read bytes from a namespace to stdout (or --output).
    Read {
        #[command(flatten)]
        host: HostArgs,
        #[arg(long)]
        nqn: String,
        #[arg(long, default_value_t = 1)]
        nsid: u32,
        /// Byte offset (a multiple of the LBA size).
        #[arg(long, default_value = "0")]
        offset: String,
        #[arg(long, default_value = "4K")]
        length: String,
        #[arg(long)]
        output: Option<std::path::PathBuf>,
    },
    /// Write stdin (or --input) to a namespace.
    Write {
        #[command(flatten)]
        host: HostArgs,
        #[arg(long)]
        nqn: String,
        #[arg(long, default_value_t = 1)]
        nsid: u32,
        #[arg(long, default_value = "0")]
        offset: String,
        #[arg(long)]
        input: Option<std::path::PathBuf>,
    },
    /// Pipelined load generator (measures the target, not the client).
    Perf(crate::nvmf_perf::NvmfPerfArgs),
    /// Manage the node's subsystems (over the API).
    #[command(subcommand)]
    Subsystem(SubsystemCmd),
}

#[derive(Subcommand)]
pub enum SubsystemCmd {
    /// Create a subsystem.
    Add {
        nqn: String,
        /// Volumes to add as namespaces 1, 2, ...
        #[arg(long = "volume")]
        volumes: Vec<String>,
        /// Let every host connect (otherwise only --host ones).
        #[arg(long)]
        allow_any_host: bool,
        #[arg(long = "host")]
        hosts: Vec<String>,
    },
    /// List the subsystems, their namespaces, hosts and controllers.
    List,
    /// Delete a subsystem (refused while hosts are connected).
    Remove { nqn: String },
    /// Add a volume as a namespace.
    AddNs {
        nqn: String,
        #[arg(long)]
        volume: String,
        #[arg(long, default_value_t = 0)]
        nsid: u32,
    },
    /// Remove a namespace (by its ID).
    RemoveNs { nqn: String, nsid: u32 },
    /// Allow a host NQN; with --dhchap-secret it must also authenticate (DH-HMAC-CHAP).
    AddHost {
        nqn: String,
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
    },
    /// Disallow a host NQN.
    RemoveHost { nqn: String, host: String },
}

fn print_subsystems(v: &[SubsystemInfo], raw: bool) {
    if raw {
        print_json(v);
        return;
    }
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

/// The target could not be reached or refused the command.
fn err(e: initiator::Error) -> CliError {
    CliError::Unavailable(e.to_string())
}

fn ascii(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .trim_end_matches([' ', '\0'])
        .to_string()
}

pub fn run(ep: &Endpoint, c: NvmfCmd, raw: bool) -> Result<()> {
    match c {
        NvmfCmd::Discover { host } => {
            let e = initiator::discover(&host.addr, &host.opts()?).map_err(err)?;
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
            let mut c = Controller::connect(&host.addr, &nqn, &host.opts()?, 0).map_err(err)?;
            let id = c.identify(nvme::CNS_CONTROLLER, 0).map_err(err)?;
            let mut out = json!({
                "cntlid": le16(&id, 78), "serial": ascii(&id[4..24]), "model": ascii(&id[24..64]),
                "firmware": ascii(&id[64..72]), "subnqn": ascii(&id[768..1024]),
                "mdts": id[77], "nn": le32(&id, 516), "ioccsz": le32(&id, 1792),
            });
            let mut nss = Vec::new();
            for nsid in c.namespaces().map_err(err)? {
                let n = c.identify(nvme::CNS_NAMESPACE, nsid).map_err(err)?;
                let lba = 1u64 << n[130];
                let nguid: String = n[104..120].iter().map(|b| format!("{b:02x}")).collect();
                nss.push(json!({"nsid": nsid, "blocks": le64(&n, 0), "lba_size": lba,
                    "size": le64(&n, 0) * lba, "used_blocks": le64(&n, 16), "nguid": nguid}));
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
            let mut c = Controller::connect(&host.addr, &nqn, &host.opts()?, 1).map_err(err)?;
            let (_, lba) = c.namespace_size(nsid).map_err(err)?;
            let lba64 = lba as u64;
            if off % lba64 != 0 || len % lba64 != 0 || len == 0 {
                return Err(CliError::Invalid(format!(
                    "--offset and --length must be multiples of the {lba}-byte LBA"
                )));
            }
            let mut data = Vec::with_capacity(len as usize);
            let chunk = 256 * lba64;
            let mut at = off;
            while at < off + len {
                let n = chunk.min(off + len - at);
                let d = c
                    .read(0, nsid, at / lba64, (n / lba64) as u32, lba)
                    .map_err(err)?;
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
            let mut c = Controller::connect(&host.addr, &nqn, &host.opts()?, 1).map_err(err)?;
            let (_, lba) = c.namespace_size(nsid).map_err(err)?;
            let l = lba as usize;
            if off % lba as u64 != 0 || data.is_empty() || data.len() % l != 0 {
                return Err(CliError::Invalid(format!(
                    "the offset and the data length must be multiples of the {lba}-byte LBA"
                )));
            }
            for (i, chunk) in data.chunks(256 * l).enumerate() {
                let slba = off / lba as u64 + (i * 256) as u64;
                c.write(0, nsid, slba, chunk, lba).map_err(err)?;
            }
            c.flush(0, nsid).map_err(err)?;
            c.disconnect();
            eprintln!("wrote {} bytes at offset {off}", data.len());
        }
        NvmfCmd::Perf(a) => crate::nvmf_perf::run(a)?,
        NvmfCmd::Subsystem(s) => subsystem(ep, s, raw)?,
    }
    Ok(())
}

fn subsystem(ep: &Endpoint, c: SubsystemCmd, raw: bool) -> Result<()> {
    let path = |nqn: &str| format!("/v1/nvmf/subsystems/{nqn}");
    match c {
        SubsystemCmd::Add {
            nqn,
            volumes,
            allow_any_host,
            hosts,
        } => {
            let body = CreateSubsystem {
                nqn: nqn.clone(),
                allow_any_host,
                hosts: Some(hosts),
            };
            let mut v: SubsystemInfo = send(ep, "POST", "/v1/nvmf/subsystems", &body)?;
            for volume in volumes {
                let body = AddNamespace { volume, nsid: 0 };
                v = send(ep, "POST", &format!("{}/namespaces", path(&nqn)), &body)?;
            }
            print_subsystems(&[v], raw);
        }
        SubsystemCmd::List => {
            let v: Vec<SubsystemInfo> = get(ep, "/v1/nvmf/subsystems")?;
            print_subsystems(&v, raw);
        }
        SubsystemCmd::Remove { nqn } => {
            let _: Deleted = delete(ep, &path(&nqn))?;
            println!("subsystem {nqn} removed");
        }
        SubsystemCmd::AddNs { nqn, volume, nsid } => {
            let body = AddNamespace {
                volume,
                nsid: nsid.into(),
            };
            let v: SubsystemInfo = send(ep, "POST", &format!("{}/namespaces", path(&nqn)), &body)?;
            print_subsystems(&[v], raw);
        }
        SubsystemCmd::RemoveNs { nqn, nsid } => {
            let _: Deleted<u32> = delete(ep, &format!("{}/namespaces/{nsid}", path(&nqn)))?;
            println!("namespace {nsid} removed from {nqn}");
        }
        SubsystemCmd::AddHost {
            nqn,
            host,
            dhchap_secret,
            dhchap_secret_file,
            dhchap_ctrl_secret,
            dhchap_ctrl_secret_file,
            dhchap_hash,
            dhchap_dhgroup,
        } => {
            let body = AddHost {
                nqn: host,
                dhchap_secret: secret_arg("dhchap-secret", &dhchap_secret, &dhchap_secret_file)
                    .map_err(CliError::Invalid)?,
                dhchap_ctrl_secret: secret_arg(
                    "dhchap-ctrl-secret",
                    &dhchap_ctrl_secret,
                    &dhchap_ctrl_secret_file,
                )
                .map_err(CliError::Invalid)?,
                dhchap_hash,
                dhchap_dhgroup,
            };
            let v: SubsystemInfo = send(ep, "POST", &format!("{}/hosts", path(&nqn)), &body)?;
            print_subsystems(&[v], raw);
        }
        SubsystemCmd::RemoveHost { nqn, host } => {
            let v: SubsystemInfo = delete(ep, &format!("{}/hosts/{host}", path(&nqn)))?;
            print_subsystems(&[v], raw);
        }
    }
    Ok(())
}
