//! NVMe/TCP in-band authentication (DH-HMAC-CHAP) against a node started in process,
//! its NVMe/TCP target started as `tessera run` starts it (loopback): the right secret
//! connects and does I/O on the admin and I/O queues; a wrong secret, no secret, or a
//! wrong controller secret (bidirectional) is refused and leaves no command but the
//! authentication ones usable; the host allowlist still applies; malformed authentication
//! messages leave the node serving others; secrets never come back from the API's
//! subsystem list, sit in a 0600 file and are never logged; `nvme gen-dhchap-key` output
//! is accepted. Hosts and secrets are added as the API's `POST .../hosts` adds them.
//! (Moved from `crates/tessera-cli/tests/cli/nvmf_auth.rs`, which keeps what the CLI
//! does with secrets: reading them from files, the text list, its own initiator.)

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use tessera_api::LayoutSpec;
use tessera_node::nvmf::HostAuthRecord;

use tessera_nvmf::auth::{Hash, Secret};
use tessera_nvmf::initiator::{Controller, Error, Options, Queue};
use tessera_nvmf::nvme::{self, Sqe};
use tessera_testkit::node::{require_tool, run_ok};

const NQN: &str = "nqn.2024-01.io.tessera.test:auth";
const HOST: &str = "nqn.2024-01.io.tessera.test:host-a";
const HOST_B: &str = "nqn.2024-01.io.tessera.test:host-b";
const LBA: u32 = 512;

struct Setup {
    node: TestNode,
    io: String,
}

fn setup(tag: &str) -> Setup {
    let node = TestNode::with_config(tag, 2, |_| {
        "[nvmf]\nlisten = \"127.0.0.1:0\"\ndiscovery = \"\"\n".to_string()
    });
    let io = node.serve_nvmf();
    let n = node.node();
    n.create_pool(
        "p",
        &["ram:64M".to_string()],
        LayoutSpec::default(),
        None,
        None,
        false,
    )
    .expect("create pool p");
    n.create_volume("v", "p", 16 << 20, false)
        .expect("create volume v");
    // `tessera nvmf subsystem add NQN --volume v`: no host allowed yet.
    n.nvmf_add_subsystem(NQN, false, &[])
        .expect("add the subsystem");
    n.nvmf_add_namespace(NQN, "v", 0).expect("add namespace v");
    Setup { node, io }
}

fn opts(host: &str, secret: Option<&Secret>, ctrl: Option<&Secret>) -> Options {
    Options {
        hostnqn: host.into(),
        dhchap_secret: secret.cloned(),
        dhchap_ctrl_secret: ctrl.cloned(),
        ..Options::default()
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed)
        .collect()
}

/// Write then read back on the admin-created controller's every I/O queue.
fn io_round_trip(c: &mut Controller, seed: u8) {
    assert!(!c.io.is_empty());
    let id = c.identify(nvme::CNS_CONTROLLER, 0).unwrap();
    assert_eq!(&id[768..768 + NQN.len()], NQN.as_bytes());
    for q in 0..c.io.len() {
        let w = pattern(seed + q as u8, 16 << 10);
        let slba = (q as u64) * 64;
        c.write(q, 1, slba, &w, LBA).unwrap();
        c.flush(q, 1).unwrap();
        assert_eq!(c.read(q, 1, slba, 32, LBA).unwrap(), w, "queue {q}");
    }
}

fn expect_auth_error(r: Result<Controller, Error>, what: &str) -> String {
    match r {
        Err(Error::Auth(m)) => m,
        Err(e) => panic!("{what}: expected an authentication error, got {e}"),
        Ok(c) => panic!("{what}: connected (cntlid {})", c.cntlid),
    }
}

fn status_of<T>(r: Result<T, Error>) -> u16 {
    match r {
        Err(Error::Status(st, _)) => st,
        Err(e) => panic!("expected an NVMe status, got {e}"),
        Ok(_) => panic!("expected an NVMe status, the command succeeded"),
    }
}

/// `r` failed with status code `code` (status code type and code, the low 11 bits).
fn assert_code<T>(r: Result<T, Error>, code: u16) {
    let st = status_of(r);
    assert_eq!(st & 0x7FF, code, "{st:#x}");
}

