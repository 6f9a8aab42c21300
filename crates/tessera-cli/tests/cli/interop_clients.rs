//! Interoperability with standard NBD clients through what `tessera up` serves: the NBD
//! Unix socket it opens in its data directory (qemu-img and the project's client), and
//! multi-connection flush semantics across a kill -9 of the node process. The other
//! clients' tests (fio, qemu-img, qemu-io, nbdinfo, nbdcopy, read-only exports) run
//! against an in-process node: `crates/tessera-node/tests/node/interop_clients.rs`.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::process::Command;

use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_nbd::proto;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;

/// Check that `path` holds only zero bytes from `from` to its end, reading only the
/// data segments the file system reports (the file may be a large sparse image).
fn assert_zero_tail(path: &Path, from: u64) {
    use std::os::unix::io::AsRawFd;
    let mut f = std::fs::File::open(path).unwrap();
    let end = f.metadata().unwrap().len();
    let fd = f.as_raw_fd();
    let mut pos = from;
    let mut buf = vec![0u8; MIB as usize];
    while pos < end {
        // SAFETY: lseek on a file descriptor we own.
        let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: no data after pos
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        assert!(hole >= data, "SEEK_HOLE failed");
        let (mut p, stop) = (data as u64, (hole as u64).min(end));
        while p < stop {
            let len = (stop - p).min(MIB) as usize;
            f.seek(SeekFrom::Start(p)).unwrap();
            f.read_exact(&mut buf[..len]).unwrap();
            if let Some(i) = buf[..len].iter().position(|&b| b != 0) {
                panic!("{}: non-zero byte at {}", path.display(), p + i as u64);
            }
            p += len as u64;
        }
        pos = stop;
    }
}

#[test]
fn unix_socket_export() {
    if !require_tool("qemu-img") {
        return;
    }
    let n = TestNode::start_default("unix-sock");
    let sock = n.data_dir.join("nbd.sock");
    assert!(sock.exists(), "no NBD Unix socket at {}", sock.display());
    let uri = format!("nbd+unix:///vol0?socket={}", sock.display());
    let data = garbage(3, (16 * MIB) as usize);
    let src = n.dir.join("src.raw");
    std::fs::write(&src, &data).unwrap();

    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&src)
            .arg(&uri),
    );
    // The volume is larger than the file; compare checks the excess reads as zero.
    run_ok(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&src)
            .arg(&uri),
    );

    let dst = n.dir.join("out.raw");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw"])
            .arg(&uri)
            .arg(&dst),
    );
    assert_eq!(std::fs::metadata(&dst).unwrap().len(), 4 << 30);
    let mut head = vec![0u8; data.len()];
    std::fs::File::open(&dst)
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    assert_same_bytes("unix socket round trip", &head, &data);
    assert_zero_tail(&dst, data.len() as u64);

    // The project's client agrees over the same socket.
    let mut c = NbdClient::connect_unix(&sock, "vol0", ClientOptions::default()).unwrap();
    let mut buf = vec![0u8; MIB as usize];
    c.read(5 * MIB, &mut buf).unwrap();
    assert_same_bytes(
        "NbdClient over Unix socket",
        &buf,
        &data[(5 * MIB) as usize..(6 * MIB) as usize],
    );
    c.disconnect().unwrap();
}

#[test]
fn multi_conn_flush_visibility() {
    let mut n = TestNode::start_default("multi-conn");
    let addr = n.addr();
    let mut a = NbdClient::connect_tcp(&addr, "vol0", ClientOptions::default()).unwrap();
    let mut b = NbdClient::connect_tcp(&addr, "vol0", ClientOptions::default()).unwrap();
    for c in [&a, &b] {
        assert_ne!(
            c.transmission_flags() & (1 << 8),
            0,
            "CAN_MULTI_CONN not advertised: {c:?}"
        );
        assert_ne!(
            c.transmission_flags() & proto::TFLAG_SEND_FLUSH,
            0,
            "SEND_FLUSH not advertised: {c:?}"
        );
    }

    // Writes on A (no FUA) into fresh allocation units, aligned and not, big and small.
    let writes: Vec<(u64, Vec<u8>)> = vec![
        (0, garbage(10, MIB as usize)),
        (5 * MIB + 4 * KIB, garbage(11, (4 * KIB) as usize)),
        (17 * MIB + 512, garbage(12, 1536)),
        (100 * MIB - 2 * KIB, garbage(13, (8 * KIB) as usize)), // straddles a unit boundary
        (3 * 1024 * MIB, garbage(14, (256 * KIB) as usize)),
    ];
    for (off, d) in &writes {
        a.write(*off, d, false).unwrap();
        // Visible on B as soon as A's write has completed.
        let mut got = vec![0u8; d.len()];
        b.read(*off, &mut got).unwrap();
        assert_same_bytes(&format!("B reading A's write at {off}"), &got, d);
    }
    // FLUSH on B covers the writes completed on A.
    b.flush().unwrap();

    // No clean shutdown, no disconnect: SIGKILL with both connections open.
    n.kill9();
    drop(a);
    drop(b);
    n.restart();

    let mut c = NbdClient::connect_tcp(&n.addr(), "vol0", ClientOptions::default()).unwrap();
    for (off, d) in &writes {
        let mut got = vec![0u8; d.len()];
        c.read(*off, &mut got).unwrap();
        assert_same_bytes(
            &format!("after kill -9: A's write at {off}, flushed by B"),
            &got,
            d,
        );
    }
    c.disconnect().unwrap();
}
