//! A deterministic, seeded model checker for block storage (issue 20, the harness).
//!
//! The engine knows nothing about pools: a [`Target`] (implemented by the test that owns
//! the system under test, e.g. `tessera-pool/tests/pool/model_check.rs`) carries out the
//! operations, and this module
//! - generates them from a seed ([`Generator`]) according to what exists now,
//! - writes data that says what it is ([`stamp`]: every 512-byte sector carries the
//!   writing volume's lineage, the sector's offset and a generation),
//! - keeps a model of what every sector of every volume may read back now and after a
//!   power loss ([`Model`]), and checks whole volumes against it after every step,
//! - and, when a seed fails, shrinks the sequence of operations it ran to a minimal one
//!   that still fails ([`minimise`]) and prints it as a replayable list.
//!
//! Model semantics (what Tessera promises, `docs/architecture.md`):
//! - a sector reads its last acknowledged write; never-written sectors read zeros;
//! - after a power loss, a sector holds the value it had at the last durable point (an
//!   acknowledged FLUSH, a catalog change's checkpoint, or a FUA write) or any write
//!   acknowledged or in flight since (per sector: devices guarantee sector atomicity);
//! - TRIM is advisory: a trimmed sector reads its old value or zeros (whole units are
//!   released, in a chain a unit the parent has data at is kept);
//! - a snapshot freezes the volume as it was at create time (and is exact after a power
//!   loss: create is a checkpoint);
//! - no sector ever holds another lineage's data (another volume, a deleted volume) that
//!   the model does not allow, nor bytes that are not a stamp at all (garbage).

use std::collections::BTreeMap;
use std::fmt;
use tessera_io::cast::usize_of;

use crate::data::Rng;

pub const SECTOR: usize = 512;
const MAGIC: u64 = 0x5453_5352_4d43_4b31; // "TSSRMCK1"

/// What a sector holds: zeros, or the stamp of a write.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Val {
    Zero,
    /// Written by a volume of `lineage` (a number never reused, one per created volume or
    /// clone) as its generation `gen` (unique across the run).
    Stamp {
        lineage: u32,
        gen: u64,
    },
}

impl fmt::Debug for Val {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Val::Zero => write!(f, "zero"),
            Val::Stamp { lineage, gen } => write!(f, "L{lineage}g{gen}"),
        }
    }
}

/// The 512 bytes of `val` written at `sector` (volume-relative).
pub fn stamp(val: Val, sector: u64) -> [u8; SECTOR] {
    let mut b = [0u8; SECTOR];
    let Val::Stamp { lineage, gen } = val else {
        return b;
    };
    b[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    b[8..16].copy_from_slice(&u64::from(lineage).to_le_bytes());
    b[16..24].copy_from_slice(&sector.to_le_bytes());
    b[24..32].copy_from_slice(&gen.to_le_bytes());
    let mut r = Rng((u64::from(lineage).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ sector.wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
        ^ gen.wrapping_mul(0x1656_67b1_9e37_79f9))
        | 1);
    for c in b[32..].chunks_mut(8) {
        c.copy_from_slice(&r.next().to_le_bytes());
    }
    b
}

/// What a sector read back holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Seen {
    Val(Val),
    /// A stamp written at another offset (misplaced data).
    Misplaced {
        lineage: u32,
        sector: u64,
        gen: u64,
    },
    /// Not zeros and not a whole stamp: garbage, or a sector torn inside.
    Garbage,
}

pub fn decode(data: &[u8], sector: u64) -> Seen {
    if crate::data::is_zero(data) {
        return Seen::Val(Val::Zero);
    }
    let word = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().expect("8 bytes"));
    if word(0) != MAGIC {
        return Seen::Garbage;
    }
    let Ok(lineage) = u32::try_from(word(8)) else {
        return Seen::Garbage;
    };
    let (at, gen) = (word(16), word(24));
    let val = Val::Stamp { lineage, gen };
    if stamp(val, at)[..] != data[..SECTOR] {
        return Seen::Garbage;
    }
    if at != sector {
        return Seen::Misplaced {
            lineage,
            sector: at,
            gen,
        };
    }
    Seen::Val(val)
}

/// What one sector may hold.
#[derive(Clone, Debug)]
struct SectorModel {
    /// What a read may return now (one value, unless a TRIM left it open).
    now: Vec<Val>,
    /// What it may hold after a power loss: the durable value and everything written
    /// (acknowledged or in flight) since.
    crash: Vec<Val>,
}

fn add(set: &mut Vec<Val>, v: Val) {
    if !set.contains(&v) {
        set.push(v);
    }
}

#[derive(Clone, Debug)]
pub struct VolModel {
    pub lineage: u32,
    pub snapshot: bool,
    sectors: Vec<SectorModel>,
}

impl VolModel {
    fn new(lineage: u32, sectors: u64) -> VolModel {
        VolModel {
            lineage,
            snapshot: false,
            sectors: vec![
                SectorModel {
                    now: vec![Val::Zero],
                    crash: vec![Val::Zero],
                };
                usize::try_from(sectors).expect("small volume")
            ],
        }
    }
    pub fn sectors(&self) -> u64 {
        self.sectors.len() as u64
    }
}

/// Which volume an operation names: by name, so a shrunk sequence (some operations
/// taken out) still means the same thing; operations on a volume that does not exist in
/// the replay are skipped.
pub type Name = String;

/// One I/O of a batch: submitted together with the others of its batch, from a
/// connection of its own.
#[derive(Clone, PartialEq, Eq)]
pub enum Io {
    Write {
        vol: Name,
        sector: u64,
        sectors: u64,
        fua: bool,
    },
    Zero {
        vol: Name,
        sector: u64,
        sectors: u64,
        may_unmap: bool,
    },
    Trim {
        vol: Name,
        sector: u64,
        sectors: u64,
    },
    Read {
        vol: Name,
        sector: u64,
        sectors: u64,
    },
    /// A write of what volume `from` holds at the same sectors (where the model knows
    /// one value; a fresh stamp where it does not): identical blocks for a
    /// deduplicating target to find ([`Kind::Duplicate`]).
    Copy {
        vol: Name,
        sector: u64,
        sectors: u64,
        from: Name,
    },
}

impl Io {
    pub fn vol(&self) -> &Name {
        match self {
            Io::Write { vol, .. }
            | Io::Zero { vol, .. }
            | Io::Trim { vol, .. }
            | Io::Read { vol, .. }
            | Io::Copy { vol, .. } => vol,
        }
    }
    pub fn range(&self) -> (u64, u64) {
        match *self {
            Io::Write {
                sector, sectors, ..
            }
            | Io::Zero {
                sector, sectors, ..
            }
            | Io::Trim {
                sector, sectors, ..
            }
            | Io::Read {
                sector, sectors, ..
            }
            | Io::Copy {
                sector, sectors, ..
            } => (sector, sectors),
        }
    }
}

