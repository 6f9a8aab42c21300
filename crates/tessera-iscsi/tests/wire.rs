//! The target on the wire, driven by a small blocking initiator written here on the
//! crate's own codec: data written in process reads back over iSCSI byte for byte and
//! the reverse (a write large enough for immediate data and several R2Ts, with header
//! and data digests on), and hostile input (PDUs before login, an unknown target, an
//! oversized data segment, a bad data digest) ends only the connection that sent it;
//! the export's QoS limits hold the LUN's I/O; an ALUA target's standby port refuses
//! media access, reports a change of state once per session, and serves the volume
//! once active.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_device::{BlockDevice, RamDevice};
use tessera_export::budget::{BufferBudget, ListenerCap};
use tessera_export::Export;
use tessera_iscsi::accept::accept_loop;
use tessera_iscsi::alua::{self, Alua, PortGroup};
use tessera_iscsi::pdu::{self, get_u32, put_u32, Digests, BHS_LEN, FLAG_FINAL};
use tessera_iscsi::target::Target;
use tessera_iscsi::text;
use tessera_pool::{Pool, PoolOptions, Volume};
use tessera_qos::{QosLimits, VolumeQos};
use tessera_testkit::blockio::{core, read, write};
use tessera_testkit::data::pattern;
use tessera_testkit::reactor::ReactorThread;

const IQN: &str = "iqn.2026-11.io.tessera:wire";
const VOL: u64 = 16 << 20;

struct Served {
    cap: Arc<ListenerCap>,
    _pool: Pool,
    vol: Arc<Volume>,
    _core: ReactorThread,
    addr: String,
}

fn serve() -> Served {
    serve_with(QosLimits::default())
}

fn serve_with(limits: QosLimits) -> Served {
    let dev: Arc<dyn BlockDevice> = RamDevice::new(VOL + (64 << 20)).unwrap();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    let vol = pool.create_volume("v", VOL).unwrap();
    let target = Target::new();
    target
        .add_target(
            IQN,
            vec![Export {
                target: vol.clone(),
                qos: Arc::new(VolumeQos::new(limits, Instant::now())),
            }],
        )
        .unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    target.add_portal(addr.clone());
    let core = ReactorThread::start();
    let mailbox = core.mailbox.clone();
    let cap = ListenerCap::new("iscsi", addr.clone(), 64);
    let listener_cap = cap.clone();
    std::thread::spawn(move || {
        accept_loop(
            l,
            target,
            listener_cap,
            BufferBudget::unlimited(),
            move || mailbox.clone(),
        )
    });
    Served {
        cap,
        _pool: pool,
        vol,
        _core: core,
        addr,
    }
}

/// A blocking initiator: one session, one command at a time.
struct Initiator {
    s: TcpStream,
    digests: Digests,
    cmdsn: u32,
    itt: u32,
    /// The last byte of the ISID: sessions with different ones are different I_T
    /// nexuses.
    isid: u8,
}

impl Initiator {
    fn connect(addr: &str) -> Initiator {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Initiator {
            s,
            digests: Digests::default(),
            cmdsn: 1,
            itt: 1,
            isid: 1,
        }
    }

    fn send(&mut self, h: &[u8; BHS_LEN], data: &[u8]) {
        self.s
            .write_all(&pdu::encode(h, data, self.digests))
            .unwrap();
    }

    /// The next PDU, digests checked; `None` once the target closed the connection.
    fn recv(&mut self) -> Option<([u8; BHS_LEN], Vec<u8>)> {
        let mut h = [0u8; BHS_LEN];
        if self.s.read_exact(&mut h).is_err() {
            return None;
        }
        if self.digests.header {
            let mut d = [0u8; 4];
            self.s.read_exact(&mut d).unwrap();
            assert_eq!(u32::from_le_bytes(d), pdu::crc32c(&h), "header digest");
        }
        let len = (usize::from(h[5]) << 16) | (usize::from(h[6]) << 8) | usize::from(h[7]);
        let mut data = vec![0u8; pdu::padded(len)];
        self.s.read_exact(&mut data).unwrap();
        if self.digests.data && len > 0 {
            let mut d = [0u8; 4];
            self.s.read_exact(&mut d).unwrap();
            assert_eq!(u32::from_le_bytes(d), pdu::crc32c(&data), "data digest");
        }
        data.truncate(len);
        Some((h, data))
    }

