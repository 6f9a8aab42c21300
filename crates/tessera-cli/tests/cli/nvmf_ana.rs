//! Asymmetric Namespace Access across nodes (issue 13, "clients follow the volume"): a
//! cluster volume's subsystem is exported by every node under one NQN; the owner's
//! namespace is the volume (ANA optimized), the others' hold no data (inaccessible).
//!
//! - The target side, raw, through the blocking initiator: Identify fields, the ANA log
//!   (content, change counts, offsets, groups only), the ANA change notice, and the path
//!   status of I/O to a path without data.
//! - Discovery on any node lists every node's path.
//! - Tessera's multipath initiator (per-core queues on a reactor): I/O goes to the
//!   optimized path, follows an ANA flip, and survives a kill -9 of the owner while I/O
//!   runs once another node takes over, with no error surfacing.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tessera_io::{AlignedBuf, CoreIo, IoHandle, IoOp, Tag, Task};
use tessera_nvmf::initiator::{discover, Controller, Error as NvmfError, Options};
use tessera_nvmf::nvme::{self, AnaState, Sqe};
use tessera_nvmf::pdu::{le16, le32, le64};
use tessera_remote::{RemoteConfig, RemoteDevice, RemoteHandle, RemoteSpec};
use tessera_testkit::reactor::ReactorThread;

const VOL_SIZE: u64 = 64 << 20;
const BS: usize = 4096;

fn nqn(volume: &str) -> String {
    format!("nqn.2026-11.io.tessera:cluster:{volume}")
}

/// A node with NVMe/TCP on a free port, a pool, and volume `db` exported over NBD (to
/// look at what landed in it).
struct Site {
    node: TestNode,
    nvmf: String,
}

fn site(tag: &str) -> Site {
    site_with(tag, "")
}

fn site_with(tag: &str, nvmf_extra: &str) -> Site {
    let port = free_port();
    let node = TestNode::start_with_config(
        tag,
        &format!("[nvmf]\nlisten = \"127.0.0.1:{port}\"\n{nvmf_extra}"),
    );
    let img = format!("{}:256M", node.dir.join("p.img").display());
    node.cli_ok(&["pool", "create", "p", &img]);
    node.cli_ok(&["volume", "create", "db", "--pool", "p", "--size", "64M"]);
    node.cli_ok(&["export", "add", "db", "--volume", "db"]);
    Site {
        node,
        nvmf: format!("127.0.0.1:{port}"),
    }
}

fn owner(n: &TestNode, volume: &str) {
    let (code, r) = put_path(n, volume, json!({"owner": true}));
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["ana_state"], "optimized", "{r}");
}

fn standby(n: &TestNode, volume: &str) {
    let (code, r) = put_path(n, volume, json!({"owner": false, "size": VOL_SIZE}));
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["ana_state"], "inaccessible", "{r}");
}

fn opts() -> Options {
    Options {
        timeout: Duration::from_secs(10),
        ..Options::default()
    }
}

/// The status of a failed command (panics on success or a transport error).
fn status_of<T>(r: tessera_nvmf::initiator::Result<T>) -> nvme::Status {
    match r {
        Err(NvmfError::Status(s, _)) => s,
        Err(e) => panic!("expected an NVMe status, got {e}"),
        Ok(_) => panic!("expected an NVMe status, the command succeeded"),
    }
}

/// Get Log Page 0Ch with an offset, a length and the log specific field.
fn ana_log_raw(c: &mut Controller, offset: u64, len: usize, lsp: u8) -> Vec<u8> {
    let numd = (len / 4 - 1) as u32;
    let sqe = Sqe {
        opc: nvme::ADM_GET_LOG_PAGE,
        cdw10: u32::from(nvme::LID_ANA) | u32::from(lsp) << 8 | (numd & 0xFFFF) << 16,
        cdw11: numd >> 16,
        cdw12: offset as u32,
        cdw13: (offset >> 32) as u32,
        ..Sqe::default()
    };
    c.admin_cmd(sqe, len).expect("get log page 0Ch").1
}

