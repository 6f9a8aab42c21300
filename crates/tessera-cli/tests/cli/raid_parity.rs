//! Parity pools (raid5) through a real node, its CLI and NBD, on file devices, where the
//! node process is killed (SIGKILL):
//!
//! - a raid5 device is lost, replaced by a file full of other data, and the rebuild onto
//!   it is killed with SIGKILL mid-way: it resumes from its cursor, completes, every byte
//!   reads back, a new volume's first writes into units that were free read zeros around
//!   them, and all of it still does once another device is gone (so the rebuilt device
//!   holds the right data, zeros in free units included);
//! - the write hole at node level: SIGKILL under a 4 KiB random write load, then a restart
//!   with one data device failing every read: each block reads back as a version that was
//!   acknowledged (or was in flight) at the kill, never as garbage.
//!
//! fio's verify on a raid6 pool with a device vanishing mid-run is tested in process, in
//! `crates/tessera-node/tests/node/raid_parity.rs`.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::collections::HashMap;
use std::net::TcpStream;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_testkit::node::run_bounded;

const MIB: u64 = 1 << 20;

// ------------------------------------------------------------------ helpers --

fn pool(n: &TestNode, name: &str) -> Value {
    let out = cli(n, &["pool", "list", "--json"]);
    let v: Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("invalid JSON ({e}): {out}"));
    v.as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("pool {name} not listed: {out}"))
}

fn rebuild_json(n: &TestNode, name: &str) -> Value {
    let out = cli(n, &["--json", "pool", "rebuild", name, "--status"]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("invalid JSON ({e}): {out}"))
}