impl fmt::Debug for Io {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Io::Write {
                vol,
                sector,
                sectors,
                fua,
            } => write!(
                f,
                "Io::Write {{ vol: {vol:?}.into(), sector: {sector}, sectors: {sectors}, fua: {fua} }}"
            ),
            Io::Zero {
                vol,
                sector,
                sectors,
                may_unmap,
            } => write!(
                f,
                "Io::Zero {{ vol: {vol:?}.into(), sector: {sector}, sectors: {sectors}, may_unmap: {may_unmap} }}"
            ),
            Io::Trim {
                vol,
                sector,
                sectors,
            } => write!(
                f,
                "Io::Trim {{ vol: {vol:?}.into(), sector: {sector}, sectors: {sectors} }}"
            ),
            Io::Read {
                vol,
                sector,
                sectors,
            } => write!(
                f,
                "Io::Read {{ vol: {vol:?}.into(), sector: {sector}, sectors: {sectors} }}"
            ),
            Io::Copy {
                vol,
                sector,
                sectors,
                from,
            } => write!(
                f,
                "Io::Copy {{ vol: {vol:?}.into(), sector: {sector}, sectors: {sectors}, from: {from:?}.into() }}"
            ),
        }
    }
}

/// One step of a run. Printed (`{:?}`) as Rust that builds it, so a minimal failing
/// sequence can be pasted into a test.
#[derive(Clone, PartialEq, Eq)]
pub enum Op {
    /// I/Os submitted at once, each on its own handle; `latency_us[d]`: completions of
    /// device `d` are that late during the batch (so I/Os overlap and complete out of
    /// order); `crash_after`: power is lost after that many more device I/Os.
    Batch {
        ios: Vec<Io>,
        latency_us: Vec<u64>,
        crash_after: Option<u64>,
        /// `(volume, snapshot)`: the snapshot is taken while the batch's I/Os are in
        /// flight.
        snapshot: Option<(Name, Name)>,
    },
    Flush {
        vol: Name,
    },
    CreateVolume {
        vol: Name,
    },
    DeleteVolume {
        vol: Name,
    },
    Snapshot {
        vol: Name,
        snap: Name,
    },
    Clone {
        snap: Name,
        vol: Name,
    },
    Rollback {
        vol: Name,
        snap: Name,
    },
    /// Device `dev` fails (vanishes).
    FailDevice {
        dev: usize,
    },
    /// Failed device `dev` is replaced by a garbage-filled one (clean restart), which is
    /// rebuilt.
    Replace {
        dev: usize,
        garbage: u64,
    },
    /// Verify copies / parity of every allocated unit (no repair): must find nothing.
    Scrub,
    /// Power is lost now (`seed` picks which unflushed device writes survive, torn or
    /// not); the pool is reopened from what the devices hold.
    PowerLoss {
        seed: u64,
    },
    /// Clean shutdown and reopen.
    Reopen,
}

fn q(s: &str) -> String {
    format!("{s:?}.into()")
}

impl fmt::Debug for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Batch {
                ios,
                latency_us,
                crash_after,
                snapshot,
            } => write!(
                f,
                "Op::Batch {{ ios: vec!{ios:?}, latency_us: vec!{latency_us:?}, crash_after: {crash_after:?}, snapshot: {} }}",
                match snapshot {
                    Some((v, s)) => format!("Some(({}, {}))", q(v), q(s)),
                    None => "None".into(),
                }
            ),
            Op::Flush { vol } => write!(f, "Op::Flush {{ vol: {} }}", q(vol)),
            Op::CreateVolume { vol } => write!(f, "Op::CreateVolume {{ vol: {} }}", q(vol)),
            Op::DeleteVolume { vol } => write!(f, "Op::DeleteVolume {{ vol: {} }}", q(vol)),
            Op::Snapshot { vol, snap } => {
                write!(f, "Op::Snapshot {{ vol: {}, snap: {} }}", q(vol), q(snap))
            }
            Op::Clone { snap, vol } => {
                write!(f, "Op::Clone {{ snap: {}, vol: {} }}", q(snap), q(vol))
            }
            Op::Rollback { vol, snap } => {
                write!(f, "Op::Rollback {{ vol: {}, snap: {} }}", q(vol), q(snap))
            }
            Op::FailDevice { dev } => write!(f, "Op::FailDevice {{ dev: {dev} }}"),
            Op::Replace { dev, garbage } => {
                write!(f, "Op::Replace {{ dev: {dev}, garbage: {garbage} }}")
            }
            Op::Scrub => write!(f, "Op::Scrub"),
            Op::PowerLoss { seed } => write!(f, "Op::PowerLoss {{ seed: {seed} }}"),
            Op::Reopen => write!(f, "Op::Reopen"),
        }
    }
}

/// Kinds of operation, for turning them on and off per layout.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, PartialOrd, Ord)]
pub enum Kind {
    Write,
    SubBlockWrite,
    Fua,
    Zero,
    Trim,
    Flush,
    Snapshot,
    Clone,
    Rollback,
    Delete,
    CreateVolume,
    FailDevice,
    Replace,
    Scrub,
    PowerLoss,
    CrashInFlight,
    Reopen,
    Stall,
    /// A snapshot taken while writes to the volume are in flight.
    SnapshotInFlight,
    /// A failed device answers again after a power loss (with what it held when it
    /// failed), as a device behind a loose cable does: the pool must still know it
    /// missed writes.
    Revive,
    /// Writes that copy another volume's blocks ([`Io::Copy`]), for deduplicating
    /// targets. Not in [`Kind::ALL`]: it adds nothing where identical blocks are stored
    /// twice anyway, and the seeds of the other layouts stay the sequences they were.
    Duplicate,
}

impl Kind {
    pub const ALL: [Kind; 20] = [
        Kind::Write,
        Kind::SubBlockWrite,
        Kind::Fua,
        Kind::Zero,
        Kind::Trim,
        Kind::Flush,
        Kind::Snapshot,
        Kind::Clone,
        Kind::Rollback,
        Kind::Delete,
        Kind::CreateVolume,
        Kind::FailDevice,
        Kind::Replace,
        Kind::Scrub,
        Kind::PowerLoss,
        Kind::CrashInFlight,
        Kind::Reopen,
        Kind::Stall,
        Kind::SnapshotInFlight,
        Kind::Revive,
    ];
}

/// Each I/O's result: the data of a read, or the negative errno.
pub type IoResults = Vec<Result<Vec<u8>, i32>>;

/// What a [`Target`] reports when the system under test fails in a way the model does not
/// allow (an I/O error while the layout's redundancy suffices, a refused catalog change, a
/// self check that finds the metadata wrong). The system's own error is kept as the source.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// An operation of the system failed; `op` says what the target was doing.
    #[error("{op}: {source}")]
    Failed {
        op: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A volume the model holds is not in the system.
    #[error("volume {0} missing")]
    Missing(String),
    /// A rollback to a snapshot that is not an ancestor of the volume: the system refuses
    /// it, and the model skips the operation (a replayed sequence may hold such a one).
    #[error("not an ancestor: {snap} of {vol}")]
    NotAncestor { vol: String, snap: String },
    /// An I/O of the target's own (a flush, a whole-volume read) answered `-errno`.
    #[error("{what} failed: {errno}")]
    Errno { what: String, errno: i32 },
    /// The system's own checks (space accounting, metadata, scrub) found it inconsistent.
    #[error("{check}: {finding}")]
    Inconsistent {
        check: &'static str,
        finding: String,
    },
}

impl TargetError {
    /// `op` failed with the system's error `source` (for `map_err`).
    pub fn failed<E: std::error::Error + Send + Sync + 'static>(
        op: &str,
    ) -> impl FnOnce(E) -> TargetError + '_ {
        move |e| TargetError::Failed {
            op: op.to_string(),
            source: Box::new(e),
        }
    }
}

