//! The model checker of `tessera-testkit` (`model_check`) driven against a real pool on
//! every layout: random batches of aligned and sub-block writes, write-zeroes, TRIM and
//! reads from several handles at once (with per-device latency so they overlap and
//! complete out of order), FLUSH, FUA, snapshots, clones, rollbacks, volume create and
//! delete, device failure, replacement by a garbage-filled device and rebuild, scrub,
//! power loss at step boundaries and in the middle of a batch, clean reopen. Every volume
//! is read back whole and checked against the model after every step.
//!
//! `TESSERA_MC_SEEDS=N`: seeds per layout (default sized for CI); `TESSERA_MC_SEED=N`:
//! one seed, every step printed; `TESSERA_MC_STEPS=N`: steps per seed;
//! `TESSERA_MC_ALL=1`: also the operations gated off by [`KNOWN_OPEN`] (the soak script
//! runs both ways). A failing seed prints a minimal replayable sequence.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::sync::atomic::{AtomicI64, Ordering::SeqCst};
use std::sync::Arc;

use common::*;
use tessera_device::{BlockDevice, FaultConfig, FaultDevice, RamDevice};
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};
use tessera_pool::format::DEV_DATA_START;
use tessera_pool::{LayoutKind, Pool, PoolOptions, ScrubFindings};
use tessera_testkit::model_check::{self, Config, Io, IoResults, Kind, Op, Target, TargetError};

const UNIT: u64 = 64 << 10;
const VOL_SIZE: u64 = 1 << 20;

/// A finding of this checker on main that is being fixed (issue 20): in CI mode the
/// operation kinds it needs are off on the layouts it affects, so CI gates what passes
/// today without weakening any check. Delete the entry when its fix lands;
/// `TESSERA_MC_ALL=1` runs everything (the soak script's `ALL=1`).
// Never built while the list is empty; kept for the next finding.
#[allow(dead_code)]
struct KnownOpen {
    /// Issue 20 item, and what the checker saw (docs/testing.md has the sequences).
    item: &'static str,
    affects: fn(&LayoutKind) -> bool,
    off: &'static [Kind],
}

const KNOWN_OPEN: &[KnownOpen] = &[
    // Item 1 (parity pools handed out free units without zeroing them; seed 7000 ec,
    // seed 1000000 raid5) is fixed by the durable allocation reserve, and item 2 on parity
    // layouts by the rebuild's zero-fill of free units: both run in CI now.
    //
    // Item 2 on mirrors (a replacement's free units keep its garbage, and a snapshot's
    // partial unit allocated from one later scrubbed as mismatched; seed 3001 raid1,
    // raid10 seed 1000000) and soak finding 6 (the same through a power loss; raid10 seed
    // 1000012) are fixed by zeroing a mirror's partial unit on every copy when it is
    // allocated (`plan_first_write`): replacement runs on mirrors in CI again, and
    // `replay_mirror_*` below replay both sequences.
];

fn layouts() -> Vec<(&'static str, LayoutKind, usize)> {
    vec![
        ("concat", LayoutKind::Concat, 2),
        ("raid0", LayoutKind::Raid0 { stripe: 16 << 10 }, 2),
        ("raid1", LayoutKind::Raid1 { copies: 2 }, 2),
        (
            "raid10",
            LayoutKind::Raid10 {
                copies: 2,
                stripe: 16 << 10,
            },
            4,
        ),
        ("raid5", LayoutKind::Raid5 { stripe: 16 << 10 }, 3),
        ("raid6", LayoutKind::Raid6 { stripe: 16 << 10 }, 4),
        (
            "ec",
            LayoutKind::Ec {
                k: 2,
                m: 2,
                stripe: 16 << 10,
            },
            4,
        ),
    ]
}

/// A pool on RAM devices behind a volatile write cache (the power-loss model) behind a
/// fault device (failure, latency).
struct PoolTarget {
    layout: LayoutKind,
    dev_size: u64,
    rams: Vec<Arc<RamDevice>>,
    caches: Vec<Arc<CacheDevice>>,
    cfgs: Vec<Arc<FaultConfig>>,
    devs: Vec<Arc<dyn BlockDevice>>,
    /// I/Os left before "the power goes" (shared by every device of the pool).
    budget: Arc<AtomicI64>,
    pool: Option<Pool>,
    io: CoreIo,
    crashes: u64,
    /// Commit before a power loss (a [`KNOWN_OPEN`] gate).
    commit_first: bool,
    /// Failed devices may come back at a power loss (`Kind::Revive`).
    revive: bool,
    /// The pool's unit size.
    unit: u64,
}

/// Device offset where the layout's data begins (docs/format.md §2.1: parity layouts
/// keep their 16 MiB stripe journal after the label).
fn data_start(layout: LayoutKind) -> u64 {
    DEV_DATA_START + if layout.is_parity() { 16 << 20 } else { 0 }
}