#[test]
fn ana_groups_log_notices_and_path_status() {
    let a = site("ana-target");
    owner(&a.node, "db");
    let mut c = Controller::connect(&a.nvmf, &nqn("db"), &opts(), 1).expect("connect");

    // Identify Controller: ANA reporting, one group per namespace.
    let id = c.identify(nvme::CNS_CONTROLLER, 0).unwrap();
    assert_eq!(id[76] & (1 << 1 | 1 << 3), 1 << 1 | 1 << 3, "CMIC");
    assert_ne!(le32(&id, 92) & (1 << 11), 0, "OAES: ANA change notices");
    assert_eq!(id[342], nvme::ANATT_SECS, "ANATT");
    assert_eq!(id[343], nvme::ANACAP, "ANACAP");
    assert_eq!(le32(&id, 344), 1, "ANAGRPMAX");
    assert_eq!(le32(&id, 348), 1, "NANAGRPID");
    let ns = c.identify(nvme::CNS_NAMESPACE, 1).unwrap();
    assert_eq!(le32(&ns, 92), 1, "ANAGRPID = NSID");
    assert_eq!(le64(&ns, 0), VOL_SIZE / 512);
    assert_eq!(c.ana_state(1).unwrap(), Some(AnaState::Optimized));

    // The log: header, one descriptor, its NSID; offsets and RGO honoured.
    let (count0, groups) = c.ana_log(false).unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(
        (groups[0].grpid, groups[0].state, groups[0].nsids.clone()),
        (1, AnaState::Optimized, vec![1])
    );
    let full = ana_log_raw(&mut c, 0, 52, 0);
    assert_eq!(le16(&full, 8), 1);
    assert_eq!(le32(&full, 16 + 4), 1, "NNSIDS");
    assert_eq!(full[16 + 16], AnaState::Optimized as u8);
    assert_eq!(le32(&full, 48), 1, "the NSID list");
    let tail = ana_log_raw(&mut c, 16, 36, 0);
    assert_eq!(tail[..], full[16..52], "LPOL: the log from byte 16");
    let rgo = ana_log_raw(&mut c, 0, 52, nvme::ANA_LSP_RGO);
    assert_eq!(le32(&rgo, 16 + 4), 0, "RGO: no NSID counted");
    assert_eq!(rgo[48..52], [0; 4], "RGO: no NSID list");

    // Data goes in while optimized.
    let data: Vec<u8> = (0..BS).map(|i| (i % 251) as u8).collect();
    c.write(0, 1, 8, &data, 512).expect("write while optimized");
    c.flush(0, 1).expect("flush while optimized");

    // ANA change notice: enable it, hold an AER, flip the path to inaccessible.
    c.admin_cmd(
        Sqe {
            opc: nvme::ADM_SET_FEATURES,
            cdw10: u32::from(nvme::FEAT_ASYNC_EVENT),
            cdw11: nvme::AEC_ANA_CHANGE | nvme::AEC_NS_ATTR,
            ..Sqe::default()
        },
        0,
    )
    .unwrap();
    let cid = c.admin.next_cid();
    let aer = Sqe {
        opc: nvme::ADM_ASYNC_EVENT,
        cid,
        ..Sqe::default()
    }
    .with_sgl(nvme::SGL_TRANSPORT_DATA_BLOCK, 0);
    c.admin.send_capsule(&aer, &[]).unwrap();
    standby(&a.node, "db");
    let (f, b) = c.admin.recv_pdu().expect("the AER completes");
    assert_eq!(f.ch.ty, tessera_nvmf::pdu::CAPSULE_RESP);
    let cqe = nvme::Cqe::parse(&b[8..24]);
    assert_eq!((cqe.cid, cqe.status), (cid, 0));
    assert_eq!(cqe.dw0, nvme::AEN_ANA_CHANGE, "notice: ANA change, log 0Ch");

    let (count1, groups) = c.ana_log(false).unwrap();
    assert!(
        count1 > count0,
        "the log's change count moves ({count0} -> {count1})"
    );
    assert_eq!(groups[0].state, AnaState::Inaccessible);
    assert!(groups[0].change_count >= 1);

    // I/O to the inaccessible path: SCT 3h / SC 02h, DNR clear; nothing reaches the data.
    for s in [
        status_of(c.read(0, 1, 0, 8, 512)),
        status_of(c.write(0, 1, 0, &[0xEE; BS], 512)),
        status_of(c.flush(0, 1)),
        status_of(c.write_zeroes(0, 1, 0, 8, false)),
        status_of(c.deallocate(0, 1, &[(0, 8)])),
    ] {
        assert_eq!(s, nvme::SC_ANA_INACCESSIBLE, "{}", nvme::status_text(s));
        assert_eq!(s & nvme::DNR, 0, "retryable elsewhere");
    }

    // Back to optimized: the data is what was written before, untouched meanwhile.
    owner(&a.node, "db");
    assert_eq!(c.ana_state(1).unwrap(), Some(AnaState::Optimized));
    assert_eq!(c.read(0, 1, 8, 8, 512).unwrap(), data);
    assert_eq!(c.read(0, 1, 0, 8, 512).unwrap(), vec![0u8; BS]);

    // A path with no data behind it: declared size, never accessible.
    let (code, r) = put_path(&a.node, "ghost", json!({"owner": false, "size": 1 << 20}));
    assert_eq!(
        (code, &r["ana_state"]),
        (200, &json!("inaccessible")),
        "{r}"
    );
    let mut g = Controller::connect(&a.nvmf, &nqn("ghost"), &opts(), 1).unwrap();
    assert_eq!(g.namespace_size(1).unwrap(), ((1 << 20) / 512, 512));
    assert_eq!(g.ana_state(1).unwrap(), Some(AnaState::Inaccessible));
    assert_eq!(
        status_of(g.read(0, 1, 0, 1, 512)),
        nvme::SC_ANA_INACCESSIBLE
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "nvmf",
            "identify",
            "--addr",
            &a.nvmf,
            "--nqn",
            &nqn("ghost"),
        ])
        .output()
        .expect("run tessera nvmf identify");
    assert!(out.status.success(), "{out:?}");
    let id: serde_json::Value = serde_json::from_slice(&out.stdout).expect("identify prints JSON");
    assert_eq!(id["namespaces"][0]["ana_state"], "inaccessible", "{id}");
    assert_eq!(id["namespaces"][0]["ana_group"], 1, "{id}");
    let (code, r) = put_path(&a.node, "ghost", json!({"owner": true}));
    assert_eq!(code, 404, "no local volume 'ghost' to own: {r}");
    let (code, _) = put_path(&a.node, "ghost", json!({"owner": false}));
    assert_eq!(code, 400, "a standby path needs the size");
    let (code, _) = put_path(&a.node, "ghost", json!({"owner": false, "size": 1000}));
    assert_eq!(code, 400, "the size must be whole sectors");
    let out = a.node.cli(&[
        "nvmf",
        "subsystem",
        "add",
        &nqn("other"),
        "--allow-any-host",
    ]);
    assert!(!out.status.success(), "cluster NQNs are reserved");
    g.disconnect();
    c.disconnect();
}