/// What the system under test does. Every method returns a [`TargetError`] when the
/// system reports a failure the model does not allow.
pub trait Target {
    /// Volume size in bytes (every volume has it).
    fn volume_size(&self) -> u64;
    /// How many devices may fail at once with no data lost (0: none).
    fn redundancy(&self) -> usize;
    fn devices(&self) -> usize;
    fn create_volume(&mut self, vol: &str) -> Result<(), TargetError>;
    fn delete_volume(&mut self, vol: &str) -> Result<(), TargetError>;
    fn snapshot(&mut self, vol: &str, snap: &str) -> Result<(), TargetError>;
    fn clone_snapshot(&mut self, snap: &str, vol: &str) -> Result<(), TargetError>;
    fn rollback(&mut self, vol: &str, snap: &str) -> Result<(), TargetError>;
    /// Submit every I/O at once (writes carry their data in `data[i]`), drain them, and
    /// return each one's result (read data for reads). With `crash_after`, every device
    /// I/O after that many fails (the moment power is lost); results are then allowed
    /// to be errors. With `snapshot`, that snapshot is created while the I/Os are in
    /// flight; its result comes second.
    fn batch(
        &mut self,
        ios: &[Io],
        data: &[Vec<u8>],
        latency_us: &[u64],
        crash_after: Option<u64>,
        snapshot: Option<(&str, &str)>,
    ) -> (IoResults, Result<(), TargetError>);
    fn flush(&mut self, vol: &str) -> Result<(), TargetError>;
    /// Read a whole volume.
    fn read_volume(&mut self, vol: &str) -> Result<Vec<u8>, TargetError>;
    fn fail_device(&mut self, dev: usize) -> Result<(), TargetError>;
    fn replace_device(&mut self, dev: usize, garbage: u64) -> Result<(), TargetError>;
    fn scrub(&mut self) -> Result<(), TargetError>;
    fn power_loss(&mut self, seed: u64) -> Result<(), TargetError>;
    fn reopen(&mut self) -> Result<(), TargetError>;
    /// Anything the system can check about itself (space accounting, metadata).
    fn self_check(&mut self) -> Result<(), TargetError>;
}

/// The model of every live volume, and the checker.
#[derive(Default)]
pub struct Model {
    pub vols: BTreeMap<Name, VolModel>,
    next_lineage: u32,
    next_gen: u64,
    /// Lineages of deleted volumes (for the message when their data shows up).
    dead: Vec<u32>,
    /// Devices failed now.
    pub failed: Vec<usize>,
}

impl Model {
    fn lineage(&mut self) -> u32 {
        self.next_lineage += 1;
        self.next_lineage
    }

    fn gen(&mut self) -> u64 {
        self.next_gen += 1;
        self.next_gen
    }

    /// Everything acknowledged to `only` (a FLUSH of that volume), or to every volume (a
    /// catalog change is a checkpoint, a clean shutdown syncs everything), is durable.
    fn durable_point(&mut self, only: Option<&str>) {
        for (_, v) in self
            .vols
            .iter_mut()
            .filter(|(n, _)| only.is_none_or(|o| o == n.as_str()))
        {
            for s in &mut v.sectors {
                s.crash.clone_from(&s.now);
            }
        }
    }

    fn apply_write(&mut self, vol: &str, sector: u64, vals: &[Val], acked: bool, fua: bool) {
        let v = self.vols.get_mut(vol).expect("checked");
        for (i, &val) in vals.iter().enumerate() {
            let s = &mut v.sectors[usize_of(sector + i as u64)];
            if acked {
                s.now = vec![val];
                if fua {
                    // Durable on acknowledgement: nothing older can come back.
                    s.crash = vec![val];
                } else {
                    add(&mut s.crash, val);
                }
            } else {
                // Failed or cut off by the power loss: the old value or the new one.
                add(&mut s.now, val);
                add(&mut s.crash, val);
            }
        }
    }

    fn apply_trim(&mut self, vol: &str, sector: u64, sectors: u64) {
        let v = self.vols.get_mut(vol).expect("checked");
        for s in &mut v.sectors[usize_of(sector)..usize_of(sector + sectors)] {
            add(&mut s.now, Val::Zero);
            add(&mut s.crash, Val::Zero);
        }
    }

    /// Check `got` (sectors from `sector` of `vol`) against what may be read now, or
    /// after a power loss (`crash`); narrow the model to what was read.
    fn check(&mut self, vol: &str, sector: u64, got: &[u8], crash: bool) -> Result<(), Mismatch> {
        let dead = self.dead.clone();
        let vm = self.vols.get_mut(vol).expect("checked");
        let my = vm.lineage;
        let mut first: Option<Mismatch> = None;
        let mut bad = 0;
        for (i, data) in got.chunks(SECTOR).enumerate() {
            let at = sector + i as u64;
            let s = &mut vm.sectors[usize_of(at)];
            let allowed = if crash { &s.crash } else { &s.now };
            let seen = decode(data, at);
            let ok = matches!(seen, Seen::Val(v) if allowed.contains(&v));
            if ok {
                let Seen::Val(v) = seen else { unreachable!() };
                s.now = vec![v];
                if crash {
                    s.crash = vec![v];
                }
                continue;
            }
            bad += 1;
            if first.is_none() {
                let read = match seen {
                    Seen::Garbage => BadRead::Garbage,
                    Seen::Misplaced {
                        lineage,
                        sector,
                        gen,
                    } if lineage != my => BadRead::Another {
                        lineage,
                        gen,
                        from_sector: Some(sector),
                    },
                    Seen::Misplaced {
                        lineage,
                        sector,
                        gen,
                    } => BadRead::Misplaced {
                        lineage,
                        gen,
                        from_sector: sector,
                    },
                    Seen::Val(Val::Stamp { lineage, gen }) if dead.contains(&lineage) => {
                        BadRead::Deleted { lineage, gen }
                    }
                    Seen::Val(Val::Stamp { lineage, gen })
                        if !allowed.iter().any(
                            |v| matches!(v, Val::Stamp { lineage: l, .. } if *l == lineage),
                        ) && lineage != my =>
                    {
                        BadRead::Another {
                            lineage,
                            gen,
                            from_sector: None,
                        }
                    }
                    Seen::Val(v) => BadRead::Stale(v),
                };
                first = Some(Mismatch {
                    vol: vol.to_string(),
                    lineage: my,
                    sector: at,
                    read,
                    allowed: allowed.clone(),
                    after_power_loss: crash,
                    bad_sectors: 0,
                });
            }
        }
        match first {
            None => Ok(()),
            Some(m) => Err(Mismatch {
                bad_sectors: bad,
                ..m
            }),
        }
    }
}

/// What a sector read back that the model does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BadRead {
    /// Not zeros and not a whole stamp.
    Garbage,
    /// Another volume's data; `from_sector` when it was written at another offset too.
    Another {
        lineage: u32,
        gen: u64,
        from_sector: Option<u64>,
    },
    /// This volume's data, written at another offset.
    Misplaced {
        lineage: u32,
        gen: u64,
        from_sector: u64,
    },
    /// A deleted volume's data.
    Deleted { lineage: u32, gen: u64 },
    /// A value this volume wrote but may not hold now: a lost or stale write.
    Stale(Val),
}