/// `what` failed with the pool's (or the layout's) error, kept as the source.
fn err<E: std::error::Error + Send + Sync + 'static>(
    what: &str,
) -> impl FnOnce(E) -> TargetError + '_ {
    TargetError::failed(what)
}

impl PoolTarget {
    /// A pool that deduplicates (block-mapped volumes, 1 MiB units) when `dedup`.
    fn with_dedup(layout: LayoutKind, ndev: usize, dedup: bool) -> PoolTarget {
        // Parity layouts keep 16 MiB of each device for their stripe journal. A dedup
        // pool's 1 MiB units hold the store, the maps, the counts and the index besides
        // the data.
        let unit = if dedup { 1 << 20 } else { UNIT };
        let dev_size = data_start(layout) + if dedup { 40 << 20 } else { 24 << 20 };
        let rams: Vec<Arc<RamDevice>> = (0..ndev)
            .map(|_| RamDevice::new(dev_size).unwrap())
            .collect();
        let mut t = PoolTarget {
            layout,
            dev_size,
            rams,
            caches: Vec::new(),
            cfgs: (0..ndev).map(|_| Arc::default()).collect(),
            devs: Vec::new(),
            budget: Arc::new(AtomicI64::new(i64::MAX)),
            pool: None,
            io: core(),
            crashes: 0,
            commit_first: false,
            revive: false,
            unit,
        };
        t.wrap_devices();
        t.pool = Some(
            Pool::create(
                "p",
                t.devs.clone(),
                PoolOptions {
                    layout,
                    unit_size: unit,
                    dedup,
                    ..PoolOptions::default()
                },
            )
            .unwrap(),
        );
        t
    }

    /// Fresh caches (nothing unflushed) and fault devices over the RAM devices.
    fn wrap_devices(&mut self) {
        self.budget = Arc::new(AtomicI64::new(i64::MAX));
        self.caches = self
            .rams
            .iter()
            .map(|r| CacheDevice::new(r.clone(), self.budget.clone()))
            .collect();
        self.devs = self
            .caches
            .iter()
            .zip(&self.cfgs)
            .map(|(c, f)| FaultDevice::new(c.clone(), f.clone()) as Arc<dyn BlockDevice>)
            .collect();
    }

    fn pool(&self) -> &Pool {
        self.pool.as_ref().expect("open")
    }

    fn vol(&self, name: &str) -> Result<Arc<tessera_pool::Volume>, TargetError> {
        self.pool()
            .volume(name)
            .ok_or_else(|| TargetError::Missing(name.to_string()))
    }

    /// Scrub the metadata units and every allocated unit (as the node's scrub job does).
    fn scrub_pass(&self, repair: bool) -> Result<ScrubFindings, TargetError> {
        let pool = self.pool();
        // Track writes once for the whole pass, as the node's scrub job does (a mirror's
        // scrub_range switches tracking on, and waits its grace, when nothing holds it).
        let _t = pool.core.layout.track_writes();
        let mut f = ScrubFindings::default();
        for u in pool.rebuild_units() {
            let r = pool
                .core
                .layout
                .scrub_range(u * self.unit, self.unit, repair)
                .map_err(err("scrub"))?;
            f.add(&r);
        }
        Ok(f)
    }

    fn open(&mut self) -> Result<(), TargetError> {
        self.pool = Some(Pool::open(self.devs.clone()).map_err(err("reopen"))?);
        Ok(())
    }
}

