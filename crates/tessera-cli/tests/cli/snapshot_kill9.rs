//! SIGKILL of a node while NBD writers load a volume and snapshots are created, cloned,
//! written through, rolled back and deleted (issue 14's crash consistency for a real
//! process; the pool-level power-loss model is `tessera-pool/tests/snapshots.rs`).
//!
//! Every write is a 4 KiB pattern naming its block and generation, each block written
//! by one writer at a time, so what a block may hold after the restart follows from
//! the times writes were sent and acknowledged:
//! - a snapshot whose create returned exists (unless its delete returned) and holds, per
//!   block, the last write acknowledged before the create was sent, or a write sent
//!   before it returned (the point lies between); one whose create was cut by the kill
//!   may exist, and then holds the same with "returned" at the kill;
//! - the volume holds the last write acknowledged before its newest durable point (a
//!   completed flush, which commits the pool, or a completed snapshot create) or any
//!   write after it;
//! - a clone holds its snapshot's blocks, with its own flushed writes until a rollback
//!   to the snapshot returned.
//!
//! Snapshots and clones that survive are then pinned to what was read, and the next
//! cycle must find them exactly so. The scrub's chain checks find nothing after each.

// Test code sizes buffers from its own small constants.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::collections::{BTreeMap, HashMap};
use std::net::TcpStream;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_nbd::client::{ClientOptions, NbdClient};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;
const WRITERS: u64 = 3;
/// Each writer owns one region of the volume.
const REGION_BLOCKS: u64 = 1024;
const VOLUME_BLOCKS: u64 = WRITERS * REGION_BLOCKS;
const CYCLES: u64 = 2;
const LOAD: Duration = Duration::from_millis(3500);
/// Snapshots the control thread takes per cycle at most (then it waits for the kill),
/// which bounds the verification's reads on a slow machine.
const SNAPSHOTS_PER_CYCLE: u64 = 16;
/// Generation tag of the writes into clones.
const CLONE_WRITER: u64 = 0xFF;

type Gen = u64;

fn connect(n: &TestNode, export: &str) -> NbdClient {
    let s = TcpStream::connect(n.addr()).expect("connect");
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    NbdClient::from_stream(s, export, ClientOptions::default()).expect("NBD handshake")
}

/// One write as its writer saw it.
struct Write {
    block: u64,
    gen: Gen,
    sent: Instant,
    acked: Option<Instant>,
}

struct WriterLog {
    writes: Vec<Write>,
    /// When each flush that completed was sent.
    flushes: Vec<Instant>,
    error: Option<String>,
}

fn writer(mut c: NbdClient, t: u64, cycle: u64, stop: Arc<AtomicBool>) -> WriterLog {
    let mut rng = Rng((0x5eed_0000_1234_5678u64 ^ (t << 48) ^ (cycle << 32)) | 1);
    let mut log = WriterLog {
        writes: Vec::new(),
        flushes: Vec::new(),
        error: None,
    };
    let mut seq = 0u64;
    while !stop.load(Ordering::Relaxed) {
        seq += 1;
        let block = t * REGION_BLOCKS + rng.next() % REGION_BLOCKS;
        let gen = ((cycle + 1) << 48) | ((t + 1) << 40) | seq;
        log.writes.push(Write {
            block,
            gen,
            sent: Instant::now(),
            acked: None,
        });
        if let Err(e) = c.write(block * BLOCK, &stamped(block, gen), false) {
            log.error = Some(format!("write: {e}"));
            break;
        }
        log.writes.last_mut().unwrap().acked = Some(Instant::now());
        if seq.is_multiple_of(16) {
            let sent = Instant::now();
            if let Err(e) = c.flush() {
                log.error = Some(format!("flush: {e}"));
                break;
            }
            log.flushes.push(sent);
        }
    }
    log
}

/// How an operation of the control thread ended: it returned, or the kill cut it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Done {
    Yes,
    InDoubt,
}

struct SnapRec {
    name: String,
    cycle: u64,
    /// Create sent; returned (`None`: cut by the kill).
    t0: Instant,
    t1: Option<Instant>,
    deleted: Option<Done>,
    /// Exactly what it holds, once verified after a restart.
    pinned: Option<Vec<Gen>>,
}

