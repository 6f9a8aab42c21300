//! `tessera iscsi`: the management of a node's iSCSI targets over its API.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use tessera_api::{CreateIscsiTarget, Deleted, IscsiAuth, IscsiChap, IscsiTargetInfo};
use tessera_http::Endpoint;

use crate::error::{CliError, Result};
use crate::manage::{delete, deleted, get, send, show};

#[derive(Subcommand, Debug)]
pub enum IscsiCmd {
    /// iSCSI targets: each a name (IQN) and its LUNs.
    #[command(subcommand)]
    Target(TargetCmd),
}

#[derive(Subcommand, Debug)]
pub enum TargetCmd {
    /// Create a target whose LUNs 0, 1, ... are the volumes, in the order given.
    Create(TargetCreateArgs),
    /// Every target.
    List,
    /// One target.
    Show(TargetName),
    /// Delete a target (sessions logged in keep their LUNs until they log out).
    Delete(TargetName),
    /// Replace who may log in to a target: its allowed initiators and CHAP, both (what
    /// is not given is cleared). Sessions logged in keep going.
    Auth(TargetAuthArgs),
}

/// Who may log in to a target. CHAP secrets are read from files (or standard input),
/// never taken on the command line, where other local users could read them.
#[derive(Args, Debug, Default)]
pub struct AccessArgs {
    /// An initiator name (IQN) allowed to log in; repeat for more. None given: any
    /// initiator (that passes CHAP, when set).
    #[arg(long = "allow-initiator", value_name = "IQN")]
    pub allowed_initiators: Vec<String>,
    /// The CHAP user name initiators must log in with (needs --chap-secret-file).
    #[arg(long, value_name = "USER", requires = "chap_secret_file")]
    pub chap_user: Option<String>,
    /// Read the initiators' CHAP secret (12 to 256 bytes) from this file, "-" for
    /// standard input; whitespace around it is ignored.
    #[arg(long, value_name = "PATH", requires = "chap_user")]
    pub chap_secret_file: Option<PathBuf>,
    /// Mutual CHAP: the user name the target answers an initiator that challenges it
    /// (needs --chap-user and --mutual-chap-secret-file).
    #[arg(long, value_name = "USER", requires_all = ["chap_user", "mutual_chap_secret_file"])]
    pub mutual_chap_user: Option<String>,
    /// Read the target's mutual CHAP secret (12 to 256 bytes, not the initiators') from
    /// this file, "-" for standard input.
    #[arg(long, value_name = "PATH", requires = "mutual_chap_user")]
    pub mutual_chap_secret_file: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct TargetAuthArgs {
    /// The target's iSCSI name (as `tessera iscsi target list` shows it).
    pub iqn: String,
    #[command(flatten)]
    pub access: AccessArgs,
    /// Let any initiator log in without CHAP (clears the allowlist and CHAP); needed
    /// when neither --allow-initiator nor --chap-user is given, so that a forgotten
    /// flag does not open the target.
    #[arg(long, conflicts_with_all = ["allowed_initiators", "chap_user"])]
    pub open: bool,
}

/// A secret from a file, or standard input for "-": trimmed, not empty.
fn read_secret(flag: &str, path: &Path) -> Result<String> {
    let text = if path == Path::new("-") {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| CliError::Invalid(format!("--{flag} -: reading standard input: {e}")))?;
        s
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| CliError::Invalid(format!("--{flag} {}: {e}", path.display())))?
    };
    let secret = text.trim();
    if secret.is_empty() {
        return Err(CliError::Invalid(format!(
            "--{flag} {}: the secret is empty",
            path.display()
        )));
    }
    Ok(secret.to_string())
}

