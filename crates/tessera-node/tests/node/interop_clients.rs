//! Interoperability with standard NBD clients against a node's NBD listener (the node
//! `tessera up` starts, in process): fio's nbd engine, qemu-img, qemu-io, nbdinfo and
//! nbdcopy (libnbd), plus the project's own client for read-only exports. Each test runs
//! its own node. (Moved from `crates/tessera-cli/tests/cli/interop_clients.rs`, which keeps
//! the NBD Unix socket `tessera up` opens in its data directory, and multi-connection
//! flush semantics across a kill -9 of the node process.)

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};

use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_nbd::proto;
use tessera_testkit::node::{nbdinfo_map, require_tool, run_ok};

const MIB: u64 = 1024 * 1024;

/// Run a command and capture everything (no success check).
fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// `qemu-io -f raw URI -c CMD ...`, insisting on exit 0 and no pattern mismatch.
fn qemu_io(uri: &str, read_only: bool, cmds: &[&str]) -> String {
    let mut c = Command::new("qemu-io");
    if read_only {
        c.arg("-r");
    }
    c.arg("-f").arg("raw").arg(uri);
    for cmd in cmds {
        c.arg("-c").arg(cmd);
    }
    let o = run(&mut c);
    let text = combined(&o);
    assert!(
        o.status.success(),
        "qemu-io {cmds:?} on {uri} failed ({}):\n{text}",
        o.status
    );
    assert!(
        !text.contains("Pattern verification failed"),
        "qemu-io {cmds:?} on {uri}:\n{text}"
    );
    assert!(
        !text.contains("failed:"),
        "qemu-io {cmds:?} on {uri}:\n{text}"
    );
    text
}

/// Write `data` to `path`, leaving `[hole_off, hole_off + hole_len)` as a real hole (the
/// bytes there are not written; `data` must be zero in that range).
fn write_sparse_file(path: &Path, data: &[u8], hole_off: usize, hole_len: usize) {
    assert!(data[hole_off..hole_off + hole_len].iter().all(|&b| b == 0));
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&data[..hole_off]).unwrap();
    f.seek(SeekFrom::Start((hole_off + hole_len) as u64))
        .unwrap();
    f.write_all(&data[hole_off + hole_len..]).unwrap();
    f.set_len(data.len() as u64).unwrap();
    f.sync_all().unwrap();
}

/// Random data with a zeroed 1 MiB hole in the middle.
fn random_with_hole(seed: u64, len: usize) -> (Vec<u8>, usize, usize) {
    let mut data = garbage(seed, len);
    let hole_off = len / 2;
    let hole_len = MIB as usize;
    data[hole_off..hole_off + hole_len].fill(0);
    (data, hole_off, hole_len)
}

fn fio_cmd(n: &TestNode, uri: &str) -> Command {
    let mut c = Command::new("fio");
    c.current_dir(&n.dir) // verify state files land here
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .arg("--rw=randwrite")
        .arg("--bs=4k")
        .arg("--iodepth=16")
        .arg("--verify=crc32c")
        .arg("--verify_fatal=1")
        .arg("--randrepeat=1")
        .arg("--group_reporting");
    c
}

#[test]
fn fio_verify_multi_conn() {
    if !require_tool("fio") {
        return;
    }
    let n = TestNode::up("fio-verify");
    let uri = n.uri("vol0");
    // 4 jobs, one NBD connection each, 64 MiB apart: 256 MiB of random 4k writes, then
    // an in-job read-back verify.
    let layout = [
        "--name=mc",
        "--numjobs=4",
        "--size=64M",
        "--offset_increment=64M",
    ];
    let o = run(fio_cmd(&n, &uri).args(layout).arg("--do_verify=1"));
    assert_fio_clean("write+verify pass", &o);

    // A separate verify-only pass over the same layout, on fresh connections.
    let o = run(fio_cmd(&n, &uri).args(layout).arg("--verify_only"));
    assert_fio_clean("verify-only pass", &o);
    let text = combined(&o);
    assert!(
        text.contains("READ:"),
        "verify-only pass did not read:\n{text}"
    );

    // Control: verify-only over a region nobody wrote must fail, so the passes above
    // really checked something.
    let o = run(fio_cmd(&n, &uri).args([
        "--name=ctl",
        "--numjobs=1",
        "--size=1M",
        "--offset=1G",
        "--verify_only",
    ]));
    let text = combined(&o);
    assert!(
        !o.status.success() && text.contains("verify"),
        "control verify over unwritten space did not fail:\n{text}"
    );
}