#[test]
fn discovery_on_any_node_lists_every_path() {
    let a = site("ana-disc-a");
    // Controller IDs unique across the paths, as Linux multipath requires.
    let b = site_with("ana-disc-b", "cntlid_range = [1000, 1999]\n");
    let (code, r) = put_path(
        &a.node,
        "db",
        json!({"owner": true, "other_paths": [b.nvmf.clone()]}),
    );
    assert_eq!(code, 200, "{r}");
    let (code, r) = put_path(
        &b.node,
        "db",
        json!({"owner": false, "size": VOL_SIZE, "other_paths": [a.nvmf.clone()]}),
    );
    assert_eq!(code, 200, "{r}");
    for s in [&a, &b] {
        let mut paths: Vec<String> = discover(&s.nvmf, &opts())
            .unwrap()
            .into_iter()
            .filter(|e| e.subnqn == nqn("db"))
            .map(|e| format!("{}:{}", e.traddr, e.trsvcid))
            .collect();
        paths.sort();
        let mut want = vec![a.nvmf.clone(), b.nvmf.clone()];
        want.sort();
        assert_eq!(paths, want, "discovery at {}", s.nvmf);
    }
    // One namespace behind both: the same identifiers on each path.
    let ids = |addr: &str| {
        let mut c = Controller::connect(addr, &nqn("db"), &opts(), 0).unwrap();
        let ns = c.identify(nvme::CNS_NAMESPACE, 1).unwrap();
        let desc = c.identify(nvme::CNS_NS_DESC_LIST, 1).unwrap();
        (ns[..8].to_vec(), ns[104..128].to_vec(), desc[..64].to_vec())
    };
    assert_eq!(ids(&a.nvmf), ids(&b.nvmf));
    let ca = Controller::connect(&a.nvmf, &nqn("db"), &opts(), 0).unwrap();
    let cb = Controller::connect(&b.nvmf, &nqn("db"), &opts(), 0).unwrap();
    assert!(ca.cntlid < 1000, "A: default range ({})", ca.cntlid);
    assert!(
        (1000..=1999).contains(&cb.cntlid),
        "B: its range ({})",
        cb.cntlid
    );
}

