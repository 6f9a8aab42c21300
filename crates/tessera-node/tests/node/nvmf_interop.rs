//! NVMe/TCP through the project's initiator against a node started in process, its
//! NVMe/TCP target started as `tessera run` starts it (loopback): identify consistent
//! with the volume, data crossing between NVMe/TCP and NBD, digests, several queues,
//! deallocate as holes, keep-alive teardown, bad PDUs, host allowlist, restart
//! persistence. The subsystems are made through the node's services, as the API's
//! `nvmf subsystem add` does. (Moved from `crates/tessera-cli/tests/cli/nvmf_interop.rs`.)

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tessera_api::LayoutSpec;
use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_nvmf::initiator::{self, Controller, Error, Options, Queue};
use tessera_nvmf::nvme::{self, Sqe};
use tessera_nvmf::pdu;
use tessera_testkit::node::free_port;

const NQN: &str = "nqn.2024-01.io.tessera.test:v";
const LBA: u32 = 512;

struct Setup {
    node: TestNode,
    io: String,
    disc: String,
}

fn setup(tag: &str, extra_hosts: &str) -> Setup {
    // The I/O port on port 0, the discovery port on a free one: two listeners, as the
    // CLI test's two free ports gave. After a restart the I/O port is a new one (the
    // stopped node's listener is still bound), and the discovery port cannot be bound
    // again (logged; no test uses discovery after a restart).
    let disc = format!("127.0.0.1:{}", free_port());
    let node = TestNode::with_config(tag, 2, |_| {
        format!("[nvmf]\nlisten = \"127.0.0.1:0\"\ndiscovery = \"{disc}\"\n")
    });
    let io = node.serve_nvmf();
    // A file-backed pool, so that data and volumes survive a restart.
    let n = node.node();
    n.create_pool(
        "p",
        &[node.file_dev("p.img", "256M")],
        LayoutSpec::default(),
        None,
        None,
        false,
    )
    .expect("create pool p");
    node.exported_volume("v", "p", 64 << 20);
    // `tessera nvmf subsystem add NQN --volume v (--allow-any-host | --host HOST)`.
    let hosts: Vec<String> = if extra_hosts.is_empty() {
        Vec::new()
    } else {
        vec![extra_hosts.to_string()]
    };
    n.nvmf_add_subsystem(NQN, extra_hosts.is_empty(), &hosts)
        .expect("add the subsystem");
    n.nvmf_add_namespace(NQN, "v", 0).expect("add namespace v");
    Setup { node, io, disc }
}

/// Connected controllers of the test's subsystem (`tessera --json nvmf subsystem list`).
fn controllers(s: &Setup) -> usize {
    s.node
        .node()
        .nvmf_get(NQN)
        .expect("the subsystem")
        .controllers
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn nbd(s: &Setup) -> NbdClient {
    NbdClient::connect_tcp(&s.node.addr(), "v", ClientOptions::default()).unwrap()
}

#[test]
fn identify_io_and_nbd_agree_with_and_without_digests() {
    let s = setup("nvmf-io", "");
    // Discovery lists the subsystem on the I/O port.
    let d = initiator::discover(&s.disc, &Options::default()).unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].subnqn, NQN);
    assert_eq!(format!("{}:{}", d[0].traddr, d[0].trsvcid), s.io);
    for (hd, dd) in [(false, false), (true, true), (true, false)] {
        let o = Options {
            hdgst: hd,
            ddgst: dd,
            ..Options::default()
        };
        let mut c = Controller::connect(&s.io, NQN, &o, 3).unwrap();
        assert_eq!(c.io.len(), 3);
        let id = c.identify(nvme::CNS_CONTROLLER, 0).unwrap();
        assert_eq!(pdu::le16(&id, 78), c.cntlid);
        assert_eq!(&id[768..768 + NQN.len()], NQN.as_bytes());
        assert_eq!(c.namespaces().unwrap(), vec![1]);
        assert_eq!(c.namespace_size(1).unwrap(), (64 << 20 >> 9, LBA));
        let n1 = c.identify(nvme::CNS_NS_DESC_LIST, 1).unwrap();
        let n2 = c.identify(nvme::CNS_NAMESPACE, 1).unwrap();
        assert_eq!(
            &n1[16..32],
            &n2[104..120],
            "NGUID descriptor = Identify NGUID"
        );
        // NVMe/TCP writes (in-capsule and via R2T) read back over NBD on each queue.
        for q in 0..3 {
            let small = pattern(q as u8 + 1, 4096);
            let big = pattern(q as u8 + 7, 64 << 10);
            let off = (q as u64) << 20;
            c.write(q, 1, off / 512, &small, LBA).unwrap();
            c.write(q, 1, (off + 8192) / 512, &big, LBA).unwrap();
            c.flush(q, 1).unwrap();
            let mut b = nbd(&s);
            let mut got = vec![0u8; 4096];
            b.read(off, &mut got).unwrap();
            assert_eq!(got, small);
            let mut got = vec![0u8; 64 << 10];
            b.read(off + 8192, &mut got).unwrap();
            assert_eq!(got, big);
            // And NBD writes read back over NVMe/TCP.
            let w = pattern(0xA5 ^ q as u8, 8192);
            b.write(off + 200 * 1024, &w, false).unwrap();
            b.flush().unwrap();
            b.disconnect().unwrap();
            assert_eq!(c.read(q, 1, (off + 200 * 1024) / 512, 16, LBA).unwrap(), w);
            c.compare(q, 1, (off + 200 * 1024) / 512, &w, LBA).unwrap();
            match c.compare(q, 1, (off + 200 * 1024) / 512, &small[..4096], LBA) {
                Err(Error::Status(st, _)) => assert_eq!(st & 0x7FF, nvme::SC_COMPARE_FAILED),
                r => panic!("compare of different data: {r:?}"),
            }
        }
        c.disconnect();
    }
}

