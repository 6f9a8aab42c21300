//! The NVMe/TCP target serving a real pool volume, in process: a reactor core runs the
//! queues, the crate's blocking initiator is the host.
//!
//! - Write Zeroes with FUA is durable when it completes, as Write with FUA is: the pool
//!   sits on a device with a volatile write cache, and the power is cut right after the
//!   command; every crash image the device could hold reads zeros there.
//! - Ranges off the wire that do not fit (u64::MAX-ish LBAs, counts that wrap) get a
//!   clean LBA-range status, and the queue keeps serving.

// Test code builds data patterns and sizes from its own constants: its truncating casts
// are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Instant;

use tessera_device::BlockDevice;
use tessera_export::budget::{BufferBudget, ListenerCap};
use tessera_export::Export;
use tessera_nvmf::initiator::{Controller, Error, Options};
use tessera_nvmf::nvme::{self, Sqe};
use tessera_nvmf::target::{Catalog, NamespaceEntry, SubsystemInfo, Target};
use tessera_pool::{Pool, PoolOptions, Volume};
use tessera_qos::{QosLimits, VolumeQos};
use tessera_testkit::blockio::{core, read};
use tessera_testkit::devices::CrashDevice;
use tessera_testkit::reactor::ReactorThread;

const NQN: &str = "nqn.2024-01.io.tessera:test:target-io";
const LBA: u32 = 512;
const VOL: u64 = 8 << 20;

struct OneSubsystem(SubsystemInfo<Volume>);

impl Catalog<Volume> for OneSubsystem {
    fn subsystem(&self, nqn: &str) -> Option<SubsystemInfo<Volume>> {
        (nqn == NQN).then(|| self.0.clone())
    }
    fn subsystem_nqns(&self) -> Vec<String> {
        vec![NQN.to_string()]
    }
    fn generation(&self) -> u64 {
        1
    }
}

/// Serve `vol` as namespace 1 of [`NQN`] on a loopback port of one reactor core.
fn serve(vol: Arc<Volume>) -> (ReactorThread, String) {
    let info = SubsystemInfo {
        nqn: NQN.to_string(),
        serial: "target-io".to_string(),
        allow_any_host: true,
        hosts: Vec::new(),
        auth: BTreeMap::new(),
        namespaces: vec![NamespaceEntry {
            nsid: 1,
            export: Some(Export {
                target: vol,
                qos: Arc::new(VolumeQos::new(QosLimits::default(), Instant::now())),
            }),
            declared_size: VOL,
            nguid: [1; 16],
            uuid: [2; 16],
            eui64: [3; 8],
        }],
    };
    let target = Target::new(Arc::new(OneSubsystem(info)));
    let core = ReactorThread::start();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let mailbox = core.mailbox.clone();
    let addr_for_cap = addr.clone();
    std::thread::spawn(move || {
        tessera_nvmf::accept::accept_loop(
            l,
            target,
            ListenerCap::new("nvme-tcp", addr_for_cap, 64),
            BufferBudget::unlimited(),
            move || mailbox.clone(),
        )
    });
    (core, addr)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed ^ (i % 253) as u8 | 1).collect()
}

/// Write Zeroes of `nlb` blocks at `slba`, with FUA and, when `deac`, DEAC.
fn write_zeroes_fua(c: &mut Controller, slba: u64, nlb: u32, deac: bool) {
    let mut sqe = Sqe {
        opc: nvme::IO_WRITE_ZEROES,
        nsid: 1,
        cdw10: slba as u32,
        cdw11: (slba >> 32) as u32,
        cdw12: (nlb - 1) | 1 << 30,
        ..Sqe::default()
    };
    if deac {
        sqe.cdw12 |= 1 << 25;
    }
    c.io[0].exec(sqe, &[], 0).expect("write zeroes");
}

