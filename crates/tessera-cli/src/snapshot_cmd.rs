//! `tessera snapshot ...` and the chain commands of `tessera volume` (clone, rollback,
//! changes): issue 14.

use clap::Subcommand;
use tessera_api::{
    ChangedExtents, CloneVolume, CreateSnapshot, CreateSnapshotGroup, DeletedSnapshot, Rollback,
    SnapshotInfo, VolumeInfo,
};
use tessera_http::Endpoint;

use crate::error::Result;
use crate::format::{bytes, local_time, table};
use crate::manage::{delete, get, send, show};

#[derive(Subcommand)]
pub enum SnapshotCmd {
    /// Snapshot a volume: instant (metadata only), read-only, crash-consistent.
    Create {
        /// The volume to snapshot.
        volume: String,
        /// Name of the snapshot.
        #[arg(long)]
        name: String,
    },
    /// Snapshot several volumes of one pool at one point in time (a consistency
    /// group): each VOLUME=SNAPSHOT.
    Group {
        /// One VOLUME=SNAPSHOT pair per volume (all in one pool): each snapshot is named
        /// as given, all taken at the same point.
        #[arg(required = true, value_name = "VOLUME=SNAPSHOT")]
        pairs: Vec<String>,
    },
    /// List snapshots: creation time, space held exclusively and shared.
    List,
    /// Delete a snapshot; its space comes back once no volume reads through it.
    Delete {
        /// Name of the snapshot.
        name: String,
    },
}

fn print_snapshots(snaps: &[SnapshotInfo]) {
    let mut rows = vec![vec![
        "SNAPSHOT".into(),
        "POOL".into(),
        "SIZE".into(),
        "CREATED".into(),
        "EXCLUSIVE".into(),
        "SHARED".into(),
        "PARENT".into(),
        "CHILDREN".into(),
    ]];
    for s in snaps {
        rows.push(vec![
            s.name.clone(),
            s.pool.clone(),
            bytes(s.size),
            local_time(s.created),
            bytes(s.exclusive),
            bytes(s.shared),
            s.parent.clone().unwrap_or_else(|| "-".into()),
            if s.children.is_empty() {
                "-".into()
            } else {
                s.children.join(",")
            },
        ]);
    }
    table(rows);
    // A replicated volume's snapshot: where its copies are, and where they are not.
    for s in snaps {
        if !s.replicas.is_empty() {
            println!("{}: copies on {}", s.name, s.replicas.join(", "));
        }
        for m in &s.missing {
            println!("{}: no copy on {m}", s.name);
        }
    }
}

pub fn snapshot(ep: &Endpoint, c: SnapshotCmd, raw: bool) -> Result<()> {
    match c {
        SnapshotCmd::Create { volume, name } => {
            let s: SnapshotInfo = send(
                ep,
                "POST",
                "/v1/snapshots",
                &CreateSnapshot { volume, name },
            )?;
            show(&s, raw, |s| print_snapshots(std::slice::from_ref(s)));
        }
        SnapshotCmd::Group { pairs } => {
            let mut snapshots = Vec::new();
            for p in pairs {
                let Some((volume, name)) = p.split_once('=') else {
                    return Err(crate::error::CliError::Usage(format!(
                        "'{p}' is not VOLUME=SNAPSHOT"
                    )));
                };
                snapshots.push(CreateSnapshot {
                    volume: volume.to_string(),
                    name: name.to_string(),
                });
            }
            let s: Vec<SnapshotInfo> = send(
                ep,
                "POST",
                "/v1/snapshot-groups",
                &CreateSnapshotGroup { snapshots },
            )?;
            show(&s[..], raw, print_snapshots);
        }
        SnapshotCmd::List => {
            let s: Vec<SnapshotInfo> = get(ep, "/v1/snapshots")?;
            show(&s[..], raw, print_snapshots);
        }
        SnapshotCmd::Delete { name } => {
            let v: DeletedSnapshot = delete(ep, &format!("/v1/snapshots/{name}"))?;
            show(&v, raw, |v| {
                println!("snapshot {name} deleted");
                for n in &v.not_deleted {
                    println!("its copy stays on {n}");
                }
            });
        }
    }
    Ok(())
}

fn print_volume(v: &VolumeInfo) {
    println!(
        "volume {} (pool {}, {}), reads through {}",
        v.name,
        v.pool,
        bytes(v.size),
        v.parent.as_deref().unwrap_or("-")
    );
}

/// `volume clone SNAPSHOT --name NAME`.
pub fn clone(ep: &Endpoint, snapshot: String, name: String, force: bool, raw: bool) -> Result<()> {
    let v: VolumeInfo = send(
        ep,
        "POST",
        "/v1/clones",
        &CloneVolume {
            snapshot,
            name,
            force,
        },
    )?;
    show(&v, raw, print_volume);
    Ok(())
}

/// `volume rollback VOLUME --to SNAPSHOT`.
pub fn rollback(ep: &Endpoint, volume: String, to: String, raw: bool) -> Result<()> {
    let v: VolumeInfo = send(
        ep,
        "POST",
        &format!("/v1/volumes/{volume}/rollback"),
        &Rollback { to },
    )?;
    show(&v, raw, print_volume);
    Ok(())
}

/// `volume changes VOLUME --since SNAPSHOT`: one `OFFSET LENGTH` line per extent.
pub fn changes(ep: &Endpoint, volume: String, since: String, raw: bool) -> Result<()> {
    let c: ChangedExtents = get(ep, &format!("/v1/volumes/{volume}/changes?since={since}"))?;
    show(&c, raw, |c| {
        for e in &c.extents {
            println!("{} {}", e.offset, e.length);
        }
        eprintln!(
            "{} extent(s), {} of {} changed since {}",
            c.extents.len(),
            bytes(c.changed),
            bytes(c.size),
            c.since
        );
    });
    Ok(())
}
