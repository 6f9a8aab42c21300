//! `tessera nvmf perf` against a real node at queue depth 128: in-capsule writes, R2T
//! writes (H2CData), large reads, digests, several queues. Every run must finish on time
//! with I/O done and no error: neither side may stop reading while the other waits on it.
//! And a host that floods a queue far past its size without reading the answers must get
//! every answer exactly once when it finally reads, and the queue must go on working.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_nvmf::initiator::{Controller, Options};
use tessera_nvmf::nvme::{self, Sqe};
use tessera_nvmf::pdu;

const NQN: &str = "nqn.2024-01.io.tessera.test:perf";

/// A node with a 256 MiB volume exported over NVMe/TCP; returns it and the I/O address.
fn setup(tag: &str) -> (TestNode, String) {
    let (p1, p2) = (free_port(), free_port());
    let node = TestNode::start_with_config(
        tag,
        &format!("[nvmf]\nlisten = \"127.0.0.1:{p1}\"\ndiscovery = \"127.0.0.1:{p2}\"\n"),
    );
    let img = format!("{}:512M", node.dir.join("p.img").display());
    node.cli_ok(&["pool", "create", "p", &img]);
    node.cli_ok(&["volume", "create", "v", "--pool", "p", "--size", "256M"]);
    node.cli_ok(&[
        "nvmf",
        "subsystem",
        "add",
        NQN,
        "--volume",
        "v",
        "--allow-any-host",
    ]);
    (node, format!("127.0.0.1:{p1}"))
}

/// Run `tessera nvmf perf` for `secs` seconds, killed if it is not done well after that;
/// returns the RESULT line's fields.
fn nvmf_perf(
    n: &TestNode,
    addr: &str,
    pattern: &str,
    bs: &str,
    extra: &[&str],
) -> HashMap<String, f64> {
    let secs = 2;
    let mut child = Command::new(BIN)
        .args([
            "nvmf",
            "perf",
            "--addr",
            addr,
            "--nqn",
            NQN,
            "--pattern",
            pattern,
        ])
        .args(["--bs", bs, "--qd", "128", "--size", "256M"])
        .args(["--time", &secs.to_string()])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tessera nvmf perf");
    let deadline = Instant::now() + Duration::from_secs(secs + 40);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!(
                "nvmf perf {pattern} bs={bs} {extra:?} hung:\n{}{}\nnode log:\n{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr),
                n.log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let what = format!("nvmf perf {pattern} bs={bs} {extra:?}");
    assert!(
        o.status.success(),
        "{what} failed: {stdout}{stderr}\nnode log:\n{}",
        n.log_text()
    );
    result_fields(&stdout, &stderr, &what)
}

#[test]
fn nvmf_perf_at_queue_depth_128_completes_for_small_large_and_r2t_blocks() {
    let _alone = crate::alone();
    let (n, addr) = setup("nvmf-perf");
    let runs: &[(&str, &str, &[&str])] = &[
        // Writes first, so that reads then hit allocated data.
        ("randwrite", "4K", &[]),
        ("randread", "4K", &[]),
        // Larger than the 8 KiB in-capsule limit: R2T, one H2CData PDU each.
        ("randwrite", "128K", &[]),
        ("randread", "128K", &[]),
        // Eight H2CData PDUs per command; 128 MiB asked for at once per queue.
        ("randwrite", "1M", &["--queues", "2"]),
        ("randread", "1M", &[]),
        ("randwrite", "256K", &["--hdgst", "--ddgst"]),
        ("randrw", "4K", &["--queues", "2", "--ddgst"]),
    ];
    for &(pattern, bs, extra) in runs {
        let r = nvmf_perf(&n, &addr, pattern, bs, extra);
        assert_eq!(r["errors"], 0.0, "{pattern} {bs} {extra:?}: {r:?}");
        assert!(r["iops"] > 0.0, "{pattern} {bs} {extra:?}: {r:?}");
    }
}

fn read_cmd(cid: u16, slba: u64, bytes: u32) -> Sqe {
    Sqe {
        opc: nvme::IO_READ,
        cid,
        nsid: 1,
        cdw10: slba as u32,
        cdw11: (slba >> 32) as u32,
        cdw12: bytes / 512 - 1,
        ..Sqe::default()
    }
    .with_sgl(nvme::SGL_TRANSPORT_DATA_BLOCK, bytes)
}

/// Read PDUs until every command in `cids` has completed; returns the status of each
/// (a second completion for a command, or one for an unknown command, fails the test).
fn collect(q: &mut tessera_nvmf::initiator::Queue, cids: &[u16]) -> HashMap<u16, u16> {
    let mut done = HashMap::new();
    while done.len() < cids.len() {
        let (f, b) = q.recv_pdu().expect("a PDU from the target");
        let (cid, status) = match f.ch.ty {
            pdu::CAPSULE_RESP => (pdu::le16(&b, 20), pdu::le16(&b, 22) >> 1),
            pdu::C2H_DATA if f.ch.flags & pdu::F_DATA_SUCCESS != 0 => (pdu::le16(&b, 8), 0),
            pdu::C2H_DATA => continue,
            t => panic!("unexpected PDU type {t:#x}"),
        };
        assert!(
            cids.contains(&cid),
            "completion for command {cid}, never sent"
        );
        assert!(
            done.insert(cid, status).is_none(),
            "second completion for command {cid}"
        );
    }
    done
}

#[test]
fn a_host_flooding_its_queue_without_reading_gets_each_answer_once() {
    let _alone = crate::alone();
    let (_n, addr) = setup("nvmf-flood");
    let o = Options {
        queue_size: 32,
        ..Options::default()
    };
    let mut c = Controller::connect(&addr, NQN, &o, 1).unwrap();
    let mut q = c.io.remove(0);
    // 400 reads of 128 KiB, far past the 32 entries agreed at Connect, and nothing read:
    // the target answers what it can, its send stalls on our full receive buffer, it
    // runs out of slots and stops taking commands, which wait in its receive buffer.
    let first: Vec<u16> = (0..400).collect();
    let mut burst = Vec::new();
    let fr = q.framing;
    for &cid in &first {
        let mut h = [0u8; 160];
        let n = fr.capsule_cmd(
            &mut h,
            &read_cmd(cid, cid as u64 * 256, 128 << 10).encode(),
            0,
        );
        burst.extend_from_slice(&h[..n]);
    }
    q.stream.write_all(&burst).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // Now read: every command is answered once, with data or Command Sequence Error.
    let st = collect(&mut q, &first);
    let ok = st.values().filter(|&&s| s & 0x7FF == 0).count();
    assert!(ok >= 32, "only {ok} of 400 reads succeeded");
    for (&cid, &s) in &st {
        assert!(
            s & 0x7FF == 0 || s & 0x7FF == nvme::SC_CMD_SEQ_ERROR & 0x7FF,
            "command {cid}: status {s:#x}"
        );
    }
    // The queue is in step: new commands are answered, once each, successfully.
    for round in 0..5u16 {
        let cids: Vec<u16> = (0..16).map(|i| 1000 + round * 16 + i).collect();
        let mut b = Vec::new();
        for &cid in &cids {
            let mut h = [0u8; 160];
            let n = fr.capsule_cmd(&mut h, &read_cmd(cid, 7 * 256, 4096).encode(), 0);
            b.extend_from_slice(&h[..n]);
        }
        q.stream.write_all(&b).unwrap();
        let st = collect(&mut q, &cids);
        assert!(st.values().all(|&s| s == 0), "round {round}: {st:?}");
    }
}