impl Target for PoolTarget {
    fn volume_size(&self) -> u64 {
        VOL_SIZE
    }
    fn redundancy(&self) -> usize {
        match self.layout {
            LayoutKind::Raid1 { copies } | LayoutKind::Raid10 { copies, .. } => copies as usize - 1,
            l => l.parity() as usize,
        }
    }
    fn devices(&self) -> usize {
        self.rams.len()
    }
    fn create_volume(&mut self, vol: &str) -> Result<(), TargetError> {
        self.pool()
            .create_volume(vol, VOL_SIZE)
            .map(|_| ())
            .map_err(err("create volume"))
    }
    fn delete_volume(&mut self, vol: &str) -> Result<(), TargetError> {
        let v = self.vol(vol)?;
        self.pool().delete_volume(&v).map_err(err("delete"))
    }
    fn snapshot(&mut self, vol: &str, snap: &str) -> Result<(), TargetError> {
        let v = self.vol(vol)?;
        self.pool()
            .create_snapshot(&v, snap)
            .map(|_| ())
            .map_err(err("snapshot"))
    }
    fn clone_snapshot(&mut self, snap: &str, vol: &str) -> Result<(), TargetError> {
        let s = self.vol(snap)?;
        self.pool()
            .clone_snapshot(&s, vol, true)
            .map(|_| ())
            .map_err(err("clone"))
    }
    fn rollback(&mut self, vol: &str, snap: &str) -> Result<(), TargetError> {
        let v = self.vol(vol)?;
        let s = self.vol(snap)?;
        if !v.ancestors().iter().any(|a| Arc::ptr_eq(a, &s)) {
            return Err(TargetError::NotAncestor {
                vol: vol.to_string(),
                snap: snap.to_string(),
            });
        }
        self.pool().rollback_volume(&v, &s).map_err(err("rollback"))
    }
    fn batch(
        &mut self,
        ios: &[Io],
        data: &[Vec<u8>],
        latency_us: &[u64],
        crash_after: Option<u64>,
        snapshot: Option<(&str, &str)>,
    ) -> (IoResults, Result<(), TargetError>) {
        let sec = model_check::SECTOR as u64;
        let mut handles = Vec::new();
        for io in ios {
            handles.push(self.vol(io.vol()).expect("checked").open_handle());
        }
        for (c, &l) in self.cfgs.iter().zip(latency_us) {
            c.latency_us.store(l, SeqCst);
        }
        if let Some(n) = crash_after {
            self.budget.store(n as i64, SeqCst);
        }
        let mut bufs: Vec<Vec<u8>> = ios
            .iter()
            .map(|io| match io {
                Io::Read { sectors, .. } => vec![0xEE; (sectors * sec) as usize],
                _ => Vec::new(),
            })
            .collect();
        for (i, io) in ios.iter().enumerate() {
            let op = match io {
                Io::Write {
                    sector, sectors, ..
                }
                | Io::Copy {
                    sector, sectors, ..
                } => IoOp::Write {
                    offset: sector * sec,
                    len: (sectors * sec) as u32,
                    buf: data[i].as_ptr(),
                },
                Io::Zero {
                    sector,
                    sectors,
                    may_unmap,
                    ..
                } => IoOp::WriteZeroes {
                    offset: sector * sec,
                    len: sectors * sec,
                    may_unmap: *may_unmap,
                },
                Io::Trim {
                    sector, sectors, ..
                } => IoOp::Discard {
                    offset: sector * sec,
                    len: sectors * sec,
                },
                Io::Read {
                    sector, sectors, ..
                } => IoOp::Read {
                    offset: sector * sec,
                    len: (sectors * sec) as u32,
                    buf: bufs[i].as_mut_ptr(),
                },
            };
            // SAFETY: `data` and `bufs` outlive the drain below.
            unsafe { handles[i].submit(&mut self.io, op, Tag::task(0, i as u32)) };
        }
        let mut res = vec![None; ios.len()];
        let mut snapped = Ok(());
        let pool = self.pool.as_ref().expect("open");
        let io = &mut self.io;
        std::thread::scope(|s| {
            // The snapshot is created on a thread of its own while this one drives the
            // I/Os: a create that waits for writes in flight must not wait for itself.
            let snap = snapshot.map(|(v, name)| {
                let v = pool.volume(v).expect("checked");
                s.spawn(move || pool.create_snapshot(&v, name).map(|_| ()))
            });
            io.run_until_idle(|_, tag, r| {
                res[tag.slot() as usize] = Some(r);
            });
            if let Some(h) = snap {
                snapped = h
                    .join()
                    .unwrap_or_else(|_| Err(tessera_pool::Error::invalid("snapshot panicked")))
                    .map_err(err("snapshot in flight"));
            }
        });
        // FUA as the frontends do it: the write, then a flush before the answer.
        for (i, io) in ios.iter().enumerate() {
            if let (Io::Write { fua: true, .. }, Some(r)) = (io, res[i]) {
                if r >= 0 {
                    res[i] = Some(flush(&mut self.io, &mut handles[i]));
                }
            }
        }
        for c in &self.cfgs {
            c.latency_us.store(0, SeqCst);
        }
        let res = res
            .into_iter()
            .zip(bufs)
            .map(|(r, b)| match r {
                Some(r) if r >= 0 => Ok(b),
                Some(r) => Err(r),
                None => Err(-libc::ETIMEDOUT),
            })
            .collect();
        (res, snapped)
    }
    fn flush(&mut self, vol: &str) -> Result<(), TargetError> {
        let mut h = self.vol(vol)?.open_handle();
        match flush(&mut self.io, &mut h) {
            0 => Ok(()),
            errno => Err(TargetError::Errno {
                what: format!("flush {vol}"),
                errno,
            }),
        }
    }
    fn read_volume(&mut self, vol: &str) -> Result<Vec<u8>, TargetError> {
        let mut h = self.vol(vol)?.open_handle();
        let mut out = Vec::with_capacity(VOL_SIZE as usize);
        let chunk = 256 << 10;
        for off in (0..VOL_SIZE).step_by(chunk) {
            let got =
                read(&mut self.io, &mut h, off, chunk).map_err(|errno| TargetError::Errno {
                    what: format!("read {vol} at {off}"),
                    errno,
                })?;
            out.extend_from_slice(&got);
        }
        Ok(out)
    }
    fn fail_device(&mut self, dev: usize) -> Result<(), TargetError> {
        self.cfgs[dev].vanish();
        Ok(())
    }
    fn replace_device(&mut self, dev: usize, garbage: u64) -> Result<(), TargetError> {
        let pool = self.pool.take().expect("open");
        pool.shutdown().map_err(err("shutdown"))?;
        drop(pool);
        // A new disk that held something else: garbage in the data area (a blank label,
        // so the pool takes it as the missing member).
        let ram = RamDevice::new(self.dev_size).unwrap();
        let start = data_start(self.layout);
        let junk = tessera_testkit::data::garbage(garbage, (self.dev_size - start) as usize);
        ram.write_at(start, &junk).unwrap();
        self.rams[dev] = ram;
        self.cfgs[dev] = Arc::default();
        self.wrap_devices();
        self.open()?;
        // As the node's rebuild job does: the free units' rows too.
        rebuild_as_the_node_does(self.pool(), dev).map_err(err("rebuild"))
    }
    fn scrub(&mut self) -> Result<(), TargetError> {
        self.scrub_pass(false).and_then(|f| {
            if f.mismatched != 0 || f.unreadable != 0 {
                Err(TargetError::Inconsistent {
                    check: "scrub",
                    finding: format!(
                        "{} bytes mismatched, {} unreadable: {:?}",
                        f.mismatched, f.unreadable, f.ranges
                    ),
                })
            } else {
                Ok(())
            }
        })
    }

