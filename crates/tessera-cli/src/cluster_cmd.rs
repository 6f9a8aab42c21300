//! `tessera cluster ...`: the cluster this node is a member of (issue 13).

use clap::Subcommand;
use tessera_api::{ClusterNode, ClusterStatus, ClusterVolume};
use tessera_http::Endpoint;

use crate::error::Result;
use crate::format::{bytes, table};
use crate::manage::{get, show};

#[derive(Subcommand)]
pub enum ClusterCmd {
    /// Live members (their etcd lease holds): API, labels, pools and free space.
    Nodes,
    /// Every volume of the cluster: size, owner, epoch, replicas.
    Volumes,
    /// This node's membership: its name, etcd, lease, and both lists.
    Status,
}

fn print_nodes(nodes: &[ClusterNode]) {
    let mut rows = vec![vec![
        "NODE".into(),
        "LABELS".into(),
        "POOLS".into(),
        "FREE".into(),
        "NVME/TCP".into(),
        "API".into(),
    ]];
    for n in nodes {
        let labels: Vec<String> = n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let pools: Vec<String> = n.pools.iter().map(|p| p.name.clone()).collect();
        rows.push(vec![
            n.name.clone(),
            labels.join(","),
            pools.join(","),
            bytes(n.pools.iter().map(|p| p.free).sum()),
            n.nvmf.clone().unwrap_or_else(|| "-".into()),
            n.api.clone(),
        ]);
    }
    table(rows);
}

fn print_volumes(vols: &[ClusterVolume]) {
    let mut rows = vec![vec![
        "VOLUME".into(),
        "SIZE".into(),
        "OWNER".into(),
        "EPOCH".into(),
        "REPLICAS".into(),
    ]];
    for v in vols {
        rows.push(vec![
            v.name.clone(),
            bytes(v.size),
            v.owner.clone(),
            v.epoch.to_string(),
            v.replicas.join(","),
        ]);
    }
    table(rows);
}

fn print_status(s: &ClusterStatus) {
    println!(
        "node {} in the cluster of etcd {}",
        s.name,
        s.etcd.join(",")
    );
    match s.lease_valid_ms {
        Some(ms) => println!("lease holds for {ms} ms more"),
        None => println!("lease: not renewed lately (etcd unreachable?)"),
    }
    println!();
    print_nodes(&s.nodes);
    println!();
    print_volumes(&s.volumes);
}

pub fn cluster(ep: &Endpoint, c: ClusterCmd, raw: bool) -> Result<()> {
    let s: ClusterStatus = get(ep, "/v1/cluster")?;
    match c {
        ClusterCmd::Nodes => show(&s.nodes[..], raw, print_nodes),
        ClusterCmd::Volumes => show(&s.volumes[..], raw, print_volumes),
        ClusterCmd::Status => show(&s, raw, print_status),
    }
    Ok(())
}
