//! `tessera bench` drives a device, a pool and a thin volume, reports a RESULT line, and
//! refuses bad arguments with one clear line.

use crate::common;

use std::process::Command;

use common::*;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .arg("bench")
        .args(args)
        .output()
        .expect("run tessera bench")
}

fn result_iops(o: &std::process::Output) -> f64 {
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "bench failed: {out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let line = out
        .lines()
        .find(|l| l.starts_with("RESULT"))
        .expect("RESULT line");
    assert!(line.contains("errors=0"), "{line}");
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix("iops="))
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn bench_drives_device_pool_and_volume() {
    let _alone = crate::alone();
    let ram = ["--device", "ram:64M"];
    assert!(result_iops(&bench(&[&ram[..], &["--time", "1", "--qd", "32"]].concat())) > 10_000.0);
    let pool = [
        "--device", "ram:32M", "--device", "ram:32M", "--layout", "raid0",
    ];
    for target in ["pool", "volume"] {
        for pattern in ["randread", "randwrite", "randrw", "read", "write"] {
            let o = bench(
                &[
                    &pool[..],
                    &[
                        "--target",
                        target,
                        "--pattern",
                        pattern,
                        "--time",
                        "1",
                        "--qd",
                        "16",
                        "--bs",
                        "8k",
                    ],
                ]
                .concat(),
            );
            assert!(result_iops(&o) > 1_000.0, "{target} {pattern}");
        }
    }
}

#[test]
fn bench_refuses_bad_arguments() {
    let _alone = crate::alone();
    for args in [
        &[
            "--device", "ram:64M", "--device", "ram:64M", "--target", "device",
        ][..],
        &["--device", "ram:64M", "--qd", "0"][..],
        &[
            "--device", "ram:64M", "--layout", "raid9", "--target", "pool",
        ][..],
        &["--device", "ram:64Q"][..],
    ] {
        let o = bench(args);
        assert!(!o.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("error"), "{args:?}: {err}");
    }
}
