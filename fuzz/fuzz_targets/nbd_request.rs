//! Walks arbitrary bytes as a stream of transmission-phase requests, the way the server's
//! connection loop does: parse a header, skip a WRITE's payload by its length, repeat.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_nbd::proto;

fuzz_target!(|data: &[u8]| {
    let mut pos = 0usize;
    while let Some(rest) = data.get(pos..) {
        let h = match proto::parse_request(rest) {
            Ok(Some(h)) => h,
            // Not enough bytes for a header: a server would wait for more.
            Ok(None) => {
                assert!(rest.len() < proto::REQUEST_HEADER_LEN);
                break;
            }
            // Bad magic: the stream cannot be resynchronised, the server closes.
            Err(e) => {
                assert_ne!(e.0, proto::REQUEST_MAGIC);
                break;
            }
        };
        // The codec must be lossless: re-encoding gives back the bytes it parsed.
        assert_eq!(proto::encode_request(&h)[..], rest[..proto::REQUEST_HEADER_LEN]);
        pos += proto::REQUEST_HEADER_LEN;
        match h.cmd {
            // No request may follow a disconnect.
            proto::CMD_DISC => break,
            proto::CMD_WRITE => {
                // A payload larger than we advertise cannot be buffered; the server drops
                // the connection instead of reading it.
                if h.length > proto::MAX_PAYLOAD {
                    break;
                }
                let len = h.length as usize;
                if data.len() - pos < len {
                    break; // payload not fully received yet
                }
                pos += len;
            }
            _ => {}
        }
    }
});