    /// Log in straight in the operational stage, asking for `digests`.
    fn login(&mut self, target: &str, digests: bool) -> Result<(), (u8, u8)> {
        let d = if digests { "CRC32C" } else { "None" };
        let keys = format!(
            "InitiatorName=iqn.2026-11.io.tessera:wire-test\0SessionType=Normal\0\
             TargetName={target}\0HeaderDigest={d}\0DataDigest={d}\0ImmediateData=Yes\0\
             InitialR2T=No\0FirstBurstLength=65536\0MaxBurstLength=131072\0\
             MaxRecvDataSegmentLength=65536\0"
        );
        // T, CSG operational, NSG full feature.
        let mut h = pdu::header(
            pdu::OP_LOGIN_REQ | pdu::FLAG_IMMEDIATE,
            0x80 | 0x04 | 0x03,
            keys.len(),
        );
        h[8..14].copy_from_slice(&[0x80, 0, 0, 0, 0, self.isid]);
        put_u32(&mut h, 16, 0);
        put_u32(&mut h, 24, self.cmdsn);
        self.send(&h, keys.as_bytes());
        let (r, data) = self.recv().expect("login response");
        assert_eq!(r[0] & 0x3f, pdu::OP_LOGIN_RESP);
        if r[36] != 0 {
            return Err((r[36], r[37]));
        }
        assert_eq!(r[1] & 0x83, 0x83, "transit to full feature");
        let answers = text::parse(&data).unwrap();
        let get = |k: &str| answers.iter().find(|(x, _)| x == k).map(|(_, v)| v.clone());
        assert_eq!(get("HeaderDigest").as_deref(), Some(d));
        assert_eq!(get("InitialR2T").as_deref(), Some("Yes"));
        self.digests = Digests {
            header: digests,
            data: digests,
        };
        Ok(())
    }

    fn command(
        &mut self,
        cdb: &[u8],
        edtl: usize,
        read: bool,
        write: bool,
        imm: &[u8],
    ) -> [u8; BHS_LEN] {
        let mut flags = FLAG_FINAL | 0x01; // simple task attribute
        if read {
            flags |= 0x40;
        }
        if write {
            flags |= 0x20;
        }
        let mut h = pdu::header(pdu::OP_SCSI_CMD, flags, imm.len());
        self.itt += 1;
        put_u32(&mut h, 16, self.itt);
        put_u32(&mut h, 20, u32::try_from(edtl).unwrap());
        put_u32(&mut h, 24, self.cmdsn);
        self.cmdsn += 1;
        h[32..32 + cdb.len()].copy_from_slice(cdb);
        self.send(&h, imm);
        h
    }

    /// WRITE(10) of `data` at `lba`: immediate data up to the first burst, then the
    /// Data-Outs the R2Ts ask for, in 32 KiB PDUs. Returns the SCSI status.
    fn write10(&mut self, lba: u32, data: &[u8]) -> u8 {
        let blocks = u16::try_from(data.len() / 512).unwrap();
        let mut cdb = [0u8; 10];
        cdb[0] = 0x2a;
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
        let imm = &data[..data.len().min(65536)];
        self.command(&cdb, data.len(), false, true, imm);
        let itt = self.itt;
        loop {
            let (h, _) = self.recv().expect("answer to WRITE(10)");
            match h[0] & 0x3f {
                pdu::OP_R2T => {
                    let ttt = get_u32(&h, 20);
                    let off = get_u32(&h, 40) as usize;
                    let len = get_u32(&h, 44) as usize;
                    let mut at = off;
                    let mut sn = 0u32;
                    while at < off + len {
                        let n = (off + len - at).min(32 << 10);
                        let last = at + n == off + len;
                        let mut d =
                            pdu::header(pdu::OP_DATA_OUT, if last { FLAG_FINAL } else { 0 }, n);
                        put_u32(&mut d, 16, itt);
                        put_u32(&mut d, 20, ttt);
                        put_u32(&mut d, 36, sn);
                        put_u32(&mut d, 40, u32::try_from(at).unwrap());
                        self.send(&d, &data[at..at + n]);
                        sn += 1;
                        at += n;
                    }
                }
                pdu::OP_SCSI_RESP => return h[3],
                op => panic!("unexpected opcode {op:#x} during a write"),
            }
        }
    }

    /// READ(10) of `blocks` at `lba`: the data of every Data-In until the S bit.
    fn read10(&mut self, lba: u32, blocks: u16) -> Vec<u8> {
        let mut cdb = [0u8; 10];
        cdb[0] = 0x28;
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
        let len = usize::from(blocks) * 512;
        self.command(&cdb, len, true, false, &[]);
        let mut out = vec![0u8; len];
        loop {
            let (h, data) = self.recv().expect("Data-In");
            assert_eq!(
                h[0] & 0x3f,
                pdu::OP_DATA_IN,
                "READ(10) answered without data"
            );
            let off = get_u32(&h, 40) as usize;
            out[off..off + data.len()].copy_from_slice(&data);
            if h[1] & 0x01 != 0 {
                assert_eq!(h[3], 0, "READ(10) status");
                return out;
            }
        }
    }

    fn test_unit_ready(&mut self) -> u8 {
        self.command(&[0u8; 6], 0, false, false, &[]);
        let (h, _) = self.recv().expect("answer to TEST UNIT READY");
        assert_eq!(h[0] & 0x3f, pdu::OP_SCSI_RESP);
        h[3]
    }