impl AccessArgs {
    /// The access control these flags ask for (secrets read now; the node checks them).
    pub fn auth(self) -> Result<IscsiAuth> {
        let stdin_twice = [&self.chap_secret_file, &self.mutual_chap_secret_file]
            .iter()
            .filter(|p| p.as_deref() == Some(Path::new("-")))
            .count()
            > 1;
        if stdin_twice {
            return Err(CliError::Invalid(
                "--chap-secret-file and --mutual-chap-secret-file cannot both read standard \
                 input"
                    .into(),
            ));
        }
        let chap = match (self.chap_user, &self.chap_secret_file) {
            (Some(user), Some(path)) => {
                let secret = read_secret("chap-secret-file", path)?;
                let mutual_secret = self
                    .mutual_chap_secret_file
                    .as_deref()
                    .map(|p| read_secret("mutual-chap-secret-file", p))
                    .transpose()?;
                Some(IscsiChap {
                    user,
                    secret,
                    mutual_user: self.mutual_chap_user,
                    mutual_secret,
                })
            }
            _ => None,
        };
        Ok(IscsiAuth {
            allowed_initiators: self.allowed_initiators,
            chap,
        })
    }
}

#[derive(Args, Debug)]
pub struct TargetCreateArgs {
    /// The target's iSCSI name, e.g. iqn.2026-11.io.tessera:db.
    pub iqn: String,
    /// A volume to serve as the next LUN (repeat for LUN 1, 2, ...).
    #[arg(long = "volume", required = true)]
    pub volumes: Vec<String>,
    #[command(flatten)]
    pub access: AccessArgs,
}

#[derive(Args, Debug)]
pub struct TargetName {
    /// The target's iSCSI name (as `tessera iscsi target list` shows it).
    pub iqn: String,
}

fn print_targets(v: &[IscsiTargetInfo]) {
    for t in v {
        let luns: Vec<String> = t
            .luns
            .iter()
            .map(|l| format!("{}={}", l.lun, l.volume))
            .collect();
        let portals = if t.portals.is_empty() {
            "-".to_string()
        } else {
            t.portals.join(",")
        };
        let initiators = if t.allowed_initiators.is_empty() {
            "any".to_string()
        } else {
            t.allowed_initiators.join(",")
        };
        // User names only: the API never returns secrets.
        let chap = match &t.chap {
            None => "none".to_string(),
            Some(c) => match &c.mutual_user {
                None => format!("one-way (user {})", c.user),
                Some(m) => format!("mutual (user {}, target user {m})", c.user),
            },
        };
        println!(
            "{}  luns: {}  portals: {}  initiators: {}  chap: {}{}",
            t.iqn,
            luns.join(","),
            portals,
            initiators,
            chap,
            if t.served { "" } else { "  (not served)" }
        );
    }
}

pub fn run(ep: &Endpoint, c: IscsiCmd, raw: bool) -> Result<()> {
    let IscsiCmd::Target(c) = c;
    let path = |iqn: &str| format!("/v1/iscsi/targets/{iqn}");
    let v: IscsiTargetInfo = match c {
        TargetCmd::Create(a) => {
            let auth = a.access.auth()?;
            let body = CreateIscsiTarget {
                iqn: a.iqn,
                volumes: a.volumes,
                allowed_initiators: auth.allowed_initiators,
                chap: auth.chap,
            };
            send(ep, "POST", "/v1/iscsi/targets", &body)?
        }
        TargetCmd::Auth(a) => {
            if !a.open && a.access.allowed_initiators.is_empty() && a.access.chap_user.is_none() {
                return Err(CliError::Invalid(
                    "give --allow-initiator and/or --chap-user with --chap-secret-file, or \
                     --open to let any initiator in without CHAP"
                        .into(),
                ));
            }
            let body = a.access.auth()?;
            send(ep, "PUT", &format!("{}/auth", path(&a.iqn)), &body)?
        }
        TargetCmd::List => {
            let v: Vec<IscsiTargetInfo> = get(ep, "/v1/iscsi/targets")?;
            show(&v[..], raw, print_targets);
            return Ok(());
        }
        TargetCmd::Show(TargetName { iqn }) => get(ep, &path(&iqn))?,
        TargetCmd::Delete(TargetName { iqn }) => {
            let v: Deleted = delete(ep, &path(&iqn))?;
            deleted(&v, raw, &format!("iSCSI target {iqn}"));
            return Ok(());
        }
    };
    show(&v, raw, |v| print_targets(std::slice::from_ref(v)));
    Ok(())
}
