//! The hang watchdog: a stalled device is reported once, with its index, within ~1.25x the
//! timeout; healthy (even slow) devices never are; the stalled I/O still completes when
//! the device returns, not earlier. Every loop is bounded by a deadline.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_device::{
    BlockDevice, FaultConfig, FaultDevice, HangCallback, NullDevice, RamDevice, Watchdog,
};
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};

type Calls = Arc<Mutex<Vec<(usize, Instant)>>>;

fn watchdog(timeout: Duration) -> (Arc<Watchdog>, Calls) {
    let calls: Calls = Arc::default();
    let c = calls.clone();
    let cb: HangCallback = Arc::new(move |d| c.lock().unwrap().push((d, Instant::now())));
    (Watchdog::new(timeout, cb), calls)
}

fn stalled(stall: Duration) -> (Arc<FaultDevice>, Arc<FaultConfig>) {
    let cfg = Arc::new(FaultConfig::default());
    cfg.stall(stall);
    (
        FaultDevice::new(RamDevice::new(1 << 20).unwrap(), cfg.clone()),
        cfg,
    )
}

fn read_op(buf: &mut [u8], slot: usize) -> IoOp {
    IoOp::Read {
        offset: (slot as u64 % 64) * 4096,
        len: buf.len() as u32,
        buf: buf.as_mut_ptr(),
    }
}

/// Keep `qd` reads in flight on `h` (tags 0..qd, buffers `bufs`) until `keep_going` says
/// stop or `limit` passes; returns (completions, the longest one, results < 0).
fn load(
    io: &mut CoreIo,
    h: &mut dyn IoHandle,
    bufs: &mut [Vec<u8>],
    limit: Duration,
    mut keep_going: impl FnMut() -> bool,
) -> (usize, Duration, usize) {
    let end = Instant::now() + limit;
    let mut started = vec![Instant::now(); bufs.len()];
    for (i, b) in bufs.iter_mut().enumerate() {
        // SAFETY: each read has its own buffer in `bufs`, which outlives the drain below.
        unsafe { h.submit(io, read_op(b, i), Tag::task(0, i as u32)) };
    }
    let (mut done, mut longest, mut errors) = (0, Duration::ZERO, 0);
    io.run_until_idle(|io, tag, res| {
        let i = tag.slot() as usize;
        done += 1;
        longest = longest.max(started[i].elapsed());
        errors += (res < 0) as usize;
        if Instant::now() < end && keep_going() {
            started[i] = Instant::now();
            // SAFETY: slot `i`'s previous read has completed; its buffer outlives the
            // drain.
            unsafe { h.submit(io, read_op(&mut bufs[i], i), tag) };
        }
    });
    (done, longest, errors)
}

fn bufs(qd: usize) -> Vec<Vec<u8>> {
    vec![vec![0u8; 4096]; qd]
}

#[test]
fn a_stalled_device_is_reported_with_its_index() {
    let timeout = Duration::from_millis(100);
    let (dog, calls) = watchdog(timeout);
    let (dev, _cfg) = stalled(Duration::from_millis(400));
    let healthy = RamDevice::new(1 << 20).unwrap();
    let mut io = CoreIo::new(0, 16, None).unwrap();
    let mut h = dog.wrap(3, dev.clone().open_handle());
    let mut g = dog.wrap(1, healthy.open_handle());
    let mut b = bufs(5);
    let t0 = Instant::now();
    let mut done = Vec::new();
    for (i, buf) in b.iter_mut().enumerate() {
        let h: &mut dyn IoHandle = if i < 4 { &mut *h } else { &mut *g };
        // SAFETY: each read has its own buffer in `b`, which outlives the drain below.
        unsafe { h.submit(&mut io, read_op(buf, i), Tag::task(0, i as u32)) };
    }
    io.run_until_idle(|_, tag, res| done.push((tag.slot(), res, t0.elapsed())));
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1, "one callback for 4 stalled I/Os: {calls:?}");
    assert_eq!(calls[0].0, 3);
    let after = calls[0].1 - t0;
    assert!(
        after >= timeout && after <= 2 * timeout,
        "reported after {after:?} (timeout {timeout:?})"
    );
    assert_eq!(dog.hangs(), 1);
    // Every I/O completed once, successfully; the stalled ones only when the device came back.
    assert_eq!(done.len(), 5);
    for &(tag, res, at) in &done {
        assert!(res >= 0, "tag {tag}: {res}");
        if tag < 4 {
            assert!(
                at >= Duration::from_millis(400),
                "tag {tag} completed early: {at:?}"
            );
        }
    }
    // The hang is over (nothing overdue) but no prompt completion was seen yet.
    assert!(dog.is_hung(3));
    assert!(!dog.is_hung(1));
}