    fn power_loss(&mut self, seed: u64) -> Result<(), TargetError> {
        // The moment of the crash: no device I/O lands from here on (the pool's own
        // threads included), then each cache keeps a random part of its unflushed writes.
        if self.commit_first {
            self.pool()
                .commit()
                .map_err(err("commit before the power loss"))?;
        }
        self.budget.store(0, SeqCst);
        drop(self.pool.take());
        self.crashes += 1;
        let mut rng = Rng((seed ^ self.crashes.wrapping_mul(0x9e37_79b9)) | 1);
        for c in &self.caches {
            c.power_loss(&mut rng);
        }
        for c in &self.cfgs {
            c.latency_us.store(0, SeqCst);
            // Half the power losses bring failed devices back (Kind::Revive); the model
            // keeps them failed: the pool's labels must say so.
            if self.revive && seed & 1 == 1 {
                c.vanished.store(false, SeqCst);
            }
        }
        self.wrap_devices();
        self.open()?;
        // What the node does at start after an unclean shutdown (architecture.md,
        // "Resync after an unclean shutdown"): a mirrored pool's copies are made equal
        // (scrub with repair) before the checker reads either copy.
        if self.layout.is_mirror() && !self.pool().opened_clean() {
            self.scrub_pass(true)?;
        }
        Ok(())
    }
    fn reopen(&mut self) -> Result<(), TargetError> {
        let pool = self.pool.take().expect("open");
        pool.shutdown().map_err(err("shutdown"))?;
        drop(pool);
        self.open()
    }
    fn self_check(&mut self) -> Result<(), TargetError> {
        let pool = self.pool();
        let chains = pool.verify_chains();
        if !chains.is_empty() {
            return Err(TargetError::Inconsistent {
                check: "chain checks",
                finding: format!("{chains:?}"),
            });
        }
        let counts = pool.verify_dedup();
        if !counts.is_empty() {
            return Err(TargetError::Inconsistent {
                check: "dedup references",
                finding: format!("{counts:?}"),
            });
        }
        let st = pool.status();
        if st.allocated + st.free != st.capacity {
            return Err(TargetError::Inconsistent {
                check: "space",
                finding: format!(
                    "allocated {} + free {} != capacity {}",
                    st.allocated, st.free, st.capacity
                ),
            });
        }
        Ok(())
    }
}

/// The operation kinds to generate on `layout` (deduplicating when `dedup`), and whether
/// power loss must follow a commit (the gate of a known-open finding that leaves power
/// loss itself on).
fn enabled(layout: LayoutKind, dedup: bool, all: bool) -> (Vec<Kind>, bool) {
    let mut kinds: Vec<Kind> = Kind::ALL.to_vec();
    if !layout.is_redundant() {
        kinds.retain(|k| !matches!(k, Kind::FailDevice | Kind::Replace | Kind::Revive));
    }
    if dedup {
        // Its volumes also get writes that copy each other's blocks (snapshots, clones
        // and rollbacks of them included).
        kinds.push(Kind::Duplicate);
    }
    let mut commit_first = false;
    if !all {
        for k in KNOWN_OPEN.iter().filter(|k| (k.affects)(&layout)) {
            eprintln!("gated off on {layout:?}: {:?} ({})", k.off, k.item);
            kinds.retain(|x| !k.off.contains(x) || *x == Kind::PowerLoss);
            commit_first |= k.off.contains(&Kind::PowerLoss);
        }
    }
    (kinds, commit_first)
}

fn check_layout(name: &str, layout: LayoutKind, ndev: usize, first_seed: u64) {
    check_pool(name, layout, ndev, false, first_seed);
}

