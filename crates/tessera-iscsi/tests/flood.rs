//! A login flood against the portal: hundreds of TCP connections that never send a
//! PDU, or send half a Login PDU and stop, while a well-behaved initiator logs in and
//! does I/O. Alone in its test binary, so the process's resident memory measures what
//! the flood costs the target.
//!
//! What it holds the target to: a Login PDU announcing more than the login phase's
//! 8192-byte data segment is closed at once; at most the listener's login bound
//! ([`LoginGate::bound_for`]) of connections are logging in at any time, a new one
//! closing the oldest, so the flood never fills the listener's cap; the good client is
//! served at once while the flood's logins hold their places, and while a flood goes
//! on; the half-open logins left are closed after the login timeout; the resident
//! memory the flood adds stays within [`RSS_BOUND`].

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_device::{BlockDevice, RamDevice};
use tessera_export::budget::{BufferBudget, ListenerCap};
use tessera_export::Export;
use tessera_iscsi::accept::{accept_gated, LoginGate};
use tessera_iscsi::pdu::{self, get_u32, put_u32, Digests, BHS_LEN, FLAG_FINAL};
use tessera_iscsi::target::Target;
use tessera_pool::{Pool, PoolOptions};
use tessera_qos::{QosLimits, VolumeQos};
use tessera_testkit::reactor::ReactorThread;

const IQN: &str = "iqn.2026-11.io.tessera:flood";
/// The listener's cap in this test.
const CAP: usize = 128;
/// Flood connections: [`OVERSIZED`] logins announcing too much data, then silent ones
/// and half logins in turn.
const FLOOD: usize = 300;
const OVERSIZED: usize = 30;
const LOGIN_TIMEOUT: Duration = Duration::from_secs(3);
/// Resident memory the flood may add to the process (the target, and the test's own
/// sockets): a connection still logging in holds a 16 KiB receive buffer, so the capped
/// flood costs a few MiB; before, each held a 1 MiB buffer, zeroed (touched) when the
/// connection was accepted: 128 MiB at this cap.
const RSS_BOUND: u64 = 24 << 20;

/// This process's resident memory, bytes.
fn rss() -> u64 {
    tessera_testkit::node::vm_rss(std::process::id())
}

/// The resident size once two readings 250 ms apart differ by less than 256 KiB (at
/// most 5 s).
fn settled_rss() -> u64 {
    let t = Instant::now();
    let mut last = rss();
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let now = rss();
        if now.abs_diff(last) < 256 << 10 || t.elapsed() > Duration::from_secs(5) {
            return now;
        }
        last = now;
    }
}

