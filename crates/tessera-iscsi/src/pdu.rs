//! The iSCSI PDU codec (RFC 7143 §11): the 48-byte Basic Header Segment, additional
//! header segments (skipped: a target of this slice uses none), the data segment padded
//! to 4 bytes, and the optional CRC32C header and data digests.
//!
//! Decoding is strict and bounded: a PDU is only taken once every byte of it has arrived,
//! its data segment may not exceed what this side declared (MaxRecvDataSegmentLength),
//! and a header that names an opcode a target never receives is an error. Nothing here
//! allocates from a length off the wire.

use thiserror::Error;

pub const BHS_LEN: usize = 48;

/// Initiator opcodes (what a target receives).
pub const OP_NOP_OUT: u8 = 0x00;
pub const OP_SCSI_CMD: u8 = 0x01;
pub const OP_TASK_MGMT_REQ: u8 = 0x02;
pub const OP_LOGIN_REQ: u8 = 0x03;
pub const OP_TEXT_REQ: u8 = 0x04;
pub const OP_DATA_OUT: u8 = 0x05;
pub const OP_LOGOUT_REQ: u8 = 0x06;
pub const OP_SNACK: u8 = 0x10;

/// Target opcodes (what a target sends).
pub const OP_NOP_IN: u8 = 0x20;
pub const OP_SCSI_RESP: u8 = 0x21;
pub const OP_TASK_MGMT_RESP: u8 = 0x22;
pub const OP_LOGIN_RESP: u8 = 0x23;
pub const OP_TEXT_RESP: u8 = 0x24;
pub const OP_DATA_IN: u8 = 0x25;
pub const OP_LOGOUT_RESP: u8 = 0x26;
pub const OP_R2T: u8 = 0x31;
pub const OP_REJECT: u8 = 0x3f;

/// The F (final) bit of byte 1.
pub const FLAG_FINAL: u8 = 0x80;
/// The immediate-delivery bit of byte 0 (initiator PDUs).
pub const FLAG_IMMEDIATE: u8 = 0x40;
/// The "reserved" ITT / TTT value.
pub const RESERVED_TAG: u32 = 0xffff_ffff;

/// Reject reasons (RFC 7143 §11.17.1).
pub const REJECT_DIGEST_ERROR: u8 = 0x02;
pub const REJECT_PROTOCOL_ERROR: u8 = 0x04;
pub const REJECT_COMMAND_NOT_SUPPORTED: u8 = 0x05;
pub const REJECT_INVALID_PDU_FIELD: u8 = 0x09;

/// Why bytes off the wire are not a PDU this target takes.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PduError {
    /// opcode {0:#04x} is not one an initiator sends to a target
    #[error("opcode {0:#04x} is not one an initiator sends to a target")]
    UnknownOpcode(u8),
    /// The data segment is larger than this side declared it receives.
    #[error("data segment of {len} bytes exceeds MaxRecvDataSegmentLength {max}")]
    DataTooLong { len: usize, max: usize },
    /// The header digest does not match.
    #[error("header digest mismatch (got {got:#010x}, computed {want:#010x})")]
    HeaderDigest { got: u32, want: u32 },
    /// The data digest does not match.
    #[error("data digest mismatch (got {got:#010x}, computed {want:#010x})")]
    DataDigest { got: u32, want: u32 },
}

/// Digests in force on a connection (negotiated at login; off until then).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

/// CRC32C as iSCSI uses it (RFC 7143 §13.1 / RFC 3385): the Castagnoli polynomial,
/// reflected, initial value and final xor all ones, sent least significant byte first.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// The data segment padded to a multiple of 4 bytes.
#[inline]
pub fn padded(len: usize) -> usize {
    (len + 3) & !3
}

fn be24(b: &[u8]) -> usize {
    (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2])
}

pub fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

pub fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

pub fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

pub fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

pub fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// A Basic Header Segment as received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bhs(pub [u8; BHS_LEN]);

