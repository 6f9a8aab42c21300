//! A read through the reactor-driven initiator completes successfully only when the
//! target sent every byte of it. A fake NVMe/TCP target on loopback (enough of a
//! controller to connect: Connect, properties, Set Features, Identify) answers each READ
//! wrongly: with too few bytes and the SUCCESS flag, or with C2HData PDUs that overlap.
//! The first must complete with an error, never with a buffer still holding what was
//! there before; the second is a protocol error that resets the connection.
//!
//! And a queue whose handle is dropped leaves nothing on its core: the hook it
//! registered there (which holds the queue and its buffers) goes once its last
//! operation is done.

// Test code builds data patterns and sizes from its own constants: its truncating casts
// are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;

use tessera_io::{CoreIo, IoHandle, IoOp, Tag, Task};
use tessera_nvmf::nvme::{self, Cqe, Sqe};
use tessera_nvmf::pdu::{self, Framing, IcResp};
use tessera_remote::{LinkStats, RemoteConfig, RemoteDevice, RemoteHandle, RemoteSpec};
use tessera_testkit::reactor::ReactorThread;

const NQN: &str = "nqn.2024-01.io.tessera:test:c2h";
const BLOCKS: u64 = 2048;
/// What the reader's buffer holds before the read: any of it left means unread data.
const STALE: u8 = 0xEE;

/// How the fake target answers a READ of `len` bytes: the (offset, length) of each
/// C2HData PDU it sends; the last one carries LAST and SUCCESS (no response capsule).
type Answer = fn(u32) -> Vec<(u32, u32)>;

fn send_data(s: &mut TcpStream, fr: &Framing, cid: u16, pieces: &[(u32, u32)]) {
    for (i, &(off, len)) in pieces.iter().enumerate() {
        let flags = if i + 1 == pieces.len() {
            pdu::F_DATA_LAST | pdu::F_DATA_SUCCESS
        } else {
            0
        };
        let mut h = [0u8; 256];
        let n = fr.data_pdu(&mut h, pdu::C2H_DATA, flags, cid, 0, off, len);
        let mut out = h[..n].to_vec();
        // The data names its offset, so misplaced bytes would show.
        out.extend((off..off + len).map(|i| (i % 251) as u8));
        s.write_all(&out).unwrap();
    }
}

fn respond(s: &mut TcpStream, fr: &Framing, cid: u16, dw0: u32) {
    let cqe = Cqe {
        dw0,
        cid,
        ..Cqe::default()
    };
    let mut b = [0u8; 64];
    let n = fr.capsule_resp(&mut b, &cqe.encode());
    s.write_all(&b[..n]).unwrap();
}

/// One connection (admin or I/O queue) of the fake controller, until the host hangs up.
fn serve(mut s: TcpStream, answer: Answer) {
    let mut ic = [0u8; pdu::IC_LEN];
    if s.read_exact(&mut ic).is_err() {
        return;
    }
    let resp = IcResp {
        pfv: 0,
        cpda: 0,
        digest: 0,
        maxh2cdata: 128 << 10,
    };
    s.write_all(&pdu::encode_icresp(&resp)).unwrap();
    // The host asked for no padding (HPDA 0): data starts right after the header.
    let fr = Framing {
        hdgst: false,
        ddgst: false,
        align: 4,
    };
    loop {
        let mut ch = [0u8; pdu::CH_LEN];
        if s.read_exact(&mut ch).is_err() {
            return;
        }
        let plen = pdu::le32(&ch, 4) as usize;
        let mut b = vec![0u8; plen];
        b[..pdu::CH_LEN].copy_from_slice(&ch);
        if s.read_exact(&mut b[pdu::CH_LEN..]).is_err() {
            return;
        }
        assert_eq!(ch[0], pdu::CAPSULE_CMD, "the host sends only commands here");
        let sqe = Sqe::parse(&b[8..72]);
        match sqe.opc {
            nvme::FABRICS if sqe.fctype() == nvme::FCTYPE_CONNECT => {
                respond(&mut s, &fr, sqe.cid, 1)
            }
            // CSTS.RDY, whatever property is asked for: the controller is ready.
            nvme::FABRICS => respond(&mut s, &fr, sqe.cid, nvme::CSTS_RDY),
            nvme::ADM_SET_FEATURES => respond(&mut s, &fr, sqe.cid, 63 | 63 << 16),
            nvme::ADM_IDENTIFY => {
                let mut id = vec![0u8; 4096];
                if sqe.cdw10 & 0xFF == u32::from(nvme::CNS_NAMESPACE) {
                    id[..8].copy_from_slice(&BLOCKS.to_le_bytes());
                    id[130] = 9; // LBA format 0: 512-byte blocks
                } else {
                    // IOCCSZ: the command alone, no in-capsule data.
                    id[1792..1796].copy_from_slice(&4u32.to_le_bytes());
                }
                let mut h = [0u8; 256];
                let flags = pdu::F_DATA_LAST | pdu::F_DATA_SUCCESS;
                let n = fr.data_pdu(&mut h, pdu::C2H_DATA, flags, sqe.cid, 0, 0, 4096);
                s.write_all(&h[..n]).unwrap();
                s.write_all(&id).unwrap();
            }
            nvme::IO_READ => send_data(&mut s, &fr, sqe.cid, &answer(sqe.sgl.len)),
            _ => respond(&mut s, &fr, sqe.cid, 0),
        }
    }
}

fn fake_target(answer: Answer) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { return };
            std::thread::spawn(move || serve(s, answer));
        }
    });
    addr
}