    /// The target closed the connection (after whatever it still had to say).
    fn closed(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match self.s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
        false
    }
}

#[test]
fn data_crosses_between_iscsi_and_the_volume_byte_for_byte() {
    let s = serve();
    for digests in [false, true] {
        let mut c = Initiator::connect(&s.addr);
        c.login(IQN, digests).unwrap();
        assert_eq!(c.test_unit_ready(), 0);
        // Over iSCSI (immediate data, then R2Ts of 128 KiB answered in 32 KiB PDUs),
        // read in process.
        let data = pattern(if digests { 11 } else { 12 }, 320 << 10);
        assert_eq!(c.write10(64, &data), 0, "WRITE(10) status");
        let mut io = core();
        let mut h = s.vol.open_handle();
        let got = read(&mut io, &mut h, 64 * 512, data.len()).unwrap();
        assert!(got == data, "data written over iSCSI differs in the volume");
        // In process, read over iSCSI (several Data-In PDUs of the initiator's 64 KiB).
        let data = pattern(if digests { 13 } else { 14 }, 200 << 10);
        assert_eq!(write(&mut io, &mut h, 4 << 20, &data), 0);
        let got = c.read10((4 << 20) / 512, u16::try_from(data.len() / 512).unwrap());
        assert!(got == data, "data written in process differs over iSCSI");
    }
}

#[test]
fn hostile_input_ends_only_the_connection_that_sent_it() {
    let s = serve();
    // A command before any login: dropped.
    let mut c = Initiator::connect(&s.addr);
    c.command(&[0u8; 6], 0, false, false, &[]);
    assert!(c.closed(), "a command before login was served");
    // An unknown target: "not found", then closed.
    let mut c = Initiator::connect(&s.addr);
    assert_eq!(c.login("iqn.2026-11.io.tessera:nope", false), Err((2, 3)));
    assert!(c.closed());
    // A data segment far over MaxRecvDataSegmentLength: rejected from its header, closed.
    let mut c = Initiator::connect(&s.addr);
    c.login(IQN, false).unwrap();
    let mut h = pdu::header(pdu::OP_SCSI_CMD, FLAG_FINAL | 0x20, 0);
    h[5..8].copy_from_slice(&[0xff, 0xff, 0xff]);
    put_u32(&mut h, 24, c.cmdsn);
    c.s.write_all(&h).unwrap();
    let (r, data) = c.recv().expect("a Reject");
    assert_eq!(r[0] & 0x3f, pdu::OP_REJECT);
    assert_eq!(r[2], pdu::REJECT_PROTOCOL_ERROR);
    assert_eq!(
        &data[..8],
        &h[..8],
        "the Reject carries the header it refuses"
    );
    assert!(c.closed());
    // A wrong data digest: rejected, closed.
    let mut c = Initiator::connect(&s.addr);
    c.login(IQN, true).unwrap();
    let mut h = pdu::header(pdu::OP_NOP_OUT | pdu::FLAG_IMMEDIATE, FLAG_FINAL, 4);
    put_u32(&mut h, 16, 77);
    put_u32(&mut h, 20, pdu::RESERVED_TAG);
    let mut wire = pdu::encode(&h, b"ping", c.digests);
    let last = wire.len() - 1;
    wire[last] ^= 0xff;
    c.s.write_all(&wire).unwrap();
    let (r, _) = c.recv().expect("a Reject");
    assert_eq!(r[0] & 0x3f, pdu::OP_REJECT);
    assert_eq!(r[2], pdu::REJECT_DIGEST_ERROR);
    assert!(c.closed());
    // Garbage instead of a login.
    let mut c = Initiator::connect(&s.addr);
    c.s.write_all(&[0xa5; 4096]).unwrap();
    assert!(c.closed());
    // The target still serves: a NOP-Out ping is echoed, a command answered.
    let mut c = Initiator::connect(&s.addr);
    c.login(IQN, true).unwrap();
    let mut h = pdu::header(pdu::OP_NOP_OUT | pdu::FLAG_IMMEDIATE, FLAG_FINAL, 5);
    put_u32(&mut h, 16, 78);
    put_u32(&mut h, 20, pdu::RESERVED_TAG);
    c.send(&h, b"hello");
    let (r, data) = c.recv().expect("a NOP-In");
    assert_eq!(r[0] & 0x3f, pdu::OP_NOP_IN);
    assert_eq!(get_u32(&r, 16), 78);
    assert_eq!(data, b"hello");
    assert_eq!(c.test_unit_ready(), 0);
}

