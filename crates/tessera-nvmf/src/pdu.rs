//! NVMe/TCP PDUs (NVMe/TCP transport binding 1.0; layouts as in Linux's
//! `include/linux/nvme-tcp.h`). All multi-byte fields are little-endian.
//!
//! Every PDU starts with an 8-byte common header (type, flags, HLEN, PDO, PLEN), then the
//! rest of its header (HLEN bytes in all), an optional header digest, padding up to PDO,
//! data, and an optional data digest. Validation follows the order the spec asks for
//! (errors are reported for the lowest erroneous field): type, flags, HLEN, PDO, PLEN,
//! header digest. A failure is fatal: the receiver sends a termination request carrying
//! the fatal error status ([`Fes`]) and the offset of the offending field, then closes.
//! A data digest error is not fatal: the command it carried fails with a Transient
//! Transport Error status.

use tessera_io::cast::{u32_of, u8_of};

/// Initialize Connection Request (host to controller).
pub const ICREQ: u8 = 0x00;
/// Initialize Connection Response.
pub const ICRESP: u8 = 0x01;
/// Host to controller termination request.
pub const H2C_TERM: u8 = 0x02;
/// Controller to host termination request.
pub const C2H_TERM: u8 = 0x03;
pub const CAPSULE_CMD: u8 = 0x04;
pub const CAPSULE_RESP: u8 = 0x05;
pub const H2C_DATA: u8 = 0x06;
pub const C2H_DATA: u8 = 0x07;
/// Ready to transfer (controller asks the host for write data).
pub const R2T: u8 = 0x09;

/// Header digest present.
pub const F_HDGST: u8 = 1 << 0;
/// Data digest present.
pub const F_DDGST: u8 = 1 << 1;
/// Last data PDU of a command's transfer.
pub const F_DATA_LAST: u8 = 1 << 2;
/// C2HData only: the command succeeded and no response capsule follows.
pub const F_DATA_SUCCESS: u8 = 1 << 3;

pub const CH_LEN: usize = 8;
pub const IC_LEN: usize = 128;
pub const CMD_HLEN: usize = 72;
pub const RSP_HLEN: usize = 24;
pub const DATA_HLEN: usize = 24;
pub const R2T_HLEN: usize = 24;
pub const TERM_HLEN: usize = 24;
/// A termination request carries at most this much (header plus the offending header).
pub const TERM_MAX: usize = 152;
pub const DIGEST_LEN: usize = 4;

/// ICReq/ICResp digest field bits.
pub const DIGEST_HDR: u8 = 1 << 0;
pub const DIGEST_DATA: u8 = 1 << 1;

/// Fatal error status of a termination request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Fes {
    InvalidHeaderField = 0x01,
    PduSequenceError = 0x02,
    HeaderDigestError = 0x03,
    DataOutOfRange = 0x04,
    DataLimitExceeded = 0x05,
    UnsupportedParameter = 0x06,
}

/// A fatal PDU error: what the termination request says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fatal {
    pub fes: Fes,
    /// Fatal error information: the byte offset of the offending field in the PDU header
    /// (for a header digest error, the digest that was received).
    pub fei: u32,
}

impl Fatal {
    pub fn new(fes: Fes, fei: u32) -> Fatal {
        Fatal { fes, fei }
    }
}

/// A `Fatal` is kept as the cause of the errors that report it (the initiator's dropped
/// connection), so it is an error itself.
impl std::error::Error for Fatal {}

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.fes {
            Fes::InvalidHeaderField => "invalid PDU header field",
            Fes::PduSequenceError => "PDU sequence error",
            Fes::HeaderDigestError => "header digest error",
            Fes::DataOutOfRange => "data transfer out of range",
            Fes::DataLimitExceeded => "data transfer limit exceeded",
            Fes::UnsupportedParameter => "unsupported parameter",
        };
        write!(f, "{what} (FEI {:#x})", self.fei)
    }
}

