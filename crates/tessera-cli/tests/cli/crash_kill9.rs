//! SIGKILL under a write load: everything acknowledged by a FLUSH (or a FUA write) before
//! the kill reads back after a restart; anything else reads back as either the durable
//! version or one of the versions written after it, never as garbage. Space accounting
//! stays consistent across crashes.
//!
//! The same under a write-back cache tier (issue 24) on a slow pool: there every write
//! acknowledged before the kill reads back (its data and the record that finds it were
//! on the cache devices before the acknowledgement), flushed or not.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_nbd::client::{ClientOptions, NbdClient};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;
const THREADS: u64 = 4;
/// Each writer thread owns one region of the volume.
const REGION: u64 = 64 * MIB;
const BLOCKS_PER_REGION: u64 = REGION / BLOCK;
const CYCLES: u64 = 3;
const LOAD: Duration = Duration::from_secs(2);

/// The contents of one block: 0 = never written (zeros), otherwise the generation whose
/// pattern it holds.
type Gen = u64;

#[derive(Clone, Debug, Default)]
struct BlockState {
    /// Known durable: acknowledged by a FLUSH or a FUA write (or read back after a restart
    /// and flushed).
    durable: Gen,
    /// Written (or sent) after the last durable point; any of them may have landed.
    later: Vec<Gen>,
}

impl BlockState {
    fn allows(&self, g: Gen) -> bool {
        g == self.durable || self.later.contains(&g)
    }
}

/// Block number -> state, for one region or all of them.
type State = HashMap<u64, BlockState>;

fn connect(n: &TestNode) -> NbdClient {
    let s = TcpStream::connect(n.addr()).expect("connect");
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    NbdClient::from_stream(s, "vol0", ClientOptions::default()).expect("NBD handshake")
}

struct WriterResult {
    state: State,
    writes: u64,
    flushes: u64,
    error: Option<String>,
}

/// Write random blocks of region `t` until the connection breaks (the node was killed)
/// or `stop` is set, tracking what is durable.
fn writer(
    mut c: NbdClient,
    t: u64,
    cycle: u64,
    mut state: State,
    stop: Arc<AtomicBool>,
    acked_is_durable: bool,
) -> WriterResult {
    let mut rng = Rng((0x1234_5678_9abc_def1u64 ^ (t << 48) ^ (cycle << 32)) | 1);
    let first = t * BLOCKS_PER_REGION;
    let mut since_flush: Vec<u64> = Vec::new();
    let (mut writes, mut flushes, mut seq) = (0u64, 0u64, 0u64);
    let mut error = None;
    while !stop.load(Ordering::Relaxed) {
        seq += 1;
        let block = first + rng.next() % BLOCKS_PER_REGION;
        let gen: Gen = ((cycle + 1) << 40) | (t << 32) | seq;
        // Recorded before sending: once sent, it may land whatever happens next.
        state.entry(block).or_default().later.push(gen);
        let fua = seq % 13 == 0;
        if let Err(e) = c.write(block * BLOCK, &stamped(block, gen), fua) {
            error = Some(format!("write: {e}"));
            break;
        }
        writes += 1;
        if fua || acked_is_durable {
            let s = state.get_mut(&block).unwrap();
            s.durable = gen;
            s.later.clear();
        } else {
            since_flush.push(block);
        }
        if seq % 50 == 0 {
            if let Err(e) = c.flush() {
                error = Some(format!("flush: {e}"));
                break;
            }
            flushes += 1;
            // Every write acknowledged before the flush was sent is durable now: with one
            // request at a time, that is the newest write of each block.
            for b in since_flush.drain(..) {
                let s = state.get_mut(&b).unwrap();
                if let Some(&last) = s.later.last() {
                    s.durable = last;
                    s.later.clear();
                }
            }
        }
    }
    WriterResult {
        state,
        writes,
        flushes,
        error,
    }
}

