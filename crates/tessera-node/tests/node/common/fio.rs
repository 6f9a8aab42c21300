//! fio over the test node's NBD listener: its output, and the checks that a run with
//! verify found nothing.

use std::process::Output;

use super::log_text;

/// A command's stdout and stderr together.
pub fn combined(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// fio succeeded, reported `err= 0`, and no verify failure (the failure message carries
/// the nodes' log).
pub fn assert_fio_clean(what: &str, o: &Output) {
    let text = combined(o);
    assert!(
        o.status.success(),
        "{what}: fio failed ({}):\n{text}\nnode log:\n{}",
        o.status,
        log_text()
    );
    let bad: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("verify:") || l.contains("verify failed") || l.contains("bad magic"))
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: fio reported verify failures:\n{}",
        bad.join("\n")
    );
    assert!(
        text.contains("err= 0"),
        "{what}: fio did not report err= 0:\n{text}"
    );
}
