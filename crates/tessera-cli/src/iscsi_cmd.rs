//! `tessera iscsi`: the management of a node's iSCSI targets over its API.

use clap::{Args, Subcommand};
use tessera_api::{CreateIscsiTarget, Deleted, IscsiTargetInfo};
use tessera_http::Endpoint;

use crate::error::Result;
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
}

#[derive(Args, Debug)]
pub struct TargetCreateArgs {
    /// The target's iSCSI name, e.g. iqn.2026-11.io.tessera:db.
    pub iqn: String,
    /// A volume to serve as the next LUN (repeat for LUN 1, 2, ...).
    #[arg(long = "volume", required = true)]
    pub volumes: Vec<String>,
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
        println!(
            "{}  luns: {}  portals: {}{}",
            t.iqn,
            luns.join(","),
            portals,
            if t.served { "" } else { "  (not served)" }
        );
    }
}

pub fn run(ep: &Endpoint, c: IscsiCmd, raw: bool) -> Result<()> {
    let IscsiCmd::Target(c) = c;
    let path = |iqn: &str| format!("/v1/iscsi/targets/{iqn}");
    let v: IscsiTargetInfo = match c {
        TargetCmd::Create(a) => {
            let body = CreateIscsiTarget {
                iqn: a.iqn,
                volumes: a.volumes,
            };
            send(ep, "POST", "/v1/iscsi/targets", &body)?
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
