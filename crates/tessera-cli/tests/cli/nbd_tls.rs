//! NBD over TLS (`NBD_OPT_STARTTLS`, X.509) against real clients: libnbd (`nbdinfo`,
//! `nbdcopy` with `nbds://` URIs) and qemu (`qemu-io` with `tls-creds-x509`). Each test
//! makes its own CA and certificates with `scripts/nbd-tls-certs.sh` (openssl).

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use tessera_nbd::proto;

const MIB: usize = 1 << 20;

fn certs(dir: &Path, ca_name: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/nbd-tls-certs.sh");
    run_ok(Command::new("bash").arg(script).arg(dir).arg(ca_name));
}

fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn nbds(port: u16, export: &str, certs: &Path) -> String {
    format!(
        "nbds://127.0.0.1:{port}/{export}?tls-certificates={}",
        certs.display()
    )
}

/// `qemu-io` over TLS with the credentials in `certs`.
fn qemu_io_tls(port: u16, export: &str, certs: &Path, cmds: &[&str]) -> Output {
    let mut c = Command::new("qemu-io");
    c.arg("--object")
        .arg(format!(
            "tls-creds-x509,id=tls0,dir={},endpoint=client",
            certs.display()
        ))
        .arg("--image-opts")
        .arg(format!(
            "driver=nbd,host=127.0.0.1,port={port},export={export},tls-creds=tls0"
        ));
    for cmd in cmds {
        c.arg("-c").arg(cmd);
    }
    run(&mut c)
}