#[inline]
pub fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
#[inline]
pub fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
#[inline]
pub fn le64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}
#[inline]
pub fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
#[inline]
pub fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
#[inline]
pub fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// CRC32C as NVMe/TCP digests use it (the standard Castagnoli CRC, stored little-endian).
#[inline]
pub fn crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// The common header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ch {
    pub ty: u8,
    pub flags: u8,
    pub hlen: u8,
    pub pdo: u8,
    pub plen: u32,
}

impl Ch {
    pub fn parse(b: &[u8]) -> Ch {
        Ch {
            ty: b[0],
            flags: b[1],
            hlen: b[2],
            pdo: b[3],
            plen: le32(b, 4),
        }
    }

    pub fn write(&self, b: &mut [u8]) {
        b[0] = self.ty;
        b[1] = self.flags;
        b[2] = self.hlen;
        b[3] = self.pdo;
        put32(b, 4, self.plen);
    }
}

/// Which end receives the PDU: a controller accepts host-to-controller types only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Controller,
    Host,
}

/// What the connection negotiated and the receiver's limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub hdgst: bool,
    pub ddgst: bool,
    /// Largest data a PDU may carry (in-capsule data, H2CData or C2HData payload).
    pub max_data: u32,
}

/// Where things are in a validated PDU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    pub ch: Ch,
    /// Offset and length of the data (0 when none).
    pub data_off: usize,
    pub data_len: usize,
    pub has_hdgst: bool,
    pub has_ddgst: bool,
}

impl Frame {
    pub fn plen(&self) -> usize {
        self.ch.plen as usize
    }
    /// Bytes needed to check the header digest and read the header.
    pub fn header_end(&self) -> usize {
        self.ch.hlen as usize + if self.has_hdgst { DIGEST_LEN } else { 0 }
    }
}

fn expected_hlen(ty: u8) -> usize {
    match ty {
        ICREQ | ICRESP => IC_LEN,
        H2C_TERM | C2H_TERM => TERM_HLEN,
        CAPSULE_CMD => CMD_HLEN,
        CAPSULE_RESP => RSP_HLEN,
        H2C_DATA | C2H_DATA => DATA_HLEN,
        R2T => R2T_HLEN,
        _ => 0,
    }
}

