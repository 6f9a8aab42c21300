//! iSCSI on a node started in process, its target and NVMe/TCP started as `tessera run`
//! starts them: the same bytes over iSCSI (libiscsi), NBD (nbdcopy) and NVMe/TCP (the
//! project's initiator). (Moved from `crates/tessera-cli/tests/cli/iscsi.rs`, which keeps
//! the targets made, refused and deleted through the CLI with its exit codes and output,
//! CHAP and allowlists set as an operator types them, and kill -9 restarts.)

use crate::common;
use common::*;

use std::process::{Command, Stdio};

use tessera_api::{IscsiAuth, LayoutSpec};
use tessera_testkit::node::{libiscsi_tool, require_tool};

const IQN: &str = "iqn.2026-11.io.tessera:itest";

/// `tools/iscsi-blockio.c`, built for this test (None: the test skips).
fn blockio() -> Option<std::path::PathBuf> {
    libiscsi_tool(
        "iscsi-blockio",
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")),
    )
}

/// Data crosses the protocols byte for byte: what NBD writes (nbdcopy, libnbd) reads
/// back over iSCSI (libiscsi's READ(16)), what iSCSI writes (WRITE(16)) reads back over
/// NBD, and the same both ways with NVMe/TCP. The NVMe/TCP side is Tessera's own
/// initiator (`tessera_nvmf::initiator`): there is no kernel or other NVMe/TCP host here.
#[test]
fn iscsi_nbd_and_nvme_tcp_see_the_same_bytes() {
    use tessera_nvmf::initiator::{Controller, Options};
    if !require_tool("nbdcopy") {
        return;
    }
    let Some(blockio) = blockio() else { return };
    // iSCSI and NVMe/TCP on ports the kernel picks (no discovery port: nothing here
    // discovers).
    let node = TestNode::with_config("iscsi-cross", 2, |_| {
        "[iscsi]\nlisten = \"127.0.0.1:0\"\n[nvmf]\nlisten = \"127.0.0.1:0\"\ndiscovery = \"\"\n"
            .to_string()
    });
    let portal = node.serve_iscsi();
    let nvmf = node.serve_nvmf();
    const SIZE: usize = 16 << 20;
    const NQN: &str = "nqn.2026-11.io.tessera.test:cross";
    let n = node.node();
    n.create_pool(
        "p",
        &[node.file_dev("p.img", "64M")],
        LayoutSpec::default(),
        None,
        None,
        false,
    )
    .expect("create pool p");
    node.exported_volume("v", "p", 16 << 20);
    // `tessera iscsi target create IQN --volume v`.
    n.iscsi_create(IQN, &["v".to_string()], IscsiAuth::default())
        .expect("create the target");
    // `tessera nvmf subsystem add NQN --volume v --allow-any-host`.
    n.nvmf_add_subsystem(NQN, true, &[])
        .expect("add the subsystem");
    n.nvmf_add_namespace(NQN, "v", 0).expect("add namespace v");
    let lun = format!("iscsi://{portal}/{IQN}/0");
    let nbd = node.uri("v");
    let file = |name: &str| node.dir.join(name);
    let run = |cmd: &mut Command| {
        let o = cmd.stdin(Stdio::null()).output().expect("run");
        assert!(
            o.status.success(),
            "{cmd:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    };

    // NBD writes the whole volume; iSCSI reads it back.
    let a = pattern(11, SIZE);
    std::fs::write(file("a"), &a).unwrap();
    run(Command::new("nbdcopy")
        .arg("--flush")
        .arg(file("a"))
        .arg(&nbd));
    run(Command::new(&blockio)
        .args(["read", &lun, "0", &SIZE.to_string()])
        .arg(file("a.iscsi")));
    assert_same_bytes("NBD -> iSCSI", &std::fs::read(file("a.iscsi")).unwrap(), &a);

    // iSCSI writes 3 MiB at an offset that is not 4 KiB-aligned (the blocks are 512
    // bytes); NBD reads the whole volume: that range is iSCSI's data, the rest NBD's.
    let (off, len) = ((5 << 20) + 3 * 512, 3 << 20);
    let b = pattern(22, len);
    std::fs::write(file("b"), &b).unwrap();
    run(Command::new(&blockio)
        .args(["write", &lun, &off.to_string()])
        .arg(file("b")));
    run(Command::new("nbdcopy").arg(&nbd).arg(file("all.nbd")));
    let mut want = a.clone();
    want[off..off + len].copy_from_slice(&b);
    assert_same_bytes(
        "iSCSI -> NBD",
        &std::fs::read(file("all.nbd")).unwrap(),
        &want,
    );

    // NVMe/TCP reads what iSCSI wrote, then writes a range iSCSI reads back.
    let mut c = Controller::connect(&nvmf, NQN, &Options::default(), 1).expect("NVMe/TCP connect");
    let chunk = 128 << 10;
    let mut got = Vec::with_capacity(len);
    // From the 512-byte block of `off` on: NVMe/TCP's LBAs are 512 bytes too.
    for at in (off..off + len).step_by(chunk) {
        let n = chunk.min(off + len - at);
        let (lba, blocks) = (
            u64::try_from(at / 512).unwrap(),
            u32::try_from(n / 512).unwrap(),
        );
        got.extend(c.read(0, 1, lba, blocks, 512).unwrap());
    }
    assert_same_bytes("iSCSI -> NVMe/TCP", &got, &b);
    let (noff, nlen) = (12 << 20, 1 << 20);
    let d = pattern(33, nlen);
    for (i, part) in d.chunks(chunk).enumerate() {
        let lba = u64::try_from((noff + i * chunk) / 512).unwrap();
        c.write(0, 1, lba, part, 512).unwrap();
    }
    c.flush(0, 1).unwrap();
    run(Command::new(&blockio)
        .args(["read", &lun, &noff.to_string(), &nlen.to_string()])
        .arg(file("d.iscsi")));
    assert_same_bytes(
        "NVMe/TCP -> iSCSI",
        &std::fs::read(file("d.iscsi")).unwrap(),
        &d,
    );
    let _ = std::fs::remove_file(&blockio);
}
