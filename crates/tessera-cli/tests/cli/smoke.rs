use crate::common;
use common::*;

#[test]
fn default_node_starts_and_reports_status() {
    let n = TestNode::start_default("smoke");
    let out = n.cli_ok(&["status"]);
    assert!(out.contains("pool0"), "{out}");
    assert!(out.contains("vol0"), "{out}");
}

/// Issue 11 finding 3: a management command whose reader has gone (`tessera volume list |
/// true`, `tessera group list --json | head -3`) ends quietly, as a Unix filter does
/// (SIGPIPE), instead of panicking with exit code 101.
#[test]
fn cli_ends_quietly_when_its_stdout_is_closed() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, Stdio};

    let n = TestNode::start_default("pipe");
    let cases: [&[&str]; 3] = [
        &["volume", "list"],
        &["group", "list", "--json"],
        &["status"],
    ];
    for args in cases {
        let mut c = Command::new(BIN)
            .arg("--api")
            .arg(n.api())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader is gone before the command has asked the node anything.
        drop(c.stdout.take());
        let o = c.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            o.status.success() || o.status.signal() == Some(libc::SIGPIPE),
            "{args:?}: {:?} {err}",
            o.status
        );
    }
}