impl Bhs {
    pub fn opcode(&self) -> u8 {
        self.0[0] & 0x3f
    }
    pub fn immediate(&self) -> bool {
        self.0[0] & FLAG_IMMEDIATE != 0
    }
    pub fn flags(&self) -> u8 {
        self.0[1]
    }
    pub fn final_bit(&self) -> bool {
        self.0[1] & FLAG_FINAL != 0
    }
    /// Bytes of additional header segments (TotalAHSLength is in 4-byte words).
    pub fn ahs_len(&self) -> usize {
        usize::from(self.0[4]) * 4
    }
    pub fn data_len(&self) -> usize {
        be24(&self.0[5..8])
    }
    pub fn lun_raw(&self) -> u64 {
        get_u64(&self.0, 8)
    }
    pub fn itt(&self) -> u32 {
        get_u32(&self.0, 16)
    }
    /// Bytes 20..24: TTT (NOP-Out, Text, Data-Out), Expected Data Transfer Length (SCSI
    /// Command), Referenced Task Tag (Task Management), CID (Login, Logout).
    pub fn word20(&self) -> u32 {
        get_u32(&self.0, 20)
    }
    pub fn cmdsn(&self) -> u32 {
        get_u32(&self.0, 24)
    }
    pub fn exp_statsn(&self) -> u32 {
        get_u32(&self.0, 28)
    }
    /// SCSI Command: the CDB (16 bytes at 32).
    pub fn cdb(&self) -> &[u8] {
        &self.0[32..48]
    }
    /// Data-Out: DataSN.
    pub fn data_sn(&self) -> u32 {
        get_u32(&self.0, 36)
    }
    /// Data-Out: Buffer Offset.
    pub fn buffer_offset(&self) -> u32 {
        get_u32(&self.0, 40)
    }
}

/// The LUN a single-level LUN field names (peripheral or flat addressing, SAM-5
/// §4.7.7): `None` for a hierarchical or extended address this target never hands out.
pub fn lun_of(raw: u64) -> Option<u16> {
    let b = raw.to_be_bytes();
    if b[2..].iter().any(|&x| x != 0) {
        return None;
    }
    match b[0] >> 6 {
        0 if b[0] == 0 => Some(u16::from(b[1])),
        1 => Some((u16::from(b[0] & 0x3f) << 8) | u16::from(b[1])),
        _ => None,
    }
}

/// The LUN field for `lun` (peripheral addressing below 256, flat above).
pub fn lun_field(lun: u16) -> u64 {
    let [hi, lo] = lun.to_be_bytes();
    let b0 = if lun < 256 { 0 } else { 0x40 | (hi & 0x3f) };
    u64::from_be_bytes([b0, lo, 0, 0, 0, 0, 0, 0])
}

/// Where one PDU lies in a receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Framed {
    pub bhs: Bhs,
    /// Offset of the data segment from the start of the PDU, and its unpadded length.
    pub data_at: usize,
    pub data_len: usize,
    /// Bytes the whole PDU takes (header, AHS, digests, padded data).
    pub total: usize,
}