/// Validate a common header for an established connection (after ICReq/ICResp). Needs
/// only the first 8 bytes, so a bogus length is refused before anything is buffered.
pub fn check_header(role: Role, b: &[u8], lim: &Limits) -> Result<Frame, Fatal> {
    let ch = Ch::parse(b);
    let bad = |fei| Err(Fatal::new(Fes::InvalidHeaderField, fei));
    // Type: direction bit is 0 for host-to-controller types, 1 for the others.
    let to_controller = matches!(ch.ty, H2C_TERM | CAPSULE_CMD | H2C_DATA);
    let to_host = matches!(ch.ty, C2H_TERM | CAPSULE_RESP | C2H_DATA | R2T);
    let ok_type = match role {
        Role::Controller => to_controller,
        Role::Host => to_host,
    };
    if !ok_type {
        // ICReq/ICResp again, an unknown type, or the wrong direction.
        return bad(0);
    }
    let term = matches!(ch.ty, H2C_TERM | C2H_TERM);
    if term {
        // 7.4.7: a termination request with an invalid length ends the connection at once
        // (we report it as an invalid header field; the caller closes without replying).
        if (ch.plen as usize) < TERM_HLEN || ch.plen as usize > TERM_MAX {
            return bad(4);
        }
    }
    // Flags.
    let valid = match ch.ty {
        CAPSULE_CMD => F_HDGST | F_DDGST,
        CAPSULE_RESP | R2T => F_HDGST,
        H2C_DATA => F_HDGST | F_DDGST | F_DATA_LAST,
        C2H_DATA => F_HDGST | F_DDGST | F_DATA_LAST | F_DATA_SUCCESS,
        _ => 0,
    };
    if ch.flags & !valid != 0 {
        return bad(1);
    }
    if ch.ty == C2H_DATA && ch.flags & (F_DATA_LAST | F_DATA_SUCCESS) == F_DATA_SUCCESS {
        return bad(1);
    }
    let has_hdgst = ch.flags & F_HDGST != 0;
    let has_ddgst = ch.flags & F_DDGST != 0;
    // Digests are all or nothing once negotiated (termination requests carry none).
    if !term && has_hdgst != lim.hdgst {
        return bad(1);
    }
    if has_ddgst && !lim.ddgst {
        return bad(1);
    }
    // HLEN.
    if ch.hlen as usize != expected_hlen(ch.ty) {
        return bad(2);
    }
    let full_hlen = ch.hlen as usize + if has_hdgst { DIGEST_LEN } else { 0 };
    let plen = ch.plen as usize;
    // PDO.
    let carries_data = matches!(ch.ty, CAPSULE_CMD | H2C_DATA | C2H_DATA);
    if !carries_data {
        if ch.pdo != 0 {
            return bad(3);
        }
    } else if !(plen == full_hlen && ch.pdo == 0)
        && ((ch.pdo as usize) < full_hlen || ch.pdo as usize > plen)
    {
        return bad(3);
    }
    // PLEN.
    if plen < full_hlen {
        return bad(4);
    }
    let (data_off, mut data_len) = if term {
        (TERM_HLEN, plen - TERM_HLEN)
    } else if plen == full_hlen {
        (full_hlen, 0)
    } else {
        (ch.pdo as usize, plen - ch.pdo as usize)
    };
    if !carries_data && !term && data_len != 0 {
        return bad(4);
    }
    if carries_data {
        if data_len > 0 && lim.ddgst && !has_ddgst {
            return bad(1);
        }
        if has_ddgst {
            if data_len <= DIGEST_LEN {
                return bad(4);
            }
            data_len -= DIGEST_LEN;
        }
        if data_len > lim.max_data as usize {
            return Err(Fatal::new(Fes::DataLimitExceeded, 4));
        }
    }
    Ok(Frame {
        ch,
        data_off,
        data_len,
        has_hdgst,
        has_ddgst,
    })
}

/// Check the header digest of a PDU whose first `f.header_end()` bytes are in `b`.
pub fn check_hdgst(f: &Frame, b: &[u8]) -> Result<(), Fatal> {
    if !f.has_hdgst {
        return Ok(());
    }
    let h = f.ch.hlen as usize;
    let got = le32(b, h);
    if crc(&b[..h]) != got {
        return Err(Fatal::new(Fes::HeaderDigestError, got));
    }
    Ok(())
}

/// True if the data digest of a complete PDU in `b` matches (or there is none).
pub fn ddgst_ok(f: &Frame, b: &[u8]) -> bool {
    if !f.has_ddgst {
        return true;
    }
    let data = &b[f.data_off..f.data_off + f.data_len];
    crc(data) == le32(b, f.data_off + f.data_len)
}

/// The Initialize Connection Request a host sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcReq {
    pub pfv: u16,
    /// Host PDU data alignment, in dwords, 0's based.
    pub hpda: u8,
    pub digest: u8,
    /// Maximum outstanding R2Ts per command, 0's based.
    pub maxr2t: u32,
}