/// `Controller::connect` was refused at Connect because the host is not allowed.
fn assert_invalid_host(r: Result<Controller, Error>, what: &str) {
    match r {
        Err(Error::Status(st, _)) => assert_eq!(st & 0x7FF, nvme::SC_CONNECT_INVALID_HOST),
        r => panic!("{what}: {:?}", r.map(|c| c.cntlid)),
    }
}

/// A queue `qid` of controller `cntlid` (0xFFFF: a new one, on the admin queue) that
/// fails authentication with `o`: it then answers `sqe` with Authentication Required.
fn unauthenticated_queue(io: &str, qid: u16, cntlid: u16, o: &Options, sqe: Sqe) -> Queue {
    let mut q = Queue::open(io, o).unwrap();
    assert!(matches!(
        q.connect(qid, NQN, cntlid, o, 32),
        Err(Error::Auth(_))
    ));
    assert_code(q.exec(sqe, &[], 4096), nvme::SC_AUTH_REQUIRED);
    q
}

/// Allow `host` on the test subsystem with DH-HMAC-CHAP secret `secret` (and the
/// controller's secret, hash and group when given), as `POST
/// /v1/nvmf/subsystems/NQN/hosts` does (`tessera nvmf subsystem add-host NQN HOST
/// --dhchap-secret ...`).
fn add_host(
    node: &TestNode,
    host: &str,
    secret: &Secret,
    ctrl: Option<&Secret>,
    hash: Option<&str>,
    dhgroup: Option<&str>,
) {
    let ctrl = ctrl.map(Secret::encode);
    let auth = HostAuthRecord::new(&secret.encode(), ctrl.as_deref(), hash, dhgroup)
        .unwrap_or_else(|e| panic!("the secrets of {host}: {e}"));
    node.node()
        .nvmf_add_host(NQN, host, Some(auth))
        .unwrap_or_else(|e| panic!("add host {host}: {e}"));
}

/// The subsystem list as the API answers it (`tessera --json nvmf subsystem list`).
fn listed(node: &TestNode) -> String {
    json(node.node().nvmf_list()).to_string()
}

fn identify_sqe() -> Sqe {
    Sqe {
        opc: nvme::ADM_IDENTIFY,
        cdw10: nvme::CNS_CONTROLLER as u32,
        ..Sqe::default()
    }
}

fn read_sqe() -> Sqe {
    Sqe {
        opc: nvme::IO_READ,
        nsid: 1,
        cdw12: 7,
        ..Sqe::default()
    }
}

