//! Offsets and lengths off the wire that do not fit the export (their end past it, or
//! past 2^64) get a clean error reply on a connection that keeps serving: the server
//! checks a range before it computes anything from it. The connection is the real one,
//! on a reactor core, serving a pool volume; the client writes raw requests.
//!
//! An unaligned write goes first, so a read-modify-write is in flight when the bad
//! requests arrive: the path where an aligned write is checked for overlap with it,
//! which widened the range to whole blocks (`offset + len`) before any bounds check.

// Test code builds data patterns and sizes from its own constants: its truncating casts
// are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_device::BlockDevice;
use tessera_export::Export;
use tessera_io::CoreIo;
use tessera_nbd::conn::{ConnOptions, NbdConn};
use tessera_nbd::proto::*;
use tessera_pool::{Pool, PoolOptions};
use tessera_qos::{QosLimits, VolumeQos};
use tessera_testkit::reactor::ReactorThread;

const SIZE: u64 = 8 << 20;

fn request(out: &mut Vec<u8>, cmd: u16, cookie: u64, offset: u64, length: u32) {
    out.extend_from_slice(&encode_request(&RequestHeader {
        flags: 0,
        cmd,
        cookie,
        offset,
        length,
    }));
}

/// Read simple replies until every cookie of `want` has one: cookie -> (error, data).
/// `reads` gives the length of each read's data (sent after a successful reply).
fn replies(
    s: &mut UnixStream,
    want: usize,
    reads: &BTreeMap<u64, u32>,
) -> BTreeMap<u64, (u32, Vec<u8>)> {
    let mut got = BTreeMap::new();
    while got.len() < want {
        let mut h = [0u8; SIMPLE_REPLY_LEN];
        s.read_exact(&mut h)
            .expect("a reply (the connection is alive)");
        assert_eq!(
            u32::from_be_bytes(h[0..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let mut data = Vec::new();
        if err == 0 {
            if let Some(&n) = reads.get(&cookie) {
                data = vec![0u8; n as usize];
                s.read_exact(&mut data).unwrap();
            }
        }
        assert!(
            got.insert(cookie, (err, data)).is_none(),
            "two replies for {cookie}"
        );
    }
    got
}

#[test]
fn out_of_range_requests_get_errors_and_the_connection_goes_on() {
    let dev: Arc<dyn BlockDevice> = tessera_device::RamDevice::new(64 << 20).unwrap();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    let vol = pool.create_volume("v", SIZE).unwrap();
    let export = Export {
        target: vol,
        qos: Arc::new(VolumeQos::new(QosLimits::default(), Instant::now())),
    };
    let core = ReactorThread::start();
    let (mut client, server) = UnixStream::pair().unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let fd: OwnedFd = server.into();
    let opts = ConnOptions {
        client: "test".into(),
        export: "v".into(),
        ..ConnOptions::default()
    };
    core.mailbox.spawn(Box::new(move |io: &mut CoreIo| {
        Box::new(NbdConn::new(
            io,
            fd,
            &export,
            opts,
            tessera_export::budget::BufferBudget::unlimited().conn(None),
        ))
    }));

    // (cookie, command, offset, length, expected error)
    let top: u64 = !4095;
    let bad: &[(u64, u16, u64, u32, u32)] = &[
        (2, CMD_WRITE_ZEROES, top, 8192, ENOSPC),
        (3, CMD_TRIM, top, 8192, EINVAL),
        (4, CMD_WRITE_ZEROES, u64::MAX - 511, 1024, ENOSPC),
        (5, CMD_TRIM, SIZE - 4096, !511, EINVAL),
        (6, CMD_READ, top, 8192, EINVAL),
        (7, CMD_READ, u64::MAX, u32::MAX, EINVAL),
        (8, CMD_WRITE_ZEROES, u64::MAX - 99, 200, ENOSPC),
        (9, CMD_TRIM, u64::MAX - 99, 200, EINVAL),
        (10, CMD_READ, u64::MAX - 99, 200, EINVAL),
        (11, CMD_CACHE, u64::MAX, u32::MAX, EINVAL),
        (12, CMD_WRITE, top, 4096, ENOSPC),
        (13, CMD_WRITE, u64::MAX - 99, 200, ENOSPC),
    ];
    let head = vec![0xA5u8; 1000];
    let mut out = Vec::new();
    // An unaligned write: a read-modify-write, in flight while the rest arrives.
    request(&mut out, CMD_WRITE, 1, 100, head.len() as u32);
    out.extend_from_slice(&head);
    for &(cookie, cmd, offset, length, _) in bad {
        request(&mut out, cmd, cookie, offset, length);
        if cmd == CMD_WRITE {
            out.extend(std::iter::repeat_n(0x11u8, length as usize));
        }
    }
    client.write_all(&out).unwrap();
    let got = replies(&mut client, bad.len() + 1, &BTreeMap::new());
    assert_eq!(got[&1].0, 0, "the unaligned write");
    for &(cookie, cmd, offset, length, err) in bad {
        assert_eq!(
            got[&cookie].0, err,
            "command {cmd} at {offset:#x}+{length:#x}"
        );
    }

    // Still serving, and only the good write changed anything.
    let mut out = Vec::new();
    request(&mut out, CMD_READ, 20, 0, 8192);
    request(&mut out, CMD_READ, 21, SIZE - 8192, 8192);
    client.write_all(&out).unwrap();
    let reads = BTreeMap::from([(20, 8192), (21, 8192)]);
    let got = replies(&mut client, 2, &reads);
    let mut want = vec![0u8; 8192];
    want[100..1100].fill(0xA5);
    assert_eq!(got[&20].0, 0);
    assert!(
        got[&20].1 == want,
        "the unaligned write landed, nothing else"
    );
    assert_eq!(
        got[&21],
        (0, vec![0u8; 8192]),
        "the end of the export is untouched"
    );
    let mut out = Vec::new();
    request(&mut out, CMD_DISC, 30, 0, 0);
    client.write_all(&out).unwrap();
}