/// Read every block of every region and check it against the recorded state; then flush
/// and make what was read the new durable state.
fn verify(n: &TestNode, state: &mut State, when: &str) -> (u64, u64) {
    let mut c = connect(n);
    let chunk = 4 * MIB;
    let mut buf = vec![0u8; chunk as usize];
    let mut failures = Vec::new();
    let (mut checked_durable, mut later_landed) = (0u64, 0u64);
    let mut observed: HashMap<u64, Gen> = HashMap::new();
    for off in (0..THREADS * REGION).step_by(chunk as usize) {
        c.read(off, &mut buf).unwrap_or_else(|e| {
            panic!(
                "{when}: read {chunk} at {off}: {e}\nnode log:\n{}",
                n.log_text()
            )
        });
        for (i, data) in buf.chunks(BLOCK as usize).enumerate() {
            let block = off / BLOCK + i as u64;
            let st = state.get(&block).cloned().unwrap_or_default();
            match decode_stamped(block, data) {
                Ok(g) if st.allows(g) => {
                    if st.durable != 0 {
                        checked_durable += 1;
                    }
                    if g != st.durable {
                        later_landed += 1;
                    }
                    if g != 0 {
                        observed.insert(block, g);
                    }
                }
                Ok(g) => failures.push(format!(
                    "block {block} (offset {}): generation {g:#x}, expected durable {:#x} or one of {:x?}",
                    block * BLOCK,
                    st.durable,
                    st.later
                )),
                Err(e) => failures.push(format!(
                    "block {block} (offset {}): {e}; expected durable {:#x} or one of {:x?}",
                    block * BLOCK,
                    st.durable,
                    st.later
                )),
            }
        }
    }
    if !failures.is_empty() {
        let n_fail = failures.len();
        failures.truncate(20);
        panic!(
            "{when}: {n_fail} block(s) read back wrong:\n{}\nnode log:\n{}",
            failures.join("\n"),
            n.log_text()
        );
    }
    // What we read is now the state of the volume; make it durable before relying on it.
    c.flush().expect("flush after verification");
    for (b, st) in state.iter_mut() {
        st.durable = observed.get(b).copied().unwrap_or(0);
        st.later.clear();
    }
    (checked_durable, later_landed)
}

/// Allocation is consistent: nothing leaked, nothing counted twice, nothing missing.
fn check_accounting(n: &TestNode, state: &State, when: &str) {
    let st = n.json(&["status"]);
    let vols = n.json(&["volume", "list"]);
    let cap = st["capacity"].as_u64().expect("status capacity");
    let alloc = st["allocated"].as_u64().expect("status allocated");
    assert!(alloc <= cap, "{when}: allocated {alloc} > capacity {cap}");
    assert_eq!(
        st["free"].as_u64(),
        Some(cap - alloc),
        "{when}: free != capacity - allocated: {st}"
    );
    let mut pool_sum = 0;
    for p in st["pools"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let pa = p["allocated"].as_u64().unwrap();
        assert!(
            pa <= p["capacity"].as_u64().unwrap(),
            "{when}: pool {name}: {p}"
        );
        let vsum: u64 = vols
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["pool"] == name)
            .map(|v| v["allocated"].as_u64().unwrap())
            .sum();
        assert_eq!(pa, vsum, "{when}: pool {name} has {pa} bytes allocated but its volumes {vsum} (leak or double count)");
        pool_sum += pa;
    }
    assert_eq!(alloc, pool_sum, "{when}: status allocated vs sum of pools");
    let vol0 = vols
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "vol0")
        .expect("vol0 listed");
    let va = vol0["allocated"].as_u64().unwrap();
    // Only the first THREADS * REGION bytes were ever written.
    assert!(
        va <= THREADS * REGION,
        "{when}: vol0 has {va} bytes allocated, only {} were ever written to",
        THREADS * REGION
    );
    // Every unit holding data must be allocated.
    let mut units: Vec<u64> = state
        .iter()
        .filter(|(_, s)| s.durable != 0)
        .map(|(b, _)| b * BLOCK / MIB)
        .collect();
    units.sort_unstable();
    units.dedup();
    assert!(
        va >= units.len() as u64 * MIB,
        "{when}: vol0 has {va} bytes allocated but data in {} units",
        units.len()
    );
}

/// One writer per region for `LOAD`, then `before_kill(n)` and a SIGKILL while the
/// writers are in the middle of their requests. Every writer must notice the kill; what
/// they wrote joins `state`. Returns their results and how long they took to notice.
fn load_then_kill(
    n: &mut TestNode,
    state: &mut State,
    cycle: u64,
    acked_is_durable: bool,
    before_kill: impl FnOnce(&TestNode),
) -> (Vec<WriterResult>, Duration) {
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for t in 0..THREADS {
        let c = connect(n);
        let region: State = state
            .iter()
            .filter(|(b, _)| **b / BLOCKS_PER_REGION == t)
            .map(|(b, s)| (*b, s.clone()))
            .collect();
        let stop = stop.clone();
        handles.push(std::thread::spawn(move || {
            writer(c, t, cycle, region, stop, acked_is_durable)
        }));
    }
    std::thread::sleep(LOAD);
    before_kill(n);
    n.kill9();
    let t0 = Instant::now();
    let mut results = Vec::new();
    for h in handles {
        let mut r = h.join().expect("writer thread panicked");
        assert!(
            r.error.is_some(),
            "cycle {cycle}: a writer did not notice the kill"
        );
        state.extend(std::mem::take(&mut r.state));
        results.push(r);
    }
    let noticed = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    (results, noticed)
}