#[test]
fn secrets_decide_who_connects_and_nothing_runs_before_authentication() {
    let s = setup("nvmf-auth");
    let secret = Secret::generate(Some(Hash::Sha256), 32);
    add_host(&s.node, HOST, &secret, None, None, None);

    // The API shows how the host authenticates, never the secret; the file that holds it
    // is the owner's only.
    let listed = listed(&s.node);
    assert!(listed.contains("\"dh-hmac-chap\""), "{listed}");
    assert!(!listed.contains("DHHC-1"), "a secret came back: {listed}");
    let cfg = s.node.dir.join("data").join("nvmf.json");
    let mode = std::fs::metadata(&cfg).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{} has mode {mode:o}", cfg.display());
    assert!(std::fs::read_to_string(&cfg)
        .unwrap()
        .contains(&secret.encode()));

    // The right secret: admin and I/O queues authenticate, identify and I/O work.
    let mut c = Controller::connect(&s.io, NQN, &opts(HOST, Some(&secret), None), 2).unwrap();
    io_round_trip(&mut c, 1);

    // A wrong secret: refused, with the controller's reason.
    let wrong = Secret::generate(Some(Hash::Sha256), 32);
    let m = expect_auth_error(
        Controller::connect(&s.io, NQN, &opts(HOST, Some(&wrong), None), 1),
        "wrong secret",
    );
    assert!(m.contains("refused"), "{m}");
    // No secret at all while the subsystem requires one.
    let m = expect_auth_error(
        Controller::connect(&s.io, NQN, &opts(HOST, None, None), 1),
        "no secret",
    );
    assert!(m.contains("--dhchap-secret"), "{m}");
    // A host outside the allowlist is refused at Connect, secret or not.
    assert_invalid_host(
        Controller::connect(&s.io, NQN, &opts(HOST_B, Some(&secret), None), 1),
        "unlisted host",
    );

    // On an admin queue that failed authentication nothing but authentication runs:
    // not Identify, not Property Get.
    let o_wrong = opts(HOST, Some(&wrong), None);
    let mut q = unauthenticated_queue(&s.io, 0, 0xFFFF, &o_wrong, identify_sqe());
    let prop = Sqe {
        opc: nvme::FABRICS,
        nsid: nvme::FCTYPE_PROPERTY_GET as u32,
        cdw11: nvme::PROP_CSTS,
        ..Sqe::default()
    };
    assert_code(q.exec(prop, &[], 0), nvme::SC_AUTH_REQUIRED);
    // A second try with the right secret on the same queue succeeds (a new transaction).
    q.authenticate(NQN, &opts(HOST, Some(&secret), None))
        .unwrap();
    q.exec(prop, &[], 0).unwrap();

    // I/O queues of an authenticated controller authenticate on their own: one joined
    // with a wrong secret (or none) reads nothing.
    let mut admin = Controller::connect(&s.io, NQN, &opts(HOST, Some(&secret), None), 0).unwrap();
    let _q1 = unauthenticated_queue(&s.io, 1, admin.cntlid, &o_wrong, read_sqe());
    let none = opts(HOST, None, None);
    let mut q2 = unauthenticated_queue(&s.io, 2, admin.cntlid, &none, read_sqe());
    // A write by R2T is refused before any data is asked for.
    let w = Sqe {
        opc: nvme::IO_WRITE,
        nsid: 1,
        cdw12: 63,
        ..Sqe::default()
    };
    assert_code(q2.exec(w, &vec![7u8; 32 << 10], 0), nvme::SC_AUTH_REQUIRED);
    admin.add_io_queue(3).unwrap();
    assert_eq!(admin.read(0, 1, 0, 32, LBA).unwrap(), pattern(1, 16 << 10));

    // Malformed authentication messages: refused, the node keeps serving.
    let good = opts(HOST, Some(&secret), None);
    for junk in [
        vec![],
        vec![0u8; 3],
        vec![0xFF; 100],
        vec![
            0x01, 0x02, 0, 0, 1, 0, 0xFF, 0, 0, 0, 0xFF, 0xFF, 0, 0, 0, 0,
        ],
        vec![0x00, 0x00, 0, 0, 1, 0, 0, 200],
    ] {
        let mut q = Queue::open(&s.io, &good).unwrap();
        let c = nvme::ConnectCmd {
            recfmt: 0,
            qid: 0,
            sqsize: 31,
            cattr: 0,
            kato: 0,
        };
        let data = nvme::ConnectData {
            hostid: good.hostid,
            cntlid: 0xFFFF,
            subnqn: NQN.into(),
            hostnqn: HOST.into(),
        }
        .encode();
        let (cqe, _) = q.exec(c.sqe(0), &data, 0).unwrap();
        assert_ne!(cqe.dw0 & tessera_nvmf::auth::CONNECT_AUTHREQ_ATR, 0);
        let _ = q.auth_send(&junk);
        let _ = q.auth_receive();
        let _ = q.auth_receive();
        assert_code(q.exec(identify_sqe(), &[], 4096), nvme::SC_AUTH_REQUIRED);
    }
    // Wrong security protocol in Authentication Send: an invalid field.
    let mut q = Queue::open(&s.io, &good).unwrap();
    assert!(q.connect(0, NQN, 0xFFFF, &good, 32).is_ok());
    let bad = Sqe {
        opc: nvme::FABRICS,
        nsid: nvme::FCTYPE_AUTH_SEND as u32,
        cdw10: 0xEA01_0100,
        cdw11: 8,
        ..Sqe::default()
    };
    assert_code(q.exec(bad, &[0u8; 8], 0), nvme::SC_INVALID_FIELD);
    let mut c2 = Controller::connect(&s.io, NQN, &good, 1).unwrap();
    io_round_trip(&mut c2, 9);
    io_round_trip(&mut c, 1);

    // Secrets are checked when given.
    let r = HostAuthRecord::new("DHHC-1:01:AAAA:", None, None, None)
        .and_then(|auth| s.node.node().nvmf_add_host(NQN, HOST_B, Some(auth)));
    assert!(r.is_err(), "a malformed secret was taken");
    // No node of this test binary has logged it (the log is the whole binary's).
    assert!(
        !log_text().contains(&secret.encode()),
        "a secret was logged"
    );
    c.disconnect();
    c2.disconnect();
}