fn read_exact_timeout(s: &mut TcpStream, n: usize) -> std::io::Result<Vec<u8>> {
    let mut b = vec![0; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// Connect without TLS, pass the greeting, and send one option; returns the stream.
fn plain_option(port: u16, opt: u32, data: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let g = read_exact_timeout(&mut s, 18).unwrap();
    assert_eq!(&g[0..8], &proto::NBDMAGIC.to_be_bytes());
    let flags = proto::CLIENT_FLAG_FIXED_NEWSTYLE | proto::CLIENT_FLAG_NO_ZEROES;
    s.write_all(&flags.to_be_bytes()).unwrap();
    let mut o = proto::IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&opt.to_be_bytes());
    o.extend_from_slice(&(data.len() as u32).to_be_bytes());
    o.extend_from_slice(data);
    s.write_all(&o).unwrap();
    s
}

/// Read one option reply: (option, reply type, payload).
fn option_reply(s: &mut TcpStream) -> (u32, u32, Vec<u8>) {
    let h = read_exact_timeout(s, 20).unwrap();
    assert_eq!(&h[0..8], &proto::OPTION_REPLY_MAGIC.to_be_bytes());
    let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
    let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    (opt, ty, read_exact_timeout(s, len).unwrap())
}

fn go_data(export: &str) -> Vec<u8> {
    let mut d = (export.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(export.as_bytes());
    d.extend_from_slice(&1u16.to_be_bytes());
    d.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
    d
}

/// A client that skips TLS and asks for `export` with GO is refused with TLS_REQD and
/// learns nothing about it (no NBD_REP_INFO: not even its size).
fn assert_go_refused_without_tls(port: u16, export: &str) {
    let mut s = plain_option(port, proto::OPT_GO, &go_data(export));
    let (opt, ty, _) = option_reply(&mut s);
    assert_eq!(opt, proto::OPT_GO);
    assert_eq!(
        ty,
        proto::REP_ERR_TLS_REQD,
        "GO without TLS on a TLS-only export"
    );
}

/// The node's log lines that say a TLS handshake failed.
fn tls_failures(node: &TestNode) -> usize {
    node.log_text()
        .lines()
        .filter(|l| l.contains("TLS handshake failed"))
        .count()
}

#[test]
fn tls_with_libnbd_and_qemu_client_certificates_and_garbage() {
    for t in ["nbdinfo", "nbdcopy", "qemu-io", "openssl"] {
        if !require_tool(t) {
            return;
        }
    }
    let tmp = temp_dir("nbd-tls");
    let good = tmp.path().join("certs");
    certs(&good, "Tessera test CA");
    let other = tmp.path().join("other");
    certs(&other, "Another CA");
    // Trusts our server, but presents a client certificate another CA signed.
    let stranger = tmp.path().join("stranger");
    std::fs::create_dir(&stranger).unwrap();
    std::fs::copy(good.join("ca-cert.pem"), stranger.join("ca-cert.pem")).unwrap();
    for f in ["client-cert.pem", "client-key.pem"] {
        std::fs::copy(other.join(f), stranger.join(f)).unwrap();
    }
    // Trusts our server, presents no client certificate at all.
    let anonymous = tmp.path().join("anonymous");
    std::fs::create_dir(&anonymous).unwrap();
    std::fs::copy(good.join("ca-cert.pem"), anonymous.join("ca-cert.pem")).unwrap();

    let p = |f: &str| path_str(&good.join(f));
    let node = TestNode::start_with_config(
        "nbd-tls-node",
        &format!(
            "[nbd.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\
             [[pool]]\nname = \"p\"\ndevices = [\"ram:256M\"]\n\
             [[volume]]\nname = \"secure\"\npool = \"p\"\nsize = \"64M\"\n\
             [[volume]]\nname = \"open\"\npool = \"p\"\nsize = \"16M\"\n\
             [[export]]\nname = \"secure\"\nvolume = \"secure\"\n\
             [[export]]\nname = \"open\"\nvolume = \"open\"\ntls = \"optional\"\n",
            p("server-cert.pem"),
            p("server-key.pem"),
            p("ca-cert.pem"),
        ),
    );
    let port = node.port;

    // libnbd over TLS: nbdinfo sees the export.
    let info = run_ok(Command::new("nbdinfo").arg(nbds(port, "secure", &good)));
    assert!(info.contains(&(64 * MIB).to_string()), "{info}");

    // A client that skips TLS is refused before any data, and is not even told the
    // TLS-only export exists; the optional export stays usable without TLS.
    let o = run(Command::new("nbdinfo").arg(format!("nbd://127.0.0.1:{port}/secure")));
    assert!(
        !o.status.success(),
        "plain nbdinfo on a TLS-only export: {}",
        text(&o)
    );
    assert!(!text(&o).contains(&(64 * MIB).to_string()), "{}", text(&o));
    assert_go_refused_without_tls(port, "secure");
    let list = run_ok(
        Command::new("nbdinfo")
            .arg("--list")
            .arg(format!("nbd://127.0.0.1:{port}")),
    );
    assert!(list.contains("open") && !list.contains("secure"), "{list}");
    let open = run_ok(Command::new("nbdinfo").arg(format!("nbd://127.0.0.1:{port}/open")));
    assert!(open.contains(&(16 * MIB).to_string()), "{open}");
    // Inside TLS the list shows both.
    let list = run_ok(
        Command::new("nbdinfo")
            .arg("--list")
            .arg(nbds(port, "", &good).replace("/?", "?")),
    );
    assert!(list.contains("open") && list.contains("secure"), "{list}");

    // nbdcopy a known file to the export over TLS and back, byte for byte.
    let src = tmp.path().join("src.img");
    let data = pattern(0x07e5_5e7a, 24 * MIB);
    std::fs::write(&src, &data).unwrap();
    run_ok(
        Command::new("nbdcopy")
            .arg(&src)
            .arg(nbds(port, "secure", &good)),
    );
    let back = tmp.path().join("back.img");
    run_ok(
        Command::new("nbdcopy")
            .arg(nbds(port, "secure", &good))
            .arg(&back),
    );
    let got = std::fs::read(&back).unwrap();
    assert_eq!(got.len(), 64 * MIB);
    assert!(
        got[..data.len()] == data[..],
        "data read back over TLS differs"
    );
    assert!(got[data.len()..].iter().all(|&b| b == 0));

    // qemu: write a pattern over TLS, read it back, and check what nbdcopy wrote.
    let o = qemu_io_tls(
        port,
        "secure",
        &good,
        &[
            "write -P 0xa5 40M 3M",
            "read -P 0xa5 40M 3M",
            "read -P 0 48M 1M",
        ],
    );
    let t = text(&o);
    assert!(
        o.status.success() && !t.contains("Pattern verification failed"),
        "{t}"
    );
    let o = qemu_io_tls(port, "secure", &good, &["read -v 0 16"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let hex: String = data[..4].iter().map(|b| format!("{b:02x} ")).collect();
    assert!(
        t.contains(hex.trim()),
        "qemu reads nbdcopy's bytes: {t}\nwant {hex}"
    );

    // Client certificates: another CA's, or none, are refused by the node's TLS
    // handshake (libnbd connects and is refused; qemu may already refuse to load a
    // client certificate its CA file does not vouch for, so only its failure counts).
    let before = tls_failures(&node);
    for (dir, who) in [(&stranger, "another CA"), (&anonymous, "no certificate")] {
        let o = run(Command::new("nbdinfo").arg(nbds(port, "secure", dir)));
        assert!(
            !o.status.success(),
            "client with {who} was let in: {}",
            text(&o)
        );
        let o = qemu_io_tls(port, "secure", dir, &["read 0 4k"]);
        assert!(
            !o.status.success(),
            "qemu with {who} was let in: {}",
            text(&o)
        );
    }
    wait_for("the refused handshakes in the log", 10, || {
        tls_failures(&node) >= before + 2
    });
    let log = node.log_text();
    // GnuTLS (libnbd) offers only a certificate whose issuer is among the CA names the
    // node's CertificateRequest lists, so the stranger sends none either.
    assert!(log.contains("peer sent no certificates"), "{log}");

    // Garbage after STARTTLS, while a TLS client copies: the garbage connection is
    // closed, the copy is not disturbed, and the node keeps serving.
    let copy_out = tmp.path().join("during.img");
    let mut copy: Child = Command::new("nbdcopy")
        .arg(nbds(port, "secure", &good))
        .arg(&copy_out)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    for i in 0..20u8 {
        let mut s = plain_option(port, proto::OPT_STARTTLS, &[]);
        let (opt, ty, _) = option_reply(&mut s);
        assert_eq!((opt, ty), (proto::OPT_STARTTLS, proto::REP_ACK));
        let garbage: Vec<u8> = (0..512u32)
            .map(|k| (k as u8).wrapping_mul(31) ^ i)
            .collect();
        let _ = s.write_all(&garbage);
        // The server hangs up (perhaps after an alert); never answers NBD.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(
            rest.len() < 64,
            "server sent {} bytes to garbage",
            rest.len()
        );
    }
    let st = copy.wait().unwrap();
    let mut err = String::new();
    let _ = BufReader::new(copy.stderr.take().unwrap()).read_line(&mut err);
    assert!(st.success(), "nbdcopy during the garbage: {err}");
    let during = std::fs::read(&copy_out).unwrap();
    assert!(
        during[..data.len()] == data[..],
        "copy during the garbage differs"
    );
    assert!(during[40 * MIB..43 * MIB].iter().all(|&b| b == 0xa5));
    let info = run_ok(Command::new("nbdinfo").arg(nbds(port, "secure", &good)));
    assert!(info.contains(&(64 * MIB).to_string()), "{info}");
}

/// `tessera up` with `--nbd-tls-*`: every export TLS-only (the default), so the node runs
/// FORCEDTLS: a client without TLS gets TLS_REQD for everything, even a list. An export
/// added with `--tls optional` is then reachable without TLS.
#[test]
fn up_with_tls_flags_forces_tls_and_export_policy_is_per_export() {
    for t in ["nbdinfo", "openssl", "qemu-img"] {
        if !require_tool(t) {
            return;
        }
    }
    let tmp = temp_dir("nbd-tls-up");
    let c = tmp.path().join("certs");
    certs(&c, "Tessera test CA");
    let data_dir = tmp.path().join("data");
    let port = free_port();
    let mut child = Command::new(BIN)
        .arg("up")
        .arg("--data-dir")
        .arg(&data_dir)
        .arg("--nbd")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--cores")
        .arg("1")
        .args(["--nvmf", "", "--nvmf-discovery", "", "--iscsi", ""])
        .arg("--nbd-tls-cert")
        .arg(c.join("server-cert.pem"))
        .arg("--nbd-tls-key")
        .arg(c.join("server-key.pem"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    struct Kill(Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            // SAFETY: signalling the node this test started, by its pid.
            unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
            let _ = self.0.wait();
        }
    }
    let out = child.stdout.take().unwrap();
    let mut child = Kill(child);
    await_ready(out, Duration::from_secs(30)).expect("node ready");
    let api = path_str(&data_dir.join("api.sock"));
    let cli = |args: &[&str]| {
        let mut c = Command::new(BIN);
        c.arg("--api").arg(&api).args(args);
        run_ok(&mut c)
    };

    // FORCEDTLS: before STARTTLS even LIST is refused, and GO too.
    let mut s = plain_option(port, proto::OPT_LIST, &[]);
    assert_eq!(option_reply(&mut s).1, proto::REP_ERR_TLS_REQD);
    assert_go_refused_without_tls(port, "vol0");
    let o = run(Command::new("nbdinfo").arg(format!("nbd://127.0.0.1:{port}/vol0")));
    assert!(!o.status.success(), "{}", text(&o));
    // With TLS (no client certificate needed: no client CA configured).
    let server_only: PathBuf = tmp.path().join("server-only");
    std::fs::create_dir(&server_only).unwrap();
    std::fs::copy(c.join("ca-cert.pem"), server_only.join("ca-cert.pem")).unwrap();
    let info = run_ok(Command::new("nbdinfo").arg(nbds(port, "vol0", &server_only)));
    assert!(info.contains("4294967296"), "{info}");

    // The API says so, with an nbds:// URI.
    let v: serde_json::Value = serde_json::from_str(&cli(&["--json", "export", "list"])).unwrap();
    let e = &v[0];
    assert_eq!(e["tls_required"], true, "{v}");
    assert!(e["uris"][0].as_str().unwrap().starts_with("nbds://"), "{v}");

    // A second export with TLS optional: reachable in plain text (the node is now
    // SELECTIVETLS for new connections) while vol0 stays TLS-only.
    cli(&["volume", "create", "v2", "--pool", "pool0", "--size", "1G"]);
    let added = cli(&["export", "add", "v2", "--volume", "v2", "--tls", "optional"]);
    assert!(added.contains("v2"), "{added}");
    let info = run_ok(Command::new("nbdinfo").arg(format!("nbd://127.0.0.1:{port}/v2")));
    assert!(info.contains("1073741824"), "{info}");
    assert_go_refused_without_tls(port, "vol0");
    // A bad policy is a clear CLI error.
    let mut bad = Command::new(BIN);
    bad.arg("--api")
        .arg(&api)
        .args(["export", "add", "v3", "--volume", "v2", "--tls", "maybe"]);
    let o = run(&mut bad);
    assert!(
        !o.status.success() && text(&o).contains("required"),
        "{}",
        text(&o)
    );
    drop(child.0.stdin.take());
    let _ = &mut child;
}