#[test]
fn qemu_img_convert_in_out_compare() {
    if !require_tool("qemu-img") {
        return;
    }
    let n = TestNode::up("qemu-img");
    n.exported_volume("v1", "pool0", 64 * MIB);
    let uri = n.uri("v1");
    let (data, hole_off, hole_len) = random_with_hole(1, (64 * MIB) as usize);
    let src = n.dir.join("src.raw");
    write_sparse_file(&src, &data, hole_off, hole_len);

    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&src)
            .arg(&uri),
    );
    let out = run_ok(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&src)
            .arg(&uri),
    );
    assert!(out.contains("Images are identical"), "{out}");

    let dst = n.dir.join("out.raw");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw"])
            .arg(&uri)
            .arg(&dst),
    );
    let got = std::fs::read(&dst).unwrap();
    assert_same_bytes("qemu-img round trip", &got, &data);
}

#[test]
fn qemu_io_fua_zero_discard() {
    if !require_tool("qemu-io") {
        return;
    }
    let n = TestNode::up("qemu-io");
    let uri = n.uri("vol0");
    // In qemu-io's write command, -f is FUA, -z writes zeroes, -u allows unmapping.
    qemu_io(&uri, false, &["write -f -P 0xab 0 4M", "read -P 0xab 0 4M"]);
    qemu_io(
        &uri,
        false,
        &[
            "write -z 0 512k",
            "read -P 0 0 512k",
            "read -P 0xab 512k 3584k",
        ],
    );
    qemu_io(
        &uri,
        false,
        &[
            "write -z -u 1M 1M",
            "read -P 0 1M 1M",
            "read -P 0 0 512k",
            "read -P 0xab 512k 512k",
            "read -P 0xab 2M 2M",
        ],
    );
    // FUA zeroing of a partial unit, and a sub-unit FUA write.
    qemu_io(
        &uri,
        false,
        &["write -z -f 3M 64k", "write -f -P 0xcd 3200k 4k"],
    );
    qemu_io(&uri, false, &["discard 2M 1M"]);

    // After the discard, everything outside it is defined.
    qemu_io(
        &uri,
        false,
        &[
            "read -P 0 0 512k",
            "read -P 0xab 512k 512k",
            "read -P 0 1M 1M",
            "read -P 0 3M 64k",
            "read -P 0xab 3136k 64k",
            "read -P 0xcd 3200k 4k",
            "read -P 0xab 3204k 892k",
            "read -P 0 4M 1M",
        ],
    );
    // The discarded range is a whole allocation unit: block status must call it zero,
    // and then it must read as zero.
    let mut c = NbdClient::connect_tcp(&n.addr(), "vol0", ClientOptions::default()).unwrap();
    let ext = c.block_status(2 * MIB, MIB as u32, false).unwrap();
    assert_eq!(
        ext.first().map(|e| e.0),
        Some(MIB as u32),
        "block status of the discarded unit: {ext:?}"
    );
    assert_ne!(
        ext[0].1 & proto::STATE_ZERO,
        0,
        "discarded unit not reported as zero: {ext:?}"
    );
    c.disconnect().unwrap();
    qemu_io(&uri, true, &["read -P 0 2M 1M"]);
}

