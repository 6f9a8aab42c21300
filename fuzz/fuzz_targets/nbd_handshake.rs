//! Feeds arbitrary client bytes to the server-side handshake. It must never panic, never
//! loop, and never allocate more than its caps, whatever the client sends.
#![no_main]

use std::io::{self, Cursor, Read, Write};

use libfuzzer_sys::fuzz_target;
use tessera_nbd::handshake::{negotiate, ExportCatalog, ExportInfo, HandshakeOutcome};

/// Client bytes come from the fuzz input; server bytes are counted and dropped.
struct Stream<'a> {
    input: Cursor<&'a [u8]>,
    written: usize,
}

impl Read for Stream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Stream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.written += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct Catalog;

impl ExportCatalog for Catalog {
    fn list(&self) -> Vec<String> {
        vec!["disk0".into(), "ro".into()]
    }
    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        match name {
            "disk0" => Some(ExportInfo { size: 1 << 30, read_only: false, description: "fuzz disk".into(), tls_required: false }),
            "ro" => Some(ExportInfo { size: 1 << 20, read_only: true, description: String::new(), tls_required: false }),
            _ => None,
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut s = Stream { input: Cursor::new(data), written: 0 };
    if let Ok(HandshakeOutcome::Transmission(n)) = negotiate(&mut s, &Catalog) {
        // Whatever was negotiated must describe a real export, consistently.
        let info = Catalog.lookup(&n.export_name).expect("negotiated an export that does not exist");
        assert_eq!((n.size, n.read_only), (info.size, info.read_only));
        assert!(n.base_allocation.is_none() || n.structured_replies);
    }
    // The server only ever answers what it was sent: no reply amplification.
    assert!(s.written <= 18 + (data.len() / 16 + 1) * 4 * (20 + 4096 + 64));
});