#[test]
fn write_zeroes_with_fua_is_durable_when_it_completes() {
    let dev = CrashDevice::new(64 << 20);
    let pool = Pool::create(
        "p",
        vec![dev.clone() as Arc<dyn BlockDevice>],
        PoolOptions::default(),
    )
    .unwrap();
    let vol = pool.create_volume("v", VOL).unwrap();
    let (core_thread, addr) = serve(vol);
    let mut c = Controller::connect(&addr, NQN, &Options::default(), 1).unwrap();

    // Data over two whole units, made durable.
    let data = pattern(7, 2 << 20);
    for (i, chunk) in data.chunks(128 << 10).enumerate() {
        let slba = (i * chunk.len()) as u64 / u64::from(LBA);
        c.write(0, 1, slba, chunk, LBA).unwrap();
    }
    c.flush(0, 1).unwrap();

    // Zeroes with FUA: 64 KiB inside the first unit (written as zeros), and the whole
    // second unit with DEAC (which the pool may deallocate instead).
    write_zeroes_fua(&mut c, 8, 128, false);
    write_zeroes_fua(&mut c, (1 << 20) / u64::from(LBA), (1 << 20) / LBA, true);
    // The power goes now. Whatever subset of unflushed writes reached the media, the
    // zeroed ranges read zeros and the rest reads the data.
    let images: Vec<Vec<u8>> = (1..=16).map(|seed| dev.crash_image(seed)).collect();
    c.disconnect();
    drop(core_thread);
    drop(pool);
    let mut want = data.clone();
    want[4096..4096 + (64 << 10)].fill(0);
    want[1 << 20..].fill(0);
    for (i, img) in images.into_iter().enumerate() {
        let pool = Pool::open(vec![CrashDevice::from_image(img) as Arc<dyn BlockDevice>])
            .unwrap_or_else(|e| panic!("crash image {}: open: {e}", i + 1));
        let v = pool.volume("v").unwrap();
        let mut h = v.open_handle();
        let got = read(&mut core(), &mut h, 0, want.len()).unwrap();
        let bad = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(
            bad.is_none(),
            "crash image {}: byte {} differs after the power cut (FUA not honoured)",
            i + 1,
            bad.unwrap()
        );
    }
}

/// The status of `e`, a command's failure.
fn status(e: Error) -> nvme::Status {
    match e {
        Error::Status(s, _) => s & 0x7FF,
        other => panic!("not a status: {other}"),
    }
}

#[test]
fn lba_ranges_off_the_wire_that_do_not_fit_are_refused_cleanly() {
    let dev: Arc<dyn BlockDevice> = tessera_device::RamDevice::new(64 << 20).unwrap();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    let vol = pool.create_volume("v", VOL).unwrap();
    let (_core, addr) = serve(vol);
    let mut c = Controller::connect(&addr, NQN, &Options::default(), 1).unwrap();
    let blocks = VOL / u64::from(LBA);
    let block = vec![0x5Au8; LBA as usize];
    // Starting LBAs whose end wraps around 2^64, or lies past the namespace, and
    // shifted by the LBA size would wrap too.
    for slba in [u64::MAX, u64::MAX - 1, 1 << 55, blocks, blocks - 1] {
        let nlb = if slba == blocks - 1 { 2 } else { 1 };
        let what = format!("slba {slba:#x} nlb {nlb}");
        let e = c.read(0, 1, slba, nlb, LBA).unwrap_err();
        assert_eq!(status(e), nvme::SC_LBA_RANGE, "read {what}");
        let data = vec![0u8; (nlb * LBA) as usize];
        let e = c.write(0, 1, slba, &data, LBA).unwrap_err();
        assert_eq!(status(e), nvme::SC_LBA_RANGE, "write {what}");
        let e = c.compare(0, 1, slba, &data, LBA).unwrap_err();
        assert_eq!(status(e), nvme::SC_LBA_RANGE, "compare {what}");
        let e = c.write_zeroes(0, 1, slba, nlb, false).unwrap_err();
        assert_eq!(status(e), nvme::SC_LBA_RANGE, "write zeroes {what}");
        let e = c.deallocate(0, 1, &[(slba, nlb)]).unwrap_err();
        assert_eq!(status(e), nvme::SC_LBA_RANGE, "deallocate {what}");
    }
    // The largest counts the fields carry, at the last block.
    let e = c
        .write_zeroes(0, 1, blocks - 1, 1 << 16, false)
        .unwrap_err();
    assert_eq!(status(e), nvme::SC_LBA_RANGE);
    let e = c.deallocate(0, 1, &[(blocks - 1, u32::MAX)]).unwrap_err();
    assert_eq!(status(e), nvme::SC_LBA_RANGE);
    // A log page offset far past any page: an empty (zero-filled) answer, no panic.
    let sqe = Sqe {
        opc: nvme::ADM_GET_LOG_PAGE,
        cdw10: u32::from(nvme::LID_ERROR) | (512 / 4 - 1) << 16,
        cdw12: u32::MAX - 3,
        cdw13: u32::MAX,
        ..Sqe::default()
    };
    let (_, page) = c.admin_cmd(sqe, 512).unwrap();
    assert!(page.iter().all(|&b| b == 0));
    // The queue still serves, and nothing was written.
    c.write(0, 1, blocks - 1, &block, LBA).unwrap();
    assert_eq!(c.read(0, 1, blocks - 1, 1, LBA).unwrap(), block);
    assert!(c.read(0, 1, 0, 8, LBA).unwrap().iter().all(|&b| b == 0));
    c.disconnect();
}
