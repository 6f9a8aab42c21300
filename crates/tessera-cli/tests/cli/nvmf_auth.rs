//! What the CLI does with NVMe/TCP in-band authentication (DH-HMAC-CHAP) secrets, end to
//! end: `nvmf subsystem add-host --dhchap-secret-file` reads the secret from a file, the
//! text `nvmf subsystem list` says how a host authenticates, and the CLI's own initiator
//! (`tessera nvmf identify`) authenticates with a secret from a file and fails, saying so,
//! with a wrong one. The target's side (who connects, what runs before authentication,
//! bidirectional secrets, hashes and groups, malformed messages, the 0600 file, nvme-cli's
//! keys) is tested on an in-process node: `crates/tessera-node/tests/node/nvmf_auth.rs`.

use crate::common;
use common::*;

use std::process::Command;

use tessera_nvmf::auth::{Hash, Secret};

const NQN: &str = "nqn.2024-01.io.tessera.test:auth";
const HOST: &str = "nqn.2024-01.io.tessera.test:host-a";

struct Setup {
    node: TestNode,
    io: String,
}

fn setup(tag: &str) -> Setup {
    let p1 = free_port();
    let node = TestNode::start_with_config(
        tag,
        &format!("[nvmf]\nlisten = \"127.0.0.1:{p1}\"\ndiscovery = \"\"\n"),
    );
    node.cli_ok(&["pool", "create", "p", "ram:64M"]);
    node.cli_ok(&["volume", "create", "v", "--pool", "p", "--size", "16M"]);
    node.cli_ok(&["nvmf", "subsystem", "add", NQN, "--volume", "v"]);
    Setup {
        node,
        io: format!("127.0.0.1:{p1}"),
    }
}

/// `nvmf subsystem add-host NQN host` with `options` (its secrets and parameters).
fn add_host(node: &TestNode, host: &str, options: &[&str]) {
    let mut args = vec!["nvmf", "subsystem", "add-host", NQN, host];
    args.extend_from_slice(options);
    node.cli_ok(&args);
}

/// The CLI initiator's `nvmf identify` of the test subsystem as HOST at `io`, with
/// `secret` (its options).
fn identify_args<'a>(io: &'a str, secret: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "nvmf",
        "identify",
        "--addr",
        io,
        "--nqn",
        NQN,
        "--hostnqn",
        HOST,
    ];
    args.extend_from_slice(secret);
    args
}

#[test]
fn the_cli_reads_secret_files_and_its_initiator_authenticates() {
    let s = setup("nvmf-auth-cli");
    let secret = Secret::generate(Some(Hash::Sha256), 32);
    let file = s.node.dir.join("host-a.key");
    std::fs::write(&file, format!("{}\n", secret.encode())).unwrap();
    add_host(&s.node, HOST, &["--dhchap-secret-file", &path_str(&file)]);
    let text = s.node.cli_ok(&["nvmf", "subsystem", "list"]);
    assert!(text.contains("auth: dh-hmac-chap"), "{text}");

    // The CLI initiator: the right secret from a file identifies, a wrong one fails.
    let out = initiator_ok(&identify_args(
        &s.io,
        &["--dhchap-secret-file", &path_str(&file)],
    ));
    assert!(out.contains(NQN), "{out}");
    let wrong = Secret::generate(Some(Hash::Sha256), 32);
    let o = initiator(&identify_args(&s.io, &["--dhchap-secret", &wrong.encode()]));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("refused"), "{err}");
}

/// Run the CLI's initiator (`tessera nvmf ...`): it talks to its target, not to a
/// node's API, so no `--api` (which it refuses).
fn initiator(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run tessera")
}

fn initiator_ok(args: &[&str]) -> String {
    tessera_testkit::node::cli_stdout(args, &initiator(args))
}