impl fmt::Display for BadRead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            BadRead::Garbage => write!(f, "garbage (not zeros, not a stamp)"),
            BadRead::Another {
                lineage,
                gen,
                from_sector: Some(sector),
            } => write!(
                f,
                "ANOTHER volume's data, the stamp of its sector {sector} (L{lineage}g{gen}): misplaced data"
            ),
            BadRead::Another {
                lineage,
                gen,
                from_sector: None,
            } => write!(f, "ANOTHER volume's data (L{lineage}g{gen})"),
            BadRead::Misplaced {
                lineage,
                gen,
                from_sector,
            } => write!(
                f,
                "the stamp of sector {from_sector} (L{lineage}g{gen}): misplaced data"
            ),
            BadRead::Deleted { lineage, gen } => {
                write!(f, "a DELETED volume's data (L{lineage}g{gen})")
            }
            BadRead::Stale(v) => write!(f, "{v:?}, a value it may not hold (lost or stale write)"),
        }
    }
}

/// A read the model does not allow: its first bad sector, and how many were bad.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub vol: String,
    /// The volume's lineage.
    pub lineage: u32,
    pub sector: u64,
    pub read: BadRead,
    /// What the sector may hold.
    pub allowed: Vec<Val>,
    /// Checked against what may be read after a power loss.
    pub after_power_loss: bool,
    pub bad_sectors: usize,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (L{}) sector {} (byte {}) reads {}; allowed {}{:?} [{} bad sectors in this read]",
            self.vol,
            self.lineage,
            self.sector,
            self.sector * SECTOR as u64,
            self.read,
            if self.after_power_loss {
                "after power loss "
            } else {
                ""
            },
            self.allowed,
            self.bad_sectors
        )
    }
}

impl std::error::Error for Mismatch {}