#[test]
fn deallocate_shows_as_holes_and_errors_keep_the_queue() {
    let s = setup("nvmf-dealloc", "");
    let mut c = Controller::connect(&s.io, NQN, &Options::default(), 1).unwrap();
    let data = pattern(3, 1 << 20);
    c.write(0, 1, 4 << 11, &data[..128 << 10], LBA).unwrap();
    let before: u64 = {
        let n = c.identify(nvme::CNS_NAMESPACE, 1).unwrap();
        pdu::le64(&n, 16)
    };
    assert!(before >= 2048, "a unit is allocated: NUSE {before}");
    // Deallocate the whole 1 MiB unit at 4 MiB: it reads as zeros and NUSE drops.
    c.deallocate(0, 1, &[(4 << 11, 2048)]).unwrap();
    let n = c.identify(nvme::CNS_NAMESPACE, 1).unwrap();
    assert!(pdu::le64(&n, 16) < before);
    assert_eq!(
        c.read(0, 1, 4 << 11, 256, LBA).unwrap(),
        vec![0u8; 128 << 10]
    );
    // Write Zeroes with DEAC also reads as zeros.
    c.write(0, 1, 8 << 11, &data[..4096], LBA).unwrap();
    c.write_zeroes(0, 1, 8 << 11, 8, true).unwrap();
    assert_eq!(c.read(0, 1, 8 << 11, 8, LBA).unwrap(), vec![0u8; 4096]);
    // Out of range and bad namespace: the right status, and the queue keeps working.
    let blocks = 64 << 11;
    match c.read(0, 1, blocks - 4, 8, LBA) {
        Err(Error::Status(st, _)) => assert_eq!(st & 0x7FF, nvme::SC_LBA_RANGE),
        r => panic!("read past the end: {r:?}"),
    }
    match c.read(0, 9, 0, 8, LBA) {
        Err(Error::Status(st, _)) => assert_eq!(st & 0x7FF, nvme::SC_INVALID_NS),
        r => panic!("read of namespace 9: {r:?}"),
    }
    let err = c.get_log_page(nvme::LID_ERROR, 0, 64).unwrap();
    assert_eq!(pdu::le16(&err, 12) >> 1 & 0x7FF, nvme::SC_INVALID_NS);
    assert_eq!(c.read(0, 1, 0, 8, LBA).unwrap().len(), 4096);
    c.disconnect();
}

/// A raw queue: ICReq done, nothing else.
fn raw(addr: &str) -> Queue {
    Queue::open(addr, &Options::default()).unwrap()
}