/// Change the spec of device `index` of pool `name` in DATA_DIR/pools.json (node stopped):
/// how a test switches fault injection on for the next start.
fn set_device_spec(n: &TestNode, name: &str, index: usize, spec: &str) {
    assert!(n.child.is_none(), "stop the node before editing pools.json");
    let path = n.data_dir.join("pools.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    let entry = v
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("pool {name} not in pools.json: {text}"));
    entry["devices"][index] = Value::String(spec.to_string());
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn connect(n: &TestNode, export: &str) -> NbdClient {
    let s = TcpStream::connect(n.addr()).expect("connect");
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    NbdClient::from_stream(s, export, ClientOptions::default()).expect("NBD handshake")
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// The 4 KiB block of (block, generation): the test kit's [`stamped`] pattern;
/// generation 0 is all zeros (never written).
fn pattern(block: u64, gen: u64) -> Vec<u8> {
    if gen == 0 {
        return vec![0; 4096];
    }
    stamped(block, gen)
}

/// Write 4 KiB blocks `first..first + count` with generations `gen(block)`, 64 KiB per
/// request.
fn write_range(c: &mut NbdClient, first: u64, count: u64, gen: impl Fn(u64) -> u64) {
    let per = 16;
    let mut b = first;
    while b < first + count {
        let k = per.min(first + count - b);
        let mut buf = Vec::with_capacity((k * 4096) as usize);
        for i in b..b + k {
            buf.extend_from_slice(&pattern(i, gen(i)));
        }
        c.write(b * 4096, &buf, false)
            .unwrap_or_else(|e| panic!("write at block {b}: {e}"));
        b += k;
    }
}

/// Read blocks `0..model.len()` and compare each with `model[block]`.
fn verify_model(n: &TestNode, export: &str, model: &[u64], when: &str) {
    let mut c = connect(n, export);
    let chunk = 256u64; // blocks per read (1 MiB)
    let mut buf = vec![0u8; (chunk * 4096) as usize];
    let mut failures = Vec::new();
    let total = model.len() as u64;
    let mut b = 0;
    while b < total {
        let k = chunk.min(total - b);
        let buf = &mut buf[..(k * 4096) as usize];
        c.read(b * 4096, buf)
            .unwrap_or_else(|e| panic!("{when}: read at block {b}: {e}"));
        for (i, data) in buf.chunks(4096).enumerate() {
            let blk = b + i as u64;
            let want = model[blk as usize];
            match decode_stamped(blk, data) {
                Ok(g) if g == want => {}
                Ok(g) => failures.push(format!(
                    "block {blk}: generation {g:#x}, expected {want:#x}"
                )),
                Err(e) => failures.push(format!("block {blk}: {e}, expected {want:#x}")),
            }
        }
        b += k;
    }
    if !failures.is_empty() {
        let nf = failures.len();
        failures.truncate(20);
        panic!(
            "{when}: {nf} of {total} blocks read back wrong:\n{}\nnode log:\n{}",
            failures.join("\n"),
            n.log_text()
        );
    }
}

/// `tessera --api ... ARGS`, insisting on success within `secs` (the harness's
/// `cli_ok` waits forever, and a hung node would hang the test).
fn cli_t(n: &TestNode, secs: u64, args: &[&str]) -> String {
    let o = run_bounded(
        Command::new(BIN).arg("--api").arg(n.api()).args(args),
        &n.dir,
        secs,
    )
    .unwrap_or_else(|e| {
        panic!(
            "tessera {args:?}: {e}\n(the node hung?)\nnode log:\n{}",
            n.log_text()
        )
    });
    cli_stdout(args, &o)
}

/// [`cli_t`] with 30 s.
fn cli(n: &TestNode, args: &[&str]) -> String {
    cli_t(n, 30, args)
}

// ------------------------------------ a. kill -9 during a parity rebuild --

const B_BLOCKS: u64 = (40 * MIB) / 4096;

#[test]
fn kill9_during_parity_rebuild_resumes_and_completes() {
    let mut n = TestNode::start_with_config("raid5-rebuild", "");
    let d = path_str(&n.dir);
    let devs: Vec<String> = ["a", "b", "c", "d"]
        .iter()
        .map(|x| format!("{d}/{x}.img:64M"))
        .collect();
    let mut args = vec![
        "pool",
        "create",
        "p",
        "--layout",
        "raid5",
        "--stripe-size",
        "64K",
    ];
    args.extend(devs.iter().map(String::as_str));
    cli(&n, &args);
    cli(
        &n,
        &["volume", "create", "v", "--pool", "p", "--size", "40M"],
    );
    cli(&n, &["export", "add", "v", "--volume", "v"]);
    assert_eq!(pool(&n, "p")["layout"], "raid5");

    // The whole volume, generation 1.
    let mut model = vec![1u64; B_BLOCKS as usize];
    {
        let mut c = connect(&n, "v");
        write_range(&mut c, 0, B_BLOCKS, |_| 1);
        c.flush().unwrap();
    }

    // Device b vanishes half a second after the next start.
    n.stop();
    set_device_spec(
        &n,
        "p",
        1,
        &format!("fault:{d}/b.img:64M;vanish_after_ms=500"),
    );
    n.restart();
    {
        // Keep writing (a 64 KiB block every 50 ms) until the datapath notices.
        let mut c = connect(&n, "v");
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut i = 0u64;
        while pool(&n, "p")["state"] != "degraded" {
            assert!(
                Instant::now() < deadline,
                "device b never failed: {}",
                pool(&n, "p")
            );
            let first = (i * 16 * 37) % B_BLOCKS;
            write_range(&mut c, first, 16, |_| 2);
            c.flush().unwrap();
            for b in first..first + 16 {
                model[b as usize] = 2;
            }
            i += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
        // Degraded writes: every 5th 4 KiB block.
        for b in (3..B_BLOCKS).step_by(5) {
            c.write(b * 4096, &pattern(b, 3), false).unwrap();
            model[b as usize] = 3;
        }
        c.flush().unwrap();
    }
    let p = pool(&n, "p");
    assert_eq!(p["device_states"][1]["state"], "failed", "{p}");
    verify_model(&n, "v", &model, "degraded, before the replace");

    // Replace b by a file that is not blank (a disk that held other data), live: the
    // rebuild onto it starts at once, slowly.
    cli(&n, &["background", "set", "rebuild", "--bw", "4M"]);
    let mut x = 0x6a75_6e6b_u64;
    let junk: Vec<u8> = (0..64 * MIB / 8)
        .flat_map(|_| xorshift(&mut x).to_le_bytes())
        .collect();
    std::fs::write(format!("{d}/e.img"), junk).unwrap();
    let e = format!("{d}/e.img:64M");
    let out = cli(&n, &["pool", "replace", "p", "--device", "1", &e]);
    assert!(out.contains("rebuilding"), "{out}");
    let v = rebuild_json(&n, "p");
    assert_eq!(v["device"], 1, "{v}");
    let total = v["units_total"].as_u64().unwrap();
    assert!(total > 40, "{v}");
    // Kill it once well past the first persisted cursor (every 16 units), well before
    // the end.
    let deadline = Instant::now() + Duration::from_secs(40);
    let before = loop {
        let v = rebuild_json(&n, "p");
        assert_eq!(v["state"], "running", "rebuild ended before the kill: {v}");
        if v["units_done"].as_u64().unwrap() >= 24 {
            break v;
        }
        assert!(Instant::now() < deadline, "rebuild made no progress: {v}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let done_before = before["units_done"].as_u64().unwrap();
    assert!(done_before < total, "{before}");
    assert_eq!(pool(&n, "p")["state"], "rebuilding");
    n.kill9();
    // The cursor the node persisted (every 16 units, after a device sync) is past 0.
    let cursor_path = n.data_dir.join("rebuild-p.json");
    let text = std::fs::read_to_string(&cursor_path)
        .unwrap_or_else(|e| panic!("no rebuild cursor at {}: {e}", cursor_path.display()));
    let cursor: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(cursor["device"], 1, "{text}");
    let next_unit = cursor["next_unit"].as_u64().unwrap();
    assert!(
        next_unit > 0,
        "cursor still at unit 0 after {before}: {text}"
    );
    n.restart();

    // It resumes from its cursor, not from 0. (The job's thread fills in
    // `resumed_at_unit_count` when it starts running, which can be a moment after the
    // node is ready on a busy machine: wait for it, boundedly.)
    let deadline = Instant::now() + Duration::from_secs(10);
    let (v, resumed) = loop {
        let v = rebuild_json(&n, "p");
        let resumed = v["resumed_at_unit_count"].as_u64().unwrap();
        if resumed > 0 || Instant::now() > deadline {
            break (v, resumed);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        resumed > 0,
        "did not resume: {v} (was {before}, cursor {text})"
    );
    assert!(resumed <= done_before, "{v} vs {before}");
    eprintln!(
        "rebuild killed at {done_before}/{total} units, cursor at unit {next_unit}, resumed with {resumed} units done"
    );
    // Client writes while it runs.
    {
        let mut c = connect(&n, "v");
        for b in (1..B_BLOCKS).step_by(11) {
            c.write(b * 4096, &pattern(b, 4), false).unwrap();
            model[b as usize] = 4;
        }
        c.flush().unwrap();
    }
    cli(&n, &["background", "set", "rebuild", "--bw", "512M"]);
    let out = cli(&n, &["pool", "rebuild", "p", "--status", "--wait"]);
    assert!(out.contains("done") && out.contains("100.0%"), "{out}");
    let p = pool(&n, "p");
    assert_eq!(p["state"], "online", "{p}");
    assert!(p["devices"][1].as_str().unwrap().contains("e.img"), "{p}");
    verify_model(&n, "v", &model, "after the rebuild");
    // Units that were free during the rebuild: a new volume's first 4 KiB write into
    // each reads zeros around it, not what the replacement held there.
    cli(
        &n,
        &["volume", "create", "w", "--pool", "p", "--size", "16M"],
    );
    cli(&n, &["export", "add", "w", "--volume", "w"]);
    let mut model_w = vec![0u64; (16 * MIB / 4096) as usize];
    {
        let mut c = connect(&n, "w");
        for b in (7..model_w.len() as u64).step_by(256) {
            c.write(b * 4096, &pattern(b, 5), false).unwrap();
            model_w[b as usize] = 5;
        }
        c.flush().unwrap();
    }
    verify_model(&n, "w", &model_w, "new volume after the rebuild");

    // Another device goes: reads of its chunks are reconstructed from the others,
    // including the rebuilt one.
    n.stop();
    std::fs::remove_file(n.dir.join("a.img")).unwrap();
    n.restart();
    let p = pool(&n, "p");
    assert_eq!(p["state"], "degraded", "{p}");
    assert_eq!(p["device_states"][0]["state"], "failed", "{p}");
    assert_eq!(p["device_states"][1]["state"], "online", "{p}");
    verify_model(&n, "v", &model, "after the rebuild, device a gone");
    verify_model(
        &n,
        "w",
        &model_w,
        "new volume after the rebuild, device a gone",
    );
}

// ------------------------------------------------- b. the write hole --

const C_THREADS: u64 = 6;
/// Each writer owns one region of the volume.
const C_REGION_BLOCKS: u64 = (8 * MIB) / 4096;
const C_LOAD: Duration = Duration::from_millis(2500);
const C_CYCLES: u64 = 3;

#[derive(Clone, Debug, Default)]
struct BlockState {
    /// Acknowledged by a FLUSH (or written with FUA).
    durable: u64,
    /// The last acknowledged write.
    acked: u64,
    /// Sent, not acknowledged when the node died.
    in_flight: Option<u64>,
    /// Everything written since `durable` (including `in_flight`).
    later: Vec<u64>,
}

struct WriterResult {
    state: HashMap<u64, BlockState>,
    writes: u64,
    flushes: u64,
    error: Option<String>,
}

fn writer(
    mut c: NbdClient,
    cycle: u64,
    t: u64,
    mut state: HashMap<u64, BlockState>,
    stop: Arc<AtomicBool>,
) -> WriterResult {
    let mut rng = (0x1234_5678_9abc_def1u64 ^ (t << 48) ^ (cycle << 40)) | 1;
    let first = t * C_REGION_BLOCKS;
    let mut since_flush = Vec::new();
    let (mut writes, mut flushes, mut seq) = (0u64, 0u64, 0u64);
    let mut error = None;
    while !stop.load(Ordering::Relaxed) {
        seq += 1;
        let block = first + xorshift(&mut rng) % C_REGION_BLOCKS;
        let gen = (2 << 40) | (t << 32) | seq;
        {
            let s = state.entry(block).or_default();
            s.later.push(gen);
            s.in_flight = Some(gen);
        }
        let fua = seq % 13 == 0;
        if let Err(e) = c.write(block * 4096, &pattern(block, gen), fua) {
            error = Some(format!("write: {e}"));
            break;
        }
        writes += 1;
        let s = state.get_mut(&block).unwrap();
        s.in_flight = None;
        s.acked = gen;
        if fua {
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
            for b in since_flush.drain(..) {
                let s = state.get_mut(&b).unwrap();
                s.durable = s.acked;
                s.later.clear();
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

/// One cycle of the write-hole test on a fresh raid5 pool `p{cycle}` (devices
/// `{cycle}-a.img` .. `{cycle}-d.img`) with volume and export `v{cycle}`: prefill and
/// flush, 4 KiB random overwrites from `C_THREADS` connections, SIGKILL mid-flight,
/// restart with device `failing` reading EIO over its whole data area, and read every
/// block back.
fn write_hole_cycle(n: &mut TestNode, cycle: u64, failing: usize) {
    let d = path_str(&n.dir);
    let (pool_name, vol) = (format!("p{cycle}"), format!("v{cycle}"));
    let devs: Vec<String> = ["a", "b", "c", "d"]
        .iter()
        .map(|x| format!("{d}/{cycle}-{x}.img:64M"))
        .collect();
    let mut args = vec![
        "pool",
        "create",
        &pool_name,
        "--layout",
        "raid5",
        "--stripe-size",
        "64K",
    ];
    args.extend(devs.iter().map(String::as_str));
    cli(n, &args);
    let blocks = C_THREADS * C_REGION_BLOCKS;
    let size = format!("{}", blocks * 4096);
    cli(
        n,
        &[
            "volume", "create", &vol, "--pool", &pool_name, "--size", &size,
        ],
    );
    cli(n, &["export", "add", &vol, "--volume", &vol]);

    // Prefill (generation 1) and flush: every unit is mapped, so what follows are
    // overwrites (partial-row read-modify-writes) of durable data.
    {
        let mut c = connect(n, &vol);
        write_range(&mut c, 0, blocks, |_| 1);
        c.flush().unwrap();
    }
    let mut state: HashMap<u64, BlockState> = (0..blocks)
        .map(|b| {
            let s = BlockState {
                durable: 1,
                acked: 1,
                ..Default::default()
            };
            (b, s)
        })
        .collect();

    // Writers, one connection each, random 4 KiB writes (FUA every 13th, FLUSH every
    // 50th), killed mid-flight.
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for t in 0..C_THREADS {
        let c = connect(n, &vol);
        let region: HashMap<u64, BlockState> = state
            .iter()
            .filter(|(b, _)| **b / C_REGION_BLOCKS == t)
            .map(|(b, s)| (*b, s.clone()))
            .collect();
        let stop = stop.clone();
        handles.push(std::thread::spawn(move || {
            writer(c, cycle, t, region, stop)
        }));
    }
    std::thread::sleep(C_LOAD);
    n.kill9();
    let t0 = Instant::now();
    let (mut writes, mut flushes, mut in_flight) = (0, 0, 0);
    for h in handles {
        let r = h.join().expect("writer thread panicked");
        assert!(
            r.error.is_some(),
            "cycle {cycle}: a writer did not notice the kill"
        );
        assert!(
            r.writes > 50 && r.flushes > 0,
            "cycle {cycle}: a writer made no progress ({} writes, {} flushes): {:?}",
            r.writes,
            r.flushes,
            r.error
        );
        writes += r.writes;
        flushes += r.flushes;
        in_flight += r.state.values().filter(|s| s.in_flight.is_some()).count();
        state.extend(r.state);
    }
    stop.store(true, Ordering::Relaxed);
    assert!(
        t0.elapsed() < Duration::from_secs(25),
        "cycle {cycle}: writers took {:?} to notice the kill",
        t0.elapsed()
    );

    // Restart with device `failing` reading EIO over its data area (17 MiB on): label
    // and stripe journal still read, so the pool opens with it healthy, recovers its
    // journal, and the device fails on the first data read.
    let spec = format!(
        "fault:{d}/{cycle}-{}.img:64M;fail_read={}-{}",
        ["a", "b", "c", "d"][failing],
        17 * MIB,
        1u64 << 40
    );
    set_device_spec(n, &pool_name, failing, &spec);
    n.restart();

    let when = format!(
        "cycle {cycle}: after SIGKILL ({writes} writes, {flushes} flushes, {in_flight} in flight) and a restart with device {failing} failing reads"
    );
    let mut c = connect(n, &vol);
    let chunk = 256u64;
    let mut buf = vec![0u8; (chunk * 4096) as usize];
    let mut failures = Vec::new();
    let mut lost_acked = Vec::new();
    let mut newer = 0u64;
    let mut b = 0;
    while b < blocks {
        c.read(b * 4096, &mut buf).unwrap_or_else(|e| {
            panic!(
                "{when}: read at block {b}: {e}\nnode log:\n{}",
                n.log_text()
            )
        });
        for (i, data) in buf.chunks(4096).enumerate() {
            let blk = b + i as u64;
            let st = &state[&blk];
            match decode_stamped(blk, data) {
                // Acknowledged writes are all there (a write in flight may or may not be).
                Ok(g) if g == st.acked || Some(g) == st.in_flight => {
                    if g != st.durable {
                        newer += 1;
                    }
                }
                // NBD only promises what a FLUSH/FUA covered: an older version written
                // since is a lost acknowledged (unflushed) write, or a stale journal
                // record replayed over newer data; not garbage, reported separately.
                Ok(g) if g == st.durable || st.later.contains(&g) => lost_acked.push(format!(
                    "block {blk}: generation {g:#x}, last acknowledged {:#x} (durable {:#x})",
                    st.acked, st.durable
                )),
                Ok(g) => failures.push(format!(
                    "block {blk} (offset {}): generation {g:#x}, expected {:#x} (acknowledged) or in-flight {:x?}",
                    blk * 4096,
                    st.acked,
                    st.in_flight
                )),
                Err(e) => failures.push(format!(
                    "block {blk} (offset {}): {e}; expected {:#x} (acknowledged) or in-flight {:x?}",
                    blk * 4096,
                    st.acked,
                    st.in_flight
                )),
            }
        }
        b += chunk;
    }
    if !failures.is_empty() {
        let nf = failures.len();
        failures.truncate(20);
        panic!(
            "{when}: {nf} block(s) read back as garbage or as a version never written:\n{}\nnode log:\n{}",
            failures.join("\n"),
            n.log_text()
        );
    }
    if !lost_acked.is_empty() {
        let nl = lost_acked.len();
        lost_acked.truncate(20);
        panic!(
            "{when}: {nl} acknowledged write(s) read back as an older version:\n{}\nnode log:\n{}",
            lost_acked.join("\n"),
            n.log_text()
        );
    }
    eprintln!("{when}: {blocks} blocks checked, {newer} newer than their last flush");
    let p = pool(n, &pool_name);
    assert_eq!(p["state"], "degraded", "{when}: {p}");
    for i in 0..4 {
        let want = if i == failing { "failed" } else { "online" };
        assert_eq!(p["device_states"][i]["state"], want, "{when}: {p}");
    }
}

#[test]
fn kill9_mid_writes_then_device_failure_reads_correct() {
    let mut n = TestNode::start_with_config("raid5-writehole", "");
    // Each cycle a fresh pool (the earlier ones stay degraded), a different device
    // failing: a data or parity chunk of every row, by rotation.
    for cycle in 0..C_CYCLES {
        write_hole_cycle(&mut n, cycle, (cycle as usize + 1) % 4);
    }
}