#[test]
fn bidirectional_null_group_and_hashes() {
    let s = setup("nvmf-auth-bidi");
    let host = Secret::generate(Some(Hash::Sha512), 64);
    let ctrl = Secret::generate(None, 48);
    add_host(
        &s.node,
        HOST,
        &host,
        Some(&ctrl),
        Some("sha512"),
        Some("null"),
    );
    let listed = listed(&s.node);
    assert!(listed.contains("dh-hmac-chap (bidirectional)"), "{listed}");
    assert!(!listed.contains("DHHC-1"), "{listed}");
    // Both ends prove themselves: I/O works.
    let mut c = Controller::connect(&s.io, NQN, &opts(HOST, Some(&host), Some(&ctrl)), 2).unwrap();
    io_round_trip(&mut c, 3);
    // The host expects another controller secret: it refuses the controller.
    let other = Secret::generate(None, 48);
    let m = expect_auth_error(
        Controller::connect(&s.io, NQN, &opts(HOST, Some(&host), Some(&other)), 1),
        "wrong controller secret",
    );
    assert!(m.contains("controller"), "{m}");
    // Unidirectional is still allowed (the host chooses whether to check the controller).
    let mut c1 = Controller::connect(&s.io, NQN, &opts(HOST, Some(&host), None), 1).unwrap();
    io_round_trip(&mut c1, 4);

    // Host B with ffdhe3072 and SHA-384, and a host that requires a group we do not
    // configure cannot pick another one.
    let b = Secret::generate(Some(Hash::Sha384), 48);
    add_host(&s.node, HOST_B, &b, None, Some("sha384"), Some("ffdhe3072"));
    let mut cb = Controller::connect(&s.io, NQN, &opts(HOST_B, Some(&b), None), 1).unwrap();
    io_round_trip(&mut cb, 5);
    // Removing the host removes its secret: it is refused as any unlisted host.
    // `tessera nvmf subsystem remove-host NQN HOST_B`.
    s.node
        .node()
        .nvmf_set_hosts(NQN, None, Some(HOST_B), None)
        .expect("remove host B");
    cb.disconnect();
    assert_invalid_host(
        Controller::connect(&s.io, NQN, &opts(HOST_B, Some(&b), None), 1),
        "removed host",
    );
    c.disconnect();
    c1.disconnect();
}

/// `nvme gen-dhchap-key` (nvme-cli) writes secrets our parser takes, and they work.
#[test]
fn nvme_cli_generated_secrets_work() {
    if !require_tool("nvme") {
        return;
    }
    let s = setup("nvmf-auth-nvmecli");
    let mut keys = Vec::new();
    for (hmac, len) in [("0", "32"), ("1", "32"), ("2", "48"), ("3", "64")] {
        let out = run_ok(Command::new("nvme").args([
            "gen-dhchap-key",
            &format!("--hmac={hmac}"),
            &format!("--key-length={len}"),
            &format!("--nqn={HOST}"),
        ]));
        let k = out.trim().to_string();
        let parsed = Secret::parse(&k).unwrap_or_else(|e| panic!("{k}: {e}"));
        assert_eq!(parsed.encode(), k);
        keys.push(parsed);
    }
    add_host(&s.node, HOST, &keys[1], Some(&keys[3]), None, None);
    let mut c =
        Controller::connect(&s.io, NQN, &opts(HOST, Some(&keys[1]), Some(&keys[3])), 1).unwrap();
    io_round_trip(&mut c, 6);
    c.disconnect();
}
