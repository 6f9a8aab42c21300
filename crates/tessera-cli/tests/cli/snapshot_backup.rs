//! Incremental backup over NBD (issue 14): the `qemu:dirty-bitmap:SNAPSHOT` metadata
//! context of qemu's namespace on exports of volumes and snapshots. A full copy of a
//! snapshot (nbdcopy) plus two increments read with `nbdinfo --map=qemu:dirty-bitmap:..`
//! rebuild the volume byte for byte; `qemu-img map` with `x-dirty-bitmap` reads the
//! same extents; the handshake's listing, selection, bad requests and a snapshot deleted
//! under an open connection are checked on the wire; the node keeps serving throughout.

// Test code sizes buffers from its own small constants.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use tessera_nbd::proto;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;

/// `nbdinfo --map=CONTEXT --json URI` as (offset, length, type) extents.
fn nbdinfo_map(context: &str, uri: &str) -> Vec<(u64, u64, u64)> {
    let out = run_ok(
        Command::new("nbdinfo")
            .arg(format!("--map={context}"))
            .arg("--json")
            .arg(uri),
    );
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("nbdinfo --map --json: {e}:\n{out}"));
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["offset"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["type"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// The extents a map marks with `bit`, adjacent ones merged, as (offset, length).
fn marked(map: &[(u64, u64, u64)], bit: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(off, len, ty) in map {
        if ty & bit == 0 {
            continue;
        }
        match out.last_mut() {
            Some(l) if l.0 + l.1 == off => l.1 += len,
            _ => out.push((off, len)),
        }
    }
    out
}

/// The dirty extents of `qemu:dirty-bitmap:SINCE` on `export`, as nbdinfo reads them;
/// checks that the map covers the export without gaps and names its states.
fn dirty_extents(n: &TestNode, export: &str, since: &str) -> Vec<(u64, u64)> {
    let map = nbdinfo_map(&format!("qemu:dirty-bitmap:{since}"), &n.uri(export));
    let mut at = 0;
    for &(off, len, ty) in &map {
        assert_eq!(off, at, "gap in the map of {export}: {map:?}");
        assert!(ty <= 1, "dirty bitmaps only set bit 0: {map:?}");
        at += len;
    }
    assert_eq!(at, SIZE, "the map of {export} covers the export");
    marked(&map, 1)
}

/// Read each extent from `export` into the same place of `image` (an incremental
/// backup applied); returns the bytes copied.
fn apply_increment(n: &TestNode, export: &str, extents: &[(u64, u64)], image: &mut [u8]) -> u64 {
    let mut c = nbd_connect(n, export);
    for &(off, len) in extents {
        c.read(off, &mut image[off as usize..(off + len) as usize])
            .unwrap();
    }
    c.disconnect().unwrap();
    extents.iter().map(|e| e.1).sum()
}

/// The block-granular (4 KiB) extents that writes of `ranges` touch, merged.
fn blocks_of(ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut r: Vec<(u64, u64)> = ranges
        .iter()
        .map(|&(off, len)| {
            let start = off / 4096 * 4096;
            (start, (off + len).div_ceil(4096) * 4096 - start)
        })
        .collect();
    r.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (off, len) in r {
        match out.last_mut() {
            Some(l) if l.0 + l.1 >= off => l.1 = l.1.max(off + len - l.0),
            _ => out.push((off, len)),
        }
    }
    out
}

fn merged(mut a: Vec<(u64, u64)>, b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    a.extend_from_slice(b);
    blocks_of(&a)
}

/// A node with a file pool and volume `v` (SIZE) exported as `v`.
fn node_with_volume(tag: &str) -> TestNode {
    let n = TestNode::start_with_config(tag, "");
    let img = format!("{}:512M", path_str(&n.dir.join("p.img")));
    n.cli_ok(&["pool", "create", "p", &img]);
    n.cli_ok(&["volume", "create", "v", "--pool", "p", "--size", "64M"]);
    n.cli_ok(&["export", "add", "v", "--volume", "v"]);
    n
}

#[test]
fn full_copy_plus_two_increments_over_nbd_dirty_bitmaps() {
    if !require_tool("nbdinfo") || !require_tool("nbdcopy") || !require_tool("qemu-img") {
        return;
    }
    let n = node_with_volume("snap-backup");
    let mut v = vec![0u8; SIZE as usize];
    write_at(&n, "v", &mut v, 0, &pattern(1, 8 * MIB as usize));
    write_at(&n, "v", &mut v, 40 * MIB, &pattern(2, MIB as usize));

    // No snapshot yet: no bitmap to ask for.
    let o = Command::new("nbdinfo")
        .arg("--map=qemu:dirty-bitmap:s1")
        .arg(n.uri("v"))
        .output()
        .unwrap();
    assert!(!o.status.success(), "a bitmap before any snapshot");

    // Full copy of s1.
    snapshot(&n, "v", "s1");
    n.cli_ok(&["export", "add", "s1e", "--volume", "s1"]);
    let s1_model = v.clone();
    let backup = n.dir.join("backup.img");
    run_ok(
        Command::new("nbdcopy")
            .arg(n.uri("s1e"))
            .arg(path_str(&backup)),
    );
    let mut image = std::fs::read(&backup).unwrap();
    assert!(image == s1_model, "full copy of s1");

    // Writes between s1 and s2: aligned, inside a block, across a unit boundary, zeroes
    // over old data, and a fresh area (whole units: nothing below to share).
    let inc1_writes = [
        (MIB, 4096),
        (3 * MIB + 1536, 512),
        (5 * MIB - 2048, 8192),
        (6 * MIB, 64 << 10),
        (20 * MIB, 2 * MIB),
    ];
    write_at(&n, "v", &mut v, MIB, &pattern(3, 4096));
    write_at(&n, "v", &mut v, 3 * MIB + 1536, &pattern(4, 512));
    write_at(&n, "v", &mut v, 5 * MIB - 2048, &pattern(5, 8192));
    {
        let mut c = nbd_connect(&n, "v");
        c.write_zeroes(6 * MIB, 64 << 10, 0).unwrap();
        c.flush().unwrap();
        c.disconnect().unwrap();
        v[6 * MIB as usize..(6 * MIB + (64 << 10)) as usize].fill(0);
    }
    write_at(&n, "v", &mut v, 20 * MIB, &pattern(6, 2 * MIB as usize));
    snapshot(&n, "v", "s2");
    n.cli_ok(&["export", "add", "s2e", "--volume", "s2"]);
    let s2_model = v.clone();

    // Increment 1: s1 -> s2, read from the s2 export.
    let inc1 = dirty_extents(&n, "s2e", "s1");
    assert_eq!(inc1, blocks_of(&inc1_writes), "dirty bitmap s1 on s2");
    assert_eq!(inc1, changes(&n, "s2", "s1"), "the API's changed extents");
    let copied = apply_increment(&n, "s2e", &inc1, &mut image);
    assert!(copied < 3 * MIB, "increment 1 copied {copied} bytes");
    assert!(image == s2_model, "full copy + increment 1 differ from s2");

    // qemu reads the same context: with x-dirty-bitmap, its block status takes the
    // bitmap's bit 0 for base:allocation's "hole" bit, so dirty extents map as no data.
    let opts = format!(
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={},export=s2e,\
         x-dirty-bitmap=qemu:dirty-bitmap:s1",
        n.port
    );
    let out =
        run_ok(Command::new("qemu-img").args(["map", "--output=json", "--image-opts", &opts]));
    let qmap: serde_json::Value = serde_json::from_str(&out).unwrap();
    let qemu_dirty: Vec<(u64, u64, u64)> = qmap
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let data = e["data"].as_bool().unwrap();
            (
                e["start"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                u64::from(!data),
            )
        })
        .collect();
    assert_eq!(marked(&qemu_dirty, 1), inc1, "qemu-img map:\n{out}");

    // Increment 2: s2 -> the live volume, read from the volume's export.
    let inc2_writes = [(7 * MIB, 4096), (MIB + 4096, 4096), (63 * MIB, MIB)];
    write_at(&n, "v", &mut v, 7 * MIB, &pattern(7, 4096));
    write_at(&n, "v", &mut v, MIB + 4096, &pattern(8, 4096));
    write_at(&n, "v", &mut v, 63 * MIB, &pattern(9, MIB as usize));
    let inc2 = dirty_extents(&n, "v", "s2");
    assert_eq!(inc2, blocks_of(&inc2_writes), "dirty bitmap s2 on v");
    apply_increment(&n, "v", &inc2, &mut image);
    assert!(
        image == v,
        "full copy + 2 increments differ from the volume"
    );
    assert!(image == read_all(&n, "v"));
    // Since s1, the volume's bitmap is both increments.
    assert_eq!(
        dirty_extents(&n, "v", "s1"),
        merged(inc1.clone(), &inc2),
        "dirty bitmap s1 on v"
    );
    // base:allocation is unchanged by all this.
    let alloc = nbdinfo_map("base:allocation", &n.uri("v"));
    assert_eq!(
        marked(&alloc, 1),
        vec![
            (8 * MIB, 12 * MIB),
            (22 * MIB, 18 * MIB),
            (41 * MIB, 22 * MIB)
        ],
        "{alloc:?}"
    );

    // Unknown bitmaps: not selected, nbdinfo says so; s2 is no ancestor of s1.
    for (export, bitmap) in [("v", "nosuch"), ("s1e", "s2"), ("s2e", "s2")] {
        let o = Command::new("nbdinfo")
            .arg(format!("--map=qemu:dirty-bitmap:{bitmap}"))
            .arg(n.uri(export))
            .output()
            .unwrap();
        assert!(
            !o.status.success(),
            "bitmap {bitmap} on {export}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    assert!(
        n.log_text().contains("does not descend from"),
        "the node logs the unknown bitmap:\n{}",
        n.log_text()
    );
    assert!(read_all(&n, "v") == v, "the node keeps serving");
    assert!(read_all(&n, "s1e") == s1_model);
    assert!(read_all(&n, "s2e") == s2_model);
}

/// A block status reply: per chunk, the context id and its (length, flags) descriptors.
type StatusChunks = Vec<(u32, Vec<(u32, u32)>)>;

/// A minimal NBD client speaking raw bytes, for what the tools never send.
struct Raw(TcpStream);

struct OptReply {
    ty: u32,
    data: Vec<u8>,
}

impl Raw {
    fn connect(n: &TestNode) -> Raw {
        let s = TcpStream::connect(n.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut r = Raw(s);
        let mut greeting = [0u8; 18];
        r.0.read_exact(&mut greeting).unwrap();
        let flags = proto::CLIENT_FLAG_FIXED_NEWSTYLE | proto::CLIENT_FLAG_NO_ZEROES;
        r.0.write_all(&flags.to_be_bytes()).unwrap();
        r.option(proto::OPT_STRUCTURED_REPLY, &[]);
        r
    }

    /// Send an option; its replies up to the final one (ACK or an error).
    fn option(&mut self, opt: u32, data: &[u8]) -> Vec<OptReply> {
        let mut b = proto::IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.0.write_all(&b).unwrap();
        let mut out = Vec::new();
        loop {
            let mut h = [0u8; 20];
            self.0.read_exact(&mut h).unwrap();
            assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), opt);
            let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
            let mut data = vec![0u8; len as usize];
            self.0.read_exact(&mut data).unwrap();
            let last = ty == proto::REP_ACK || ty & proto::REP_FLAG_ERROR != 0;
            out.push(OptReply { ty, data });
            if last {
                return out;
            }
        }
    }

    /// LIST or SET_META_CONTEXT; returns the (id, name) replies and the final type.
    fn meta(&mut self, opt: u32, export: &str, queries: &[&str]) -> (Vec<(u32, String)>, u32) {
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        let reps = self.option(opt, &d);
        let last = reps.last().unwrap().ty;
        let ctx = reps
            .iter()
            .filter(|r| r.ty == proto::REP_META_CONTEXT)
            .map(|r| {
                (
                    u32::from_be_bytes(r.data[0..4].try_into().unwrap()),
                    String::from_utf8(r.data[4..].to_vec()).unwrap(),
                )
            })
            .collect();
        (ctx, last)
    }

    fn go(&mut self, export: &str) {
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        let reps = self.option(proto::OPT_GO, &d);
        assert_eq!(reps.last().unwrap().ty, proto::REP_ACK, "GO {export}");
    }

    /// BLOCK_STATUS: the chunks of the reply as (context id, [(length, flags)]), or the
    /// error number of an error chunk.
    fn block_status(&mut self, offset: u64, len: u32) -> Result<StatusChunks, u32> {
        let h = proto::encode_request(&proto::RequestHeader {
            flags: 0,
            cmd: proto::CMD_BLOCK_STATUS,
            cookie: 77,
            offset,
            length: len,
        });
        self.0.write_all(&h).unwrap();
        let mut chunks = Vec::new();
        loop {
            let mut h = [0u8; 20];
            self.0.read_exact(&mut h).unwrap();
            assert_eq!(
                u32::from_be_bytes(h[0..4].try_into().unwrap()),
                proto::STRUCTURED_REPLY_MAGIC
            );
            let flags = u16::from_be_bytes(h[4..6].try_into().unwrap());
            let ty = u16::from_be_bytes(h[6..8].try_into().unwrap());
            assert_eq!(u64::from_be_bytes(h[8..16].try_into().unwrap()), 77);
            let plen = u32::from_be_bytes(h[16..20].try_into().unwrap());
            let mut p = vec![0u8; plen as usize];
            self.0.read_exact(&mut p).unwrap();
            match ty {
                proto::REPLY_TYPE_BLOCK_STATUS => {
                    assert_eq!((plen - 4) % 8, 0);
                    let id = u32::from_be_bytes(p[0..4].try_into().unwrap());
                    let extents = p[4..]
                        .chunks(8)
                        .map(|e| {
                            (
                                u32::from_be_bytes(e[0..4].try_into().unwrap()),
                                u32::from_be_bytes(e[4..8].try_into().unwrap()),
                            )
                        })
                        .collect();
                    chunks.push((id, extents));
                }
                proto::REPLY_TYPE_ERROR => {
                    assert_ne!(flags & proto::REPLY_FLAG_DONE, 0);
                    return Err(u32::from_be_bytes(p[0..4].try_into().unwrap()));
                }
                t => panic!("unexpected reply chunk type {t}"),
            }
            if flags & proto::REPLY_FLAG_DONE != 0 {
                return Ok(chunks);
            }
        }
    }
}

fn ctx(id: u32, name: &str) -> (u32, String) {
    (id, name.to_string())
}

/// The (offset, length) extents with `bit` set in one block status chunk at `base`.
fn chunk_marked(base: u64, extents: &[(u32, u32)], bit: u32) -> Vec<(u64, u64)> {
    let map: Vec<(u64, u64, u64)> = extents
        .iter()
        .scan(base, |at, &(len, flags)| {
            let e = (*at, u64::from(len), u64::from(flags & bit));
            *at += u64::from(len);
            Some(e)
        })
        .collect();
    marked(&map, u64::from(bit))
}

#[test]
fn dirty_bitmap_contexts_on_the_wire() {
    let n = node_with_volume("snap-bitmap-wire");
    let mut v = vec![0u8; SIZE as usize];
    write_at(&n, "v", &mut v, 0, &pattern(1, 2 * MIB as usize));
    snapshot(&n, "v", "s1");
    write_at(&n, "v", &mut v, 8192, &pattern(2, 4096));
    snapshot(&n, "v", "s2");
    write_at(&n, "v", &mut v, 3 * MIB, &pattern(3, 4096));
    n.cli_ok(&["export", "add", "s2e", "--volume", "s2"]);

    // Listing: the prefix and the namespace list the ancestors, nearest first; no query
    // lists everything; a snapshot lists only its own ancestors.
    let mut c = Raw::connect(&n);
    let both = vec![
        ctx(0, "qemu:dirty-bitmap:s2"),
        ctx(0, "qemu:dirty-bitmap:s1"),
    ];
    let list = proto::OPT_LIST_META_CONTEXT;
    assert_eq!(
        c.meta(list, "v", &["qemu:dirty-bitmap:"]),
        (both.clone(), proto::REP_ACK)
    );
    assert_eq!(
        c.meta(list, "v", &["qemu:"]),
        (both.clone(), proto::REP_ACK)
    );
    let mut all = vec![ctx(0, "base:allocation")];
    all.extend(both);
    assert_eq!(c.meta(list, "v", &[]), (all, proto::REP_ACK));
    assert_eq!(
        c.meta(list, "s2e", &["qemu:dirty-bitmap:"]),
        (vec![ctx(0, "qemu:dirty-bitmap:s1")], proto::REP_ACK)
    );
    assert_eq!(c.meta(list, "nosuch", &["qemu:"]).1, proto::REP_ERR_UNKNOWN);

    // Malformed requests get their error and the session goes on.
    let set = proto::OPT_SET_META_CONTEXT;
    let mut bad = 1u32.to_be_bytes().to_vec();
    bad.extend_from_slice(b"v");
    bad.extend_from_slice(&1u32.to_be_bytes());
    bad.extend_from_slice(&200u32.to_be_bytes()); // a query longer than the option
    bad.extend_from_slice(b"qemu:dirty-bitmap:s1");
    let reps = c.option(set, &bad);
    assert_eq!(reps.last().unwrap().ty, proto::REP_ERR_INVALID);
    let reps = c.option(set, &[0xff; 3]);
    assert_eq!(reps.last().unwrap().ty, proto::REP_ERR_INVALID);
    // Wildcards, an unknown name and a name from the wrong namespace select nothing.
    assert_eq!(
        c.meta(
            set,
            "v",
            &[
                "qemu:dirty-bitmap:",
                "qemu:",
                "qemu:dirty-bitmap:s9",
                "x-foo:s1",
                "s1"
            ]
        ),
        (vec![], proto::REP_ACK)
    );

    // Both contexts: one chunk each, the bitmap's blocks exact.
    assert_eq!(
        c.meta(set, "v", &["qemu:dirty-bitmap:s1", "base:allocation"]),
        (
            vec![ctx(1, "base:allocation"), ctx(2, "qemu:dirty-bitmap:s1")],
            proto::REP_ACK
        )
    );
    c.go("v");
    let chunks = c.block_status(0, (4 * MIB) as u32).unwrap();
    assert_eq!(chunks.len(), 2, "one chunk per context");
    let alloc = &chunks.iter().find(|c| c.0 == 1).unwrap().1;
    assert_eq!(
        chunk_marked(0, alloc, proto::STATE_HOLE),
        vec![(2 * MIB, MIB)]
    );
    let dirty = &chunks.iter().find(|c| c.0 == 2).unwrap().1;
    assert_eq!(
        chunk_marked(0, dirty, proto::STATE_DIRTY),
        vec![(8192, 4096), (3 * MIB, MIB)]
    );
    // Beyond the end: EINVAL, and the connection still answers.
    assert_eq!(
        c.block_status(SIZE - 4096, 8192).unwrap_err(),
        proto::EINVAL
    );
    let again = c.block_status(3 * MIB, 4096).unwrap();
    assert_eq!(again.iter().find(|c| c.0 == 2).unwrap().1, vec![(4096, 1)]);

    // s1 deleted under the open connection (hidden: v still reads through it): the
    // connection keeps its bitmap; new sessions are no longer offered it.
    n.cli_ok(&["snapshot", "delete", "s1"]);
    let after = c.block_status(0, (4 * MIB) as u32).unwrap();
    assert_eq!(after, chunks, "block status after s1 was deleted");
    let mut d = Raw::connect(&n);
    assert_eq!(
        d.meta(list, "v", &["qemu:dirty-bitmap:"]),
        (vec![ctx(0, "qemu:dirty-bitmap:s2")], proto::REP_ACK)
    );
    assert_eq!(
        d.meta(set, "v", &["qemu:dirty-bitmap:s1"]),
        (vec![], proto::REP_ACK)
    );
    // A new snapshot named s1 is another base: the dirty bitmap of the new s1 is empty.
    snapshot(&n, "v", "s1");
    assert_eq!(
        d.meta(set, "v", &["qemu:dirty-bitmap:s1"]),
        (vec![ctx(2, "qemu:dirty-bitmap:s1")], proto::REP_ACK)
    );
    d.go("v");
    let fresh = d.block_status(0, (4 * MIB) as u32).unwrap();
    assert_eq!(fresh, vec![(2, vec![((4 * MIB) as u32, 0)])]);
    assert_eq!(c.block_status(0, (4 * MIB) as u32).unwrap(), chunks);
    assert!(read_all(&n, "v") == v, "the node keeps serving");
}
