//! A remote NVMe/TCP namespace as a device (tessera-remote), driven on a real reactor
//! against a real node: data crosses to the node's NBD export, QD 64 verifies with
//! batched sends, a kill -9 and restart of the target mid-load loses nothing (in-flight
//! commands are resubmitted), and a target gone past the timeout fails I/O with an error
//! while the reactor keeps running.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_device::{BlockDevice, RamDevice};
use tessera_io::{AlignedBuf, CoreIo, IoHandle, IoOp, Tag, Task};
use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_pool::{LayoutKind, Pool, PoolOptions, Volume};
use tessera_remote::{LinkStats, RemoteConfig, RemoteDevice, RemoteHandle, RemoteSpec};
use tessera_testkit::reactor::ReactorThread;

const NQN: &str = "nqn.2024-01.io.tessera.test:remote";
const VOL: u64 = 64 << 20;
/// Where the test keeps the core's handle between jobs (CoreIo::locals key).
const HANDLE_KEY: usize = 0x7265_6d6f;
const VOLUME_KEY: usize = 0x7265_6d70;

/// The handle a job drives: the remote device's own (with its counters) or a volume's.
enum Handle {
    Remote(RemoteHandle),
    Volume(Box<dyn IoHandle>),
}

struct Target {
    node: TestNode,
    nvmf: String,
}

fn target(tag: &str) -> Target {
    let port = free_port();
    let node =
        TestNode::start_with_config(tag, &format!("[nvmf]\nlisten = \"127.0.0.1:{port}\"\n"));
    // File-backed, so the data survives a kill -9 and restart.
    let img = format!("{}:256M", node.dir.join("p.img").display());
    node.cli_ok(&["pool", "create", "p", &img]);
    node.cli_ok(&["volume", "create", "v", "--pool", "p", "--size", "64M"]);
    node.cli_ok(&["export", "add", "v", "--volume", "v"]);
    node.cli_ok(&[
        "nvmf",
        "subsystem",
        "add",
        NQN,
        "--volume",
        "v",
        "--allow-any-host",
    ]);
    Target {
        node,
        nvmf: format!("127.0.0.1:{port}"),
    }
}

fn open(t: &Target, timeout: Duration) -> Arc<RemoteDevice> {
    let spec = RemoteSpec::parse(&format!("nvme-tcp://{}/{NQN}?nsid=1", t.nvmf)).unwrap();
    let cfg = RemoteConfig {
        timeout,
        ..RemoteConfig::default()
    };
    RemoteDevice::open_with(spec, cfg).unwrap()
}

#[derive(Clone)]
enum Req {
    Write(u64, Vec<u8>),
    Read(u64, usize),
    Flush,
}

struct Outcome {
    results: Vec<i32>,
    /// The data of each read (empty for the others).
    data: Vec<Vec<u8>>,
    stats: LinkStats,
    elapsed: Duration,
    /// The most commands the core counted as waiting for a peer on this host right after
    /// this job's submissions (the reactor sleeps instead of polling while any do).
    peer_waits_max: usize,
    /// What the core still counted when the job's last completion arrived.
    peer_waits_left: usize,
}

/// Runs a list of requests through the core's RemoteHandle at a queue depth.
struct Job {
    dev: Arc<RemoteDevice>,
    /// Drive this volume (a pool with a remote leg) instead of the device itself.
    volume: Option<Arc<Volume>>,
    handle: Option<Handle>,
    reqs: Vec<Req>,
    bufs: Vec<AlignedBuf>,
    results: Vec<i32>,
    next: usize,
    inflight: usize,
    qd: usize,
    id: u32,
    progress: Arc<AtomicUsize>,
    tx: Sender<Outcome>,
    started: Instant,
    done: bool,
    peer_waits_max: usize,
}