#[test]
fn kill9_under_write_load_keeps_flushed_data() {
    let mut n = TestNode::start_default("kill9");
    let mut state: State = HashMap::new();
    for cycle in 0..CYCLES {
        let (results, noticed) = load_then_kill(&mut n, &mut state, cycle, false, |_| {});
        let (mut writes, mut flushes) = (0, 0);
        for r in results {
            assert!(
                r.writes > 50 && r.flushes > 0,
                "cycle {cycle}: a writer made no progress ({} writes, {} flushes): {:?}",
                r.writes,
                r.flushes,
                r.error
            );
            writes += r.writes;
            flushes += r.flushes;
        }
        assert!(
            noticed < Duration::from_secs(15),
            "writers took {noticed:?} to notice the kill"
        );

        n.restart();
        let when =
            format!("cycle {cycle} ({writes} writes, {flushes} flushes) after SIGKILL + restart");
        let (durable, landed) = verify(&n, &mut state, &when);
        eprintln!(
            "{when}: {} blocks tracked, {durable} durable checked, {landed} later writes landed",
            state.len()
        );
        assert!(durable > 0, "{when}: nothing was durable");
        check_accounting(&n, &state, &when);
    }
    // One more restart without load: the state read and flushed last time is all there.
    n.kill9();
    n.restart();
    verify(&n, &mut state, "final restart");
    check_accounting(&n, &state, "final restart");
    assert!(n.is_running());
}

/// A node whose volume `vol0` (4 regions) lives on a pool of one slow file (2 ms per I/O)
/// under a write-back cache of two mirrored files, every unit allocated and flushed.
fn write_back_node() -> (TestNode, State) {
    let n = TestNode::start_with_config("kill9-wb", "");
    let d = path_str(&n.dir);
    n.cli_ok(&[
        "pool",
        "create",
        "p",
        &format!("fault:{d}/slow.img:400M;latency_us=2000"),
        "--cache",
        &format!("{d}/c0.img:96M,{d}/c1.img:96M"),
        "--cache-mode",
        "write-back",
        "--cache-unit",
        "64K",
    ]);
    let size = format!("{}", THREADS * REGION);
    n.cli_ok(&["volume", "create", "vol0", "--pool", "p", "--size", &size]);
    n.cli_ok(&["export", "add", "vol0", "--volume", "vol0"]);
    // Every unit allocated and its mapping durable: a kill -9 before a commit loses a
    // new unit's mapping with or without a cache (docs/format.md §3).
    const PREFILL: Gen = 1 << 60;
    let mut c = connect(&n);
    let mut state = State::new();
    let chunk = MIB;
    for off in (0..THREADS * REGION).step_by(chunk as usize) {
        let mut buf = Vec::with_capacity(chunk as usize);
        for b in off / BLOCK..(off + chunk) / BLOCK {
            buf.extend_from_slice(&stamped(b, PREFILL));
            state.insert(
                b,
                BlockState {
                    durable: PREFILL,
                    later: Vec::new(),
                },
            );
        }
        c.write(off, &buf, false).expect("prefill");
    }
    c.flush().expect("flush the prefill");
    (n, state)
}

#[test]
fn kill9_in_write_back_keeps_every_acknowledged_write() {
    let (mut n, mut state) = write_back_node();
    let mut dirty_seen = 0;
    for cycle in 0..2u64 {
        let mut before = serde_json::Value::Null;
        let (results, _) = load_then_kill(&mut n, &mut state, cycle, true, |n| {
            before = n.json(&["pool", "cache", "show", "p"]);
        });
        let writes: u64 = results.iter().map(|r| r.writes).sum();
        let dirty = before["dirty_bytes"].as_u64().unwrap_or(0);
        eprintln!(
            "cycle {cycle}: {writes} writes; {dirty} bytes dirty in the cache just before the kill"
        );
        dirty_seen += dirty;
        n.restart();
        let after = n.json(&["pool", "cache", "show", "p"]);
        assert_eq!(after["mode"], "write-back", "{after}");
        let when = format!("write-back cycle {cycle} ({writes} writes) after SIGKILL + restart");
        let (durable, _) = verify(&n, &mut state, &when);
        assert!(durable > 0, "{when}: nothing checked");
        check_accounting(&n, &state, &when);
    }
    assert!(
        dirty_seen > 0,
        "no write was ever only in the cache at a kill"
    );
    assert!(n.is_running());
}