/// Validate and decode an ICReq (exactly 128 bytes in `b`).
pub fn parse_icreq(b: &[u8]) -> Result<IcReq, Fatal> {
    let ch = Ch::parse(b);
    let bad = |fei| Err(Fatal::new(Fes::InvalidHeaderField, fei));
    if ch.ty != ICREQ {
        // Anything but ICReq first is out of sequence.
        return Err(Fatal::new(Fes::PduSequenceError, 0));
    }
    if ch.flags != 0 {
        return bad(1);
    }
    if ch.hlen as usize != IC_LEN {
        return bad(2);
    }
    if ch.pdo != 0 {
        return bad(3);
    }
    if ch.plen as usize != IC_LEN {
        return bad(4);
    }
    let r = IcReq {
        pfv: le16(b, 8),
        hpda: b[10],
        digest: b[11],
        maxr2t: le32(b, 12),
    };
    if r.pfv != 0 {
        return Err(Fatal::new(Fes::UnsupportedParameter, 8));
    }
    if r.hpda > 31 {
        return Err(Fatal::new(Fes::UnsupportedParameter, 10));
    }
    Ok(r)
}

pub fn encode_icreq(r: &IcReq) -> [u8; IC_LEN] {
    let mut b = [0u8; IC_LEN];
    Ch {
        ty: ICREQ,
        flags: 0,
        hlen: u8_of(IC_LEN),
        pdo: 0,
        plen: u32_of(IC_LEN),
    }
    .write(&mut b);
    put16(&mut b, 8, r.pfv);
    b[10] = r.hpda;
    b[11] = r.digest;
    put32(&mut b, 12, r.maxr2t);
    b
}

/// The Initialize Connection Response a controller sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcResp {
    pub pfv: u16,
    /// Controller PDU data alignment, in dwords, 0's based.
    pub cpda: u8,
    pub digest: u8,
    /// MAXH2CDATA: the most data one H2CData PDU may carry.
    pub maxh2cdata: u32,
}

pub fn encode_icresp(r: &IcResp) -> [u8; IC_LEN] {
    let mut b = [0u8; IC_LEN];
    Ch {
        ty: ICRESP,
        flags: 0,
        hlen: u8_of(IC_LEN),
        pdo: 0,
        plen: u32_of(IC_LEN),
    }
    .write(&mut b);
    put16(&mut b, 8, r.pfv);
    b[10] = r.cpda;
    b[11] = r.digest;
    put32(&mut b, 12, r.maxh2cdata);
    b
}

/// Validate and decode an ICResp (128 bytes), as a host.
pub fn parse_icresp(b: &[u8]) -> Result<IcResp, Fatal> {
    let ch = Ch::parse(b);
    if ch.ty != ICRESP {
        return Err(Fatal::new(Fes::PduSequenceError, 0));
    }
    if ch.flags != 0 {
        return Err(Fatal::new(Fes::InvalidHeaderField, 1));
    }
    if ch.hlen as usize != IC_LEN || ch.plen as usize != IC_LEN {
        return Err(Fatal::new(Fes::InvalidHeaderField, 2));
    }
    let r = IcResp {
        pfv: le16(b, 8),
        cpda: b[10],
        digest: b[11],
        maxh2cdata: le32(b, 12),
    };
    if r.pfv != 0 {
        return Err(Fatal::new(Fes::UnsupportedParameter, 8));
    }
    // MAXH2CDATA shall be at least 4 KiB and a multiple of 4.
    if r.maxh2cdata < 4096 || !r.maxh2cdata.is_multiple_of(4) {
        return Err(Fatal::new(Fes::InvalidHeaderField, 12));
    }
    Ok(r)
}

/// Digest and padding layout a sender uses for its PDUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Framing {
    pub hdgst: bool,
    pub ddgst: bool,
    /// The peer's PDU data alignment in bytes (4 × (PDA + 1)).
    pub align: usize,
}

impl Framing {
    /// Data offset of a PDU with header length `hlen`: header, digest, padding.
    pub fn pdo(&self, hlen: usize) -> usize {
        let h = hlen + if self.hdgst { DIGEST_LEN } else { 0 };
        let a = self.align.max(1);
        h.div_ceil(a) * a
    }