#[test]
fn nbdinfo_map_shows_holes_after_trim() {
    if !require_tool("nbdinfo") || !require_tool("qemu-io") {
        return;
    }
    let n = TestNode::up("nbdinfo-map");
    let uri = n.uri("vol0");
    let size = 4 << 30;
    assert_eq!(nbdinfo_map(&uri), vec![(0, size, 3)]);

    qemu_io(&uri, false, &["write -P 0x5a 0 4M"]);
    assert_eq!(
        nbdinfo_map(&uri),
        vec![(0, 4 * MIB, 0), (4 * MIB, size - 4 * MIB, 3)]
    );

    qemu_io(&uri, false, &["discard 1M 2M"]);
    assert_eq!(
        nbdinfo_map(&uri),
        vec![
            (0, MIB, 0),
            (MIB, 2 * MIB, 3),
            (3 * MIB, MIB, 0),
            (4 * MIB, size - 4 * MIB, 3)
        ]
    );
    qemu_io(
        &uri,
        true,
        &["read -P 0x5a 0 1M", "read -P 0 1M 2M", "read -P 0x5a 3M 1M"],
    );
}

#[test]
fn nbdcopy_round_trip() {
    if !require_tool("nbdcopy") {
        return;
    }
    let n = TestNode::up("nbdcopy");
    n.exported_volume("v1", "pool0", 32 * MIB);
    let uri = n.uri("v1");
    let (data, hole_off, hole_len) = random_with_hole(2, (32 * MIB) as usize);
    let src = n.dir.join("src.raw");
    write_sparse_file(&src, &data, hole_off, hole_len);

    run_ok(Command::new("nbdcopy").arg("--flush").arg(&src).arg(&uri));
    let dst = n.dir.join("out.raw");
    run_ok(Command::new("nbdcopy").arg(&uri).arg(&dst));
    let got = std::fs::read(&dst).unwrap();
    assert!(
        got.len() >= data.len(),
        "nbdcopy produced only {} bytes",
        got.len()
    );
    assert_same_bytes("nbdcopy round trip", &got[..data.len()], &data);
}

#[test]
fn read_only_export_rejects_writes() {
    if !require_tool("qemu-io") {
        return;
    }
    let n = TestNode::up("read-only");
    n.exported_volume("v1", "pool0", 16 * MIB);
    qemu_io(&n.uri("v1"), false, &["write -P 0x3c 0 2M"]);
    // `tessera export add v1ro --volume v1 --read-only`.
    n.node()
        .add_export("v1ro", "v1", true, None)
        .expect("export v1 read-only as v1ro");
    let ro = n.uri("v1ro");

    qemu_io(&ro, true, &["read -P 0x3c 0 2M", "read -P 0 2M 14M"]);

    let mut c = NbdClient::connect_tcp(&n.addr(), "v1ro", ClientOptions::default()).unwrap();
    assert_ne!(
        c.transmission_flags() & proto::TFLAG_READ_ONLY,
        0,
        "READ_ONLY not advertised: {c:?}"
    );
    let e = c.write(0, &[0x77u8; 4096], false).unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EPERM),
        "write on a read-only export: {e}"
    );
    let e = c.write(4 * MIB, &[0x77u8; 512], true).unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EPERM),
        "FUA write on a read-only export: {e}"
    );
    let e = c.write_zeroes(0, 4096, 0).unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EPERM),
        "write zeroes on a read-only export: {e}"
    );
    let e = c.trim(0, MIB as u32).unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EPERM),
        "trim on a read-only export: {e}"
    );
    // The connection is still usable, and nothing changed.
    let mut buf = vec![0u8; 4096];
    c.read(0, &mut buf).unwrap();
    assert!(
        buf.iter().all(|&b| b == 0x3c),
        "read-only export content changed"
    );
    c.disconnect().unwrap();

    // qemu-io refuses to write (it cannot even open the export read-write).
    let o = run(Command::new("qemu-io")
        .args(["-f", "raw"])
        .arg(&ro)
        .args(["-c", "write -P 0x99 0 4k"]));
    let text = combined(&o);
    assert!(
        !o.status.success(),
        "qemu-io write on a read-only export succeeded:\n{text}"
    );
    assert!(
        !text.contains("wrote 4096/4096"),
        "qemu-io wrote to a read-only export:\n{text}"
    );

    qemu_io(&ro, true, &["read -P 0x3c 0 2M", "read -P 0 2M 14M"]);
    qemu_io(
        &n.uri("v1"),
        true,
        &["read -P 0x3c 0 2M", "read -P 0 2M 14M"],
    );
}