/// Take one PDU off the front of `buf`. `Ok(None)`: not all of it has arrived yet (a
/// receive buffer must be able to hold `BHS_LEN + 4 + 1020 + padded(max_data) + 4`).
/// `max_data` is the MaxRecvDataSegmentLength this side declared.
pub fn frame(buf: &[u8], digests: Digests, max_data: usize) -> Result<Option<Framed>, PduError> {
    if buf.len() < BHS_LEN {
        return Ok(None);
    }
    let mut h = [0u8; BHS_LEN];
    h.copy_from_slice(&buf[..BHS_LEN]);
    let bhs = Bhs(h);
    match bhs.opcode() {
        OP_NOP_OUT | OP_SCSI_CMD | OP_TASK_MGMT_REQ | OP_LOGIN_REQ | OP_TEXT_REQ | OP_DATA_OUT
        | OP_LOGOUT_REQ | OP_SNACK => {}
        op => return Err(PduError::UnknownOpcode(op)),
    }
    let data_len = bhs.data_len();
    if data_len > max_data {
        return Err(PduError::DataTooLong {
            len: data_len,
            max: max_data,
        });
    }
    let hdr_end = BHS_LEN + bhs.ahs_len();
    let data_at = hdr_end + if digests.header { 4 } else { 0 };
    let data_end = data_at + padded(data_len);
    let total = data_end + if digests.data && data_len > 0 { 4 } else { 0 };
    if buf.len() < data_at {
        return Ok(None);
    }
    if digests.header {
        let got = u32::from_le_bytes([
            buf[hdr_end],
            buf[hdr_end + 1],
            buf[hdr_end + 2],
            buf[hdr_end + 3],
        ]);
        let want = crc32c(&buf[..hdr_end]);
        if got != want {
            return Err(PduError::HeaderDigest { got, want });
        }
    }
    if buf.len() < total {
        return Ok(None);
    }
    if digests.data && data_len > 0 {
        let got = u32::from_le_bytes([
            buf[data_end],
            buf[data_end + 1],
            buf[data_end + 2],
            buf[data_end + 3],
        ]);
        let want = crc32c(&buf[data_at..data_end]);
        if got != want {
            return Err(PduError::DataDigest { got, want });
        }
    }
    Ok(Some(Framed {
        bhs,
        data_at,
        data_len,
        total,
    }))
}

/// A header this target sends: opcode, flags and the data segment length set; the
/// caller fills the opcode-specific fields.
pub fn header(opcode: u8, flags: u8, data_len: usize) -> [u8; BHS_LEN] {
    let mut h = [0u8; BHS_LEN];
    h[0] = opcode;
    h[1] = flags;
    let len = u32::try_from(data_len).unwrap_or(u32::MAX).to_be_bytes();
    debug_assert!(len[0] == 0, "a data segment fits in 24 bits");
    h[5..8].copy_from_slice(&len[1..]);
    h
}

/// What follows the header of a PDU this target sends: its header digest, when on.
pub fn header_digest(h: &[u8; BHS_LEN], digests: Digests) -> Option<[u8; 4]> {
    digests.header.then(|| crc32c(h).to_le_bytes())
}

/// What follows `data` (a data segment of `data.len()` bytes): the pad bytes and the data
/// digest, when on, as `(bytes, len)`.
pub fn data_trailer(data: &[u8], digests: Digests) -> ([u8; 8], usize) {
    let mut out = [0u8; 8];
    let pad = padded(data.len()) - data.len();
    let mut n = pad;
    if digests.data && !data.is_empty() {
        let mut c = crc32c::crc32c(data);
        if pad > 0 {
            c = crc32c::crc32c_append(c, &[0u8; 3][..pad]);
        }
        out[n..n + 4].copy_from_slice(&c.to_le_bytes());
        n += 4;
    }
    (out, n)
}