    /// Write a header-only PDU (`hlen` bytes of `b` already hold the type-specific fields)
    /// and its digest; returns the bytes to send.
    #[allow(
        clippy::cast_possible_truncation,
        reason = "HLEN is one of the header lengths above (at most 128), PLEN adds a digest"
    )]
    fn finish_header(&self, b: &mut [u8], ty: u8, hlen: usize) -> usize {
        let flags = if self.hdgst { F_HDGST } else { 0 };
        let n = hlen + if self.hdgst { DIGEST_LEN } else { 0 };
        Ch {
            ty,
            flags,
            hlen: hlen as u8,
            pdo: 0,
            plen: n as u32,
        }
        .write(b);
        if self.hdgst {
            let d = crc(&b[..hlen]);
            put32(b, hlen, d);
        }
        n
    }

    /// Write the header (with digest and padding) of a PDU carrying `data_len` bytes of
    /// data; the data and its digest follow. Returns the header length on the wire (PDO).
    #[allow(
        clippy::cast_possible_truncation,
        reason = "HLEN is at most 128 and PDO adds a digest and at most 128 bytes of padding \
                  (PDA <= 31), so both fit a byte; data_len is a command's transfer, at most \
                  MDTS or the in-capsule size, so PLEN fits its u32"
    )]
    fn data_header(
        &self,
        b: &mut [u8],
        ty: u8,
        extra_flags: u8,
        hlen: usize,
        data_len: usize,
    ) -> usize {
        let pdo = if data_len > 0 { self.pdo(hlen) } else { 0 };
        let ddg = if data_len > 0 && self.ddgst {
            DIGEST_LEN
        } else {
            0
        };
        let hd = hlen + if self.hdgst { DIGEST_LEN } else { 0 };
        let plen = if data_len > 0 {
            pdo + data_len + ddg
        } else {
            hd
        };
        let mut flags = extra_flags | if self.hdgst { F_HDGST } else { 0 };
        if data_len > 0 && self.ddgst {
            flags |= F_DDGST;
        }
        Ch {
            ty,
            flags,
            hlen: hlen as u8,
            pdo: pdo as u8,
            plen: plen as u32,
        }
        .write(b);
        if self.hdgst {
            let d = crc(&b[..hlen]);
            put32(b, hlen, d);
        }
        for x in &mut b[hd..pdo.max(hd)] {
            *x = 0;
        }
        pdo.max(hd)
    }

    /// CapsuleResp: 16-byte CQE. Returns the bytes to send from `b` (at least 28 long).
    pub fn capsule_resp(&self, b: &mut [u8], cqe: &[u8; 16]) -> usize {
        b[8..24].copy_from_slice(cqe);
        self.finish_header(b, CAPSULE_RESP, RSP_HLEN)
    }

    /// R2T for `len` bytes at `offset` of command `cid`.
    pub fn r2t(&self, b: &mut [u8], cid: u16, ttag: u16, offset: u32, len: u32) -> usize {
        put16(b, 8, cid);
        put16(b, 10, ttag);
        put32(b, 12, offset);
        put32(b, 16, len);
        put32(b, 20, 0);
        self.finish_header(b, R2T, R2T_HLEN)
    }

    /// C2HData or H2CData header; returns its length (the PDO). `b` needs room for
    /// `pdo(24)` bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn data_pdu(
        &self,
        b: &mut [u8],
        ty: u8,
        flags: u8,
        cid: u16,
        ttag: u16,
        offset: u32,
        len: u32,
    ) -> usize {
        put16(b, 8, cid);
        put16(b, 10, ttag);
        put32(b, 12, offset);
        put32(b, 16, len);
        put32(b, 20, 0);
        self.data_header(b, ty, flags, DATA_HLEN, len as usize)
    }

    /// CapsuleCmd: 64-byte SQE and `data_len` bytes of in-capsule data that follow.
    pub fn capsule_cmd(&self, b: &mut [u8], sqe: &[u8; 64], data_len: usize) -> usize {
        b[8..72].copy_from_slice(sqe);
        self.data_header(b, CAPSULE_CMD, 0, CMD_HLEN, data_len)
    }
}

