//! Logs an operator can live with: 900 garbage connections to the NBD and NVMe/TCP ports
//! write a bounded number of lines (the lines remote clients cause are rate-limited; it
//! was 823 lines before), the node keeps serving real clients, and the connect and
//! disconnect lines of those clients carry their fields, in text and in JSON.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::io::Write;
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_nvmf::initiator::{Controller, Options};

const NQN: &str = "nqn.2024-01.io.tessera:vol0";

/// `tessera up` with a chosen log format, its stderr in a file; killed when dropped.
struct Node {
    child: Child,
    log: std::path::PathBuf,
    nbd: String,
    nvmf: String,
    _dir: Box<dyn std::any::Any>,
}

impl Node {
    fn start(format: &str) -> Node {
        let dir = temp_dir("log-limits");
        let (p1, p2, p3) = (free_port(), free_port(), free_port());
        let log = dir.path().join("node.log");
        let mut child = Command::new(BIN)
            .args(["--log-format", format, "up", "--cores", "2", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--nbd", &format!("127.0.0.1:{p1}")])
            .args(["--nvmf", &format!("127.0.0.1:{p2}")])
            .args(["--nvmf-discovery", &format!("127.0.0.1:{p3}")])
            .args(["--iscsi", ""])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start tessera");
        let out = child.stdout.take().unwrap();
        let ready = await_ready(out, Duration::from_secs(30));
        let mut n = Node {
            child,
            log,
            nbd: format!("127.0.0.1:{p1}"),
            nvmf: format!("127.0.0.1:{p2}"),
            _dir: Box::new(dir),
        };
        if ready.is_none() {
            let _ = n.child.kill();
            panic!("node did not become ready:\n{}", n.log_text());
        }
        n
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `count` connections to `addr` that each send junk and hang up, from 8 threads.
fn garbage(addr: &str, count: usize) {
    std::thread::scope(|s| {
        for t in 0..8 {
            s.spawn(move || {
                for i in (t..count).step_by(8) {
                    let Ok(mut c) = TcpStream::connect(addr) else {
                        continue;
                    };
                    let junk: Vec<u8> = (0..200).map(|k| (i * 31 + k * 7) as u8 | 1).collect();
                    let _ = c.write_all(&junk);
                    let _ = c.set_read_timeout(Some(Duration::from_millis(200)));
                    let _ = std::io::Read::read(&mut c, &mut [0u8; 256]);
                }
            });
        }
    });
}

/// A real NBD client and a real NVMe/TCP host write and read back.
fn real_clients(n: &Node) {
    let data = pattern(5, 8192);
    let mut c = NbdClient::connect_tcp(&n.nbd, "vol0", ClientOptions::default()).unwrap();
    c.write(1 << 20, &data, false).unwrap();
    let mut got = vec![0u8; data.len()];
    c.read(1 << 20, &mut got).unwrap();
    assert_eq!(got, data, "NBD read back after the garbage");
    c.disconnect().unwrap();
    let mut h = Controller::connect(&n.nvmf, NQN, &Options::default(), 1).unwrap();
    h.write(0, 1, (2 << 20) / 512, &data, 512).unwrap();
    let got = h.read(0, 1, (2 << 20) / 512, 16, 512).unwrap();
    assert_eq!(got, data, "NVMe/TCP read back after the garbage");
    h.disconnect();
}

/// Wait (bounded) until the log has `what` (the disconnect lines come from the reactors);
/// the log as it then is, which the caller checks.
fn wait_for_line(n: &Node, what: &str) -> String {
    let (Ok(t) | Err(t)) = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || n.log_text(),
        |t| t.contains(what),
    );
    t
}

fn flood_then_serve(format: &str) -> String {
    let n = Node::start(format);
    let before = n.log_text().lines().count();
    let t0 = Instant::now();
    garbage(&n.nbd, 450);
    garbage(&n.nvmf, 450);
    real_clients(&n);
    let text = wait_for_line(&n, "nvmf: host disconnected");
    let lines = text.lines().count() - before;
    // 10 lines per kind per 10 s window (two kinds), the summaries, and the four
    // session lines of the real clients.
    let windows = t0.elapsed().as_secs() as usize / 10 + 1;
    let bound = windows * 2 * 11 + 8;
    assert!(
        lines <= bound,
        "{lines} log lines (bound {bound}) after 900 garbage connections:\n{text}"
    );
    text
}

#[test]
fn garbage_is_rate_limited_and_sessions_are_logged_in_json() {
    let text = flood_then_serve("json");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let find = |msg: &str| {
        lines
            .iter()
            .find(|l| l["fields"]["message"] == msg)
            .unwrap_or_else(|| panic!("no {msg:?} line in:\n{text}"))
            .clone()
    };
    let c = find("nbd: client connected");
    assert_eq!(c["level"], "INFO");
    assert_eq!(c["fields"]["protocol"], "nbd");
    assert_eq!(c["fields"]["export"], "vol0");
    assert_eq!(c["fields"]["volume"], "vol0");
    assert_eq!(c["fields"]["pool"], "pool0");
    assert!(c["fields"]["client"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:"));
    assert!(c["timestamp"].is_string());
    let d = find("nbd: client disconnected");
    assert_eq!(d["fields"]["client"], c["fields"]["client"]);
    assert_eq!(d["fields"]["write_bytes"], 8192);
    assert_eq!(d["fields"]["read_bytes"], 8192);
    assert!(d["fields"]["duration_s"].is_number());
    let h = find("nvmf: host connected");
    assert_eq!(h["fields"]["protocol"], "nvme-tcp");
    assert_eq!(h["fields"]["subnqn"], NQN);
    assert!(h["fields"]["hostnqn"].as_str().unwrap().starts_with("nqn."));
    assert!(h["fields"]["client"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:"));
    let io_queue = lines
        .iter()
        .filter(|l| l["fields"]["message"] == "nvmf: host disconnected")
        .find(|l| l["fields"]["qid"] == 1)
        .unwrap_or_else(|| panic!("no I/O queue disconnect line:\n{text}"));
    assert_eq!(io_queue["fields"]["subnqn"], NQN);
    assert_eq!(io_queue["fields"]["write_bytes"], 8192);
    // The garbage itself was reported, with the client's address.
    let bad = find("nbd: handshake failed");
    assert!(bad["fields"]["client"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:"));
    find("nvmf: terminating the connection");
}

#[test]
fn garbage_is_rate_limited_and_sessions_are_logged_in_text() {
    let text = flood_then_serve("text");
    let line = |msg: &str| {
        text.lines()
            .find(|l| l.contains(msg))
            .unwrap_or_else(|| panic!("no {msg:?} line in:\n{text}"))
            .to_string()
    };
    let c = line("nbd: client connected");
    for f in [
        "INFO",
        "protocol=\"nbd\"",
        "client=127.0.0.1:",
        "export=vol0",
        "volume=vol0",
        "pool=pool0",
    ] {
        assert!(c.contains(f), "{f} missing: {c}");
    }
    let d = line("nbd: client disconnected");
    for f in ["write_bytes=8192", "read_bytes=8192", "duration_s="] {
        assert!(d.contains(f), "{f} missing: {d}");
    }
    let h = line("nvmf: host disconnected");
    for f in ["protocol=\"nvme-tcp\"", "client=127.0.0.1:", "hostnqn="] {
        assert!(h.contains(f), "{f} missing: {h}");
    }
}