fn expect_term(q: &mut Queue, fes: pdu::Fes) {
    match q.recv_pdu() {
        Err(Error::Terminated { fes: f, .. }) => assert_eq!(f, fes as u16),
        r => panic!(
            "expected a termination request with FES {fes:?}, got {:?}",
            r.map(|x| x.0)
        ),
    }
    // Then the connection closes.
    let mut b = [0u8; 1];
    assert_eq!(q.stream.read(&mut b).unwrap_or(0), 0);
}

#[test]
fn bad_pdus_get_the_prescribed_answer_and_others_are_served() {
    let s = setup("nvmf-bad", "");
    // A good client connected throughout.
    let mut good = Controller::connect(&s.io, NQN, &Options::default(), 1).unwrap();
    // 1. Command before Connect: Command Sequence Error, the queue continues.
    let mut q = raw(&s.io);
    let sqe = Sqe {
        opc: nvme::IO_READ,
        nsid: 1,
        ..Sqe::default()
    };
    match q.exec(sqe, &[], 4096) {
        Err(Error::Status(st, _)) => assert_eq!(st & 0x7FF, nvme::SC_CMD_SEQ_ERROR),
        r => panic!("command before connect: {:?}", r.map(|x| x.0)),
    }
    // 2. Unknown PDU type: invalid header field at offset 0.
    let mut b = [0u8; 72];
    b[0] = 0x0E;
    b[2] = 72;
    b[4] = 72;
    q.stream.write_all(&b).unwrap();
    expect_term(&mut q, pdu::Fes::InvalidHeaderField);
    // 3. Wrong HLEN for a capsule.
    let mut q = raw(&s.io);
    let mut h = [0u8; 256];
    let n = q.framing.capsule_cmd(&mut h, &[0u8; 64], 0);
    h[2] = 60;
    q.stream.write_all(&h[..n]).unwrap();
    expect_term(&mut q, pdu::Fes::InvalidHeaderField);
    // 4. Bad header digest.
    let o = Options {
        hdgst: true,
        ..Options::default()
    };
    let mut q = Queue::open(&s.io, &o).unwrap();
    let n = q.framing.capsule_cmd(&mut h, &[0u8; 64], 0);
    h[n - 1] ^= 0xFF;
    q.stream.write_all(&h[..n]).unwrap();
    expect_term(&mut q, pdu::Fes::HeaderDigestError);
    // 5. Bad data digest: Transient Transport Error, the queue continues.
    let o = Options {
        ddgst: true,
        ..Options::default()
    };
    let mut c = Controller::connect(&s.io, NQN, &o, 1).unwrap();
    {
        let q = &mut c.io[0];
        let sqe = Sqe {
            opc: nvme::IO_WRITE,
            cid: 77,
            nsid: 1,
            cdw12: 7,
            ..Sqe::default()
        }
        .with_sgl(nvme::SGL_DATA_BLOCK_OFFSET, 4096);
        let data = pattern(9, 4096);
        let n = q.framing.capsule_cmd(&mut h, &sqe.encode(), 4096);
        let mut out = h[..n].to_vec();
        out.extend_from_slice(&data);
        out.extend_from_slice(&(pdu::crc(&data) ^ 1).to_le_bytes());
        q.stream.write_all(&out).unwrap();
        let (_, r) = q.recv_pdu().unwrap();
        let cqe = nvme::Cqe::parse(&r[8..24]);
        assert_eq!(cqe.cid, 77);
        assert_eq!(cqe.status & 0x7FF, nvme::SC_TRANSIENT_TRANSPORT);
    }
    assert_eq!(c.read(0, 1, 0, 8, LBA).unwrap().len(), 4096);
    c.disconnect();
    // 6. H2CData for a transfer that was never asked for.
    let mut q = raw(&s.io);
    q.send_h2c(1, 5, 0, &[0u8; 512], true).unwrap();
    expect_term(&mut q, pdu::Fes::InvalidHeaderField);
    // 7. A non-ICReq first PDU.
    let mut st = TcpStream::connect(&s.io).unwrap();
    st.write_all(&[pdu::CAPSULE_CMD, 0, 72, 0, 72, 0, 0, 0])
        .unwrap();
    let mut t = [0u8; 24];
    st.read_exact(&mut t).unwrap();
    assert_eq!(t[0], pdu::C2H_TERM);
    assert_eq!(pdu::parse_term(&t).0, pdu::Fes::PduSequenceError as u16);
    // 8. More commands than the queue size: the extra one is refused.
    let o = Options {
        queue_size: 32,
        ..Options::default()
    };
    let mut c = Controller::connect(&s.io, NQN, &o, 1).unwrap();
    {
        let q = &mut c.io[0];
        for cid in 0..40u16 {
            let sqe = Sqe {
                opc: nvme::IO_FLUSH,
                cid: 1000 + cid,
                nsid: 1,
                ..Sqe::default()
            };
            let n = q.framing.capsule_cmd(&mut h, &sqe.encode(), 0);
            q.stream.write_all(&h[..n]).unwrap();
        }
        let mut ok = 0;
        for _ in 0..40 {
            let (_, r) = q.recv_pdu().unwrap();
            let cqe = nvme::Cqe::parse(&r[8..24]);
            match cqe.status & 0x7FF {
                0 => ok += 1,
                nvme::SC_CMD_SEQ_ERROR => {}
                x => panic!("flush status {x:#x}"),
            }
        }
        assert!(ok >= 32, "at least a queue's worth succeeded ({ok})");
    }
    c.disconnect();
    // The good client was served all along.
    let w = pattern(1, 4096);
    good.write(0, 1, 100, &w, LBA).unwrap();
    assert_eq!(good.read(0, 1, 100, 8, LBA).unwrap(), w);
    good.disconnect();
}

