//! The fault-injecting device: errors at chosen offsets, random errors, added latency,
//! and vanishing after a number of I/Os or a time — on the datapath and the sync face.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_device::{open_device, BlockDevice, DeviceSpec, FaultConfig, FaultDevice, RamDevice};
use tessera_io::{CoreIo, IoHandle, IoOp};
use tessera_testkit::blockio::run;

fn read(io: &mut CoreIo, h: &mut dyn IoHandle, offset: u64, buf: &mut [u8]) -> i32 {
    run(
        io,
        h,
        IoOp::Read {
            offset,
            len: buf.len() as u32,
            buf: buf.as_mut_ptr(),
        },
    )
}

fn setup() -> (Arc<FaultDevice>, Arc<FaultConfig>, CoreIo) {
    let cfg = Arc::new(FaultConfig::default());
    let dev = FaultDevice::new(RamDevice::new(1 << 20).unwrap(), cfg.clone());
    (dev, cfg, CoreIo::new(0, 16, None).unwrap())
}

#[test]
fn errors_hit_only_the_chosen_range() {
    let (dev, cfg, mut io) = setup();
    let mut h = dev.clone().open_handle();
    let mut buf = vec![0u8; 4096];
    cfg.fail_reads(8192, 12288);
    assert_eq!(read(&mut io, &mut *h, 8192, &mut buf), -libc::EIO);
    assert!(read(&mut io, &mut *h, 4096, &mut buf) >= 0);
    // Overlapping the range by one byte is enough.
    assert_eq!(read(&mut io, &mut *h, 4097, &mut buf), -libc::EIO);
    // Read faults leave writes alone; writes have their own range.
    assert!(
        run(
            &mut io,
            &mut *h,
            IoOp::Write {
                offset: 8192,
                len: 4096,
                buf: buf.as_ptr()
            }
        ) >= 0
    );
    cfg.fail_writes(0, 4096);
    assert_eq!(
        run(
            &mut io,
            &mut *h,
            IoOp::Write {
                offset: 0,
                len: 4096,
                buf: buf.as_ptr()
            }
        ),
        -libc::EIO
    );
    // Clearing the range heals the device.
    cfg.fail_reads(0, 0);
    assert!(read(&mut io, &mut *h, 8192, &mut buf) >= 0);
}

#[test]
fn random_errors_follow_the_rate() {
    let (dev, cfg, mut io) = setup();
    let mut h = dev.clone().open_handle();
    let mut buf = vec![0u8; 512];
    cfg.error_ppm.store(100_000, Relaxed); // 10%
    let fails = (0..20_000)
        .filter(|_| read(&mut io, &mut *h, 0, &mut buf) < 0)
        .count();
    assert!(
        (1_400..2_600).contains(&fails),
        "{fails} failures of 20000 at 10%"
    );
}

#[test]
fn latency_is_added_to_completions() {
    let (dev, cfg, mut io) = setup();
    let mut h = dev.clone().open_handle();
    let mut buf = vec![0u8; 512];
    cfg.latency_us.store(20_000, Relaxed);
    let t = Instant::now();
    assert!(read(&mut io, &mut *h, 0, &mut buf) >= 0);
    assert!(
        t.elapsed() >= Duration::from_millis(20),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn sync_latency_slows_the_synchronous_face_only() {
    let (dev, cfg, _io) = setup();
    let buf = vec![7u8; 4096];
    // Without the knob, the datapath's latency leaves the synchronous face alone.
    cfg.latency_us.store(50_000, Relaxed);
    let t = Instant::now();
    dev.write_at(0, &buf).unwrap();
    assert!(t.elapsed() < Duration::from_millis(50), "{:?}", t.elapsed());
    cfg.latency_us.store(0, Relaxed);
    cfg.set("sync_latency_us", "20000").unwrap();
    for call in 0..3 {
        let t = Instant::now();
        match call {
            0 => dev.write_at(0, &buf).unwrap(),
            1 => dev.read_at(0, &mut vec![0u8; 4096]).unwrap(),
            _ => dev.sync().unwrap(),
        }
        assert!(
            t.elapsed() >= Duration::from_millis(20),
            "call {call}: {:?}",
            t.elapsed()
        );
    }
}

#[test]
fn a_vanished_device_fails_everything() {
    let (dev, cfg, mut io) = setup();
    let mut h = dev.clone().open_handle();
    let mut buf = vec![0u8; 512];
    cfg.vanish_after_ios.store(3, Relaxed);
    assert!(read(&mut io, &mut *h, 0, &mut buf) >= 0);
    assert!(read(&mut io, &mut *h, 0, &mut buf) >= 0);
    assert_eq!(read(&mut io, &mut *h, 0, &mut buf), -libc::ENODEV);
    assert_eq!(run(&mut io, &mut *h, IoOp::Flush), -libc::ENODEV);
    assert!(dev.read_at(0, &mut buf).is_err());
    assert!(dev.sync().is_err());
}

#[test]
fn specs_build_fault_devices_that_vanish_in_time() {
    let d = open_device(&DeviceSpec::parse("fault:ram:1M;vanish_after_ms=1").unwrap()).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let mut h = d.clone().open_handle();
    let mut io = CoreIo::new(0, 16, None).unwrap();
    let mut buf = vec![0u8; 512];
    assert_eq!(read(&mut io, &mut *h, 0, &mut buf), -libc::ENODEV);
}

#[test]
fn a_stalled_device_completes_late_on_both_faces() {
    let d = open_device(&DeviceSpec::parse("fault:ram:1M;stall_ms=30").unwrap()).unwrap();
    let mut h = d.clone().open_handle();
    let mut io = CoreIo::new(0, 16, None).unwrap();
    let mut buf = vec![0u8; 512];
    let t = Instant::now();
    assert!(read(&mut io, &mut *h, 0, &mut buf) >= 0);
    assert!(
        t.elapsed() >= Duration::from_millis(30),
        "{:?}",
        t.elapsed()
    );
    let t = Instant::now();
    d.read_at(0, &mut buf).unwrap();
    d.write_at(0, &buf).unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(60),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn a_stall_can_start_late_and_be_cleared() {
    let (dev, cfg, mut io) = setup();
    cfg.set("stall_ms", "40").unwrap();
    cfg.set("stall_after_ms", "50").unwrap();
    let mut h = dev.clone().open_handle();
    let mut buf = vec![0u8; 512];
    let t = Instant::now();
    assert!(read(&mut io, &mut *h, 0, &mut buf) >= 0);
    assert!(t.elapsed() < Duration::from_millis(40), "{:?}", t.elapsed());
    std::thread::sleep(Duration::from_millis(60));
    let t = Instant::now();
    assert!(read(&mut io, &mut *h, 0, &mut buf) >= 0);
    assert!(
        t.elapsed() >= Duration::from_millis(40),
        "{:?}",
        t.elapsed()
    );
    cfg.unstall();
    let t = Instant::now();
    assert!(read(&mut io, &mut *h, 0, &mut buf) >= 0);
    dev.read_at(0, &mut buf).unwrap();
    assert!(t.elapsed() < Duration::from_millis(40), "{:?}", t.elapsed());
}

#[test]
fn unknown_settings_list_the_stall_keys() {
    let err = FaultConfig::default()
        .set("bogus", "1")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("stall_ms") && err.contains("stall_after_ms"),
        "{err}"
    );
}