/// Opens a handle on its core, reads once, and reports the result, the buffer and the
/// queue's figures.
struct ReadOnce {
    dev: Arc<RemoteDevice>,
    h: Option<RemoteHandle>,
    buf: Vec<u8>,
    tx: std::sync::mpsc::Sender<(i32, Vec<u8>, LinkStats)>,
    done: bool,
}

impl Task for ReadOnce {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        let mut h = RemoteHandle::open(&self.dev);
        let op = IoOp::Read {
            offset: 0,
            len: self.buf.len() as u32,
            buf: self.buf.as_mut_ptr(),
        };
        // SAFETY: `buf` stays in the task, untouched, until the completion.
        unsafe { h.submit(io, op, Tag::task(id, 0)) };
        self.h = Some(h);
    }

    fn on_complete(&mut self, _io: &mut CoreIo, _slot: u32, res: i32) {
        let stats = self.h.take().expect("one completion").stats();
        let _ = self.tx.send((res, std::mem::take(&mut self.buf), stats));
        self.done = true;
    }

    fn finished(&self) -> bool {
        self.done
    }
}

fn device(answer: Answer) -> Arc<RemoteDevice> {
    let addr = fake_target(answer);
    let cfg = RemoteConfig {
        timeout: Duration::from_millis(400),
        ..RemoteConfig::default()
    };
    RemoteDevice::open_with(RemoteSpec::single(&addr, NQN, 1), cfg).unwrap()
}

fn read_through(answer: Answer, len: usize) -> (i32, Vec<u8>, LinkStats) {
    read_on(&ReactorThread::start(), device(answer), len)
}

/// Open a handle on `core`, read `len` bytes at 0, drop the handle.
fn read_on(core: &ReactorThread, dev: Arc<RemoteDevice>, len: usize) -> (i32, Vec<u8>, LinkStats) {
    let (tx, rx) = channel();
    core.mailbox.spawn(Box::new(move |_io: &mut CoreIo| {
        Box::new(ReadOnce {
            dev,
            h: None,
            buf: vec![STALE; len],
            tx,
            done: false,
        }) as Box<dyn Task>
    }));
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the read completed in time")
}

#[test]
fn a_read_with_a_short_c2hdata_and_success_fails() {
    // Half the bytes, flagged as the whole answer.
    let (res, buf, _) = read_through(|len| vec![(0, len / 2)], 4096);
    assert_eq!(
        res,
        -libc::EIO,
        "a read missing {} bytes completed with {res}; stale bytes {}",
        4096 / 2,
        buf.iter().filter(|&&b| b == STALE).count()
    );
}

#[test]
fn a_read_with_c2hdata_in_pieces_gets_every_byte() {
    // The same machinery accepts a well-formed answer in several PDUs.
    let (res, buf, _) = read_through(|len| vec![(0, 1024), (1024, len - 1024)], 4096);
    assert_eq!(res, 4096);
    let want: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    assert!(buf == want, "the read's bytes are the target's, in place");
}

#[test]
fn overlapping_c2hdata_is_a_protocol_error_that_resets_the_connection() {
    // 5 KiB of PDUs for a 4 KiB read: the second one starts inside the first. Every
    // byte of the range is covered, so only ordering catches it. The target does it
    // again on every connection: the read fails once the timeout runs out.
    let (res, _, stats) = read_through(|len| vec![(0, 2048), (1024, len - 1024)], 4096);
    assert!(res < 0, "an overlapped read completed with {res}");
    assert!(
        stats.connects >= 2 && stats.resubmitted >= 1,
        "the connection was reset and the read sent again: {stats:?}"
    );
}

#[test]
fn a_blocking_read_with_a_short_c2hdata_fails() {
    // The device's synchronous face (tools, metadata reads) runs the crate's blocking
    // initiator: the same rule holds there.
    let addr = fake_target(|len| vec![(0, len / 2)]);
    let cfg = RemoteConfig {
        timeout: Duration::from_millis(400),
        ..RemoteConfig::default()
    };
    let dev = RemoteDevice::open_with(RemoteSpec::single(&addr, NQN, 1), cfg).unwrap();
    let mut buf = vec![STALE; 4096];
    let r = tessera_device::BlockDevice::read_at(&*dev, 0, &mut buf);
    assert!(r.is_err(), "a read missing half its bytes returned Ok");
}

/// Reports the hooks registered on its core, and is done.
struct CountHooks(std::sync::mpsc::Sender<usize>);

impl Task for CountHooks {
    fn start(&mut self, io: &mut CoreIo, _id: u32) {
        let _ = self.0.send(io.hook_count());
    }
    fn on_complete(&mut self, _io: &mut CoreIo, _slot: u32, _res: i32) {}
    fn finished(&self) -> bool {
        true
    }
}

fn hooks_on(core: &ReactorThread) -> usize {
    let (tx, rx) = channel();
    core.mailbox.spawn(Box::new(move |_io: &mut CoreIo| {
        Box::new(CountHooks(tx)) as Box<dyn Task>
    }));
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the core answered")
}

#[test]
fn closed_queues_leave_no_hook_on_their_core() {
    let dev = device(|len| vec![(0, len)]);
    let core = ReactorThread::start();
    let before = hooks_on(&core);
    for i in 0..50 {
        let (res, _, _) = read_on(&core, dev.clone(), 4096);
        assert_eq!(res, 4096, "read {i}");
    }
    // Each closed queue goes once its last timer has fired (the reconnect deadline, at
    // most the device's timeout, 400 ms here).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut left = hooks_on(&core);
    while left > before && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        left = hooks_on(&core);
    }
    assert_eq!(
        left, before,
        "hooks left on the core after 50 queues closed"
    );
}