/// Writes `blocks` 4 KiB blocks (block `i` at offset `i * BS`, stamped with `stamp`) at
/// queue depth 8 through the core's remote handle; reports the results.
struct Writer {
    dev: Arc<RemoteDevice>,
    handle: Option<RemoteHandle>,
    bufs: Vec<AlignedBuf>,
    results: Vec<i32>,
    next: usize,
    inflight: usize,
    id: u32,
    progress: Arc<AtomicUsize>,
    tx: Sender<Vec<i32>>,
    done: bool,
}

const WRITER_KEY: usize = 0x616e_6177;

fn stamp_block(i: usize, stamp: u64) -> Vec<u8> {
    let mut d = vec![0u8; BS];
    for (k, w) in d.chunks_mut(8).enumerate() {
        w.copy_from_slice(&(stamp << 32 | (i as u64) << 12 | k as u64).to_le_bytes());
    }
    d
}

impl Writer {
    fn issue(&mut self, io: &mut CoreIo) {
        while self.inflight < 8 && self.next < self.bufs.len() {
            let i = self.next;
            self.next += 1;
            self.inflight += 1;
            let op = IoOp::Write {
                offset: (i * BS) as u64,
                len: BS as u32,
                buf: self.bufs[i].as_ptr(),
            };
            let h = self.handle.as_mut().expect("opened at start");
            // SAFETY: bufs[i] lives in the writer until its completion arrives.
            unsafe { h.submit(io, op, Tag::task(self.id, i as u32)) };
        }
    }

    fn check_done(&mut self, io: &mut CoreIo) {
        if !self.done && self.inflight == 0 && self.next == self.bufs.len() {
            self.done = true;
            if let Some(h) = self.handle.take() {
                // Kept for the next writer: the same queue, as a long-lived device has.
                io.locals.insert(WRITER_KEY, Box::new(h));
                let _ = self.tx.send(std::mem::take(&mut self.results));
            }
        }
    }
}

impl Task for Writer {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        self.id = id;
        self.handle = Some(match io.locals.remove(&WRITER_KEY) {
            Some(b) => *b.downcast::<RemoteHandle>().expect("a remote handle"),
            None => RemoteHandle::open(&self.dev),
        });
        self.issue(io);
        self.check_done(io);
    }

    fn on_complete(&mut self, io: &mut CoreIo, slot: u32, res: i32) {
        self.results[slot as usize] = res;
        self.inflight -= 1;
        self.progress.fetch_add(1, Relaxed);
        self.issue(io);
        self.check_done(io);
    }

    fn finished(&self) -> bool {
        self.done
    }
}

fn start_writer(
    core: &ReactorThread,
    dev: &Arc<RemoteDevice>,
    blocks: usize,
    stamp: u64,
    progress: Arc<AtomicUsize>,
) -> Receiver<Vec<i32>> {
    let (tx, rx) = channel();
    let dev = dev.clone();
    core.mailbox.spawn(Box::new(move |_io: &mut CoreIo| {
        let bufs = (0..blocks)
            .map(|i| {
                let mut b = AlignedBuf::zeroed(BS);
                b.as_mut_slice().copy_from_slice(&stamp_block(i, stamp));
                b
            })
            .collect();
        Box::new(Writer {
            dev,
            handle: None,
            bufs,
            results: vec![i32::MIN; blocks],
            next: 0,
            inflight: 0,
            id: 0,
            progress,
            tx,
            done: false,
        }) as Box<dyn Task>
    }));
    rx
}

fn all_written(results: &[i32], what: &str) {
    for (i, r) in results.iter().enumerate() {
        assert_eq!(*r, BS as i32, "{what}: write {i} failed ({r})");
    }
}