impl Job {
    fn issue(&mut self, io: &mut CoreIo) {
        while self.inflight < self.qd && self.next < self.reqs.len() {
            let i = self.next;
            self.next += 1;
            self.inflight += 1;
            let op = match &self.reqs[i] {
                Req::Write(off, d) => {
                    self.bufs[i].as_mut_slice()[..d.len()].copy_from_slice(d);
                    IoOp::Write {
                        offset: *off,
                        len: d.len() as u32,
                        buf: self.bufs[i].as_ptr(),
                    }
                }
                Req::Read(off, len) => IoOp::Read {
                    offset: *off,
                    len: *len as u32,
                    buf: self.bufs[i].as_mut_ptr(),
                },
                Req::Flush => IoOp::Flush,
            };
            let tag = Tag::task(self.id, i as u32);
            match self.handle.as_mut().unwrap() {
                // SAFETY: bufs[i] lives in the job until the job has seen every completion.
                Handle::Remote(h) => unsafe { h.submit(io, op, tag) },
                // SAFETY: as above.
                Handle::Volume(h) => unsafe { h.submit(io, op, tag) },
            }
        }
        self.peer_waits_max = self.peer_waits_max.max(io.peer_waits());
    }
}

impl Task for Job {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        self.id = id;
        let h = match &self.volume {
            Some(v) => Handle::Volume(match io.locals.remove(&VOLUME_KEY) {
                Some(b) => *b.downcast::<Box<dyn IoHandle>>().unwrap(),
                None => Box::new(v.open_handle()),
            }),
            None => Handle::Remote(match io.locals.remove(&HANDLE_KEY) {
                Some(b) => *b.downcast::<RemoteHandle>().unwrap(),
                None => RemoteHandle::open(&self.dev),
            }),
        };
        self.handle = Some(h);
        self.started = Instant::now();
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

impl Job {
    fn check_done(&mut self, io: &mut CoreIo) {
        if self.done || self.inflight > 0 || self.next < self.reqs.len() {
            return;
        }
        self.done = true;
        let stats = match self.handle.take().unwrap() {
            Handle::Remote(h) => {
                let stats = h.stats();
                io.locals.insert(HANDLE_KEY, Box::new(h));
                stats
            }
            Handle::Volume(h) => {
                io.locals.insert(VOLUME_KEY, Box::new(h));
                LinkStats::default()
            }
        };
        let data = self
            .reqs
            .iter()
            .zip(&self.bufs)
            .map(|(r, b)| match r {
                Req::Read(_, len) => b.as_slice()[..*len].to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let _ = self.tx.send(Outcome {
            results: std::mem::take(&mut self.results),
            data,
            stats,
            elapsed: self.started.elapsed(),
            peer_waits_max: self.peer_waits_max,
            peer_waits_left: io.peer_waits(),
        });
    }
}

struct Core(ReactorThread);

impl Core {
    fn start() -> Core {
        Core(ReactorThread::start())
    }

    /// Start `reqs` at queue depth `qd`; the outcome arrives on the returned channel.
    fn spawn(
        &self,
        dev: &Arc<RemoteDevice>,
        reqs: Vec<Req>,
        qd: usize,
        progress: Arc<AtomicUsize>,
    ) -> std::sync::mpsc::Receiver<Outcome> {
        self.spawn_on(dev, None, reqs, qd, progress)
    }

    fn spawn_on(
        &self,
        dev: &Arc<RemoteDevice>,
        volume: Option<Arc<Volume>>,
        reqs: Vec<Req>,
        qd: usize,
        progress: Arc<AtomicUsize>,
    ) -> std::sync::mpsc::Receiver<Outcome> {
        let (tx, rx) = channel();
        let dev = dev.clone();
        self.0.mailbox.spawn(Box::new(move |_io: &mut CoreIo| {
            let n = reqs.len();
            let bufs = reqs
                .iter()
                .map(|r| match r {
                    Req::Write(_, d) => AlignedBuf::zeroed(d.len()),
                    Req::Read(_, len) => AlignedBuf::zeroed(*len),
                    Req::Flush => AlignedBuf::zeroed(0),
                })
                .collect();
            Box::new(Job {
                dev,
                volume,
                handle: None,
                reqs,
                bufs,
                results: vec![i32::MIN; n],
                next: 0,
                inflight: 0,
                qd,
                id: 0,
                progress,
                tx,
                started: Instant::now(),
                done: false,
                peer_waits_max: 0,
            }) as Box<dyn Task>
        }));
        rx
    }

    fn run(&self, dev: &Arc<RemoteDevice>, reqs: Vec<Req>, qd: usize, limit: Duration) -> Outcome {
        let o = self
            .spawn(dev, reqs, qd, Arc::new(AtomicUsize::new(0)))
            .recv_timeout(limit)
            .expect("the job finished in time");
        // Every command answered (or failed) is no longer counted as waiting on the peer:
        // a leftover count would stop this core's polling for good.
        assert_eq!(o.peer_waits_left, 0, "peer waits left after the job");
        o
    }
}

/// `n` writes of `bs` bytes scattered over the volume, with data that names block and
/// generation; updates `model` to what they leave. A block is written again only after
/// every other block was (a prime stride), so no two writes in flight overlap and the
/// order among concurrent writes cannot matter.
fn random_writes(seed: u64, n: usize, bs: usize, model: &mut [u8]) -> Vec<Req> {
    let blocks = model.len() / bs;
    let first = Rng(seed).below(blocks as u64) as usize;
    (0..n)
        .map(|i| {
            let b = (first + i * 7919) % blocks;
            let d = block(b, seed ^ i as u64, bs);
            model[b * bs..(b + 1) * bs].copy_from_slice(&d);
            Req::Write((b * bs) as u64, d)
        })
        .collect()
}

/// Read the whole volume through the remote device at `qd` and compare with `model`.
fn verify_remote(core: &Core, dev: &Arc<RemoteDevice>, model: &[u8], what: &str) {
    let chunk = 256 << 10;
    let reqs: Vec<Req> = (0..model.len() / chunk)
        .map(|i| Req::Read((i * chunk) as u64, chunk))
        .collect();
    let o = core.run(dev, reqs, 16, Duration::from_secs(60));
    for (i, (r, d)) in o.results.iter().zip(&o.data).enumerate() {
        assert_eq!(*r, chunk as i32, "{what}: read {i} failed");
        assert!(
            d[..] == model[i * chunk..(i + 1) * chunk],
            "{what}: data of chunk {i} differs"
        );
    }
}

/// Read the whole volume through the target node's NBD export and compare with `model`.
fn verify_nbd(t: &Target, model: &[u8], what: &str) {
    let mut c = NbdClient::connect_tcp(&t.node.addr(), "v", ClientOptions::default()).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    for (i, want) in model.chunks(buf.len()).enumerate() {
        c.read((i * buf.len()) as u64, &mut buf[..want.len()])
            .unwrap();
        assert!(buf[..want.len()] == *want, "{what}: NBD MiB {i} differs");
    }
}

#[test]
fn writes_read_back_directly_and_through_nbd_and_qd64_batches() {
    let t = target("remote-io");
    let dev = open(&t, Duration::from_secs(5));
    assert_eq!(dev.size(), VOL);
    assert_eq!(dev.alignment(), 512);
    let core = Core::start();
    let mut model = vec![0u8; VOL as usize];

    // Small (in-capsule), large (R2T/H2CData) and multi-command (beyond MDTS) writes.
    let mut reqs = Vec::new();
    for (i, (off, len)) in [
        (0u64, 4096usize),
        (8192, 512),
        (1 << 20, 64 << 10),
        (4 << 20, 3 << 20),
    ]
    .into_iter()
    .enumerate()
    {
        let d = pattern(i as u64 + 1, len);
        model[off as usize..off as usize + len].copy_from_slice(&d);
        reqs.push(Req::Write(off, d));
    }
    reqs.push(Req::Flush);
    let o = core.run(&dev, reqs.clone(), 1, Duration::from_secs(30));
    for (r, req) in o.results.iter().zip(&reqs) {
        // One command completes with its byte count; a request split into several
        // (beyond MDTS) and a flush complete with 0.
        let want = match req {
            Req::Write(_, d) if d.len() <= 1 << 20 => d.len() as i32,
            _ => 0,
        };
        assert_eq!(*r, want);
    }
    // Reads of the same shapes come back identical.
    let reads: Vec<Req> = reqs
        .iter()
        .filter_map(|r| match r {
            Req::Write(off, d) => Some(Req::Read(*off, d.len())),
            _ => None,
        })
        .collect();
    let o = core.run(&dev, reads.clone(), 4, Duration::from_secs(30));
    for (i, req) in reads.iter().enumerate() {
        let Req::Read(off, len) = req else {
            unreachable!()
        };
        assert_eq!(o.results[i], if *len <= 1 << 20 { *len as i32 } else { 0 });
        assert!(
            o.data[i][..] == model[*off as usize..*off as usize + len],
            "read {i}"
        );
    }

    // Bad requests fail with -EINVAL and nothing else happens.
    let o = core.run(
        &dev,
        vec![
            Req::Read(VOL, 4096),
            Req::Write(100, vec![1; 512]),
            Req::Read(0, 4096),
        ],
        4,
        Duration::from_secs(10),
    );
    assert_eq!(o.results[..2], [-libc::EINVAL, -libc::EINVAL]);
    assert_eq!(o.results[2], 4096);

    // QD 64 of 4 KiB random writes: several capsules per send.
    let before = o.stats;
    let reqs = random_writes(7, 20_000, 4096, &mut model);
    let o = core.run(&dev, reqs, 64, Duration::from_secs(60));
    assert!(o.results.iter().all(|&r| r == 4096), "a QD64 write failed");
    let capsules = o.stats.capsules - before.capsules;
    let sends = o.stats.sends - before.sends;
    eprintln!(
        "QD64: {capsules} capsules in {sends} sends ({:.1} per send), {:.0} IOPS",
        capsules as f64 / sends as f64,
        20_000.0 / o.elapsed.as_secs_f64()
    );
    assert!(capsules >= 20_000);
    // The target is on this host: commands in flight count as waits on a peer here, one
    // each, up to the queue depth.
    assert!(
        (2..=64).contains(&o.peer_waits_max),
        "QD64 peer waits: {}",
        o.peer_waits_max
    );
    assert!(
        sends * 3 / 2 < capsules,
        "QD64 writes were not batched: {capsules} capsules in {sends} sends"
    );
    verify_remote(&core, &dev, &model, "after QD64");
    verify_nbd(&t, &model, "after QD64");

    // The synchronous face agrees too, unaligned included.
    let mut b = vec![0u8; 1000];
    dev.read_at(4 << 20 | 300, &mut b).unwrap();
    assert_eq!(b[..], model[(4 << 20 | 300)..(4 << 20 | 300) + 1000]);
    dev.write_at(777, &[9u8; 100]).unwrap();
    model[777..877].fill(9);
    dev.sync().unwrap();
    verify_nbd(&t, &model, "after synchronous writes");
}

#[test]
fn a_killed_and_restarted_target_loses_no_io() {
    let mut t = target("remote-kill");
    let dev = open(&t, Duration::from_secs(30));
    let core = Core::start();
    let mut model = vec![0u8; VOL as usize];
    let n = 60_000;
    let reqs = random_writes(11, n, 4096, &mut model);
    let progress = Arc::new(AtomicUsize::new(0));
    let rx = core.spawn(&dev, reqs, 64, progress.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    while progress.load(Relaxed) < n / 6 {
        assert!(Instant::now() < deadline, "no progress before the kill");
        std::thread::sleep(Duration::from_millis(5));
    }
    t.node.kill9();
    let at_kill = progress.load(Relaxed);
    assert!(
        at_kill < n,
        "the load finished before the kill; make it longer"
    );
    std::thread::sleep(Duration::from_millis(300));
    t.node.restart();
    let o = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the load finished after the restart");
    let failed = o.results.iter().filter(|&&r| r != 4096).count();
    assert_eq!(
        failed,
        0,
        "I/Os failed across the restart: {:?}",
        o.results.iter().find(|&&r| r != 4096)
    );
    eprintln!(
        "killed at {at_kill}/{n}; resubmitted {}, connects {}",
        o.stats.resubmitted, o.stats.connects
    );
    assert!(o.stats.connects >= 2, "the queue did not reconnect");
    assert!(o.stats.resubmitted > 0, "nothing was in flight at the kill");
    // Commands dropped with the connection and sent again are counted once, not twice.
    assert_eq!(o.peer_waits_left, 0, "peer waits left after the restart");
    // Acknowledged writes must be durable on the target before we compare after another
    // restart; flush, then check both ways.
    let o = core.run(&dev, vec![Req::Flush], 1, Duration::from_secs(10));
    assert_eq!(o.results, [0]);
    verify_remote(&core, &dev, &model, "after the restart");
    verify_nbd(&t, &model, "after the restart");
}

#[test]
fn a_target_gone_past_the_timeout_fails_io_and_the_reactor_keeps_running() {
    let mut t = target("remote-gone");
    let dev = open(&t, Duration::from_secs(2));
    let core = Core::start();
    // Flushed, so the write survives the kill -9 (the target's thin map commits on flush).
    let o = core.run(
        &dev,
        vec![Req::Write(0, vec![5; 4096]), Req::Flush],
        1,
        Duration::from_secs(10),
    );
    assert_eq!(o.results, [4096, 0]);
    t.node.kill9();
    let started = Instant::now();
    let reqs: Vec<Req> = (0..32)
        .map(|i| Req::Write(i * 4096, vec![6; 4096]))
        .collect();
    let o = core.run(&dev, reqs, 32, Duration::from_secs(20));
    let took = started.elapsed();
    assert!(
        o.results.iter().all(|&r| r == -libc::ENOTCONN),
        "I/O to a dead target: {:?}",
        o.results
    );
    assert!(
        took >= Duration::from_millis(1500),
        "failed before the timeout ({took:?})"
    );
    assert!(took < Duration::from_secs(10), "took {took:?} to fail");
    // Still gone: new I/O fails at once, and the reactor runs other work meanwhile.
    let o = core.run(&dev, vec![Req::Read(0, 4096)], 1, Duration::from_secs(5));
    assert_eq!(o.results, [-libc::ENOTCONN]);
    assert!(o.elapsed < Duration::from_secs(1));
    // Back again: the queue reconnects on later I/O.
    t.node.restart();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = core.run(&dev, vec![Req::Read(0, 4096)], 1, Duration::from_secs(10));
        if o.results[0] == 4096 {
            assert!(o.data[0] == vec![5u8; 4096], "the flushed write was lost");
            break;
        }
        assert_eq!(o.results[0], -libc::ENOTCONN);
        assert!(Instant::now() < deadline, "the queue never came back");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_revived_device_holds_the_first_io_for_a_reconnect_instead_of_failing_it() {
    // What a replica's resync relies on: once the peer answers a probe again, the
    // per-core queues that gave up on it must not fail the next I/O while their own
    // retry backoff runs (that would drop the replica again).
    let mut t = target("remote-revive");
    let dev = open(&t, Duration::from_secs(2));
    let core = Core::start();
    let o = core.run(
        &dev,
        vec![Req::Write(0, vec![9; 4096]), Req::Flush],
        1,
        Duration::from_secs(10),
    );
    assert_eq!(o.results, [4096, 0]);
    t.node.kill9();
    let o = core.run(&dev, vec![Req::Read(0, 4096)], 1, Duration::from_secs(20));
    assert_eq!(o.results, [-libc::ENOTCONN], "I/O to a dead target");
    // The queue failed fast and just tried to reconnect (on that I/O): its next attempt
    // is a backoff away.
    let o = core.run(&dev, vec![Req::Read(0, 4096)], 1, Duration::from_secs(5));
    assert_eq!(o.results, [-libc::ENOTCONN]);
    t.node.restart();
    let mut probe = vec![0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(20);
    while dev.read_at(0, &mut probe).is_err() {
        assert!(
            Instant::now() < deadline,
            "the target never answered the probe"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    dev.revive();
    let o = core.run(&dev, vec![Req::Read(0, 4096)], 1, Duration::from_secs(10));
    assert_eq!(o.results, [4096], "the first I/O after the revival");
    assert!(o.data[0] == vec![9u8; 4096], "the flushed write was lost");
}

#[test]
fn a_raid1_pool_with_a_remote_leg_writes_both_legs() {
    let t = target("remote-raid1");
    let remote = open(&t, Duration::from_secs(5));
    let local = RamDevice::new(VOL).unwrap();
    let devs: Vec<Arc<dyn BlockDevice>> = vec![remote.clone(), local.clone()];
    // Formatting goes through the remote device's synchronous face.
    let pool = Pool::create(
        "mirror",
        devs,
        PoolOptions {
            layout: LayoutKind::Raid1 { copies: 2 },
            unit_size: 64 << 10,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let size = 16 << 20;
    let vol = pool.create_volume("v", size).unwrap();
    let core = Core::start();
    let mut model = vec![0u8; size as usize];
    let reqs = random_writes(3, 3000, 4096, &mut model);
    let o = core
        .spawn_on(
            &remote,
            Some(vol.clone()),
            reqs,
            32,
            Arc::new(AtomicUsize::new(0)),
        )
        .recv_timeout(Duration::from_secs(60))
        .expect("the raid1 load finished");
    assert!(o.results.iter().all(|&r| r >= 0), "a raid1 write failed");
    let o = core
        .spawn_on(
            &remote,
            Some(vol.clone()),
            vec![Req::Flush],
            1,
            Arc::new(AtomicUsize::new(0)),
        )
        .recv_timeout(Duration::from_secs(30))
        .unwrap();
    assert_eq!(o.results, [0]);
    // The volume reads back what was written...
    let chunk = 1 << 20;
    let reads: Vec<Req> = (0..size as usize / chunk)
        .map(|i| Req::Read((i * chunk) as u64, chunk))
        .collect();
    let o = core
        .spawn_on(
            &remote,
            Some(vol.clone()),
            reads,
            4,
            Arc::new(AtomicUsize::new(0)),
        )
        .recv_timeout(Duration::from_secs(60))
        .unwrap();
    for (i, d) in o.data.iter().enumerate() {
        assert!(o.results[i] >= 0);
        assert!(
            d[..] == model[i * chunk..(i + 1) * chunk],
            "volume MiB {i} differs"
        );
    }
    // ...and both legs hold the same data area, with the data in it: the remote leg read
    // over NVMe/TCP, the local one from RAM.
    let start = tessera_pool::format::DEV_DATA_START;
    let mut a = vec![0u8; (VOL - start) as usize];
    let mut b = vec![0u8; a.len()];
    remote.read_at(start, &mut a).unwrap();
    local.read_at(start, &mut b).unwrap();
    assert!(a.iter().any(|&x| x != 0), "nothing reached the remote leg");
    assert!(a == b, "the remote and local legs differ");
    let sample = &model[..4096];
    if sample.iter().any(|&x| x != 0) {
        assert!(
            a.windows(4096).step_by(512).any(|w| w == sample),
            "written data not on the remote leg"
        );
    }
}

/// A TCP relay in front of the target. On connections of I/O queues (qid != 0 in the
/// Connect command) accepted while `garbage` is set, the first `intact` bytes from the
/// target (ICResp and the Connect response) pass and everything after is replaced with
/// 0xFF bytes. Admin queues pass untouched, so reconnects always succeed: the queue
/// connects, meets garbage, and breaks, again and again.
fn garbling_proxy(target: String, garbage: Arc<AtomicBool>, intact: usize) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(client) = c else { return };
            let Ok(server) = std::net::TcpStream::connect(&target) else {
                continue;
            };
            let garble = garbage.load(Relaxed);
            let io_queue = Arc::new(AtomicBool::new(false));
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            let seen = io_queue.clone();
            std::thread::spawn(move || relay(c2, s2, Relay::Watch(seen)));
            let mode = if garble {
                Relay::Garble(io_queue, intact)
            } else {
                Relay::Pass
            };
            std::thread::spawn(move || relay(server, client, mode));
        }
    });
    addr
}

enum Relay {
    Pass,
    /// Host to target: note whether the Connect command is for an I/O queue.
    Watch(Arc<AtomicBool>),
    /// Target to host: garble after this many bytes if the queue is an I/O queue.
    Garble(Arc<AtomicBool>, usize),
}

/// Where the Connect command's QID sits in the host's byte stream: after the ICReq
/// (128 bytes), the capsule header (8) and CDW10's low half (SQE bytes 40..42).
const CONNECT_QID_AT: usize = 128 + 8 + 42;

fn relay(mut from: std::net::TcpStream, mut to: std::net::TcpStream, mode: Relay) {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 64 << 10];
    let mut head = Vec::new();
    let mut passed = 0usize;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        match &mode {
            Relay::Pass => {}
            Relay::Watch(io_queue) => {
                if head.len() < CONNECT_QID_AT + 2 {
                    head.extend_from_slice(&buf[..n]);
                    if head.len() >= CONNECT_QID_AT + 2 {
                        let qid =
                            u16::from_le_bytes([head[CONNECT_QID_AT], head[CONNECT_QID_AT + 1]]);
                        io_queue.store(qid != 0, Relaxed);
                    }
                }
            }
            Relay::Garble(io_queue, intact) => {
                if io_queue.load(Relaxed) {
                    for (i, b) in buf[..n].iter_mut().enumerate() {
                        if passed + i >= *intact {
                            *b = 0xFF;
                        }
                    }
                }
            }
        }
        passed += n;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
    let _ = from.shutdown(std::net::Shutdown::Both);
}

#[test]
fn a_peer_that_answers_garbage_fails_io_after_the_timeout() {
    let t = target("remote-garbage");
    let garbage = Arc::new(AtomicBool::new(false));
    // ICResp (128 bytes) and the Connect response (24) pass; what follows is garbage.
    let proxy = garbling_proxy(t.nvmf.clone(), garbage.clone(), 128 + 24);
    let spec = RemoteSpec::parse(&format!("nvme-tcp://{proxy}/{NQN}")).unwrap();
    let cfg = RemoteConfig {
        timeout: Duration::from_secs(2),
        ..RemoteConfig::default()
    };
    let dev = RemoteDevice::open_with(spec, cfg).unwrap();
    garbage.store(true, Relaxed);
    let core = Core::start();
    let started = Instant::now();
    let o = core.run(
        &dev,
        vec![Req::Write(0, vec![1; 4096])],
        1,
        Duration::from_secs(20),
    );
    assert_eq!(o.results, [-libc::ENOTCONN]);
    assert!(
        o.stats.connects >= 2,
        "the queue reconnected after meeting the garbage ({} connects)",
        o.stats.connects
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(10),
        "failed after {took:?}"
    );
    // The reactor still serves: the same device through a clean path works again.
    garbage.store(false, Relaxed);
    std::thread::sleep(Duration::from_millis(600));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = core.run(&dev, vec![Req::Read(0, 4096)], 1, Duration::from_secs(10));
        if o.results[0] == 4096 {
            break;
        }
        assert_eq!(o.results[0], -libc::ENOTCONN);
        assert!(Instant::now() < deadline, "the queue never came back");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_target_that_stops_answering_fails_io_and_recovers_when_it_resumes() {
    let t = target("remote-stall");
    let dev = open(&t, Duration::from_secs(2));
    let core = Core::start();
    let o = core.run(
        &dev,
        vec![Req::Write(0, vec![7; 4096]), Req::Flush],
        1,
        Duration::from_secs(10),
    );
    assert_eq!(o.results, [4096, 0]);
    let pid = t.node.pid() as i32;
    // SAFETY: signalling our own child process; SIGCONT below (and the node's Drop kill
    // works on a stopped process too).
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    // The stop takes effect asynchronously (a reactor spinning on another CPU may still
    // answer for a moment): wait until every thread of the node is stopped.
    let stopped = Instant::now() + Duration::from_secs(10);
    while !all_threads_stopped(pid) {
        assert!(Instant::now() < stopped, "the node did not stop");
        std::thread::sleep(Duration::from_millis(5));
    }
    let started = Instant::now();
    let o = core.run(&dev, vec![Req::Read(0, 4096)], 1, Duration::from_secs(20));
    let took = started.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert_eq!(o.results, [-libc::ENOTCONN], "I/O to a stopped target");
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(8),
        "failed after {took:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = core.run(&dev, vec![Req::Read(0, 4096)], 1, Duration::from_secs(10));
        if o.results[0] == 4096 {
            assert!(o.data[0] == vec![7u8; 4096], "the flushed write was lost");
            break;
        }
        assert_eq!(o.results[0], -libc::ENOTCONN);
        assert!(Instant::now() < deadline, "the queue never came back");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every thread of process `pid` is in the stopped state ('T' in /proc/PID/task/*/stat).
fn all_threads_stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|st| {
                st.rsplit_once(')')
                    .map(|(_, rest)| rest.trim_start().starts_with('T'))
            })
            .unwrap_or(false)
    })
}