#[test]
fn the_exports_qos_limits_hold_its_io() {
    let s = serve_with(QosLimits {
        read_iops: Some(50),
        ..QosLimits::default()
    });
    let mut c = Initiator::connect(&s.addr);
    c.login(IQN, false).unwrap();
    // 30 reads at 50 IOPS (a bucket of 100 ms, 5 reads): at least half a second; an
    // unlimited LUN on a RAM device answers them in milliseconds.
    let t = Instant::now();
    for i in 0..30u32 {
        c.read10(i * 8, 8);
    }
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(400),
        "30 reads at 50 IOPS took {took:?}: the limit did not hold"
    );
    // Commands without I/O are not held.
    let t = Instant::now();
    for _ in 0..30 {
        assert_eq!(c.test_unit_ready(), 0);
    }
    assert!(t.elapsed() < Duration::from_millis(400));
}

#[test]
fn vanished_clients_give_their_listener_slot_back() {
    let s = serve();
    for _ in 0..5 {
        let c = Initiator::connect(&s.addr);
        drop(c);
    }
    // Half a login: the first PDU of a continued text, then gone.
    let mut c = Initiator::connect(&s.addr);
    let mut h = pdu::header(pdu::OP_LOGIN_REQ | pdu::FLAG_IMMEDIATE, 0x40, 16);
    put_u32(&mut h, 24, 1);
    c.send(&h, b"InitiatorName=iq");
    drop(c);
    // A session that queues reads and goes away without reading their data: the
    // target's sends fail, and what it still had to send must not keep it alive.
    let mut c = Initiator::connect(&s.addr);
    c.login(IQN, false).unwrap();
    // 64 reads of 1 MiB, 16 Data-In PDUs each: more than one gathered send holds.
    for i in 0..64u32 {
        let mut cdb = [0u8; 10];
        cdb[0] = 0x28;
        cdb[2..6].copy_from_slice(&((i % 8) * 2048).to_be_bytes());
        cdb[7..9].copy_from_slice(&2048u16.to_be_bytes());
        c.command(&cdb, 2048 * 512, true, false, &[]);
    }
    // Unread data in the receive queue makes the close a reset.
    std::thread::sleep(Duration::from_millis(50));
    drop(c);
    let t = Instant::now();
    while s.cap.open() > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{} connections still hold listener slots",
            s.cap.open()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // And the core still serves.
    let mut c = Initiator::connect(&s.addr);
    c.login(IQN, false).unwrap();
    assert_eq!(c.test_unit_ready(), 0);
}

/// A command whose Data-Out all goes as immediate data: the response PDU and its data
/// (the sense, after its 2-byte length, when the status is CHECK CONDITION).
fn immediate(c: &mut Initiator, cdb: &[u8], data: &[u8]) -> ([u8; BHS_LEN], Vec<u8>) {
    c.command(cdb, data.len(), false, true, data);
    let (h, d) = c.recv().expect("SCSI response");
    assert_eq!(h[0] & 0x3f, pdu::OP_SCSI_RESP);
    (h, d)
}

/// MISCOMPARE with the offset of the first differing byte in INFORMATION (VALID set).
fn assert_miscompare(h: &[u8; BHS_LEN], d: &[u8], offset: u32) {
    assert_eq!(h[3], 0x02, "CHECK CONDITION");
    let sense = &d[2..];
    assert_eq!(
        (sense[0], sense[2], sense[12]),
        (0xf0, 0x0e, 0x1d),
        "{sense:02x?}"
    );
    assert_eq!(get_u32(sense, 3), offset);
}

#[test]
fn compare_and_write_and_verify_compare_with_the_volume() {
    let s = serve();
    let mut c = Initiator::connect(&s.addr);
    c.login(IQN, false).unwrap();
    assert_eq!(c.write10(10, &[b'A'; 1024]), 0);
    // COMPARE AND WRITE of 2 blocks at LBA 10: 'A's match, 'B's are written.
    let mut caw = [0u8; 16];
    caw[0] = 0x89;
    caw[2..10].copy_from_slice(&10u64.to_be_bytes());
    caw[13] = 2;
    let data = [[b'A'; 1024], [b'B'; 1024]].concat();
    let (h, _) = immediate(&mut c, &caw, &data);
    assert_eq!(h[3], 0, "COMPARE AND WRITE that matches");
    assert_eq!(c.read10(10, 2), vec![b'B'; 1024]);
    // A difference at byte 700: nothing is written, MISCOMPARE says where.
    let mut data = [[b'B'; 1024], [b'C'; 1024]].concat();
    data[700] = b'X';
    let (h, d) = immediate(&mut c, &caw, &data);
    assert_miscompare(&h, &d, 700);
    assert_eq!(c.read10(10, 2), vec![b'B'; 1024]);
    // A Data-Out other than twice the blocks is an invalid CDB.
    let (h, d) = immediate(&mut c, &caw, &data[..1536]);
    assert_eq!((h[3], d[2 + 2], d[2 + 12]), (0x02, 0x05, 0x24));

    // VERIFY(10) with BYTCHK 1: the same blocks pass; a difference at byte 1000 is
    // reported; BYTCHK 3 compares one block with each block of the range.
    let mut v = [0u8; 10];
    v[0] = 0x2f;
    v[1] = 0x02;
    v[2..6].copy_from_slice(&10u32.to_be_bytes());
    v[8] = 2;
    let (h, _) = immediate(&mut c, &v, &[b'B'; 1024]);
    assert_eq!(h[3], 0, "VERIFY that matches");
    let mut bad = vec![b'B'; 1024];
    bad[1000] = 0;
    let (h, d) = immediate(&mut c, &v, &bad);
    assert_miscompare(&h, &d, 1000);
    v[1] = 0x06;
    let (h, _) = immediate(&mut c, &v, &[b'B'; 512]);
    assert_eq!(h[3], 0, "VERIFY BYTCHK 3 that matches");
    assert_eq!(c.write10(11, &[b'D'; 512]), 0);
    let (h, d) = immediate(&mut c, &v, &[b'B'; 512]);
    assert_miscompare(&h, &d, 512);
}