struct CloneRec {
    name: String,
    snap: String,
    created: Done,
    /// Its own writes (block, generation), and whether their flush completed.
    writes: Vec<(u64, Gen)>,
    writes_durable: bool,
    rolled_back: Option<Done>,
    pinned: Option<Vec<Gen>>,
}

#[derive(Default)]
struct Chain {
    snaps: Vec<SnapRec>,
    clones: Vec<CloneRec>,
}

/// `tessera --api API ARGS` (the control thread cannot borrow the node, which the main
/// thread kills).
fn cli(api: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("--api")
        .arg(api)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run tessera cli")
}

/// Run a CLI command of the control thread: `Done::Yes` when it succeeded,
/// `Done::InDoubt` when it failed because the node was killed (the control thread stops
/// then), a panic for any other failure.
fn control_op(api: &str, killed: &AtomicBool, args: &[&str]) -> Done {
    let o = cli(api, args);
    if o.status.success() {
        return Done::Yes;
    }
    if killed.load(Ordering::SeqCst) {
        return Done::InDoubt;
    }
    panic!(
        "tessera {args:?} failed under load: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Snapshot, clone, write into the clone and roll it back, delete older snapshots, in
/// a loop until the node dies. Everything is recorded in `chain` before it is sent.
fn control(
    api: String,
    addr: String,
    cycle: u64,
    chain: Arc<Mutex<Chain>>,
    killed: Arc<AtomicBool>,
) {
    let mut rng = Rng(0xc0ff_ee00_0000_0001u64 ^ (cycle << 20));
    for i in 0..SNAPSHOTS_PER_CYCLE {
        std::thread::sleep(Duration::from_millis(60 + rng.next() % 80));
        let name = format!("c{cycle}s{i}");
        let t0 = Instant::now();
        chain.lock().unwrap().snaps.push(SnapRec {
            name: name.clone(),
            cycle,
            t0,
            t1: None,
            deleted: None,
            pinned: None,
        });
        if control_op(&api, &killed, &["snapshot", "create", "v", "--name", &name]) == Done::InDoubt
        {
            return;
        }
        chain.lock().unwrap().snaps.last_mut().unwrap().t1 = Some(Instant::now());

        if i % 2 == 1 {
            // A clone of it, written through an export of its own, then rolled back to
            // the snapshot (some of the time).
            let clone = format!("c{cycle}k{i}");
            chain.lock().unwrap().clones.push(CloneRec {
                name: clone.clone(),
                snap: name.clone(),
                created: Done::InDoubt,
                writes: Vec::new(),
                writes_durable: false,
                rolled_back: None,
                pinned: None,
            });
            let rec =
                |f: &dyn Fn(&mut CloneRec)| f(chain.lock().unwrap().clones.last_mut().unwrap());
            if control_op(&api, &killed, &["volume", "clone", &name, "--name", &clone])
                == Done::InDoubt
            {
                return;
            }
            rec(&|c| c.created = Done::Yes);
            if control_op(
                &api,
                &killed,
                &["export", "add", &clone, "--volume", &clone],
            ) == Done::InDoubt
            {
                return;
            }
            // An NBD failure is only expected once the node is being killed.
            let died = |e: std::io::Error| {
                assert!(killed.load(Ordering::SeqCst), "NBD to clone {clone}: {e}");
            };
            let s = match TcpStream::connect(&addr) {
                Ok(s) => s,
                Err(e) => return died(e),
            };
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut c = match NbdClient::from_stream(s, &clone, ClientOptions::default()) {
                Ok(c) => c,
                Err(e) => return died(e),
            };
            for j in 0..8u64 {
                // Distinct blocks, so each holds one write of the clone.
                let block = rng.next() % (VOLUME_BLOCKS / 8) * 8 + j;
                let gen = ((cycle + 1) << 48) | (CLONE_WRITER << 40) | (i << 8) | j;
                rec(&|c| c.writes.push((block, gen)));
                if let Err(e) = c.write(block * BLOCK, &stamped(block, gen), false) {
                    return died(e);
                }
            }
            if let Err(e) = c.flush() {
                return died(e);
            }
            rec(&|c| c.writes_durable = true);
            let _ = c.disconnect();
            if control_op(&api, &killed, &["export", "remove", &clone]) == Done::InDoubt {
                return;
            }
            if i % 4 == 3 {
                rec(&|c| c.rolled_back = Some(Done::InDoubt));
                // The connection's handle goes a moment after the client hangs up.
                let mut tries = 0;
                loop {
                    let o = cli(&api, &["volume", "rollback", &clone, "--to", &name]);
                    if o.status.success() {
                        rec(&|c| c.rolled_back = Some(Done::Yes));
                        break;
                    }
                    if killed.load(Ordering::SeqCst) {
                        return;
                    }
                    tries += 1;
                    assert!(
                        tries < 100 && String::from_utf8_lossy(&o.stderr).contains("in use"),
                        "rollback of {clone}: {}",
                        String::from_utf8_lossy(&o.stderr)
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }

        if i % 3 == 2 {
            // Delete the snapshot two creates back (in the middle of the chain; a clone
            // may still read through it).
            let old = {
                let mut ch = chain.lock().unwrap();
                let len = ch.snaps.len();
                let s = &mut ch.snaps[len - 3];
                if s.t1.is_none() || s.deleted.is_some() {
                    continue;
                }
                s.deleted = Some(Done::InDoubt);
                s.name.clone()
            };
            if control_op(&api, &killed, &["snapshot", "delete", &old]) == Done::InDoubt {
                return;
            }
            chain
                .lock()
                .unwrap()
                .snaps
                .iter_mut()
                .find(|s| s.name == old)
                .unwrap()
                .deleted = Some(Done::Yes);
        }
    }
}

/// Per block, its writes of this cycle in order (one writer per block, one request at a
/// time, so send order is the order they landed in).
fn histories(logs: &[WriterLog]) -> HashMap<u64, Vec<&Write>> {
    let mut h: HashMap<u64, Vec<&Write>> = HashMap::new();
    for l in logs {
        for w in &l.writes {
            h.entry(w.block).or_default().push(w);
        }
    }
    h
}

/// What block `b` may hold at a point in `[t0, t1]` of this cycle: the last write
/// acknowledged before `t0` (or `base` before any), or any later one sent before `t1`.
fn allowed_at(base: Gen, hist: Option<&Vec<&Write>>, t0: Instant, t1: Instant) -> Vec<Gen> {
    let Some(h) = hist else {
        return vec![base];
    };
    let last_acked = h.iter().rposition(|w| w.acked.is_some_and(|a| a < t0));
    let first = last_acked.map_or(base, |i| h[i].gen);
    let from = last_acked.map_or(0, |i| i + 1);
    let mut out = vec![first];
    out.extend(h[from..].iter().filter(|w| w.sent < t1).map(|w| w.gen));
    out
}

/// What block `b` of snapshot `s` may hold: exactly what it held when last verified, or
/// what the writes of its cycle allow between its create and its return (or the kill).
fn snap_allowed(
    s: &SnapRec,
    b: u64,
    base: &[Gen],
    hist: &HashMap<u64, Vec<&Write>>,
    kill: Instant,
) -> Vec<Gen> {
    match &s.pinned {
        Some(p) => vec![p[b as usize]],
        None => allowed_at(base[b as usize], hist.get(&b), s.t0, s.t1.unwrap_or(kill)),
    }
}

/// Read export `export` (a volume of `VOLUME_BLOCKS`) block by block as generations;
/// every block must decode.
fn read_gens(n: &TestNode, export: &str, what: &str) -> Vec<Gen> {
    let mut c = connect(n, export);
    let chunk = 4 * MIB;
    let mut buf = vec![0u8; chunk as usize];
    let mut out = Vec::with_capacity(VOLUME_BLOCKS as usize);
    let mut bad = Vec::new();
    for off in (0..VOLUME_BLOCKS * BLOCK).step_by(chunk as usize) {
        c.read(off, &mut buf).unwrap();
        for (i, data) in buf.chunks(BLOCK as usize).enumerate() {
            let block = off / BLOCK + i as u64;
            match decode_stamped(block, data) {
                Ok(g) => out.push(g),
                Err(e) => {
                    bad.push(format!("block {block}: {e}"));
                    out.push(u64::MAX);
                }
            }
        }
    }
    c.disconnect().unwrap();
    assert!(
        bad.is_empty(),
        "{what}: garbage read back:\n{}",
        bad.join("\n")
    );
    out
}

/// Read a snapshot or clone through a temporary export.
fn read_member(n: &TestNode, name: &str) -> Vec<Gen> {
    let export = format!("x-{name}");
    n.cli_ok(&["export", "add", &export, "--volume", name]);
    let g = read_gens(n, &export, name);
    n.cli_ok(&["export", "remove", &export]);
    g
}

fn check_blocks(what: &str, got: &[Gen], allowed: impl Fn(u64) -> Vec<Gen>) {
    let mut failures = Vec::new();
    for (b, &g) in got.iter().enumerate() {
        let ok = allowed(b as u64);
        if !ok.contains(&g) {
            failures.push(format!(
                "block {b}: generation {g:#x}, expected one of {ok:x?}"
            ));
        }
    }
    if !failures.is_empty() {
        let count = failures.len();
        failures.truncate(20);
        panic!("{what}: {count} block(s) wrong:\n{}", failures.join("\n"));
    }
}

#[test]
fn kill9_while_snapshots_clones_and_deletes_run_under_write_load() {
    let mut n = TestNode::start_with_config("snap-kill9", "");
    let img = format!("{}:2G", path_str(&n.dir.join("p.img")));
    n.cli_ok(&["pool", "create", "p", &img]);
    let size = format!("{}", VOLUME_BLOCKS * BLOCK);
    n.cli_ok(&["volume", "create", "v", "--pool", "p", "--size", &size]);
    n.cli_ok(&["export", "add", "v", "--volume", "v"]);
    // What the volume holds at the start of a cycle, exactly.
    let mut base: Vec<Gen> = vec![0; VOLUME_BLOCKS as usize];
    let chain = Arc::new(Mutex::new(Chain::default()));
    for cycle in 0..CYCLES {
        let stop = Arc::new(AtomicBool::new(false));
        let killed = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..WRITERS)
            .map(|t| {
                let c = connect(&n, "v");
                let stop = stop.clone();
                std::thread::spawn(move || writer(c, t, cycle, stop))
            })
            .collect();
        let ctl = {
            let (api, addr, chain, killed) = (n.api(), n.addr(), chain.clone(), killed.clone());
            std::thread::spawn(move || control(api, addr, cycle, chain, killed))
        };
        std::thread::sleep(LOAD);
        killed.store(true, Ordering::SeqCst);
        n.kill9();
        let kill = Instant::now();
        let logs: Vec<WriterLog> = writers.into_iter().map(|h| h.join().unwrap()).collect();
        stop.store(true, Ordering::Relaxed);
        ctl.join().expect("control thread");
        for (t, l) in logs.iter().enumerate() {
            assert!(
                l.error.is_some() && l.writes.len() > 20 && !l.flushes.is_empty(),
                "cycle {cycle}: writer {t} made no progress or missed the kill ({} writes, {} flushes, {:?})",
                l.writes.len(),
                l.flushes.len(),
                l.error
            );
        }
        n.restart();
        let when = format!("cycle {cycle} after SIGKILL + restart");
        let hist = histories(&logs);
        let vols = n.json(&["volume", "list"]);
        let exists = |name: &str| vols.as_array().unwrap().iter().any(|v| v["name"] == name);

        // Snapshots.
        let mut guard = chain.lock().unwrap();
        let Chain { snaps, clones } = &mut *guard;
        let (mut checked, mut created) = (0, 0);
        // Verified now (pinned after the clones are checked against the allowed sets).
        let mut verified: BTreeMap<String, Vec<Gen>> = BTreeMap::new();
        for s in snaps.iter() {
            let present = exists(&s.name);
            match (s.t1.is_some(), s.deleted) {
                (_, Some(Done::Yes)) => {
                    assert!(!present, "{when}: deleted snapshot {} is back", s.name)
                }
                (true, None) => assert!(present, "{when}: snapshot {} is lost", s.name),
                _ => {}
            }
            if !present {
                continue;
            }
            let got = read_member(&n, &s.name);
            let what = format!("{when}: snapshot {}", s.name);
            if s.pinned.is_none() {
                assert_eq!(s.cycle, cycle);
                created += 1;
            }
            check_blocks(&what, &got, |b| snap_allowed(s, b, &base, &hist, kill));
            checked += 1;
            verified.insert(s.name.clone(), got);
        }

        // The volume's newest durable point: a completed flush (it commits the pool) or
        // snapshot create (its checkpoint holds the volume's blocks as they were).
        let durable = logs
            .iter()
            .flat_map(|l| l.flushes.iter().copied())
            .chain(
                snaps
                    .iter()
                    .filter(|s| s.cycle == cycle && s.t1.is_some())
                    .map(|s| s.t0),
            )
            .max();

        // Clones: their snapshot's blocks, plus their own writes until rolled back.
        for c in clones.iter_mut() {
            let present = exists(&c.name);
            if c.created == Done::Yes {
                assert!(present, "{when}: clone {} is lost", c.name);
            }
            if !present {
                continue;
            }
            let got = read_member(&n, &c.name);
            let what = format!("{when}: clone {}", c.name);
            if let Some(p) = &c.pinned {
                assert!(got == *p, "{what} changed since it was last verified");
                continue;
            }
            let snap = snaps
                .iter()
                .find(|s| s.name == c.snap)
                .unwrap_or_else(|| panic!("{what}: its snapshot {} is unknown", c.snap));
            // Where the snapshot was read now, the clone shares exactly its blocks.
            let snap_read = verified.get(&c.snap);
            let own: HashMap<u64, Gen> = c.writes.iter().copied().collect();
            check_blocks(&what, &got, |b| {
                let mut ok = match snap_read {
                    Some(r) => vec![r[b as usize]],
                    None => snap_allowed(snap, b, &base, &hist, kill),
                };
                match (own.get(&b), c.rolled_back) {
                    (Some(&g), None) if c.writes_durable => ok = vec![g],
                    (Some(&g), None | Some(Done::InDoubt)) => ok.push(g),
                    _ => {}
                }
                ok
            });
            c.pinned = Some(got);
        }
        clones.retain(|c| c.pinned.is_some());
        for s in snaps.iter_mut() {
            if let Some(g) = verified.remove(&s.name) {
                s.pinned = Some(g);
            }
        }
        snaps.retain(|s| s.pinned.is_some());

        drop(guard);
        // The volume: its newest durable point, or anything written after it.
        let got = read_gens(&n, "v", &format!("{when}: volume"));
        check_blocks(&format!("{when}: volume"), &got, |b| {
            let h = hist.get(&b);
            let Some(d) = durable else {
                let mut ok = vec![base[b as usize]];
                ok.extend(h.into_iter().flatten().map(|w| w.gen));
                return ok;
            };
            // Everything sent at all may have landed.
            allowed_at(base[b as usize], h, d, kill + Duration::from_secs(3600))
        });
        // What was read is the state from now on; make it durable before relying on it.
        let mut c = connect(&n, "v");
        c.flush().unwrap();
        c.disconnect().unwrap();
        base = got;

        let scrub = n.json(&["pool", "scrub", "p", "--wait"]);
        assert_eq!(
            scrub["metadata_findings"].as_array().unwrap().len(),
            0,
            "{when}: {scrub}"
        );
        eprintln!(
            "{when}: {} writes, {checked} snapshots checked ({created} new), {} clones",
            logs.iter().map(|l| l.writes.len()).sum::<usize>(),
            chain.lock().unwrap().clones.len()
        );
        assert!(created > 0, "{when}: no snapshot was created under load");
    }
    assert!(n.is_running());
}