/// Block `i` of node `n`'s volume `db`, read over its NBD export.
fn block_at(n: &TestNode, i: usize) -> Vec<u8> {
    let mut c = nbd_connect(n, "db");
    let mut out = vec![0u8; BS];
    c.read((i * BS) as u64, &mut out).expect("NBD read");
    out
}

#[test]
fn multipath_initiator_follows_the_owner() {
    let a = site("ana-mp-a");
    let mut b = site("ana-mp-b");
    owner(&a.node, "db");
    standby(&b.node, "db");
    let spec = RemoteSpec::parse(&format!(
        "nvme-tcp://{},{}/{}?nsid=1",
        b.nvmf,
        a.nvmf,
        nqn("db")
    ))
    .unwrap();
    assert!(spec.multipath());
    // Failover has this long to happen without an I/O error surfacing.
    let timeout = Duration::from_secs(15);
    let cfg = RemoteConfig {
        timeout,
        ..RemoteConfig::default()
    };
    // B is listed first but inaccessible: the device opens on A, the optimized path.
    let dev = RemoteDevice::open_with(spec, cfg).expect("open over two paths");
    assert_eq!(tessera_device::BlockDevice::size(&*dev), VOL_SIZE);
    let core = ReactorThread::start();
    let n = 256;

    let r = start_writer(&core, &dev, n, 1, Arc::default())
        .recv_timeout(Duration::from_secs(60))
        .expect("first writes finish");
    all_written(&r, "on A");
    assert_eq!(
        block_at(&a.node, n - 1),
        stamp_block(n - 1, 1),
        "landed on A"
    );
    assert_eq!(block_at(&b.node, n - 1), vec![0u8; BS], "nothing reached B");

    // Ownership moves to B (A first stops serving): the queue follows by itself.
    standby(&a.node, "db");
    owner(&b.node, "db");
    let r = start_writer(&core, &dev, n, 2, Arc::default())
        .recv_timeout(Duration::from_secs(60))
        .expect("writes after the flip finish");
    all_written(&r, "after the flip");
    for i in [0, n / 2, n - 1] {
        assert_eq!(block_at(&b.node, i), stamp_block(i, 2), "block {i} on B");
        assert_eq!(block_at(&a.node, i), stamp_block(i, 1), "A kept block {i}");
    }
    // The synchronous face follows too.
    let mut one = vec![0u8; BS];
    tessera_device::BlockDevice::read_at(&*dev, 0, &mut one).unwrap();
    assert_eq!(one, stamp_block(0, 2));

    // kill -9 the owner (B) while writes run; A takes over within the timeout.
    let blocks = (VOL_SIZE as usize) / BS;
    let progress = Arc::new(AtomicUsize::new(0));
    let rx = start_writer(&core, &dev, blocks, 3, progress.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    while progress.load(Relaxed) < 64 {
        assert!(Instant::now() < deadline, "writes never got under way on B");
        std::thread::sleep(Duration::from_millis(1));
    }
    b.node.kill9();
    let killed_at = Instant::now();
    let done_at_kill = progress.load(Relaxed);
    assert!(
        done_at_kill + 8 < blocks / 2,
        "the kill came late ({done_at_kill} of {blocks} done): nothing left to fail over"
    );
    std::thread::sleep(Duration::from_millis(500));
    owner(&a.node, "db");
    let r = rx
        .recv_timeout(timeout + Duration::from_secs(60))
        .expect("writes finish after the failover");
    all_written(&r, "across the kill");
    eprintln!(
        "failover: {done_at_kill} of {blocks} writes done at the kill; all done {:?} after it",
        killed_at.elapsed()
    );
    // The writes not yet done at the kill were (re)sent to A.
    for i in [blocks - 1, blocks - 2, blocks / 2 + done_at_kill / 2] {
        if i >= done_at_kill + 8 {
            assert_eq!(block_at(&a.node, i), stamp_block(i, 3), "block {i} on A");
        }
    }
    let mut last = vec![0u8; BS];
    tessera_device::BlockDevice::read_at(&*dev, ((blocks - 1) * BS) as u64, &mut last).unwrap();
    assert_eq!(last, stamp_block(blocks - 1, 3));
    drop(core);
    dev.disconnect();
}