/// What went wrong for [`good_client`].
#[derive(Debug, thiserror::Error)]
enum ClientFailed {
    /// The socket failed at `step` (connect, send, recv).
    #[error("{step}: {source}")]
    Io {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The target refused the login; the first bytes of its answer.
    #[error("login refused: {0:02x?}")]
    LoginRefused([u8; 4]),
    /// A command got an answer other than its data and a good status.
    #[error("opcode {opcode:#x} status {status:#x}")]
    Unexpected { opcode: u8, status: u8 },
    #[error("read back differs")]
    ReadBackDiffers,
}

fn io_failed(step: &'static str) -> impl FnOnce(std::io::Error) -> ClientFailed {
    move |source| ClientFailed::Io { step, source }
}

/// Log in (operational stage straight to full feature), then a WRITE(10) of 8 KiB of
/// immediate data and a READ(10) of it back. Errors name what went wrong.
fn good_client(addr: &str) -> Result<(), ClientFailed> {
    let mut s = TcpStream::connect(addr).map_err(io_failed("connect"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let keys = format!(
        "InitiatorName=iqn.2026-11.io.tessera:flood-good\0SessionType=Normal\0\
         TargetName={IQN}\0HeaderDigest=None\0DataDigest=None\0ImmediateData=Yes\0\
         MaxRecvDataSegmentLength=65536\0"
    );
    let mut h = pdu::header(
        pdu::OP_LOGIN_REQ | pdu::FLAG_IMMEDIATE,
        0x80 | 0x04 | 0x03,
        keys.len(),
    );
    h[8..14].copy_from_slice(&[0x80, 0, 0, 0, 0, 2]);
    put_u32(&mut h, 24, 1);
    let d = Digests::default();
    let send = |s: &mut TcpStream, h: &[u8; BHS_LEN], data: &[u8]| {
        s.write_all(&pdu::encode(h, data, d))
            .map_err(io_failed("send"))
    };
    let recv = |s: &mut TcpStream| -> Result<([u8; BHS_LEN], Vec<u8>), ClientFailed> {
        let mut h = [0u8; BHS_LEN];
        s.read_exact(&mut h).map_err(io_failed("recv"))?;
        let len = (usize::from(h[5]) << 16) | (usize::from(h[6]) << 8) | usize::from(h[7]);
        let mut data = vec![0u8; pdu::padded(len)];
        s.read_exact(&mut data).map_err(io_failed("recv"))?;
        data.truncate(len);
        Ok((h, data))
    };
    send(&mut s, &h, keys.as_bytes())?;
    let (r, _) = recv(&mut s)?;
    if r[0] & 0x3f != pdu::OP_LOGIN_RESP || r[36] != 0 || r[1] & 0x83 != 0x83 {
        return Err(ClientFailed::LoginRefused([r[0], r[1], r[2], r[3]]));
    }
    let data: Vec<u8> = (0..8192u32)
        .map(|i| u8::try_from((i * 7 + 3) % 251).unwrap())
        .collect();
    for (itt, cmdsn, write) in [(1u32, 1u32, true), (2, 2, false)] {
        let mut cdb = [0u8; 10];
        cdb[0] = if write { 0x2a } else { 0x28 };
        cdb[2..6].copy_from_slice(&100u32.to_be_bytes());
        cdb[7..9].copy_from_slice(&16u16.to_be_bytes());
        let imm: &[u8] = if write { &data } else { &[] };
        let flags = FLAG_FINAL | 0x01 | if write { 0x20 } else { 0x40 };
        let mut h = pdu::header(pdu::OP_SCSI_CMD, flags, imm.len());
        put_u32(&mut h, 16, itt);
        put_u32(&mut h, 20, 8192);
        put_u32(&mut h, 24, cmdsn);
        h[32..42].copy_from_slice(&cdb);
        send(&mut s, &h, imm)?;
        let mut got = Vec::new();
        loop {
            let (r, d) = recv(&mut s)?;
            match r[0] & 0x3f {
                pdu::OP_SCSI_RESP if r[3] == 0 => break,
                pdu::OP_DATA_IN => {
                    assert_eq!(get_u32(&r, 40) as usize, got.len());
                    got.extend_from_slice(&d);
                    if r[1] & 0x01 != 0 {
                        break;
                    }
                }
                opcode => {
                    return Err(ClientFailed::Unexpected {
                        opcode,
                        status: r[3],
                    })
                }
            }
        }
        if !write && got != data {
            return Err(ClientFailed::ReadBackDiffers);
        }
    }
    Ok(())
}

/// Whether the target closed `s` (EOF or reset) within `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 512];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn a_login_flood_is_capped_timed_out_and_bounded_in_memory() {
    let dev: Arc<dyn BlockDevice> = RamDevice::new(80 << 20).unwrap();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    let vol = pool.create_volume("v", 16 << 20).unwrap();
    let target = Target::new();
    target.set_login_timeout(LOGIN_TIMEOUT);
    target
        .add_target(
            IQN,
            vec![Export {
                target: vol.clone(),
                qos: Arc::new(VolumeQos::new(QosLimits::default(), Instant::now())),
            }],
        )
        .unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let core = ReactorThread::start();
    let mailbox = core.mailbox.clone();
    let cap = ListenerCap::new("iscsi", addr.clone(), CAP);
    let listener_cap = cap.clone();
    let bound = LoginGate::bound_for(CAP);
    let gate = LoginGate::new(bound);
    let listener_gate = gate.clone();
    let t2 = target.clone();
    std::thread::spawn(move || {
        accept_gated(
            l,
            t2,
            listener_cap,
            &listener_gate,
            BufferBudget::unlimited(),
            move || mailbox.clone(),
        )
    });

    // Unflooded, the good client is served (and its session's memory is counted before
    // the flood starts). The pool allocates for a while after its first writes (some
    // 30 MiB): the baseline is taken once that has settled.
    good_client(&addr).unwrap();
    let before = settled_rss();

    let t0 = Instant::now();
    let mut flood: Vec<(usize, TcpStream)> = Vec::new();
    for i in 0..FLOOD {
        let mut s = TcpStream::connect(&addr).unwrap();
        let kind = if i < OVERSIZED { 2 } else { i % 2 };
        match kind {
            // Silent.
            0 => {}
            // Half a Login PDU: the header announces 4000 bytes of text, 1000 come.
            1 => {
                let mut h = pdu::header(pdu::OP_LOGIN_REQ | pdu::FLAG_IMMEDIATE, 0x83, 4000);
                put_u32(&mut h, 24, 1);
                let _ = s.write_all(&h);
                let _ = s.write_all(&[b'x'; 1000]);
            }
            // A Login PDU announcing 200 KiB of data, more than the login phase allows.
            _ => {
                let mut h = pdu::header(pdu::OP_LOGIN_REQ | pdu::FLAG_IMMEDIATE, 0x83, 200 << 10);
                put_u32(&mut h, 24, 1);
                let _ = s.write_all(&h);
                let _ = s.write_all(&[b'y'; 60 << 10]);
            }
        }
        flood.push((kind, s));
    }
    // Let the accept thread catch up. Every flood connection was admitted to its login
    // or, while the listener was full, refused; all but `bound` of the admitted ones
    // were closed to make room for newer ones (the oversized ones by their own fault).
    // A closed connection's task gives its slot back within its login tick.
    let t = Instant::now();
    loop {
        let seen = gate.evicted() + cap.refused() + u64::try_from(gate.logging_in()).unwrap();
        if seen >= u64::try_from(FLOOD - OVERSIZED).unwrap() && cap.open() <= bound {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "evicted {}, logging in {}, slots held {}, refused {}",
            gate.evicted(),
            gate.logging_in(),
            cap.open(),
            cap.refused()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let peak = rss();
    eprintln!(
        "flood of {FLOOD} connected in {:?}: {} logging in, {} closed for newer ones, {} refused at the cap, {} slots held after {:?}; RSS {} KiB -> {} KiB (+{} KiB)",
        t0.elapsed(),
        gate.logging_in(),
        gate.evicted(),
        cap.refused(),
        cap.open(),
        t.elapsed(),
        before >> 10,
        peak >> 10,
        peak.saturating_sub(before) >> 10,
    );
    // The flood keeps its login places only, far from the listener's cap.
    assert!(gate.logging_in() <= bound);
    assert!(gate.evicted() > 0);

    // The oversized logins, and every login closed for a newer one, are closed long
    // before the login timeout; at most `bound` silent and half logins stay.
    let quick = Duration::from_secs(1);
    let t = Instant::now();
    let mut open_after_quick = Vec::new();
    for (kind, mut s) in flood {
        let left = quick
            .saturating_sub(t.elapsed())
            .max(Duration::from_millis(1));
        if closed_within(&mut s, left) {
            continue;
        }
        assert_ne!(kind, 2, "a login announcing 200 KiB of data was kept open");
        open_after_quick.push(s);
    }
    assert!(
        open_after_quick.len() <= bound,
        "{} flood connections still open (bound {bound})",
        open_after_quick.len()
    );
    eprintln!(
        "{} half-open logins left after {:?}",
        open_after_quick.len(),
        t0.elapsed()
    );
    let filled = Instant::now();

    // The good client, while the flood's half-open logins hold every login place:
    // served at once (its login closes the oldest of them), not after the timeout.
    let t = Instant::now();
    good_client(&addr).unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "good client took {:?}",
        t.elapsed()
    );
    eprintln!("good client served in {:?} beside the flood", t.elapsed());

    // And while a slow flood of silent connections goes on, 100 a second: in the login
    // timeout that is more than the listener's cap, which it would fill and keep full
    // (every new client refused until the oldest timed out); the login bound keeps it
    // to its places, and the good client is served at once.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooder = {
        let (addr, stop) = (addr.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && held.len() < 1000 {
                if let Ok(s) = TcpStream::connect(&addr) {
                    held.push(s);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            held.len()
        })
    };
    // Long enough for the slow flood to have filled the cap without the bound.
    std::thread::sleep(LOGIN_TIMEOUT / 2 + Duration::from_millis(500));
    let t = Instant::now();
    let mut tries = 0;
    loop {
        tries += 1;
        match good_client(&addr) {
            Ok(()) => break,
            Err(e) => assert!(
                t.elapsed() < Duration::from_secs(1),
                "good client not served during a flood in {:?} ({tries} tries): {e}",
                t.elapsed()
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let flooded = flooder.join().unwrap();
    eprintln!(
        "good client served in {:?} ({tries} tries) during a slow flood of {flooded} connections ({} refused at the cap in all)",
        t.elapsed(),
        cap.refused()
    );

    // Every half-open login left is closed within the timeout (plus slack), counted
    // from when the flood ended, and its slot is given back.
    for mut s in open_after_quick {
        let left = (LOGIN_TIMEOUT + Duration::from_secs(3)).saturating_sub(filled.elapsed());
        assert!(
            closed_within(&mut s, left.max(Duration::from_millis(1))),
            "a half-open login still open after {:?}",
            t0.elapsed()
        );
    }
    eprintln!(
        "every half-open login closed {:?} after the flood connected",
        t0.elapsed()
    );
    let t = Instant::now();
    while cap.open() > 0 {
        assert!(
            t.elapsed() < LOGIN_TIMEOUT + Duration::from_secs(3),
            "{} slots still held",
            cap.open()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let grew = peak.saturating_sub(before);
    assert!(
        grew < RSS_BOUND,
        "the flood added {} KiB of resident memory (bound {} KiB)",
        grew >> 10,
        RSS_BOUND >> 10
    );
    // And the target still serves.
    good_client(&addr).unwrap();
    drop(core);
}