/// Read PDUs until one that is not an R2T: the Reject the target answers with.
fn reject_after_r2ts(c: &mut Initiator) -> ([u8; BHS_LEN], Vec<u8>) {
    loop {
        let (h, d) = c.recv().expect("a Reject before the connection closes");
        if h[0] & 0x3f != pdu::OP_R2T {
            assert_eq!(h[0] & 0x3f, pdu::OP_REJECT, "answer {:#x}", h[0]);
            return (h, d);
        }
    }
}

/// A WRITE(10) of `blocks` at `lba` with `imm` as immediate data; the first R2T, if
/// `r2t` (none comes when all the data went as immediate data).
fn start_write(c: &mut Initiator, lba: u32, blocks: u16, imm: &[u8], r2t: bool) -> (u32, u32) {
    let mut cdb = [0u8; 10];
    cdb[0] = 0x2a;
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
    c.command(&cdb, usize::from(blocks) * 512, false, true, imm);
    if !r2t {
        return (c.itt, 0);
    }
    let (h, _) = c.recv().expect("R2T");
    assert_eq!(h[0] & 0x3f, pdu::OP_R2T);
    assert_eq!(get_u32(&h, 16), c.itt);
    (c.itt, get_u32(&h, 20))
}

fn data_out(itt: u32, ttt: u32, offset: u32, len: usize) -> [u8; BHS_LEN] {
    let mut d = pdu::header(pdu::OP_DATA_OUT, FLAG_FINAL, len);
    put_u32(&mut d, 16, itt);
    put_u32(&mut d, 20, ttt);
    put_u32(&mut d, 36, 0);
    put_u32(&mut d, 40, offset);
    d
}