/// A termination request (`ty` = H2C_TERM or C2H_TERM) quoting up to 128 bytes of the
/// offending PDU header.
#[allow(
    clippy::cast_possible_truncation,
    reason = "HLEN is 24 and PLEN at most TERM_MAX (152)"
)]
pub fn encode_term(ty: u8, fatal: Fatal, offending: &[u8]) -> Vec<u8> {
    let n = offending.len().min(TERM_MAX - TERM_HLEN);
    let mut b = vec![0u8; TERM_HLEN + n];
    Ch {
        ty,
        flags: 0,
        hlen: TERM_HLEN as u8,
        pdo: 0,
        plen: (TERM_HLEN + n) as u32,
    }
    .write(&mut b);
    put16(&mut b, 8, fatal.fes as u16);
    put32(&mut b, 10, fatal.fei);
    b[TERM_HLEN..].copy_from_slice(&offending[..n]);
    b
}

/// Decode a termination request's FES and FEI.
pub fn parse_term(b: &[u8]) -> (u16, u32) {
    (le16(b, 8), le32(b, 10))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAIN: Limits = Limits {
        hdgst: false,
        ddgst: false,
        max_data: 8192,
    };
    const DIGESTS: Limits = Limits {
        hdgst: true,
        ddgst: true,
        max_data: 8192,
    };

    fn cmd_pdu(f: &Framing, data: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; 256];
        let sqe = [7u8; 64];
        let h = f.capsule_cmd(&mut b, &sqe, data.len());
        b.truncate(h);
        b.extend_from_slice(data);
        if f.ddgst && !data.is_empty() {
            b.extend_from_slice(&crc(data).to_le_bytes());
        }
        b
    }

    #[test]
    fn crc32c_known_value() {
        // The CRC32C check value of "123456789".
        assert_eq!(crc(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn capsule_roundtrip_with_and_without_digests() {
        for (f, lim) in [
            (Framing::default(), PLAIN),
            (
                Framing {
                    hdgst: true,
                    ddgst: true,
                    align: 1,
                },
                DIGESTS,
            ),
        ] {
            let data = vec![0xAB; 4096];
            let b = cmd_pdu(&f, &data);
            let fr = check_header(Role::Controller, &b, &lim).unwrap();
            assert_eq!(fr.plen(), b.len());
            assert_eq!(fr.data_len, 4096);
            check_hdgst(&fr, &b).unwrap();
            assert!(ddgst_ok(&fr, &b));
            assert_eq!(&b[fr.data_off..fr.data_off + 4096], &data[..]);
            // No data: PDO 0.
            let b = cmd_pdu(&f, &[]);
            let fr = check_header(Role::Controller, &b, &lim).unwrap();
            assert_eq!(fr.data_len, 0);
            assert_eq!(b[3], 0);
        }
    }

    #[test]
    fn alignment_pads_the_data_offset() {
        let f = Framing {
            hdgst: true,
            ddgst: false,
            align: 32,
        };
        assert_eq!(f.pdo(24), 32);
        let mut b = vec![0xEE; 64];
        let n = f.data_pdu(&mut b, C2H_DATA, F_DATA_LAST, 1, 0, 0, 512);
        assert_eq!(n, 32);
        assert!(b[28..32].iter().all(|&x| x == 0));
        assert_eq!(le32(&b, 4), 32 + 512);
    }

    #[test]
    fn fields_are_checked_in_order() {
        let f = Framing::default();
        let good = cmd_pdu(&f, &[1; 16]);
        let err = |b: &[u8], lim: &Limits| check_header(Role::Controller, b, lim).unwrap_err();
        let mut b = good.clone();
        b[0] = CAPSULE_RESP; // wrong direction
        assert_eq!(err(&b, &PLAIN), Fatal::new(Fes::InvalidHeaderField, 0));
        b[0] = ICREQ; // IC after initialization
        assert_eq!(err(&b, &PLAIN).fei, 0);
        let mut b = good.clone();
        b[1] = F_DATA_LAST;
        assert_eq!(err(&b, &PLAIN).fei, 1);
        // Header digest negotiated but missing.
        assert_eq!(err(&good, &DIGESTS).fei, 1);
        let mut b = good.clone();
        b[2] = 24;
        assert_eq!(err(&b, &PLAIN).fei, 2);
        let mut b = good.clone();
        b[3] = 8; // data offset inside the header
        assert_eq!(err(&b, &PLAIN).fei, 3);
        let mut b = good.clone();
        put32(&mut b, 4, 40); // shorter than the header
        assert_eq!(err(&b, &PLAIN).fei, 3);
        let mut b = good;
        put32(&mut b, 4, 72 + 1_000_000);
        assert_eq!(err(&b, &PLAIN).fes, Fes::DataLimitExceeded);
    }

    #[test]
    fn digests_are_verified() {
        let f = Framing {
            hdgst: true,
            ddgst: true,
            align: 1,
        };
        let mut b = cmd_pdu(&f, &[5; 100]);
        let fr = check_header(Role::Controller, &b, &DIGESTS).unwrap();
        b[20] ^= 1;
        assert_eq!(
            check_hdgst(&fr, &b).unwrap_err().fes,
            Fes::HeaderDigestError
        );
        b[20] ^= 1;
        let last = b.len() - 5;
        b[last] ^= 1;
        assert!(!ddgst_ok(&fr, &b));
    }

    #[test]
    fn icreq_validation() {
        let r = IcReq {
            pfv: 0,
            hpda: 0,
            digest: DIGEST_HDR,
            maxr2t: 0,
        };
        let b = encode_icreq(&r);
        assert_eq!(parse_icreq(&b).unwrap(), r);
        let mut x = b;
        x[8] = 1;
        assert_eq!(parse_icreq(&x).unwrap_err().fes, Fes::UnsupportedParameter);
        let mut x = b;
        x[10] = 32;
        assert_eq!(parse_icreq(&x).unwrap_err().fei, 10);
        let mut x = b;
        x[0] = CAPSULE_CMD;
        assert_eq!(parse_icreq(&x).unwrap_err().fes, Fes::PduSequenceError);
        let resp = IcResp {
            pfv: 0,
            cpda: 0,
            digest: 0,
            maxh2cdata: 131072,
        };
        assert_eq!(parse_icresp(&encode_icresp(&resp)).unwrap(), resp);
    }

    #[test]
    fn term_request_quotes_the_header() {
        let t = encode_term(C2H_TERM, Fatal::new(Fes::HeaderDigestError, 9), &[1; 200]);
        assert_eq!(t.len(), TERM_MAX);
        let fr = check_header(Role::Host, &t, &PLAIN).unwrap();
        assert_eq!(fr.data_len, TERM_MAX - TERM_HLEN);
        assert_eq!(parse_term(&t), (Fes::HeaderDigestError as u16, 9));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_headers_never_panic(b in proptest::collection::vec(proptest::prelude::any::<u8>(), 8..300)) {
            for lim in [PLAIN, DIGESTS] {
                for role in [Role::Controller, Role::Host] {
                    if let Ok(f) = check_header(role, &b, &lim) {
                        if b.len() >= f.header_end() {
                            let _ = check_hdgst(&f, &b);
                        }
                        if b.len() >= f.plen() {
                            let _ = ddgst_ok(&f, &b);
                        }
                        proptest::prop_assert!(f.data_off + f.data_len <= f.plen());
                    }
                }
            }
            let _ = parse_icreq(&b[..b.len().min(128)].iter().copied().chain(std::iter::repeat(0)).take(128).collect::<Vec<_>>());
        }
    }
}
