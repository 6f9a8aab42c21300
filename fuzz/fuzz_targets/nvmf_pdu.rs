//! Walks arbitrary bytes as an NVMe/TCP stream the way a target queue does: an ICReq
//! first, then PDUs validated header first (before their data is buffered), header
//! digest, data digest, and the SQE of each command capsule decoded.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_nvmf::{nvme, pdu};

fuzz_target!(|data: &[u8]| {
    let Some(first) = data.get(..pdu::IC_LEN) else {
        return;
    };
    let Ok(ic) = pdu::parse_icreq(first) else {
        return;
    };
    let lim = pdu::Limits {
        hdgst: ic.digest & pdu::DIGEST_HDR != 0,
        ddgst: ic.digest & pdu::DIGEST_DATA != 0,
        max_data: 128 << 10,
    };
    let mut pos = pdu::IC_LEN;
    while let Some(rest) = data.get(pos..) {
        if rest.len() < pdu::CH_LEN {
            break;
        }
        let Ok(f) = pdu::check_header(pdu::Role::Controller, rest, &lim) else {
            break; // a target sends C2HTermReq and closes
        };
        assert!(f.data_off + f.data_len <= f.plen());
        if rest.len() < f.plen() {
            break;
        }
        if pdu::check_hdgst(&f, rest).is_err() {
            break;
        }
        let _ = pdu::ddgst_ok(&f, rest);
        if f.ch.ty == pdu::CAPSULE_CMD {
            let sqe = nvme::Sqe::parse(&rest[8..72]);
            let _ = (sqe.slba(), sqe.nlb(), nvme::ConnectCmd::parse(&sqe));
            if f.data_len >= nvme::CONNECT_DATA_LEN {
                let _ = nvme::ConnectData::parse(&rest[f.data_off..]);
            }
        }
        pos += f.plen();
    }
});
