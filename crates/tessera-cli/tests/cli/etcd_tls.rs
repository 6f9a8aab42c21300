//! A node joins an etcd that demands TLS client certificates and a password
//! (`tessera up --etcd https://... --etcd-ca/--etcd-cert/--etcd-key --etcd-user
//! --etcd-password-file`) and creates a cluster volume; its spec is in etcd. A password
//! file the group may read is refused at start, and the password shows nowhere.

use crate::common;
use common::*;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tessera_cluster::{volume_key, Etcd, EtcdOptions, Secret};
use tessera_testkit::etcd::EtcdCluster;

const PASSWORD: &str = "tessera-e2e-secret-pw";

fn certs(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/nbd-tls-certs.sh");
    run_ok(
        Command::new("bash")
            .arg(script)
            .arg(dir)
            .arg("Tessera etcd CA"),
    );
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        // SAFETY: signalling the node this test started, by its pid.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn up(data_dir: &Path, etcd: &EtcdCluster, c: &Path, pw_file: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("up")
        .arg("--data-dir")
        .arg(data_dir)
        .arg("--nbd")
        .arg(format!("127.0.0.1:{}", free_port()))
        .args(["--cores", "1", "--nvmf"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .args(["--nvmf-discovery", "", "--iscsi", ""])
        .arg("--etcd")
        .arg(etcd.endpoints().join(","))
        .arg("--etcd-ca")
        .arg(c.join("ca-cert.pem"))
        .arg("--etcd-cert")
        .arg(c.join("client-cert.pem"))
        .arg("--etcd-key")
        .arg(c.join("client-key.pem"))
        .args(["--etcd-user", "tessera", "--etcd-password-file"])
        .arg(pw_file)
        .stdin(Stdio::null());
    cmd
}

#[test]
fn up_joins_a_tls_and_password_etcd_and_creates_a_cluster_volume() {
    for t in ["etcd", "openssl", "curl"] {
        if !require_tool(t) {
            return;
        }
    }
    let tmp = temp_dir("etcd-tls-up");
    let c = tmp.path().join("certs");
    certs(&c);
    let etcd = EtcdCluster::start_tls("tls-up", 1, &c);
    let mut o = EtcdOptions::new(Duration::from_secs(3));
    o.ca = Some(c.join("ca-cert.pem"));
    o.cert = Some(c.join("client-cert.pem"));
    o.key = Some(c.join("client-key.pem"));
    let admin = Etcd::with_options(&etcd.endpoints(), o.clone()).unwrap();
    admin
        .enable_auth("rootpw", "tessera", PASSWORD, "/tessera/")
        .unwrap();
    // A password file others may read: refused, saying why.
    let pw = tmp.path().join("etcd-password");
    std::fs::write(&pw, format!("{PASSWORD}\n")).unwrap();
    std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = up(&tmp.path().join("refused"), &etcd, &c, &pw)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("etcd_password_file") && text.contains("chmod 600"),
        "{text}"
    );
    assert!(!text.contains(PASSWORD), "{text}");

    // Mode 600: the node joins.
    std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o600)).unwrap();
    let data_dir = tmp.path().join("data");
    let log = tmp.path().join("node.log");
    let mut child = up(&data_dir, &etcd, &c, &pw)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let _child = Kill(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut banner = Vec::new();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("node ready: {banner:?}"));
        let ready = line.starts_with("tessera: ready");
        banner.push(line);
        if ready {
            break;
        }
    }
    let api = path_str(&data_dir.join("api.sock"));
    let cli = |args: &[&str]| {
        let mut c = Command::new(BIN);
        c.arg("--api").arg(&api).args(args);
        run_ok(&mut c)
    };
    cli(&[
        "pool",
        "create",
        "p",
        &format!("{}:256M", path_str(&tmp.path().join("p.img"))),
    ]);
    let status: serde_json::Value =
        serde_json::from_str(&cli(&["--json", "cluster", "status"])).unwrap();
    let me = status["name"].as_str().unwrap().to_string();
    assert!(
        status["etcd"][0].as_str().unwrap().starts_with("https://"),
        "{status}"
    );
    // A second member, configured in its TOML file this time (`[cluster]` keys).
    let q = |f: &str| path_str(&c.join(f));
    let b = TestNode::start_in_netns(
        "etcd-tls-b",
        None,
        1,
        "name = \"node-b\"",
        &format!(
            "[nvmf]\nlisten = \"127.0.0.1:{}\"\ndiscovery = \"\"\n\
             [replication]\ntimeout_ms = 3000\nregion_size = \"1M\"\n\
             [cluster]\netcd = {}\netcd_ca = \"{}\"\netcd_cert = \"{}\"\netcd_key = \"{}\"\n\
             etcd_user = \"tessera\"\netcd_password_file = \"{}\"\n",
            free_port(),
            etcd.toml_endpoints(),
            q("ca-cert.pem"),
            q("client-cert.pem"),
            q("client-key.pem"),
            path_str(&pw),
        ),
    );
    b.cli_ok(&[
        "pool",
        "create",
        "p",
        &format!("{}:256M", path_str(&b.dir.join("p.img"))),
    ]);
    wait_for("both members listed with their pools", 20, || {
        let v: serde_json::Value =
            serde_json::from_str(&cli(&["--json", "cluster", "nodes"])).unwrap();
        v.as_array().is_some_and(|l| {
            l.len() == 2
                && l.iter()
                    .all(|r| r["pools"].as_array().is_some_and(|p| !p.is_empty()))
        })
    });
    cli(&[
        "volume",
        "create",
        "tlsvol",
        "--size",
        "16M",
        "--replicas",
        "2",
    ]);
    // The spec is in etcd, written by the node as user tessera over TLS.
    o.user = Some("tessera".into());
    o.password = Some(Secret::new(PASSWORD));
    let reader = Etcd::with_options(&etcd.endpoints(), o).unwrap();
    let kv = reader
        .get(&volume_key("tlsvol"))
        .unwrap()
        .expect("the spec in etcd");
    let spec: serde_json::Value = serde_json::from_slice(&kv.value).unwrap();
    assert_eq!(spec["owner"], me.as_str(), "{spec}");
    assert_eq!(spec["replicas"].as_array().map(Vec::len), Some(2), "{spec}");
    assert!(spec.to_string().contains("node-b:p"), "{spec}");
    let vols = cli(&["--json", "cluster", "volumes"]);
    assert!(vols.contains("tlsvol"), "{vols}");
    // The password is in no output, status or log.
    for (what, text) in [
        ("banner", banner.join("\n")),
        ("status", status.to_string()),
        ("log", std::fs::read_to_string(&log).unwrap_or_default()),
    ] {
        assert!(
            !text.contains(PASSWORD),
            "{what} shows the password: {text}"
        );
    }
}