/// Why a step of a run failed: what the system reported, or what it was caught doing.
#[derive(Debug, thiserror::Error)]
pub enum Violation {
    /// The system under test reported a failure the model does not allow.
    #[error(transparent)]
    Target(#[from] TargetError),
    /// An I/O of a batch failed with no power loss to excuse it.
    #[error("{io:?} failed: {errno}")]
    IoFailed { io: Io, errno: i32 },
    /// A volume read back what the model does not allow.
    #[error(transparent)]
    Mismatch(#[from] Box<Mismatch>),
    /// A read inside a batch returned what the model does not allow.
    #[error("read in batch: {0}")]
    ReadInBatch(#[source] Box<Mismatch>),
    /// The scrub after a power loss's recovery found the redundancy wrong.
    #[error("after power loss: {0}")]
    AfterPowerLoss(#[source] TargetError),
    /// The system under test panicked (the message).
    #[error("panicked: {0}")]
    Panicked(String),
}

impl Violation {
    /// The class of a failure, for the shrinker: a smaller sequence must fail the same
    /// way (the sector and the values may differ).
    fn kind(&self) -> String {
        let target = |e: &TargetError| match e {
            TargetError::Failed { op, .. } => format!("failed: {op}"),
            TargetError::Missing(_) => "missing volume".to_string(),
            TargetError::NotAncestor { .. } => "not an ancestor".to_string(),
            TargetError::Errno { what, .. } => {
                format!("errno: {}", what.replace(|c: char| c.is_ascii_digit(), ""))
            }
            TargetError::Inconsistent { check, .. } => format!("inconsistent: {check}"),
        };
        let read = |m: &Mismatch| match m.read {
            BadRead::Garbage => "garbage",
            BadRead::Another { .. } => "ANOTHER",
            BadRead::Misplaced { .. } => "misplaced",
            BadRead::Deleted { .. } => "DELETED",
            BadRead::Stale(_) => "lost or stale",
        };
        match self {
            Violation::Target(e) => target(e),
            Violation::IoFailed { .. } => "io failed".to_string(),
            Violation::Mismatch(m) => read(m).to_string(),
            Violation::ReadInBatch(m) => format!("in batch: {}", read(m)),
            Violation::AfterPowerLoss(e) => format!("after power loss: {}", target(e)),
            Violation::Panicked(_) => "panicked".to_string(),
        }
    }
}

/// The knobs of a run.
#[derive(Clone, Debug)]
pub struct Config {
    pub steps: usize,
    pub enabled: Vec<Kind>,
    /// Live volumes and snapshots at most (the pool must hold them all written whole).
    pub max_volumes: usize,
    /// Print every step.
    pub verbose: bool,
}

/// Generates the next operation from the model's state and a seeded [`Rng`].
pub struct Generator {
    rng: Rng,
    cfg: Config,
    next_name: u32,
}

impl Generator {
    pub fn new(seed: u64, cfg: Config) -> Generator {
        Generator {
            rng: Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1),
            cfg,
            next_name: 0,
        }
    }

    fn on(&self, k: Kind) -> bool {
        self.cfg.enabled.contains(&k)
    }

    fn pick<'a>(&mut self, v: &'a [&'a Name]) -> Option<&'a Name> {
        if v.is_empty() {
            None
        } else {
            Some(v[usize_of(self.rng.below(v.len() as u64))])
        }
    }

    fn name(&mut self, prefix: &str) -> Name {
        self.next_name += 1;
        format!("{prefix}{}", self.next_name)
    }

    fn io(&mut self, m: &Model, vol: &Name, taken: &[(Name, u64, u64)], vsize: u64) -> Option<Io> {
        let total = vsize / SECTOR as u64;
        let r = &mut self.rng;
        // Shapes: sub-block, aligned blocks, across a unit boundary, a whole unit.
        let (sector, sectors) = match r.below(8) {
            0..=1 if self.cfg.enabled.contains(&Kind::SubBlockWrite) => {
                let n = 1 + r.below(12);
                (r.below(total - n), n)
            }
            2 => (128 * r.below(total / 128), 128),
            _ => {
                let n = 8 * (1 + r.below(6));
                (8 * r.below((total - n) / 8), n)
            }
        };
        // Overlapping I/Os of one batch would have no defined order: keep them apart.
        if taken
            .iter()
            .any(|(v, s, n)| v == vol && sector < s + n && *s < sector + sectors)
        {
            return None;
        }
        let snapshot = m.vols[vol].snapshot;
        let k = self.rng.below(20);
        let vol = vol.clone();
        Some(match k {
            0..=3 => Io::Read {
                vol,
                sector,
                sectors,
            },
            _ if snapshot => Io::Read {
                vol,
                sector,
                sectors,
            },
            4 if self.on(Kind::Zero) => Io::Zero {
                vol,
                sector,
                sectors,
                may_unmap: self.rng.below(2) == 0,
            },
            5 if self.on(Kind::Trim) => Io::Trim {
                vol,
                sector,
                sectors,
            },
            _ if self.on(Kind::Duplicate) && self.rng.below(2) == 0 => {
                let others: Vec<&Name> = m.vols.keys().filter(|n| **n != vol).collect();
                match self.pick(&others).cloned() {
                    Some(from) => Io::Copy {
                        vol,
                        sector,
                        sectors,
                        from,
                    },
                    None => Io::Write {
                        vol,
                        sector,
                        sectors,
                        fua: false,
                    },
                }
            }
            _ if self.on(Kind::Write) => Io::Write {
                vol,
                sector,
                sectors,
                fua: self.on(Kind::Fua) && self.rng.below(6) == 0,
            },
            _ => Io::Read {
                vol,
                sector,
                sectors,
            },
        })
    }

    /// The next operation for `m` on a target with `devices` devices of which
    /// `redundancy` may fail.
    pub fn next(&mut self, m: &Model, t: &dyn Target) -> Op {
        let names: Vec<&Name> = m.vols.keys().collect();
        let vols: Vec<&Name> = names
            .iter()
            .copied()
            .filter(|n| !m.vols[*n].snapshot)
            .collect();
        let snaps: Vec<&Name> = names
            .iter()
            .copied()
            .filter(|n| m.vols[*n].snapshot)
            .collect();
        let room = names.len() < self.cfg.max_volumes;
        loop {
            let k = self.rng.below(100);
            let op = match k {
                0..=54 if !names.is_empty() => {
                    let n = 1 + usize_of(self.rng.below(6));
                    let mut ios = Vec::new();
                    let mut taken = Vec::new();
                    for _ in 0..n {
                        let v = self.pick(&names).expect("not empty").clone();
                        if let Some(io) = self.io(m, &v, &taken, t.volume_size()) {
                            let (s, c) = io.range();
                            taken.push((v, s, c));
                            ios.push(io);
                        }
                    }
                    let latency_us = if self.on(Kind::Stall) && self.rng.below(2) == 0 {
                        (0..t.devices()).map(|_| self.rng.below(400)).collect()
                    } else {
                        Vec::new()
                    };
                    let crash_after = (self.on(Kind::CrashInFlight) && self.rng.below(25) == 0)
                        .then(|| self.rng.below(40));
                    let snapshot = if self.on(Kind::SnapshotInFlight)
                        && crash_after.is_none()
                        && room
                        && self.rng.below(12) == 0
                    {
                        let busy: Vec<&Name> = vols
                            .iter()
                            .copied()
                            .filter(|v| ios.iter().any(|io| io.vol() == *v))
                            .collect();
                        self.pick(&busy).cloned().map(|v| (v, self.name("s")))
                    } else {
                        None
                    };
                    Op::Batch {
                        ios,
                        latency_us,
                        crash_after,
                        snapshot,
                    }
                }
                55..=64 if self.on(Kind::Flush) && !names.is_empty() => Op::Flush {
                    vol: self.pick(&names).expect("not empty").clone(),
                },
                65..=67 if self.on(Kind::CreateVolume) && room => Op::CreateVolume {
                    vol: self.name("v"),
                },
                68..=69 if self.on(Kind::Delete) && names.len() > 1 => Op::DeleteVolume {
                    vol: self.pick(&names).expect("not empty").clone(),
                },
                70..=73 if self.on(Kind::Snapshot) && room && !vols.is_empty() => Op::Snapshot {
                    vol: self.pick(&vols).expect("not empty").clone(),
                    snap: self.name("s"),
                },
                74..=75 if self.on(Kind::Clone) && room && !snaps.is_empty() => Op::Clone {
                    snap: self.pick(&snaps).expect("not empty").clone(),
                    vol: self.name("c"),
                },
                76..=77 if self.on(Kind::Rollback) && !vols.is_empty() && !snaps.is_empty() => {
                    Op::Rollback {
                        vol: self.pick(&vols).expect("not empty").clone(),
                        snap: self.pick(&snaps).expect("not empty").clone(),
                    }
                }
                78..=79 if self.on(Kind::FailDevice) && m.failed.len() < t.redundancy() => {
                    let healthy: Vec<usize> =
                        (0..t.devices()).filter(|d| !m.failed.contains(d)).collect();
                    Op::FailDevice {
                        dev: healthy[usize_of(self.rng.below(healthy.len() as u64))],
                    }
                }
                80..=83 if self.on(Kind::Replace) && !m.failed.is_empty() => Op::Replace {
                    dev: m.failed[usize_of(self.rng.below(m.failed.len() as u64))],
                    garbage: self.rng.next(),
                },
                84..=85 if self.on(Kind::Scrub) => Op::Scrub,
                86..=90 if self.on(Kind::PowerLoss) => Op::PowerLoss {
                    seed: self.rng.next(),
                },
                91 if self.on(Kind::Reopen) => Op::Reopen,
                92..=99 if self.on(Kind::CreateVolume) && names.is_empty() => Op::CreateVolume {
                    vol: self.name("v"),
                },
                _ => continue,
            };
            return op;
        }
    }
}

/// Which snapshot `vol` may roll back to: one it reads through (the target decides;
/// the model only needs the snapshot to exist). Returns whether the op applies.
fn valid(m: &Model, op: &Op) -> bool {
    let has = |n: &Name| m.vols.contains_key(n);
    let is_snap = |n: &Name| m.vols.get(n).is_some_and(|v| v.snapshot);
    match op {
        Op::Batch { ios, snapshot, .. } => {
            ios.iter().all(|io| {
                let (s, n) = io.range();
                has(io.vol())
                    && s + n <= m.vols[io.vol()].sectors()
                    && (matches!(io, Io::Read { .. }) || !is_snap(io.vol()))
                    && match io {
                        Io::Copy { from, .. } => has(from) && s + n <= m.vols[from].sectors(),
                        _ => true,
                    }
            }) && snapshot
                .as_ref()
                .is_none_or(|(v, s)| has(v) && !is_snap(v) && !has(s))
        }
        Op::Flush { vol } => has(vol),
        Op::CreateVolume { vol } => !has(vol),
        Op::DeleteVolume { vol } => has(vol),
        Op::Snapshot { vol, snap } => has(vol) && !is_snap(vol) && !has(snap),
        Op::Clone { snap, vol } => is_snap(snap) && !has(vol),
        Op::Rollback { vol, snap } => has(vol) && !is_snap(vol) && is_snap(snap),
        Op::FailDevice { dev } => !m.failed.contains(dev),
        Op::Replace { dev, .. } => m.failed.contains(dev),
        Op::Scrub | Op::PowerLoss { .. } | Op::Reopen => true,
    }
}

/// Carry out `op` on `t` and the model, then check every volume. `Ok(false)`: the op did
/// not apply (skipped in a replay).
pub fn step(m: &mut Model, t: &mut dyn Target, op: &Op) -> Result<bool, Violation> {
    if !valid(m, op) {
        return Ok(false);
    }
    if let Op::FailDevice { .. } = op {
        if m.failed.len() >= t.redundancy() {
            return Ok(false);
        }
    }
    if let Op::Rollback { vol, snap } = op {
        // A rollback target must be an ancestor; the target says no otherwise, and the
        // replayed sequence skips it.
        match t.rollback(vol, snap) {
            Ok(()) => {
                let mut snapm = m.vols[snap].clone();
                snapm.snapshot = false;
                snapm.lineage = m.vols[vol].lineage;
                m.vols.insert(vol.clone(), snapm);
                m.durable_point(None);
            }
            Err(TargetError::NotAncestor { .. }) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
        check_all(m, t, false)?;
        return Ok(true);
    }
    let mut crashed = false;
    match op {
        Op::Batch {
            ios,
            latency_us,
            crash_after,
            snapshot,
        } => {
            let mut data = Vec::with_capacity(ios.len());
            let mut vals = Vec::with_capacity(ios.len());
            for io in ios {
                match io {
                    Io::Write {
                        vol,
                        sector,
                        sectors,
                        ..
                    } => {
                        let lineage = m.vols[vol].lineage;
                        let v: Vec<Val> = (0..*sectors)
                            .map(|_| Val::Stamp {
                                lineage,
                                gen: m.gen(),
                            })
                            .collect();
                        let mut d = Vec::with_capacity(usize_of(*sectors) * SECTOR);
                        for (i, val) in v.iter().enumerate() {
                            d.extend_from_slice(&stamp(*val, sector + i as u64));
                        }
                        data.push(d);
                        vals.push(v);
                    }
                    Io::Copy {
                        vol,
                        sector,
                        sectors,
                        from,
                    } => {
                        // What `from` reads now where that is one value (the bytes it
                        // holds), else a write of this volume's own.
                        let lineage = m.vols[vol].lineage;
                        let known: Vec<Option<Val>> = (0..*sectors)
                            .map(
                                |i| match m.vols[from].sectors[usize_of(sector + i)].now[..] {
                                    [one] => Some(one),
                                    _ => None,
                                },
                            )
                            .collect();
                        let v: Vec<Val> = known
                            .into_iter()
                            .map(|k| {
                                k.unwrap_or_else(|| Val::Stamp {
                                    lineage,
                                    gen: m.gen(),
                                })
                            })
                            .collect();
                        let mut d = Vec::with_capacity(usize_of(*sectors) * SECTOR);
                        for (i, val) in v.iter().enumerate() {
                            d.extend_from_slice(&stamp(*val, sector + i as u64));
                        }
                        data.push(d);
                        vals.push(v);
                    }
                    Io::Zero { sectors, .. } => {
                        data.push(Vec::new());
                        vals.push(vec![Val::Zero; usize_of(*sectors)]);
                    }
                    _ => {
                        data.push(Vec::new());
                        vals.push(Vec::new());
                    }
                }
            }
            if let Some((vol, snap)) = snapshot {
                // Everything acknowledged before is in the snapshot (create is a
                // checkpoint); what is in flight to that volume may or may not be, per
                // sector.
                m.durable_point(None);
                let mut sm = m.vols[vol].clone();
                sm.snapshot = true;
                for (io, v) in ios.iter().zip(&vals) {
                    if io.vol() != vol {
                        continue;
                    }
                    let (first, n) = io.range();
                    for i in 0..n {
                        let sec = &mut sm.sectors[usize_of(first + i)];
                        let val = match io {
                            Io::Write { .. } | Io::Zero { .. } | Io::Copy { .. } => v[usize_of(i)],
                            Io::Trim { .. } => Val::Zero,
                            Io::Read { .. } => continue,
                        };
                        add(&mut sec.now, val);
                        sec.crash.clone_from(&sec.now);
                    }
                }
                m.vols.insert(snap.clone(), sm);
            }
            let (res, snapped) = t.batch(
                ios,
                &data,
                latency_us,
                *crash_after,
                snapshot.as_ref().map(|(v, s)| (v.as_str(), s.as_str())),
            );
            snapped?;
            let mut err = None;
            for ((io, r), v) in ios.iter().zip(&res).zip(&vals) {
                let ok = r.is_ok();
                if !ok && crash_after.is_none() && err.is_none() {
                    err = r.as_ref().err().map(|&errno| Violation::IoFailed {
                        io: io.clone(),
                        errno,
                    });
                }
                match io {
                    Io::Write {
                        vol, sector, fua, ..
                    } => m.apply_write(vol, *sector, v, ok, *fua),
                    Io::Zero { vol, sector, .. } | Io::Copy { vol, sector, .. } => {
                        m.apply_write(vol, *sector, v, ok, false);
                    }
                    Io::Trim {
                        vol,
                        sector,
                        sectors,
                    } => m.apply_trim(vol, *sector, *sectors),
                    Io::Read { vol, sector, .. } => {
                        if let Ok(got) = r {
                            if crash_after.is_none() {
                                // Reads of one batch never overlap its writes.
                                m.check(vol, *sector, got, false)
                                    .map_err(|e| Violation::ReadInBatch(Box::new(e)))?;
                            }
                        }
                    }
                }
            }
            if let Some(e) = err {
                return Err(e);
            }
            if crash_after.is_some() {
                t.power_loss(0x5eed)?;
                crashed = true;
            }
        }
        Op::Flush { vol } => {
            t.flush(vol)?;
            m.durable_point(Some(vol));
        }
        Op::CreateVolume { vol } => {
            t.create_volume(vol)?;
            let lineage = m.lineage();
            let sectors = t.volume_size() / SECTOR as u64;
            m.vols.insert(vol.clone(), VolModel::new(lineage, sectors));
            m.durable_point(None);
        }
        Op::DeleteVolume { vol } => {
            t.delete_volume(vol)?;
            let v = m.vols.remove(vol).expect("valid");
            // Its own writes are dead unless a clone or snapshot still holds them (then
            // that volume's model allows them, which `check` looks at first).
            m.dead.push(v.lineage);
            m.durable_point(None);
        }
        Op::Snapshot { vol, snap } => {
            t.snapshot(vol, snap)?;
            m.durable_point(None);
            let mut s = m.vols[vol].clone();
            s.snapshot = true;
            m.vols.insert(snap.clone(), s);
        }
        Op::Clone { snap, vol } => {
            t.clone_snapshot(snap, vol)?;
            m.durable_point(None);
            let mut c = m.vols[snap].clone();
            c.snapshot = false;
            c.lineage = m.lineage();
            m.vols.insert(vol.clone(), c);
        }
        Op::Rollback { .. } => unreachable!(),
        Op::FailDevice { dev } => {
            t.fail_device(*dev)?;
            m.failed.push(*dev);
        }
        Op::Replace { dev, garbage } => {
            t.replace_device(*dev, *garbage)?;
            m.failed.retain(|d| d != dev);
            // A clean shutdown came first: everything is durable.
            m.durable_point(None);
        }
        Op::Scrub => {
            if m.failed.is_empty() {
                t.scrub()?;
            }
        }
        Op::PowerLoss { seed } => {
            t.power_loss(*seed)?;
            crashed = true;
        }
        Op::Reopen => {
            t.reopen()?;
            m.durable_point(None);
        }
    }
    check_all(m, t, crashed)?;
    if crashed {
        // Parity must be right again after the reopen's recovery.
        if m.failed.is_empty() && t.redundancy() > 0 {
            t.scrub().map_err(Violation::AfterPowerLoss)?;
        }
    }
    Ok(true)
}

fn check_all(m: &mut Model, t: &mut dyn Target, crash: bool) -> Result<(), Violation> {
    let names: Vec<Name> = m.vols.keys().cloned().collect();
    for n in names {
        let got = t.read_volume(&n)?;
        m.check(&n, 0, &got, crash).map_err(Box::new)?;
    }
    Ok(t.self_check()?)
}

/// How a run failed: the operations it ran (the last one failed) and why.
#[derive(Debug)]
pub struct Failure {
    pub ops: Vec<Op>,
    /// Index of the failing operation in the sequence run (a replay skips operations
    /// that no longer apply, so this is not `ops.len() - 1` there).
    pub at: usize,
    pub error: Violation,
}

/// Run `ops` (a replay) or `cfg.steps` generated ones (`ops == None`) on a fresh target.
pub fn run(
    seed: u64,
    cfg: &Config,
    make: &mut dyn FnMut() -> Box<dyn Target>,
    ops: Option<&[Op]>,
) -> Result<Vec<Op>, Failure> {
    let mut t = make();
    let mut m = Model::default();
    let mut gen = Generator::new(seed, cfg.clone());
    let mut done = Vec::new();
    let n = ops.map_or(cfg.steps, <[Op]>::len);
    for i in 0..n {
        let op = match ops {
            Some(o) => o[i].clone(),
            None => gen.next(&m, t.as_ref()),
        };
        let t0 = std::time::Instant::now();
        // A panic inside the system under test is a failure of this sequence too.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            step(&mut m, t.as_mut(), &op)
        }))
        .unwrap_or_else(|p| {
            Err(Violation::Panicked(
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
                    .unwrap_or_default(),
            ))
        });
        if cfg.verbose {
            eprintln!("step {i} ({} ms): {op:?}", t0.elapsed().as_millis());
        }
        match r {
            Ok(true) => done.push(op),
            Ok(false) => {}
            Err(error) => {
                done.push(op);
                return Err(Failure {
                    ops: done,
                    at: i,
                    error,
                });
            }
        }
    }
    Ok(done)
}

/// Shrink a failing sequence: drop chunks of operations (halves, quarters, ... single
/// ones), then I/Os inside batches, keeping every change after which `fails` still
/// holds. Bounded by `budget` replays.
pub fn minimise(ops: Vec<Op>, budget: usize, fails: &mut dyn FnMut(&[Op]) -> bool) -> Vec<Op> {
    let mut cur = ops;
    let mut tries = 0;
    let mut chunk = cur.len().div_ceil(2).max(1);
    loop {
        let mut i = 0;
        let mut progress = false;
        while i < cur.len() && tries < budget {
            // The last op is where it failed: keep it.
            let end = (i + chunk).min(cur.len() - 1);
            if end <= i {
                break;
            }
            let mut cand = cur[..i].to_vec();
            cand.extend_from_slice(&cur[end..]);
            tries += 1;
            if fails(&cand) {
                cur = cand;
                progress = true;
            } else {
                i += chunk;
            }
        }
        if tries >= budget || (chunk == 1 && !progress) {
            break;
        }
        if !progress {
            chunk = chunk.div_ceil(2);
        }
    }
    // Then the I/Os of each batch, and the stall / crash knobs.
    let mut i = 0;
    while i < cur.len() && tries < budget {
        if let Op::Batch {
            ios,
            latency_us,
            crash_after,
            snapshot,
        } = cur[i].clone()
        {
            if !latency_us.is_empty() {
                let mut cand = cur.clone();
                cand[i] = Op::Batch {
                    ios: ios.clone(),
                    latency_us: Vec::new(),
                    crash_after,
                    snapshot,
                };
                tries += 1;
                if fails(&cand) {
                    cur = cand;
                }
            }
            let mut j = 0;
            loop {
                let Op::Batch {
                    ios,
                    latency_us,
                    crash_after,
                    snapshot,
                } = cur[i].clone()
                else {
                    unreachable!()
                };
                if j >= ios.len() || ios.len() == 1 || tries >= budget {
                    break;
                }
                let mut fewer = ios.clone();
                fewer.remove(j);
                let mut cand = cur.clone();
                cand[i] = Op::Batch {
                    ios: fewer,
                    latency_us,
                    crash_after,
                    snapshot,
                };
                tries += 1;
                if fails(&cand) {
                    cur = cand;
                } else {
                    j += 1;
                }
            }
        }
        i += 1;
    }
    cur
}

/// Seeds to run: `TESSERA_MC_SEED=N` one (verbose), else `TESSERA_MC_SEEDS=N` (or
/// `default`) starting at `TESSERA_MC_FIRST_SEED` (or `first`).
pub fn seeds_from_env(first: u64, default: u64) -> (Vec<u64>, bool) {
    let first = std::env::var("TESSERA_MC_FIRST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(first);
    if let Some(s) = std::env::var("TESSERA_MC_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return (vec![s], true);
    }
    let n = std::env::var("TESSERA_MC_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    ((first..first + n).collect(), false)
}

/// A seed that failed, shrunk to a minimal sequence: what [`check_seeds`] returns. Its
/// `Display` is the report (the seed to replay, the error, the minimal sequence).
#[derive(Debug)]
pub struct Shrunk {
    /// What was checked (e.g. the layout's name).
    pub what: String,
    pub seed: u64,
    /// How many operations the failing run carried out.
    pub ops_run: usize,
    pub error: Violation,
    /// The smallest sequence found that fails the same way, and how it fails.
    pub minimal: Vec<Op>,
    pub minimal_error: Option<Violation>,
}

impl fmt::Display for Shrunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "model check {}: seed {} failed after {} ops: {}",
            self.what, self.seed, self.ops_run, self.error
        )?;
        write!(
            f,
            "replay: TESSERA_MC_SEED={}; minimal sequence ({} ops, fails with: ",
            self.seed,
            self.minimal.len()
        )?;
        match &self.minimal_error {
            Some(e) => writeln!(f, "{e}):")?,
            // The minimal sequence passed when run once more: the failure is not
            // reproducible from the sequence alone (timing).
            None => writeln!(f, "the same, not reproduced by the replay):")?,
        }
        for op in &self.minimal {
            writeln!(f, "    {op:?},")?;
        }
        Ok(())
    }
}

impl std::error::Error for Shrunk {}

/// Run `seeds`; on the first failure shrink it, print the seed, the error and the
/// minimal replayable sequence, and return it as the error.
pub fn check_seeds(
    what: &str,
    seeds: &[u64],
    cfg: &Config,
    make: &mut dyn FnMut() -> Box<dyn Target>,
) -> Result<usize, Box<Shrunk>> {
    let mut steps = 0;
    for &seed in seeds {
        match run(seed, cfg, make, None) {
            Ok(done) => steps += done.len(),
            Err(f) => {
                eprintln!(
                    "model check {what}: seed {seed} failed after {} ops: {}; shrinking...",
                    f.ops.len(),
                    f.error
                );
                let quiet = Config {
                    verbose: false,
                    ..cfg.clone()
                };
                let kind = f.error.kind();
                let mut fails = |ops: &[Op]| match run(seed, &quiet, make, Some(ops)) {
                    Ok(_) => false,
                    // The same kind of failure (the sector may differ).
                    Err(g) => g.error.kind() == kind && g.at + 1 == ops.len(),
                };
                let minimal = minimise(f.ops.clone(), 300, &mut fails);
                let minimal_error = run(seed, &quiet, make, Some(&minimal))
                    .err()
                    .map(|g| g.error);
                let shrunk = Shrunk {
                    what: what.to_string(),
                    seed,
                    ops_run: f.ops.len(),
                    error: f.error,
                    minimal,
                    minimal_error,
                };
                eprintln!("{shrunk}");
                return Err(Box::new(shrunk));
            }
        }
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_decode_and_say_where_they_belong() {
        let v = Val::Stamp { lineage: 3, gen: 9 };
        let s = stamp(v, 17);
        assert_eq!(decode(&s, 17), Seen::Val(v));
        assert!(matches!(decode(&s, 18), Seen::Misplaced { sector: 17, .. }));
        let mut torn = s;
        torn[300] ^= 1;
        assert_eq!(decode(&torn, 17), Seen::Garbage);
        assert_eq!(decode(&[0u8; SECTOR], 5), Seen::Val(Val::Zero));
    }

    #[test]
    fn model_allows_durable_or_later_after_power_loss() {
        let mut m = Model::default();
        m.vols.insert("a".into(), VolModel::new(1, 4));
        let g = |gen| Val::Stamp { lineage: 1, gen };
        m.apply_write("a", 0, &[g(1)], true, false);
        m.durable_point(None);
        m.apply_write("a", 0, &[g(2)], true, false);
        m.apply_write("a", 0, &[g(3)], true, false);
        for ok in [g(1), g(2), g(3)] {
            let mut m2 = Model {
                vols: m.vols.clone(),
                ..Model::default()
            };
            assert!(m2.check("a", 0, &stamp(ok, 0), true).is_ok());
        }
        assert!(
            m.check("a", 0, &[0u8; SECTOR], true).is_err(),
            "durable value lost"
        );
        assert!(
            m.check("a", 0, &stamp(g(2), 0), false).is_err(),
            "stale read"
        );
        let other = Val::Stamp { lineage: 2, gen: 1 };
        let e = m.check("a", 0, &stamp(other, 0), true).unwrap_err();
        assert!(matches!(e.read, BadRead::Another { .. }), "{e}");
        assert!(e.to_string().contains("ANOTHER"), "{e}");
    }

    /// Volumes in memory, right unless `lose_sector` is set: then that sector of every
    /// volume silently keeps what it had (a write acknowledged and lost).
    struct MemTarget {
        vols: BTreeMap<String, Vec<u8>>,
        lose_sector: Option<u64>,
    }

    const MEM_VOL: u64 = 64 << 10;

    impl Target for MemTarget {
        fn volume_size(&self) -> u64 {
            MEM_VOL
        }
        fn redundancy(&self) -> usize {
            0
        }
        fn devices(&self) -> usize {
            1
        }
        fn create_volume(&mut self, vol: &str) -> Result<(), TargetError> {
            self.vols.insert(vol.into(), vec![0; usize_of(MEM_VOL)]);
            Ok(())
        }
        fn delete_volume(&mut self, vol: &str) -> Result<(), TargetError> {
            self.vols.remove(vol);
            Ok(())
        }
        fn snapshot(&mut self, vol: &str, snap: &str) -> Result<(), TargetError> {
            let v = self.read_volume(vol)?;
            self.vols.insert(snap.into(), v);
            Ok(())
        }
        fn clone_snapshot(&mut self, snap: &str, vol: &str) -> Result<(), TargetError> {
            self.snapshot(snap, vol)
        }
        fn rollback(&mut self, vol: &str, snap: &str) -> Result<(), TargetError> {
            Err(TargetError::NotAncestor {
                vol: vol.into(),
                snap: snap.into(),
            })
        }
        fn batch(
            &mut self,
            ios: &[Io],
            data: &[Vec<u8>],
            _latency_us: &[u64],
            _crash_after: Option<u64>,
            _snapshot: Option<(&str, &str)>,
        ) -> (IoResults, Result<(), TargetError>) {
            let mut res = Vec::new();
            for (io, d) in ios.iter().zip(data) {
                let (first, n) = io.range();
                let v = self.vols.get_mut(io.vol()).expect("the model knows it");
                let bytes = usize_of(first) * SECTOR..usize_of(first + n) * SECTOR;
                match io {
                    Io::Read { .. } => {
                        res.push(Ok(v[bytes].to_vec()));
                        continue;
                    }
                    Io::Write { .. } | Io::Copy { .. } => v[bytes].copy_from_slice(d),
                    Io::Zero { .. } | Io::Trim { .. } => v[bytes].fill(0),
                }
                if let Some(lost) = self.lose_sector.filter(|s| (first..first + n).contains(s)) {
                    // The bug: that sector goes back to zeros after the write.
                    v[usize_of(lost) * SECTOR..usize_of(lost + 1) * SECTOR].fill(0);
                }
                res.push(Ok(Vec::new()));
            }
            (res, Ok(()))
        }
        fn flush(&mut self, _vol: &str) -> Result<(), TargetError> {
            Ok(())
        }
        fn read_volume(&mut self, vol: &str) -> Result<Vec<u8>, TargetError> {
            self.vols
                .get(vol)
                .cloned()
                .ok_or_else(|| TargetError::Missing(vol.into()))
        }
        fn fail_device(&mut self, _dev: usize) -> Result<(), TargetError> {
            Ok(())
        }
        fn replace_device(&mut self, _dev: usize, _garbage: u64) -> Result<(), TargetError> {
            Ok(())
        }
        fn scrub(&mut self) -> Result<(), TargetError> {
            Ok(())
        }
        fn power_loss(&mut self, _seed: u64) -> Result<(), TargetError> {
            Ok(())
        }
        fn reopen(&mut self) -> Result<(), TargetError> {
            Ok(())
        }
        fn self_check(&mut self) -> Result<(), TargetError> {
            Ok(())
        }
    }

    fn mem_config() -> Config {
        Config {
            steps: 60,
            enabled: vec![
                Kind::Write,
                Kind::SubBlockWrite,
                Kind::Zero,
                Kind::Flush,
                Kind::Delete,
                Kind::CreateVolume,
            ],
            max_volumes: 3,
            verbose: false,
        }
    }

    /// The checker end to end: a right target passes, one that loses a sector's writes
    /// is caught as a lost write on that sector, and the sequence is shrunk to a few
    /// operations that still fail that way.
    #[test]
    fn check_seeds_catches_a_lost_write_and_shrinks_it() {
        let seeds: Vec<u64> = (1..=4).collect();
        let mut right = || {
            Box::new(MemTarget {
                vols: BTreeMap::new(),
                lose_sector: None,
            }) as Box<dyn Target>
        };
        let steps = check_seeds("mem", &seeds, &mem_config(), &mut right).expect("a right target");
        assert!(steps > 100, "{steps} steps ran");

        let mut lossy = || {
            Box::new(MemTarget {
                vols: BTreeMap::new(),
                lose_sector: Some(3),
            }) as Box<dyn Target>
        };
        let shrunk =
            check_seeds("mem", &seeds, &mem_config(), &mut lossy).expect_err("a lost write");
        let (Violation::Mismatch(m) | Violation::ReadInBatch(m)) = &shrunk.error else {
            panic!("not a mismatch: {shrunk}");
        };
        assert_eq!(m.sector, 3, "{shrunk}");
        assert!(matches!(m.read, BadRead::Stale(Val::Zero)), "{shrunk}");
        assert!(
            shrunk.minimal.len() <= 3 && shrunk.minimal.len() < shrunk.ops_run,
            "{shrunk}"
        );
        let again = shrunk
            .minimal_error
            .as_ref()
            .expect("the minimal sequence fails");
        assert_eq!(again.kind(), shrunk.error.kind(), "{shrunk}");
        assert!(
            shrunk.to_string().contains("lost or stale write"),
            "{shrunk}"
        );
    }

    #[test]
    fn minimise_keeps_only_what_the_failure_needs() {
        let ops: Vec<Op> = (0..40).map(|i| Op::PowerLoss { seed: i }).collect();
        let min = minimise(ops, 500, &mut |o: &[Op]| {
            o.contains(&Op::PowerLoss { seed: 7 }) && o.last() == Some(&Op::PowerLoss { seed: 39 })
        });
        assert_eq!(
            min,
            vec![Op::PowerLoss { seed: 7 }, Op::PowerLoss { seed: 39 }]
        );
    }
}