/// A whole PDU in one buffer: header, header digest, data, padding, data digest (login,
/// text and other small replies).
pub fn encode(h: &[u8; BHS_LEN], data: &[u8], digests: Digests) -> Vec<u8> {
    let mut v = Vec::with_capacity(BHS_LEN + 8 + padded(data.len()) + 4);
    v.extend_from_slice(h);
    if let Some(d) = header_digest(h, digests) {
        v.extend_from_slice(&d);
    }
    v.extend_from_slice(data);
    let (t, n) = data_trailer(data, digests);
    v.extend_from_slice(&t[..n]);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nop_out(data: &[u8]) -> [u8; BHS_LEN] {
        let mut h = header(OP_NOP_OUT | FLAG_IMMEDIATE, FLAG_FINAL, data.len());
        put_u32(&mut h, 16, 7);
        put_u32(&mut h, 20, RESERVED_TAG);
        h
    }

    #[test]
    fn crc32c_matches_the_rfc_3720_vectors() {
        // RFC 3720 B.4: 32 bytes of zeros, of ones, incrementing, decrementing.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        let inc: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&inc), 0x46dd_794e);
        let dec: Vec<u8> = (0..32).rev().collect();
        assert_eq!(crc32c(&dec), 0x113f_db5c);
    }

    #[test]
    fn a_pdu_round_trips_with_and_without_digests() {
        for digests in [
            Digests::default(),
            Digests {
                header: true,
                data: true,
            },
        ] {
            let data = b"hello";
            let h = nop_out(data);
            let wire = encode(&h, data, digests);
            let extra = if digests.header { 8 } else { 0 };
            assert_eq!(wire.len(), BHS_LEN + 8 + extra);
            // Every prefix is incomplete, never an error.
            for n in 0..wire.len() {
                assert_eq!(frame(&wire[..n], digests, 8192), Ok(None), "prefix {n}");
            }
            let f = frame(&wire, digests, 8192).unwrap().unwrap();
            assert_eq!(f.total, wire.len());
            assert_eq!(&wire[f.data_at..f.data_at + f.data_len], data);
            assert_eq!(f.bhs.opcode(), OP_NOP_OUT);
            assert!(f.bhs.immediate());
            assert_eq!(f.bhs.itt(), 7);
        }
    }

    #[test]
    fn additional_header_segments_are_skipped() {
        let mut h = nop_out(b"abcd");
        h[4] = 2; // 8 bytes of AHS
        let mut wire = h.to_vec();
        wire.extend_from_slice(&[9u8; 8]);
        wire.extend_from_slice(b"abcd");
        let f = frame(&wire, Digests::default(), 8192).unwrap().unwrap();
        assert_eq!(f.data_at, BHS_LEN + 8);
        assert_eq!(&wire[f.data_at..f.data_at + 4], b"abcd");
    }

    #[test]
    fn oversized_data_segments_and_bad_digests_are_errors() {
        // The length field alone decides, before any of the data arrived.
        let h = header(OP_SCSI_CMD, FLAG_FINAL, 0xff_ffff);
        assert_eq!(
            frame(&h, Digests::default(), 8192),
            Err(PduError::DataTooLong {
                len: 0xff_ffff,
                max: 8192
            })
        );
        let digests = Digests {
            header: true,
            data: true,
        };
        let mut wire = encode(&nop_out(b"data"), b"data", digests);
        wire[BHS_LEN] ^= 1;
        assert!(matches!(
            frame(&wire, digests, 8192),
            Err(PduError::HeaderDigest { .. })
        ));
        let mut wire = encode(&nop_out(b"data"), b"data", digests);
        let last = wire.len() - 1;
        wire[last] ^= 1;
        assert!(matches!(
            frame(&wire, digests, 8192),
            Err(PduError::DataDigest { .. })
        ));
        // A target opcode sent to the target.
        let h = header(OP_SCSI_RESP, FLAG_FINAL, 0);
        assert_eq!(
            frame(&h, Digests::default(), 8192),
            Err(PduError::UnknownOpcode(OP_SCSI_RESP))
        );
    }

    #[test]
    fn luns_encode_and_decode() {
        for lun in [0u16, 1, 255, 256, 0x3fff] {
            assert_eq!(lun_of(lun_field(lun)), Some(lun));
        }
        assert_eq!(lun_field(1), 0x0001_0000_0000_0000);
        assert_eq!(lun_of(0x0001_0000_0000_0001), None);
        assert_eq!(lun_of(0xc000_0000_0000_0000), None);
    }

    #[test]
    fn padding_rounds_up_to_words() {
        assert_eq!(
            [0, 1, 2, 3, 4, 5].map(padded),
            [0, 4, 4, 4, 4, 8],
            "pad to 4 bytes"
        );
        let (t, n) = data_trailer(b"abcde", Digests::default());
        assert_eq!((n, &t[..n]), (3, &[0u8, 0, 0][..]));
    }
}