#[test]
fn keep_alive_timeout_tears_down_an_idle_controller() {
    let s = setup("nvmf-kato", "");
    // A timeout long enough that a keep-alive every 100 ms survives a busy machine's
    // scheduling stalls.
    let o = Options {
        kato_ms: 600,
        ..Options::default()
    };
    let mut c = Controller::connect(&s.io, NQN, &o, 2).unwrap();
    // Kept alive: still there after several timeouts' worth.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(1800) {
        c.keep_alive().unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(c.read(0, 1, 0, 8, LBA).unwrap().len(), 4096);
    // Idle: the target tears the controller down (waited for, bounded), and then every
    // queue is closed.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let ctrls = controllers(&s);
        if ctrls == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the idle controller outlived its keep-alive timeout by 15 s: {ctrls} controllers"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(c.keep_alive().is_err(), "admin queue survived the timeout");
    assert!(
        c.read(1, 1, 0, 8, LBA).is_err(),
        "I/O queue survived the timeout"
    );
    assert_eq!(controllers(&s), 0);
}

#[test]
fn host_allowlist_and_persistence_across_restart() {
    let host = "nqn.2024-01.io.tessera.test:host-a";
    let mut s = setup("nvmf-hosts", host);
    let other = Options {
        hostnqn: "nqn.2024-01.io.tessera.test:intruder".into(),
        ..Options::default()
    };
    match Controller::connect(&s.io, NQN, &other, 1) {
        Err(Error::Status(st, _)) => assert_eq!(st & 0x7FF, nvme::SC_CONNECT_INVALID_HOST),
        r => panic!("unknown host connected: {:?}", r.map(|c| c.cntlid)),
    }
    // Discovery hides the subsystem from it, shows it to the allowed host.
    assert!(initiator::discover(&s.disc, &other).unwrap().is_empty());
    let me = Options {
        hostnqn: host.into(),
        ..Options::default()
    };
    assert_eq!(initiator::discover(&s.disc, &me).unwrap().len(), 1);
    let mut c = Controller::connect(&s.io, NQN, &me, 1).unwrap();
    let w = pattern(5, 8192);
    c.write(0, 1, 2048, &w, LBA).unwrap();
    c.flush(0, 1).unwrap();
    c.disconnect();
    // The volume is refused deletion while it is a namespace.
    assert!(s.node.node().delete_volume("v").is_err());
    s.node.restart();
    // As `tessera run` does: NVMe/TCP is served again (on a new I/O port).
    s.io = s.node.serve_nvmf();
    // The subsystem, its namespace, its hosts and the data are back.
    let mut c = Controller::connect(&s.io, NQN, &me, 1).unwrap();
    assert_eq!(c.namespaces().unwrap(), vec![1]);
    assert_eq!(c.read(0, 1, 2048, 16, LBA).unwrap(), w);
    assert!(Controller::connect(&s.io, NQN, &other, 1).is_err());
    c.disconnect();
}