/// Data beyond what the login negotiated or the command announced (FirstBurstLength
/// 64 KiB, InitialR2T=Yes, the target's MaxRecvDataSegmentLength 256 KiB): each gets a
/// Reject (RFC 7143 §11.17.1: Protocol Error, or Invalid PDU Field for a transfer tag
/// that names no transfer) carrying the refused header, then the connection closes
/// (error recovery level 0); none of the data reaches the volume; another session
/// goes on being served throughout.
#[test]
fn data_beyond_what_was_negotiated_ends_only_its_connection() {
    let s = serve();
    let mut other = Initiator::connect(&s.addr);
    other.login(IQN, false).unwrap();
    let mut io = core();
    let mut h = s.vol.open_handle();
    let mut untouched = |lba: u64, len: usize, what: &str| {
        let got = read(&mut io, &mut h, lba * 512, len).unwrap();
        assert!(
            got.iter().all(|&b| b == 0),
            "{what}: data reached the volume"
        );
    };
    let mut still_serving = |what: &str| {
        assert_eq!(other.test_unit_ready(), 0, "after {what}");
        assert_eq!(other.read10(0, 8).len(), 4096, "after {what}");
    };

    // Immediate data past FirstBurstLength (64 KiB + 512 of a 128 KiB write).
    let mut c = Initiator::connect(&s.addr);
    c.login(IQN, false).unwrap();
    let imm = vec![0x5a; (64 << 10) + 512];
    let sent = {
        let mut cdb = [0u8; 10];
        cdb[0] = 0x2a;
        cdb[2..6].copy_from_slice(&1000u32.to_be_bytes());
        cdb[7..9].copy_from_slice(&256u16.to_be_bytes());
        c.command(&cdb, 128 << 10, false, true, &imm)
    };
    let (r, d) = reject_after_r2ts(&mut c);
    assert_eq!(r[2], pdu::REJECT_PROTOCOL_ERROR);
    assert_eq!(
        &d[..BHS_LEN],
        &sent[..],
        "the Reject carries the header it refuses"
    );
    assert!(c.closed());
    untouched(1000, 128 << 10, "immediate data past the first burst");
    still_serving("immediate data past the first burst");

    // Unsolicited Data-Out (InitialR2T=Yes allows none), even within FirstBurstLength.
    let mut c = Initiator::connect(&s.addr);
    c.login(IQN, false).unwrap();
    let (itt, _) = start_write(&mut c, 2000, 128, &[0x5a; 4096], false);
    let d = data_out(itt, pdu::RESERVED_TAG, 4096, 8192);
    c.send(&d, &[0x5a; 8192]);
    let (r, data) = reject_after_r2ts(&mut c);
    assert_eq!(r[2], pdu::REJECT_INVALID_PDU_FIELD);
    assert_eq!(&data[..BHS_LEN], &d[..]);
    assert!(c.closed());
    untouched(2000, 64 << 10, "unsolicited Data-Out");
    still_serving("unsolicited Data-Out");

    // A Data-Out longer than MaxRecvDataSegmentLength: refused from its header.
    let mut c = Initiator::connect(&s.addr);
    c.login(IQN, false).unwrap();
    let (itt, ttt) = start_write(&mut c, 3000, 2048, &[], true);
    let d = data_out(itt, ttt, 0, (256 << 10) + 512);
    c.s.write_all(&d).unwrap();
    let (r, data) = reject_after_r2ts(&mut c);
    assert_eq!(r[2], pdu::REJECT_PROTOCOL_ERROR);
    assert_eq!(&data[..BHS_LEN], &d[..]);
    assert!(c.closed());
    untouched(3000, 1 << 20, "a Data-Out over MaxRecvDataSegmentLength");
    still_serving("a Data-Out over MaxRecvDataSegmentLength");

    // Data-Out past the command's expected transfer length: 8 KiB for a 4 KiB write,
    // and 512 bytes at offset 4096 of it.
    for (offset, len) in [(0u32, 8192usize), (4096, 512)] {
        let mut c = Initiator::connect(&s.addr);
        c.login(IQN, false).unwrap();
        let (itt, ttt) = start_write(&mut c, 4000, 8, &[], true);
        let d = data_out(itt, ttt, offset, len);
        c.send(&d, &vec![0x5a; len]);
        let (r, data) = reject_after_r2ts(&mut c);
        assert_eq!(
            r[2],
            pdu::REJECT_PROTOCOL_ERROR,
            "offset {offset} length {len}"
        );
        assert_eq!(&data[..BHS_LEN], &d[..]);
        assert!(c.closed());
        untouched(4000, 16 << 10, "Data-Out past the transfer length");
        still_serving("Data-Out past the transfer length");
    }

    // Data-Out for a transfer tag no R2T gave, or for another command's tag.
    for wrong in ["TTT", "ITT"] {
        let mut c = Initiator::connect(&s.addr);
        c.login(IQN, false).unwrap();
        let (itt, ttt) = start_write(&mut c, 5000, 8, &[], true);
        let d = match wrong {
            "TTT" => data_out(itt, ttt.wrapping_add(7), 0, 4096),
            _ => data_out(itt.wrapping_add(100), ttt, 0, 4096),
        };
        c.send(&d, &[0x5a; 4096]);
        let (r, data) = reject_after_r2ts(&mut c);
        assert_eq!(r[2], pdu::REJECT_INVALID_PDU_FIELD, "unknown {wrong}");
        assert_eq!(&data[..BHS_LEN], &d[..]);
        assert!(c.closed());
        untouched(5000, 4096, "Data-Out for an unknown tag");
        still_serving("Data-Out for an unknown tag");
    }
    // The session that stayed still writes and reads.
    let data = pattern(21, 64 << 10);
    assert_eq!(other.write10(6000, &data), 0);
    assert!(other.read10(6000, 128) == data);
}

/// PERSISTENT RESERVE OUT with service action `sa`, type `ptype`, the basic parameter
/// list (key, service action key): the SCSI status.
fn prout(c: &mut Initiator, sa: u8, ptype: u8, key: u64, sa_key: u64) -> u8 {
    let mut cdb = [0u8; 10];
    cdb[0] = 0x5f;
    cdb[1] = sa;
    cdb[2] = ptype;
    cdb[8] = 24;
    let mut p = [0u8; 24];
    p[..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&sa_key.to_be_bytes());
    immediate(c, &cdb, &p).0[3]
}

/// TEST UNIT READY: the status and (sense key, ASC, ASCQ) of a CHECK CONDITION.
fn tur_sense(c: &mut Initiator) -> (u8, Option<(u8, u8, u8)>) {
    c.command(&[0u8; 6], 0, false, false, &[]);
    let (h, d) = c.recv().expect("answer to TEST UNIT READY");
    assert_eq!(h[0] & 0x3f, pdu::OP_SCSI_RESP);
    let sense = (h[3] == 0x02).then(|| (d[2 + 2] & 0x0f, d[2 + 12], d[2 + 13]));
    (h[3], sense)
}