#[test]
fn a_healthy_device_under_load_is_never_reported() {
    let timeout = Duration::from_millis(40);
    let (dog, calls) = watchdog(timeout);
    let mut io = CoreIo::new(0, 64, None).unwrap();
    // A slow but healthy device (a quarter of the timeout per I/O) at QD 16 ...
    let cfg = Arc::new(FaultConfig::default());
    cfg.latency_us.store(10_000, Relaxed);
    let slow = FaultDevice::new(RamDevice::new(1 << 20).unwrap(), cfg);
    let mut h = dog.wrap(0, slow.open_handle());
    let (n, _, errors) = load(&mut io, &mut *h, &mut bufs(16), 10 * timeout, || true);
    assert!(n > 100 && errors == 0, "{n} completions, {errors} errors");
    // ... and a fast one with completions inline, hammered.
    let mut h = dog.wrap(1, NullDevice::new(1 << 30).open_handle());
    let (n, _, errors) = load(&mut io, &mut *h, &mut bufs(32), 5 * timeout, || true);
    assert!(
        n > 10_000 && errors == 0,
        "{n} completions, {errors} errors"
    );
    assert!(
        calls.lock().unwrap().is_empty(),
        "{:?}",
        calls.lock().unwrap()
    );
    assert_eq!(dog.hangs(), 0);
}

#[test]
fn one_callback_per_hang_and_none_after_the_stall_ends() {
    let timeout = Duration::from_millis(40);
    let (dog, calls) = watchdog(timeout);
    let (dev, cfg) = stalled(Duration::from_millis(300));
    let mut io = CoreIo::new(0, 16, None).unwrap();
    let mut h = dog.wrap(7, dev.open_handle());
    let mut b = bufs(4);
    // Stalled for ~800 ms (about 80 ticks): reported once, not on every tick.
    load(&mut io, &mut *h, &mut b, Duration::from_millis(800), || {
        true
    });
    assert_eq!(dog.hangs(), 1, "{:?}", calls.lock().unwrap());
    assert_eq!(calls.lock().unwrap()[0].0, 7);
    // The stall ends: prompt completions for 10 timeouts and no new report.
    cfg.unstall();
    let (n, longest, _) = load(&mut io, &mut *h, &mut b, 10 * timeout, || true);
    // (Not asserting on `longest`: the harness' own view of latency includes the test
    // thread being descheduled; the watchdog counts its ticks, which that does not skew.)
    assert!(n > 100, "{n} completions, longest {longest:?}");
    assert_eq!(dog.hangs(), 1, "{:?}", calls.lock().unwrap());
    assert!(!dog.is_hung(7));
    // A new hang of the same device is a new report.
    cfg.stall(Duration::from_millis(200));
    let t0 = Instant::now();
    load(&mut io, &mut *h, &mut b, Duration::from_secs(2), || {
        dog.hangs() < 2
    });
    assert_eq!(dog.hangs(), 2);
    assert!(calls.lock().unwrap()[1].1 - t0 <= 2 * timeout);
}

#[test]
fn cores_share_one_report() {
    let timeout = Duration::from_millis(50);
    let (dog, _calls) = watchdog(timeout);
    let (dev, _cfg) = stalled(Duration::from_millis(300));
    let ok = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        for core in 0..3 {
            let (dog, dev, ok) = (dog.clone(), dev.clone(), ok.clone());
            s.spawn(move || {
                let mut io = CoreIo::new(core, 16, None).unwrap();
                let mut h = dog.wrap(2, dev.open_handle());
                let (n, longest, errors) =
                    load(&mut io, &mut *h, &mut bufs(2), Duration::ZERO, || false);
                if n == 2 && errors == 0 && longest >= Duration::from_millis(300) {
                    ok.fetch_add(1, Relaxed);
                }
            });
        }
    });
    assert_eq!(ok.load(Relaxed), 3);
    assert_eq!(dog.hangs(), 1);
}

#[test]
fn errors_pass_through_and_are_not_hangs() {
    let (dog, _calls) = watchdog(Duration::from_millis(20));
    let cfg = Arc::new(FaultConfig::default());
    cfg.fail_reads(0, 1 << 20);
    let dev = FaultDevice::new(RamDevice::new(1 << 20).unwrap(), cfg);
    let mut io = CoreIo::new(0, 16, None).unwrap();
    let mut h = dog.wrap(0, dev.clone().open_handle());
    let (n, _, errors) = load(
        &mut io,
        &mut *h,
        &mut bufs(4),
        Duration::from_millis(100),
        || true,
    );
    assert_eq!(n, errors);
    assert_eq!(dog.hangs(), 0);
    assert_eq!(h.size(), dev.size());
}

#[test]
fn run_until_idle_does_not_wait_for_the_check() {
    // The check's period would be 2.5 s; a healthy read must not wait for it.
    let (dog, _calls) = watchdog(Duration::from_secs(10));
    let mut io = CoreIo::new(0, 16, None).unwrap();
    let mut h = dog.wrap(0, RamDevice::new(1 << 20).unwrap().open_handle());
    let t0 = Instant::now();
    for _ in 0..3 {
        load(&mut io, &mut *h, &mut bufs(1), Duration::ZERO, || false);
    }
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
}
