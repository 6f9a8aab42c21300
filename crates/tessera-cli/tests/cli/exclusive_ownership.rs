//! Exclusive ownership of data (docs/architecture.md "Exclusive ownership"): a second node
//! on a data directory that a node holds stops at once, having opened nothing; a device
//! that a pool holds cannot be claimed by another pool, in the same node or another one,
//! not even with --force; a device labelled for another pool is refused for `pool
//! create`, `pool replace` and `pool spare add` unless --force. In every case the first
//! owner's data reads back byte for byte. Real `tessera` processes on 127.0.0.1; every
//! wait is bounded.

use crate::common;
use common::*;

use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_nbd::client::{ClientOptions, NbdClient};

const BLOCK: usize = 64 << 10;
/// The part of each volume the tests write and verify.
const SPAN: usize = 8 << 20;

fn connect(n: &TestNode, export: &str) -> NbdClient {
    let s = TcpStream::connect(n.addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    NbdClient::from_stream(s, export, ClientOptions::default()).expect("NBD handshake")
}

/// The pattern `seed` over the first SPAN bytes of `export`, flushed.
fn write_pattern(n: &TestNode, export: &str, seed: u64) {
    let mut c = connect(n, export);
    for i in 0..SPAN / BLOCK {
        c.write((i * BLOCK) as u64, &block(i, seed, BLOCK), false)
            .unwrap();
    }
    c.flush().unwrap();
    c.disconnect().unwrap();
}

/// Every byte of the first SPAN bytes of `export` is pattern `seed`.
fn verify_pattern(n: &TestNode, export: &str, seed: u64, when: &str) {
    let mut c = connect(n, export);
    let mut buf = vec![0u8; BLOCK];
    for i in 0..SPAN / BLOCK {
        c.read((i * BLOCK) as u64, &mut buf).unwrap();
        assert!(
            buf == block(i, seed, BLOCK),
            "{export}: block {i} differs from pattern {seed} ({when})"
        );
    }
    c.disconnect().unwrap();
}

/// What a `tessera` process that must fail did.
struct Refusal {
    code: Option<i32>,
    stderr: String,
    took: Duration,
}

/// Run `tessera ARGS` (a node that must not start), bounded by 15 s; kill it if it runs
/// longer and fail the test.
fn run_refused(args: &[&str]) -> Refusal {
    let t0 = Instant::now();
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tessera");
    let deadline = t0 + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tessera {args:?} was still running after 15 s: it should have refused");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = t0.elapsed();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    Refusal {
        code: status.code(),
        stderr,
        took,
    }
}

fn pool_names(n: &TestNode) -> Vec<String> {
    let v = n.json(&["pool", "list"]);
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect()
}

fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json") || p.ends_with(".lock"))
        .map(|p| (path_str(&p), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn a_second_node_on_the_same_data_dir_refuses_at_once() {
    // Node A: a mirror on two files and a RAM pool (what a second node used to resync
    // and recreate), each with a volume and an export.
    let tmp = temp_dir("own-dir-cfg");
    let d = path_str(tmp.path());
    let extra = format!(
        "[nvmf]\nenabled = false\n\
         [[pool]]\nname = \"m\"\ndevices = [\"{d}/a.img:64M\", \"{d}/b.img:64M\"]\nlayout = \"raid1\"\n\
         [[pool]]\nname = \"r\"\ndevices = [\"ram:64M\"]\n\
         [[volume]]\nname = \"v\"\npool = \"m\"\nsize = \"32M\"\n\
         [[volume]]\nname = \"rv\"\npool = \"r\"\nsize = \"32M\"\n\
         [[export]]\nname = \"v\"\nvolume = \"v\"\n\
         [[export]]\nname = \"rv\"\nvolume = \"rv\"\n"
    );
    let mut a = TestNode::start_with_config("own-dir", &extra);
    write_pattern(&a, "v", 1);
    write_pattern(&a, "rv", 2);
    let data = path_str(&a.data_dir);
    let before = files_of(&a.data_dir);
    let holder = format!("pid {}", a.pid());

    // B: `tessera up` on A's data directory, another NBD port.
    let other_port = free_port();
    let other = format!("127.0.0.1:{other_port}");
    let up = run_refused(&[
        "up",
        "--data-dir",
        &data,
        "--nbd",
        &other,
        "--nvmf",
        "",
        "--cores",
        "1",
    ]);
    // B: `tessera node` with A's config, another NBD port.
    let cfg = std::fs::read_to_string(a.config.as_ref().unwrap())
        .unwrap()
        .replace(&a.addr(), &other);
    let cfg_b = tmp.path().join("b.toml");
    std::fs::write(&cfg_b, cfg).unwrap();
    let node = run_refused(&["node", "--config", &path_str(&cfg_b)]);

    for (what, r) in [("up", &up), ("node --config", &node)] {
        eprintln!("{what}: refused in {:.0} ms", r.took.as_secs_f64() * 1e3);
        assert!(
            r.code.is_some_and(|c| c != 0),
            "{what} exited with {:?}",
            r.code
        );
        assert!(
            r.stderr.contains("is in use by another tessera node") && r.stderr.contains(&holder),
            "{what}: the error should name the lock and its holder ({holder}): {}",
            r.stderr
        );
        assert!(
            r.took < Duration::from_secs(2),
            "{what} took {:?} to refuse",
            r.took
        );
    }
    // B touched nothing: no embedded pool created, the catalogs and the lock as they were.
    assert!(!a.data_dir.join("pool0.img").exists());
    assert_eq!(files_of(&a.data_dir), before);
    // A kept serving: its data is intact, it takes writes, its log has no second opener.
    assert!(a.is_running());
    verify_pattern(&a, "v", 1, "after the second nodes");
    verify_pattern(&a, "rv", 2, "after the second nodes");
    write_pattern(&a, "v", 3);
    verify_pattern(&a, "v", 3, "rewritten");
    // And after a clean restart: the mirror comes back clean (nobody else opened it).
    a.stop();
    a.restart();
    verify_pattern(&a, "v", 3, "after a restart");
    assert!(
        !a.log_text().contains("not shut down cleanly"),
        "{}",
        a.log_text()
    );
    // With A gone, the directory is free again: B's very config, refused above, now starts
    // on A's data directory and serves A's data.
    a.stop();
    a.config = Some(cfg_b);
    a.port = other_port;
    a.restart();
    verify_pattern(&a, "v", 3, "B on A's directory after A stopped");
    assert!(
        !a.log_text().contains("is in use by another tessera node"),
        "{}",
        a.log_text()
    );
    a.stop();
}

#[test]
fn two_pools_cannot_claim_one_device() {
    let a = TestNode::start_with_config("own-dev-a", "[nvmf]\nenabled = false\n");
    let d = path_str(&a.dir);
    let shared = format!("{d}/shared.img");
    a.cli_ok(&["pool", "create", "p1", &format!("{shared}:64M")]);
    a.cli_ok(&["volume", "create", "v1", "--pool", "p1", "--size", "32M"]);
    a.cli_ok(&["export", "add", "v1", "--volume", "v1"]);
    write_pattern(&a, "v1", 7);

    // The same node, the same file: by its path, by another spelling, by a symlink,
    // with and without --force.
    std::os::unix::fs::symlink(&shared, a.dir.join("link.img")).unwrap();
    let dotted = format!("{d}/./shared.img");
    let link = format!("{d}/link.img");
    for dev in [&shared, &dotted, &link] {
        let e = a.cli_fails(&["pool", "create", "p2", dev]);
        assert!(e.contains("shared.img") || e.contains(dev.as_str()), "{e}");
        let e = a.cli_fails(&["pool", "create", "p2", dev, "--force"]);
        assert!(
            e.contains("in use") || e.contains("already used by a pool"),
            "{dev} --force: {e}"
        );
    }
    // A hard link is another path to the same file: its lock refuses it, in a raid1
    // pool next to a fresh device, with --force.
    let hard = format!("{d}/hard.img");
    std::fs::hard_link(&shared, &hard).unwrap();
    let e = a.cli_fails(&[
        "pool",
        "create",
        "p3",
        "--layout",
        "raid1",
        &format!("{d}/fresh.img:64M"),
        &hard,
        "--force",
    ]);
    assert!(
        e.contains("hard.img is in use") && e.contains("pool 'p1'"),
        "{e}"
    );
    assert_eq!(pool_names(&a), vec!["p1".to_string()]);

    // Another node, its own data directory: the file is held by A's process.
    let b = TestNode::start_with_config("own-dev-b", "[nvmf]\nenabled = false\n");
    let e = b.cli_fails(&["pool", "create", "q", &shared]);
    assert!(
        e.contains("p1"),
        "the error should name the owning pool: {e}"
    );
    let e = b.cli_fails(&["pool", "create", "q", &shared, "--force"]);
    assert!(
        e.contains("in use") && e.contains(&format!("process {}", a.pid())),
        "the error should say the device is in use, and by whom: {e}"
    );
    assert!(pool_names(&b).is_empty());

    // A's data is intact, now and after a restart (its label was not overwritten).
    verify_pattern(&a, "v1", 7, "after the claims");
    let mut a = a;
    a.stop();
    a.restart();
    verify_pattern(&a, "v1", 7, "after a restart");
    assert_eq!(pool_names(&a), vec!["p1".to_string()]);
}

#[test]
fn a_device_labelled_for_another_pool_needs_force() {
    // A donor node labels three files for its pools, and stops (it holds nothing then).
    let mut donor = TestNode::start_with_config("own-label-donor", "[nvmf]\nenabled = false\n");
    let dd = path_str(&donor.dir);
    for (pool, file) in [("other", "x"), ("other2", "y"), ("other3", "z")] {
        donor.cli_ok(&["pool", "create", pool, &format!("{dd}/{file}.img:64M")]);
    }
    donor.stop();
    let x = format!("{dd}/x.img");
    let y = format!("{dd}/y.img");
    let z = format!("{dd}/z.img");

    let mut n = TestNode::start_with_config("own-label", "[nvmf]\nenabled = false\n");
    let d = path_str(&n.dir);
    // pool create: refused, naming the pool; --force takes it.
    let e = n.cli_fails(&["pool", "create", "new", &x]);
    assert!(e.contains("'other'") && e.contains("--force"), "{e}");
    n.cli_ok(&["pool", "create", "new", &x, "--force"]);

    // A mirror whose device 1 is lost.
    n.cli_ok(&[
        "pool",
        "create",
        "m",
        "--layout",
        "raid1",
        &format!("{d}/m0.img:64M"),
        &format!("{d}/m1.img:64M"),
    ]);
    n.cli_ok(&["volume", "create", "v", "--pool", "m", "--size", "32M"]);
    n.cli_ok(&["export", "add", "v", "--volume", "v"]);
    write_pattern(&n, "v", 11);
    // pool spare add: refused, naming the pool; --force takes it and wipes its label. (On
    // the healthy pool: a degraded one takes a new spare into a rebuild at once, and the
    // remove below would race it.)
    let e = n.cli_fails(&["pool", "spare", "add", "m", &z]);
    assert!(e.contains("'other3'") && e.contains("--force"), "{e}");
    n.cli_ok(&["pool", "spare", "add", "m", &z, "--force"]);
    let label = std::fs::read(&z).unwrap();
    assert!(
        label[..8192].iter().all(|&b| b == 0),
        "the forced spare's label was not wiped"
    );
    n.cli_ok(&["pool", "spare", "remove", "m", &z]);
    n.stop();
    std::fs::remove_file(n.dir.join("m1.img")).unwrap();
    n.restart();
    let p: Value = n.json(&["pool", "status", "m"]);
    assert_eq!(p["device_states"][1]["state"], "failed", "{p}");

    // pool replace: refused, naming the pool; --force takes it, and the rebuild onto it
    // restores every byte.
    let e = n.cli_fails(&["pool", "replace", "m", "--device", "1", &y]);
    assert!(e.contains("'other2'") && e.contains("--force"), "{e}");
    let out = n.cli_ok(&["pool", "replace", "m", "--device", "1", &y, "--force"]);
    assert!(out.contains("rebuilding"), "{out}");
    let out = n.cli_ok(&["pool", "rebuild", "m", "--status", "--wait"]);
    assert!(out.contains("done"), "{out}");
    verify_pattern(&n, "v", 11, "after the replace");
    // The old copy goes: the replacement serves every byte.
    n.stop();
    std::fs::remove_file(n.dir.join("m0.img")).unwrap();
    n.restart();
    let p: Value = n.json(&["pool", "status", "m"]);
    assert_eq!(p["device_states"][1]["state"], "online", "{p}");
    verify_pattern(&n, "v", 11, "from the replacement alone");
}