/// The unit attentions persistent reservations establish reach the next command of
/// each affected session once, and not the session that acted; INQUIRY does not take
/// them.
#[test]
fn reservation_unit_attentions_reach_the_other_sessions_once() {
    let s = serve();
    let mut sessions: Vec<Initiator> = (1..=3u8)
        .map(|i| {
            let mut c = Initiator::connect(&s.addr);
            c.isid = i;
            c.login(IQN, false).unwrap();
            c
        })
        .collect();
    for (i, c) in sessions.iter_mut().enumerate() {
        let key = u64::try_from(i).unwrap() + 1;
        assert_eq!(prout(c, 0, 0, 0, key), 0, "REGISTER");
    }
    let [a, b, c] = &mut sessions[..] else {
        unreachable!()
    };
    // a reserves Exclusive Access, then preempts b's key.
    assert_eq!(prout(a, 1, 3, 1, 0), 0, "RESERVE");
    assert_eq!(prout(a, 4, 3, 1, 2), 0, "PREEMPT");
    // INQUIRY neither reports nor clears it.
    b.command(&[0x12, 0, 0, 0, 36, 0], 36, true, false, &[]);
    let (h, _) = b.recv().expect("INQUIRY data");
    assert_eq!(h[0] & 0x3f, pdu::OP_DATA_IN);
    assert_eq!(
        tur_sense(b),
        (0x02, Some((0x06, 0x2a, 0x05))),
        "REGISTRATIONS PREEMPTED"
    );
    // Once: the next TEST UNIT READY is GOOD.
    assert_eq!(tur_sense(b), (0, None));
    assert_eq!(tur_sense(c), (0, None), "c was not preempted");
    assert_eq!(tur_sense(a), (0, None));
    // CLEAR: every other registrant (c) is told RESERVATIONS PREEMPTED.
    assert_eq!(prout(a, 3, 0, 1, 0), 0, "CLEAR");
    assert_eq!(
        tur_sense(c),
        (0x02, Some((0x06, 0x2a, 0x03))),
        "RESERVATIONS PREEMPTED"
    );
    assert_eq!(tur_sense(c), (0, None));
    assert_eq!(tur_sense(b), (0, None), "b was not registered at the CLEAR");
    assert_eq!(tur_sense(a), (0, None));
    // RELEASE of a Write Exclusive, Registrants Only reservation: RESERVATIONS RELEASED
    // to the other registrants.
    assert_eq!(prout(a, 0, 0, 0, 1), 0);
    assert_eq!(prout(b, 0, 0, 0, 2), 0);
    assert_eq!(prout(a, 1, 5, 1, 0), 0, "RESERVE");
    assert_eq!(prout(a, 2, 5, 1, 0), 0, "RELEASE");
    assert_eq!(
        tur_sense(b),
        (0x02, Some((0x06, 0x2a, 0x04))),
        "RESERVATIONS RELEASED"
    );
    assert_eq!(tur_sense(b), (0, None));
    assert_eq!(tur_sense(c), (0, None), "c is not registered");
}

const ALUA_IQN: &str = "iqn.2026-11.io.tessera:cluster:wire";

/// Served: an ALUA target (this port group 7, standby; group 3 active/optimized) beside
/// the plain one, and what makes group 7 active.
fn serve_alua() -> (Served, Arc<Alua<Volume>>, Export<Volume>) {
    let s = serve();
    let export = Export {
        target: s.vol.clone(),
        qos: Arc::new(VolumeQos::new(QosLimits::default(), Instant::now())),
    };
    let a = Alua::new(7, 7, VOL);
    a.set_other_groups(vec![PortGroup {
        id: 3,
        rel_port: 3,
        state: alua::ACTIVE_OPTIMIZED,
    }]);
    (s, a, export)
}

/// A command answered with a status only (no Data-In): the status and (sense key, ASC,
/// ASCQ) of a CHECK CONDITION.
fn status_of(c: &mut Initiator, cdb: &[u8], edtl: usize, read: bool) -> (u8, Option<(u8, u8, u8)>) {
    c.command(cdb, edtl, read, false, &[]);
    let (h, d) = c.recv().expect("an answer");
    assert_eq!(h[0] & 0x3f, pdu::OP_SCSI_RESP, "answered with a status");
    let sense = (h[3] == 0x02).then(|| (d[2 + 2] & 0x0f, d[2 + 12], d[2 + 13]));
    (h[3], sense)
}

/// The Data-In of a command that succeeds.
fn data_of(c: &mut Initiator, cdb: &[u8], edtl: usize) -> Vec<u8> {
    c.command(cdb, edtl, true, false, &[]);
    let mut out = Vec::new();
    loop {
        let (h, d) = c.recv().expect("Data-In");
        assert_eq!(
            h[0] & 0x3f,
            pdu::OP_DATA_IN,
            "{cdb:02x?} answered without data"
        );
        out.extend_from_slice(&d);
        if h[1] & 0x01 != 0 {
            assert_eq!(h[3], 0, "{cdb:02x?} status");
            return out;
        }
    }
}