fn check_pool(name: &str, layout: LayoutKind, ndev: usize, dedup: bool, first_seed: u64) {
    let (seeds, verbose) = model_check::seeds_from_env(first_seed, 2);
    let all = std::env::var("TESSERA_MC_ALL").is_ok_and(|v| v == "1");
    let steps = std::env::var("TESSERA_MC_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    let (enabled, commit_first) = enabled(layout, dedup, all);
    let revive = enabled.contains(&Kind::Revive);
    let cfg = Config {
        steps,
        enabled,
        max_volumes: 6,
        verbose,
    };
    let mut make = || {
        let mut t = PoolTarget::with_dedup(layout, ndev, dedup);
        t.commit_first = commit_first;
        t.revive = revive;
        Box::new(t) as Box<dyn Target>
    };
    let t0 = std::time::Instant::now();
    match model_check::check_seeds(name, &seeds, &cfg, &mut make) {
        Ok(ops) => eprintln!(
            "model check {name}: {} seeds, {ops} ops, {:.1} s",
            seeds.len(),
            t0.elapsed().as_secs_f64()
        ),
        Err(msg) => panic!("{msg}"),
    }
}

#[test]
fn model_check_concat() {
    check_layout("concat", LayoutKind::Concat, 2, 1000);
}

#[test]
fn model_check_raid0() {
    let (n, l, d) = layouts()[1];
    check_layout(n, l, d, 2000);
}

#[test]
fn model_check_raid1() {
    let (n, l, d) = layouts()[2];
    check_layout(n, l, d, 3000);
}

#[test]
fn model_check_raid10() {
    let (n, l, d) = layouts()[3];
    check_layout(n, l, d, 4000);
}

#[test]
fn model_check_raid5() {
    let (n, l, d) = layouts()[4];
    check_layout(n, l, d, 5000);
}

#[test]
fn model_check_raid6() {
    let (n, l, d) = layouts()[5];
    check_layout(n, l, d, 6000);
}

#[test]
fn model_check_ec() {
    let (n, l, d) = layouts()[6];
    check_layout(n, l, d, 7000);
}

/// A dedup pool (issue 25): block-mapped volumes whose blocks are shared, overwritten in
/// place, released by TRIM and delete, through power losses and reopens.
///
/// Seed 8104 (the first seed CI runs here) found pages of a commit that a power loss took
/// coming back at a later open: their generation was past the journal's end then, and
/// became valid once the next open's journal reached it. It fails at op 59 without the
/// erase of such pages at open (`DedupCore::open`).
#[test]
fn model_check_dedup_concat() {
    check_pool("dedup-concat", LayoutKind::Concat, 2, true, 8104);
}

/// A dedup pool on a mirror: device failure, revival and replacement by a garbage-filled
/// device besides.
#[test]
fn model_check_dedup_raid1() {
    check_pool(
        "dedup-raid1",
        LayoutKind::Raid1 { copies: 2 },
        2,
        true,
        9000,
    );
}

/// Replay a minimal sequence the checker printed on `layouts()[i]`: it must pass.
fn replay(i: usize, seed: u64, ops: &[Op]) {
    let (name, layout, ndev) = layouts()[i];
    replay_on(name, layout, ndev, false, seed, ops);
}

/// Replay `ops` on a pool of `layout` (deduplicating when `dedup`): it must pass.
fn replay_on(name: &str, layout: LayoutKind, ndev: usize, dedup: bool, seed: u64, ops: &[Op]) {
    let cfg = Config {
        steps: ops.len(),
        enabled: Kind::ALL.to_vec(),
        max_volumes: 6,
        verbose: false,
    };
    let mut make = || {
        let mut t = PoolTarget::with_dedup(layout, ndev, dedup);
        t.revive = true;
        Box::new(t) as Box<dyn Target>
    };
    if let Err(f) = model_check::run(seed, &cfg, &mut make, Some(ops)) {
        panic!(
            "replay of {name} seed {seed} failed at op {}: {}",
            f.at, f.error
        );
    }
}

/// Issue 25 (dedup-raid1 seed 9001, the first run of the dedup model check): after a
/// garbage-filled replacement is rebuilt, a dedup store unit was handed out without
/// zeroing; its blocks not yet written differed between the copies and the scrub
/// reported the unit as mismatched. A mirror now zeroes every dedup unit it hands out.
#[test]
fn replay_dedup_mirror_replacement_then_store_unit() {
    replay_on(
        "dedup-raid1",
        LayoutKind::Raid1 { copies: 2 },
        2,
        true,
        9001,
        &[
            Op::FailDevice { dev: 0 },
            Op::CreateVolume { vol: "v3".into() },
            Op::Replace {
                dev: 0,
                garbage: 9376998817540299601,
            },
            Op::CreateVolume { vol: "v4".into() },
            Op::Batch {
                ios: vec![Io::Copy {
                    vol: "v4".into(),
                    sector: 832,
                    sectors: 32,
                    from: "v3".into(),
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Scrub,
        ],
    );
}

/// Issue 25 (dedup seed 8326, both layouts): two writes of different sectors of one
/// 4 KiB block at once both merged into the block's old bytes, and the second to publish
/// undid the first. Merges of a block now go one at a time.
#[test]
fn replay_dedup_two_partial_writes_of_one_block() {
    replay_on(
        "dedup-concat",
        LayoutKind::Concat,
        2,
        true,
        8326,
        &[
            Op::CreateVolume { vol: "v1".into() },
            Op::Batch {
                ios: vec![
                    Io::Write {
                        vol: "v1".into(),
                        sector: 1043,
                        sectors: 1,
                        fua: false,
                    },
                    Io::Write {
                        vol: "v1".into(),
                        sector: 1040,
                        sectors: 2,
                        fua: false,
                    },
                ],
                latency_us: vec![143, 366],
                crash_after: None,
                snapshot: None,
            },
        ],
    );
}

/// Issue 25, snapshots of dedup volumes (dedup-concat seed 20002, the first run with
/// them): a write of zeros over blocks a snapshot holds puts `ZERO` entries into the
/// volume's new layer, whose map page had no map unit yet, so the commit skipped it and
/// the zeros were lost at the power loss after a FLUSH. A cleared block's page now gets
/// its map unit first.
#[test]
fn replay_dedup_zeros_over_a_snapshot_survive_a_power_loss() {
    replay_on(
        "dedup-concat",
        LayoutKind::Concat,
        2,
        true,
        20002,
        &[
            Op::CreateVolume { vol: "v1".into() },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v1".into(),
                    sector: 38,
                    sectors: 5,
                    fua: true,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Snapshot {
                vol: "v1".into(),
                snap: "s3".into(),
            },
            Op::Batch {
                ios: vec![Io::Zero {
                    vol: "v1".into(),
                    sector: 0,
                    sectors: 128,
                    may_unmap: true,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: Some(("v1".into(), "s6".into())),
            },
            Op::Flush { vol: "v1".into() },
            Op::PowerLoss {
                seed: 11449560451839608328,
            },
        ],
    );
}

/// Issue 20 item 2 on mirrors (raid1 seed 3001 with `TESSERA_MC_ALL=1`): a garbage
/// replacement is rebuilt, then a first write after a snapshot allocates a partial unit
/// from a free unit whose copies differ; the scrub must find the copies equal.
#[test]
fn replay_mirror_rebuild_then_partial_unit() {
    replay(
        2,
        3001,
        &[
            Op::CreateVolume { vol: "v1".into() },
            Op::FailDevice { dev: 1 },
            Op::Replace {
                dev: 1,
                garbage: 7429542396112789736,
            },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v1".into(),
                    sector: 1680,
                    sectors: 32,
                    fua: false,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: Some(("v1".into(), "s2".into())),
            },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v1".into(),
                    sector: 1704,
                    sectors: 40,
                    fua: true,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Scrub,
        ],
    );
}

/// Soak finding 6 (raid10 seed 1000012): writes reach one copy of units whose
/// allocation a power loss undoes (the resync covers allocated units only); after the
/// next power loss a first write into a unit shared with a snapshot allocates one of
/// them as a partial unit; the scrub must find the copies equal.
#[test]
fn replay_mirror_power_loss_then_partial_unit() {
    let w = |vol: &str, sector, sectors, fua| Io::Write {
        vol: vol.into(),
        sector,
        sectors,
        fua,
    };
    let batch = |ios, snapshot| Op::Batch {
        ios,
        latency_us: vec![],
        crash_after: None,
        snapshot,
    };
    replay(
        3,
        1000012,
        &[
            Op::CreateVolume { vol: "v1".into() },
            batch(
                vec![w("v1", 192, 16, false), w("v1", 1456, 48, false)],
                None,
            ),
            batch(
                vec![w("v1", 1377, 6, true)],
                Some(("v1".into(), "s2".into())),
            ),
            batch(vec![w("v1", 120, 48, false), w("v1", 224, 40, false)], None),
            Op::PowerLoss {
                seed: 9322758288081702969,
            },
            batch(vec![w("v1", 193, 8, false)], None),
            Op::Scrub,
        ],
    );
}

/// Soak finding 5 (raid6 and ec, seed 1000001): a clone's unflushed writes to a degraded
/// parity pool, a power loss, then a garbage replacement rebuilt: the clone read an older
/// version of its own block after the rebuild than before it.
fn degraded_power_loss_rebuild_ops() -> Vec<Op> {
    vec![
        Op::CreateVolume { vol: "v1".into() },
        Op::Snapshot {
            vol: "v1".into(),
            snap: "s4".into(),
        },
        Op::CreateVolume { vol: "v5".into() },
        Op::Clone {
            snap: "s4".into(),
            vol: "c6".into(),
        },
        Op::Snapshot {
            vol: "v5".into(),
            snap: "s8".into(),
        },
        Op::Batch {
            ios: vec![Io::Write {
                vol: "c6".into(),
                sector: 1064,
                sectors: 40,
                fua: false,
            }],
            latency_us: vec![],
            crash_after: None,
            snapshot: None,
        },
        Op::Batch {
            ios: vec![Io::Write {
                vol: "v5".into(),
                sector: 1250,
                sectors: 8,
                fua: true,
            }],
            latency_us: vec![],
            crash_after: None,
            snapshot: None,
        },
        Op::FailDevice { dev: 2 },
        Op::Batch {
            ios: vec![Io::Write {
                vol: "c6".into(),
                sector: 1024,
                sectors: 128,
                fua: false,
            }],
            latency_us: vec![],
            crash_after: None,
            snapshot: None,
        },
        Op::PowerLoss {
            seed: 11957064070464123875,
        },
        Op::Replace {
            dev: 2,
            garbage: 17023233405787239088,
        },
    ]
}

#[test]
fn finding5_raid6_degraded_power_loss_rebuild() {
    replay(5, 1000001, &degraded_power_loss_rebuild_ops());
}

#[test]
fn finding5_ec_degraded_power_loss_rebuild() {
    replay(6, 1000001, &degraded_power_loss_rebuild_ops());
}

/// Soak finding 8 (raid6 and ec, seeds 2000009 and 2000035): a device fails, a batch of
/// writes is cut by a power loss (the failed device comes back: its failure was not
/// recorded yet), then a second device fails: a row whose degraded write's record left
/// out the first device's chunk decoded to an old value (or garbage).
fn degraded_crash_then_second_failure_ops(seed: u64) -> Vec<Op> {
    if seed == 2000009 {
        vec![
            Op::CreateVolume { vol: "v1".into() },
            Op::CreateVolume { vol: "v2".into() },
            Op::Batch {
                ios: vec![
                    Io::Write {
                        vol: "v2".into(),
                        sector: 352,
                        sectors: 40,
                        fua: false,
                    },
                    Io::Trim {
                        vol: "v1".into(),
                        sector: 368,
                        sectors: 24,
                    },
                    Io::Read {
                        vol: "v1".into(),
                        sector: 1872,
                        sectors: 8,
                    },
                ],
                latency_us: vec![],
                crash_after: None,
                snapshot: Some(("v2".into(), "s3".into())),
            },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v2".into(),
                    sector: 1536,
                    sectors: 128,
                    fua: false,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Snapshot {
                vol: "v1".into(),
                snap: "s4".into(),
            },
            Op::Batch {
                ios: vec![
                    Io::Read {
                        vol: "s4".into(),
                        sector: 208,
                        sectors: 8,
                    },
                    Io::Read {
                        vol: "s4".into(),
                        sector: 312,
                        sectors: 8,
                    },
                    Io::Write {
                        vol: "v2".into(),
                        sector: 424,
                        sectors: 48,
                        fua: false,
                    },
                ],
                latency_us: vec![279, 286, 133, 129],
                crash_after: None,
                snapshot: None,
            },
            Op::Snapshot {
                vol: "v1".into(),
                snap: "s5".into(),
            },
            Op::Batch {
                ios: vec![
                    Io::Write {
                        vol: "v1".into(),
                        sector: 1291,
                        sectors: 3,
                        fua: true,
                    },
                    Io::Read {
                        vol: "s5".into(),
                        sector: 434,
                        sectors: 3,
                    },
                ],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Batch {
                ios: vec![Io::Read {
                    vol: "v1".into(),
                    sector: 968,
                    sectors: 8,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: Some(("v2".into(), "s6".into())),
            },
            Op::FailDevice { dev: 1 },
            Op::Batch {
                ios: vec![
                    Io::Write {
                        vol: "v1".into(),
                        sector: 1248,
                        sectors: 40,
                        fua: true,
                    },
                    Io::Read {
                        vol: "s6".into(),
                        sector: 1408,
                        sectors: 128,
                    },
                    Io::Write {
                        vol: "v2".into(),
                        sector: 22,
                        sectors: 1,
                        fua: false,
                    },
                ],
                latency_us: vec![],
                crash_after: Some(18),
                snapshot: None,
            },
            Op::FailDevice { dev: 3 },
        ]
    } else {
        vec![
            Op::CreateVolume { vol: "v1".into() },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v1".into(),
                    sector: 1632,
                    sectors: 16,
                    fua: true,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Batch {
                ios: vec![
                    Io::Write {
                        vol: "v1".into(),
                        sector: 704,
                        sectors: 8,
                        fua: false,
                    },
                    Io::Write {
                        vol: "v1".into(),
                        sector: 1152,
                        sectors: 128,
                        fua: true,
                    },
                ],
                latency_us: vec![],
                crash_after: None,
                snapshot: Some(("v1".into(), "s3".into())),
            },
            Op::Snapshot {
                vol: "v1".into(),
                snap: "s4".into(),
            },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v1".into(),
                    sector: 696,
                    sectors: 32,
                    fua: false,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v1".into(),
                    sector: 159,
                    sectors: 1,
                    fua: false,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Batch {
                ios: vec![
                    Io::Write {
                        vol: "v1".into(),
                        sector: 1632,
                        sectors: 8,
                        fua: true,
                    },
                    Io::Write {
                        vol: "v1".into(),
                        sector: 936,
                        sectors: 16,
                        fua: false,
                    },
                ],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Batch {
                ios: vec![Io::Read {
                    vol: "v1".into(),
                    sector: 432,
                    sectors: 8,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: Some(("v1".into(), "s5".into())),
            },
            Op::CreateVolume { vol: "v6".into() },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v6".into(),
                    sector: 1277,
                    sectors: 3,
                    fua: false,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v1".into(),
                    sector: 986,
                    sectors: 9,
                    fua: false,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v1".into(),
                    sector: 1936,
                    sectors: 48,
                    fua: true,
                }],
                latency_us: vec![],
                crash_after: None,
                snapshot: None,
            },
            Op::FailDevice { dev: 0 },
            Op::Batch {
                ios: vec![Io::Write {
                    vol: "v1".into(),
                    sector: 956,
                    sectors: 9,
                    fua: false,
                }],
                latency_us: vec![],
                crash_after: Some(14),
                snapshot: None,
            },
            Op::FailDevice { dev: 3 },
        ]
    }
}

#[test]
fn finding8_raid6_degraded_crash_then_second_failure() {
    for seed in [2000009, 2000035] {
        replay(5, seed, &degraded_crash_then_second_failure_ops(seed));
    }
}

#[test]
fn finding8_ec_degraded_crash_then_second_failure() {
    for seed in [2000009, 2000035] {
        replay(6, seed, &degraded_crash_then_second_failure_ops(seed));
    }
}

/// Soak finding 9 (raid6 and ec seed 8000029, `TESSERA_MC_ALL=1`): two devices fail, and
/// the power goes in the middle of a batch while the second failure's label is written;
/// a label torn on one of the two healthy devices made the open refuse the pool. Fixed
/// by the labels' two slots (docs/format.md §1). The shrinker's minimal sequence.
fn torn_label_on_a_degraded_pool_ops() -> Vec<Op> {
    vec![
        Op::PowerLoss {
            seed: 11221429319456747218,
        },
        Op::CreateVolume { vol: "v1".into() },
        Op::Batch {
            ios: vec![Io::Write {
                vol: "v1".into(),
                sector: 1800,
                sectors: 24,
                fua: false,
            }],
            latency_us: vec![],
            crash_after: Some(37),
            snapshot: None,
        },
        Op::PowerLoss {
            seed: 8293992038920111359,
        },
        Op::PowerLoss {
            seed: 15203412036186600449,
        },
        Op::Batch {
            ios: vec![
                Io::Write {
                    vol: "v1".into(),
                    sector: 1586,
                    sectors: 12,
                    fua: false,
                },
                Io::Write {
                    vol: "v1".into(),
                    sector: 1864,
                    sectors: 48,
                    fua: false,
                },
                Io::Write {
                    vol: "v1".into(),
                    sector: 1368,
                    sectors: 40,
                    fua: false,
                },
            ],
            latency_us: vec![],
            crash_after: None,
            snapshot: Some(("v1".into(), "s2".into())),
        },
        Op::Clone {
            snap: "s2".into(),
            vol: "c4".into(),
        },
        Op::PowerLoss {
            seed: 15664975885261434713,
        },
        Op::CreateVolume { vol: "v5".into() },
        Op::Batch {
            ios: vec![
                Io::Write {
                    vol: "v5".into(),
                    sector: 1550,
                    sectors: 7,
                    fua: false,
                },
                Io::Write {
                    vol: "v5".into(),
                    sector: 1944,
                    sectors: 24,
                    fua: true,
                },
            ],
            latency_us: vec![],
            crash_after: None,
            snapshot: Some(("v5".into(), "s6".into())),
        },
        Op::FailDevice { dev: 0 },
        Op::PowerLoss {
            seed: 11668578573278657762,
        },
        Op::PowerLoss {
            seed: 6968555736164943070,
        },
        Op::Batch {
            ios: vec![Io::Write {
                vol: "c4".into(),
                sector: 1944,
                sectors: 48,
                fua: false,
            }],
            latency_us: vec![],
            crash_after: None,
            snapshot: None,
        },
        Op::FailDevice { dev: 3 },
        Op::Batch {
            ios: vec![
                Io::Read {
                    vol: "s2".into(),
                    sector: 1632,
                    sectors: 32,
                },
                Io::Write {
                    vol: "c4".into(),
                    sector: 848,
                    sectors: 48,
                    fua: false,
                },
            ],
            latency_us: vec![223, 99, 338, 85],
            crash_after: Some(6),
            snapshot: None,
        },
    ]
}

#[test]
fn finding9_raid6_torn_label_on_a_degraded_pool() {
    replay(5, 8000029, &torn_label_on_a_degraded_pool_ops());
}

#[test]
fn finding9_ec_torn_label_on_a_degraded_pool() {
    replay(6, 8000029, &torn_label_on_a_degraded_pool_ops());
}