/// REPORT TARGET PORT GROUPS (extended header): (group, state) of each descriptor.
fn rtpg(c: &mut Initiator) -> Vec<(u16, u8)> {
    let d = data_of(c, &[0xa3, 0x2a, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], 256);
    assert_eq!(d[4], 0x10, "extended header");
    d[8..]
        .chunks(12)
        .map(|g| (u16::from_be_bytes([g[2], g[3]]), g[0] & 0x0f))
        .collect()
}

const STANDBY: (u8, Option<(u8, u8, u8)>) = (0x02, Some((0x02, 0x04, 0x0b)));
const STATE_CHANGED: (u8, Option<(u8, u8, u8)>) = (0x02, Some((0x06, 0x2a, 0x06)));
const READ8: [u8; 10] = [0x28, 0, 0, 0, 0, 0x10, 0, 0, 8, 0];

/// An ALUA target: a standby port refuses media access before any data moves and
/// answers what it may; a change of state is one unit attention per session; turned
/// active it serves the volume, turned standby again it refuses it.
#[test]
fn alua_standby_sense_unit_attention_and_flips() {
    let (s, a, export) = serve_alua();
    // A listener of its own, serving the ALUA target and a plain one of the same volume.
    let target = Target::new();
    target.add_alua_target(ALUA_IQN, a.clone()).unwrap();
    target.add_target(IQN, vec![export.clone()]).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let reactor = ReactorThread::start();
    let mailbox = reactor.mailbox.clone();
    let cap = ListenerCap::new("iscsi", addr.clone(), 8);
    std::thread::spawn(move || {
        accept_loop(l, target, cap, BufferBudget::unlimited(), move || {
            mailbox.clone()
        })
    });
    let mut c = Initiator::connect(&addr);
    c.login(ALUA_IQN, false).unwrap();
    // Standby: media access and TEST UNIT READY refused, the rest answered.
    assert_eq!(status_of(&mut c, &[0u8; 6], 0, false), STANDBY);
    assert_eq!(status_of(&mut c, &READ8, 4096, true), STANDBY);
    assert_eq!(
        c.write10(0x10, &[0xab; 4096]),
        0x02,
        "no R2T, CHECK CONDITION"
    );
    assert_eq!(
        status_of(&mut c, &[0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0], 0, false),
        STANDBY
    );
    let inq = data_of(&mut c, &[0x12, 0, 0, 0, 96, 0], 96);
    assert_eq!(inq[5] & 0x30, 0x10, "TPGS: implicit");
    let cap10 = data_of(&mut c, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], 8);
    assert_eq!(
        u64::from(u32::from_be_bytes(cap10[..4].try_into().unwrap())),
        VOL / 512 - 1
    );
    assert_eq!(rtpg(&mut c), vec![(3, 0), (7, 2)]);

    // Active: one unit attention, then the volume.
    a.set_active(export.clone());
    assert_eq!(status_of(&mut c, &[0u8; 6], 0, false), STATE_CHANGED);
    assert_eq!(status_of(&mut c, &[0u8; 6], 0, false), (0, None), "once");
    assert_eq!(rtpg(&mut c), vec![(3, 2), (7, 0)], "one owner");
    let data = pattern(7, 4096);
    assert_eq!(c.write10(0x10, &data), 0, "WRITE(10) on the active port");
    assert_eq!(c.read10(0x10, 8), data);
    let mut io = core();
    let mut h = s.vol.open_handle();
    let back = read(&mut io, &mut h, 0x10 * 512, data.len()).unwrap();
    assert!(back == data, "the write reached the volume");
    // A session that logs in now sees no attention: its first TEST UNIT READY is GOOD.
    let mut d = Initiator::connect(&addr);
    d.isid = 2;
    d.login(ALUA_IQN, false).unwrap();
    assert_eq!(status_of(&mut d, &[0u8; 6], 0, false), (0, None));

    // Standby again: both sessions told once, then refused.
    a.set_standby();
    for x in [&mut c, &mut d] {
        // INQUIRY neither reports nor takes it.
        data_of(x, &[0x12, 0, 0, 0, 96, 0], 96);
        assert_eq!(status_of(x, &READ8, 4096, true), STATE_CHANGED);
        assert_eq!(status_of(x, &READ8, 4096, true), STANDBY);
    }
    assert_eq!(rtpg(&mut c), vec![(3, 2), (7, 2)]);
    // A plain target has no target port groups.
    let mut p = Initiator::connect(&addr);
    p.isid = 3;
    p.login(IQN, false).unwrap();
    let plain_inq = data_of(&mut p, &[0x12, 0, 0, 0, 96, 0], 96);
    assert_eq!(plain_inq[5] & 0x30, 0);
    assert_eq!(
        status_of(
            &mut p,
            &[0xa3, 0x0a, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
            256,
            true
        ),
        (0x02, Some((0x05, 0x20, 0x00)))
    );
    drop(reactor);
}
