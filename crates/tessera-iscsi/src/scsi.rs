//! SCSI block commands (SPC-4 / SBC-3 as hosts and libiscsi's suite use them): CDB
//! decoding into [`Command`], the data of the commands answered without I/O (INQUIRY and
//! its VPD pages, READ CAPACITY, MODE SENSE, REPORT LUNS, REQUEST SENSE), and fixed
//! format sense data for everything that fails.
//!
//! Logical blocks are 512 bytes, the alignment the volumes enforce (as the NVMe/TCP
//! namespaces use), on 4 KiB physical blocks.

use tessera_io::cast::{u16_of, u32_of, u8_of};

use crate::pdu::{get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};

pub const BLOCK_SHIFT: u32 = 9;
pub const BLOCK_SIZE: u32 = 1 << BLOCK_SHIFT;
/// Largest READ/WRITE a command may ask for: 1 MiB (the Block Limits page says so).
pub const MAX_TRANSFER_BLOCKS: u32 = 2048;
/// Largest WRITE SAME (the Block Limits page's MAXIMUM WRITE SAME LENGTH): 16 MiB.
pub const MAX_WRITE_SAME_BLOCKS: u32 = 1 << 15;
/// WRITE SAME with non-zero data is written as writes of one replicated buffer of at
/// most this many blocks (1 MiB).
pub const WRITE_SAME_CHUNK_BLOCKS: u32 = 2048;
/// UNMAP limits (Block Limits page).
pub const MAX_UNMAP_BLOCKS: u32 = 1 << 20;
pub const MAX_UNMAP_DESCRIPTORS: u32 = 256;
/// Largest COMPARE AND WRITE (the Block Limits page's MAXIMUM COMPARE AND WRITE LENGTH,
/// its largest value): 255 blocks to compare and 255 to write.
pub const MAX_COMPARE_AND_WRITE_BLOCKS: u32 = 255;

/// PERSISTENT RESERVE IN service actions 0 (READ KEYS) to 3 (READ FULL STATUS), and
/// OUT 0 (REGISTER) to 7 (REGISTER AND MOVE): the range `decode` accepts (`pr` names
/// and serves them; decoding does not depend on it).
pub const PRIN_SERVICE_ACTIONS: u8 = 4;
pub const PROUT_SERVICE_ACTIONS: u8 = 8;

/// SCSI status codes.
pub const GOOD: u8 = 0x00;
pub const CHECK_CONDITION: u8 = 0x02;

/// Sense keys.
pub const NO_SENSE: u8 = 0x00;
pub const NOT_READY: u8 = 0x02;
pub const MEDIUM_ERROR: u8 = 0x03;
pub const HARDWARE_ERROR: u8 = 0x04;
pub const ILLEGAL_REQUEST: u8 = 0x05;
pub const UNIT_ATTENTION: u8 = 0x06;
pub const DATA_PROTECT: u8 = 0x07;
pub const MISCOMPARE: u8 = 0x0e;

/// Sense data: key and additional sense code/qualifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
    /// The INFORMATION field (VALID set): for a miscompare, the offset of the first
    /// byte that differed.
    pub info: Option<u32>,
    /// Sense-key specific field pointer (SKSV set, SPC-4 §4.5.2.4.2): the CDB byte and
    /// the bit of the field found invalid.
    pub field: Option<(u16, u8)>,
}

impl Sense {
    pub const INVALID_OPCODE: Sense = Sense::illegal(0x20, 0);
    pub const LBA_OUT_OF_RANGE: Sense = Sense::illegal(0x21, 0);
    pub const INVALID_FIELD_IN_CDB: Sense = Sense::illegal(0x24, 0);
    pub const LUN_NOT_SUPPORTED: Sense = Sense::illegal(0x25, 0);
    pub const INVALID_FIELD_IN_PARAMETER_LIST: Sense = Sense::illegal(0x26, 0);
    pub const PARAMETER_LIST_LENGTH_ERROR: Sense = Sense::illegal(0x1a, 0);
    pub const SAVING_NOT_SUPPORTED: Sense = Sense::illegal(0x39, 0);
    pub const WRITE_PROTECTED: Sense = Sense {
        key: DATA_PROTECT,
        asc: 0x27,
        ascq: 0,
        info: None,
        field: None,
    };
    /// Thin provisioning: the pool has no space left for the write.
    pub const SPACE_ALLOCATION_FAILED: Sense = Sense {
        key: DATA_PROTECT,
        asc: 0x27,
        ascq: 0x07,
        info: None,
        field: None,
    };
    pub const READ_ERROR: Sense = Sense {
        key: MEDIUM_ERROR,
        asc: 0x11,
        ascq: 0,
        info: None,
        field: None,
    };
    pub const WRITE_ERROR: Sense = Sense {
        key: MEDIUM_ERROR,
        asc: 0x0c,
        ascq: 0,
        info: None,
        field: None,
    };
    pub const INTERNAL_TARGET_FAILURE: Sense = Sense {
        key: HARDWARE_ERROR,
        asc: 0x44,
        ascq: 0,
        info: None,
        field: None,
    };

    const fn illegal(asc: u8, ascq: u8) -> Sense {
        Sense {
            key: ILLEGAL_REQUEST,
            asc,
            ascq,
            info: None,
            field: None,
        }
    }

    /// MISCOMPARE during verify operation (VERIFY, COMPARE AND WRITE): `offset` is the
    /// first byte of the Data-Out buffer that differed from the medium.
    pub const fn miscompare(offset: u32) -> Sense {
        Sense {
            key: MISCOMPARE,
            asc: 0x1d,
            ascq: 0,
            info: Some(offset),
            field: None,
        }
    }

    /// INVALID FIELD IN CDB, pointing at bit `bit` of CDB byte `byte` (the field's most
    /// significant bit). An initiator tells "this field" from "this command is not
    /// supported" by it (libiscsi does, for service-action commands).
    pub const fn invalid_cdb_field(byte: u16, bit: u8) -> Sense {
        Sense {
            key: ILLEGAL_REQUEST,
            asc: 0x24,
            ascq: 0,
            info: None,
            field: Some((byte, bit)),
        }
    }

    /// Fixed format sense data (response code 0x70, current error), 18 bytes.
    pub fn fixed(&self) -> [u8; 18] {
        let mut s = [0u8; 18];
        s[0] = 0x70;
        s[2] = self.key & 0x0f;
        if let Some(info) = self.info {
            s[0] |= 0x80; // VALID: the INFORMATION field means something
            put_u32(&mut s, 3, info);
        }
        s[7] = 10;
        s[12] = self.asc;
        s[13] = self.ascq;
        if let Some((byte, bit)) = self.field {
            // SKSV, C/D (a CDB field), BPV (the bit pointer is valid).
            s[15] = 0x80 | 0x40 | 0x08 | (bit & 0x07);
            put_u16(&mut s, 16, byte);
        }
        s
    }

    /// The sense for an I/O that failed with `-errno`.
    pub fn from_errno(errno: i32, write: bool) -> Sense {
        match errno {
            libc::EINVAL | libc::ERANGE => Sense::LBA_OUT_OF_RANGE,
            libc::EROFS => Sense::WRITE_PROTECTED,
            libc::ENOSPC => Sense::SPACE_ALLOCATION_FAILED,
            libc::EIO if write => Sense::WRITE_ERROR,
            libc::EIO => Sense::READ_ERROR,
            _ => Sense::INTERNAL_TARGET_FAILURE,
        }
    }
}

/// A decoded CDB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    TestUnitReady,
    Inquiry {
        evpd: bool,
        page: u8,
        alloc: u32,
    },
    ReadCapacity10,
    ReadCapacity16 {
        alloc: u32,
    },
    Read {
        lba: u64,
        blocks: u32,
        fua: bool,
    },
    Write {
        lba: u64,
        blocks: u32,
        fua: bool,
    },
    SynchronizeCache {
        lba: u64,
        blocks: u32,
    },
    ReportLuns {
        alloc: u32,
    },
    ModeSense(ModeSense),
    RequestSense {
        desc: bool,
        alloc: u32,
    },
    Unmap {
        param_len: u32,
    },
    /// WRITE SAME(10) or (16). `ndob`: no data-out buffer, the blocks are zeroed
    /// (unmapped with `unmap`).
    WriteSame16 {
        lba: u64,
        blocks: u32,
        unmap: bool,
        ndob: bool,
    },
    /// RESERVE(6): an SPC-2 reservation of the whole unit for this I_T nexus.
    Reserve6,
    /// RELEASE(6): the SPC-2 reservation this I_T nexus holds, if any, ends.
    Release6,
    /// START STOP UNIT and PREVENT ALLOW MEDIUM REMOVAL: a volume has no medium to
    /// spin or eject, so both succeed without doing anything.
    NoOp,
    /// PRE-FETCH(10/16): the range is checked; there is no cache to load it into.
    Prefetch {
        lba: u64,
        blocks: u32,
    },
    /// MODE SELECT(6/10) with its parameter list length.
    ModeSelect {
        ten: bool,
        param_len: u32,
    },
    /// REPORT SUPPORTED OPERATION CODES.
    ReportOpcodes(OpcodeQuery),
    /// REPORT TARGET PORT GROUPS (MAINTENANCE IN, service action 0Ah): `extended`
    /// asks for the extended header (PARAMETER DATA FORMAT 001b).
    ReportTargetPortGroups {
        extended: bool,
        alloc: u32,
    },
    /// VERIFY(10/12/16). `bytchk`: 0 the medium only (nothing to compare), 1 every
    /// block against the Data-Out buffer, 3 one Data-Out block against every block.
    Verify {
        lba: u64,
        blocks: u32,
        bytchk: u8,
    },
    /// COMPARE AND WRITE: the Data-Out buffer is `blocks` to compare, then `blocks` to
    /// write where they matched.
    CompareAndWrite {
        lba: u64,
        blocks: u32,
        fua: bool,
    },
    /// ORWRITE(16): the blocks become what they held OR the Data-Out buffer.
    OrWrite {
        lba: u64,
        blocks: u32,
        fua: bool,
    },
    /// GET LBA STATUS from `lba`.
    GetLbaStatus {
        lba: u64,
        alloc: u32,
    },
    /// READ DEFECT DATA(10/12): a volume has no defect lists; the header says so.
    ReadDefectData {
        twelve: bool,
        /// Byte 2 of the CDB (REQ_PLIST, REQ_GLIST, the list format), echoed back.
        format: u8,
        alloc: u32,
    },
    /// PERSISTENT RESERVE IN with service action `sa` (0..=3; others are refused).
    PersistentReserveIn {
        sa: u8,
        alloc: u32,
    },
    /// PERSISTENT RESERVE OUT: service action, scope and type from the CDB, and the
    /// parameter list's length.
    PersistentReserveOut {
        sa: u8,
        scope: u8,
        ptype: u8,
        param_len: u32,
    },
}

/// REPORT SUPPORTED OPERATION CODES' fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpcodeQuery {
    /// 0: every command; 1: `opcode` (without service action); 2: `opcode` with
    /// service action `sa`; 3: either.
    pub options: u8,
    pub opcode: u8,
    pub sa: u16,
    /// Return command timeouts descriptors.
    pub rctd: bool,
    pub alloc: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModeSense {
    pub ten: bool,
    /// Disable block descriptors.
    pub dbd: bool,
    /// Page control: 0 current, 1 changeable, 2 default, 3 saved.
    pub pc: u8,
    pub page: u8,
    pub subpage: u8,
    pub alloc: u32,
}

impl Command {
    /// Bytes of the medium a comparing command reads to compare its data with.
    pub fn read_back_len(&self) -> u64 {
        match *self {
            Command::Verify { blocks, bytchk, .. } if bytchk != 0 => {
                u64::from(blocks) << BLOCK_SHIFT
            }
            Command::CompareAndWrite { blocks, .. } | Command::OrWrite { blocks, .. } => {
                u64::from(blocks) << BLOCK_SHIFT
            }
            _ => 0,
        }
    }

    /// Bytes the initiator sends with the command (Data-Out) for the unit's block size.
    pub fn data_out_len(&self) -> u64 {
        match *self {
            Command::Write { blocks, .. } => u64::from(blocks) << BLOCK_SHIFT,
            Command::Unmap { param_len } => u64::from(param_len),
            Command::WriteSame16 { ndob: false, .. } => u64::from(BLOCK_SIZE),
            Command::ModeSelect { param_len, .. } => u64::from(param_len),
            Command::Verify {
                blocks, bytchk: 1, ..
            } => u64::from(blocks) << BLOCK_SHIFT,
            Command::Verify {
                blocks, bytchk: 3, ..
            } if blocks > 0 => u64::from(BLOCK_SIZE),
            Command::CompareAndWrite { blocks, .. } => u64::from(blocks) << (BLOCK_SHIFT + 1),
            Command::OrWrite { blocks, .. } => u64::from(blocks) << BLOCK_SHIFT,
            Command::PersistentReserveOut { param_len, .. } => u64::from(param_len),
            _ => 0,
        }
    }
}

/// Decode a CDB (16 bytes as the SCSI Command PDU carries it; shorter CDBs are padded).
pub fn decode(cdb: &[u8]) -> Result<Command, Sense> {
    let op = cdb[0];
    let fua = cdb[1] & 0x08 != 0;
    // Protection information: volumes have none, so a non-zero RDPROTECT/WRPROTECT is
    // an invalid field (SBC-3 §5.x, "not formatted with protection information").
    let protect = cdb[1] >> 5;
    let io = |lba: u64, blocks: u32, write: bool| -> Result<Command, Sense> {
        if protect != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB);
        }
        if blocks > MAX_TRANSFER_BLOCKS {
            return Err(Sense::INVALID_FIELD_IN_CDB);
        }
        Ok(if write {
            Command::Write { lba, blocks, fua }
        } else {
            Command::Read { lba, blocks, fua }
        })
    };
    match op {
        0x00 => Ok(Command::TestUnitReady),
        // RESERVE(6) / RELEASE(6): the obsolete third-party and extent forms (byte 1)
        // are not served.
        0x16 | 0x17 if cdb[1] & 0x1f != 0 => Err(Sense::INVALID_FIELD_IN_CDB),
        0x16 => Ok(Command::Reserve6),
        0x17 => Ok(Command::Release6),
        0x03 => Ok(Command::RequestSense {
            desc: cdb[1] & 1 != 0,
            alloc: u32::from(cdb[4]),
        }),
        0x12 => {
            let evpd = cdb[1] & 1 != 0;
            if !evpd && cdb[2] != 0 {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::Inquiry {
                evpd,
                page: cdb[2],
                alloc: u32::from(get_u16(cdb, 3)),
            })
        }
        0x25 => Ok(Command::ReadCapacity10),
        0x9e if cdb[1] & 0x1f == 0x10 => Ok(Command::ReadCapacity16 {
            alloc: get_u32(cdb, 10),
        }),
        0x9e if cdb[1] & 0x1f == 0x12 => Ok(Command::GetLbaStatus {
            lba: get_u64(cdb, 2),
            alloc: get_u32(cdb, 10),
        }),
        0x9e => Err(Sense::INVALID_FIELD_IN_CDB),
        // READ(6)/WRITE(6): 21-bit LBA, 0 blocks means 256; no FUA, no protection.
        0x08 | 0x0a => {
            let lba = (u64::from(cdb[1] & 0x1f) << 16) | u64::from(get_u16(cdb, 2));
            let blocks = if cdb[4] == 0 { 256 } else { u32::from(cdb[4]) };
            let write = op == 0x0a;
            Ok(if write {
                Command::Write {
                    lba,
                    blocks,
                    fua: false,
                }
            } else {
                Command::Read {
                    lba,
                    blocks,
                    fua: false,
                }
            })
        }
        0x28 | 0x2a => io(
            u64::from(get_u32(cdb, 2)),
            u32::from(get_u16(cdb, 7)),
            op == 0x2a,
        ),
        0xa8 | 0xaa => io(u64::from(get_u32(cdb, 2)), get_u32(cdb, 6), op == 0xaa),
        0x88 | 0x8a => io(get_u64(cdb, 2), get_u32(cdb, 10), op == 0x8a),
        // WRITE AND VERIFY(10/12/16): the data written is what the volume returns (the
        // medium has no separate verify step), so this is a write, durable before the
        // status as FUA makes it. BYTCHK asks the target to compare the data it just
        // wrote with itself: nothing more to check.
        0x2e | 0xae | 0x8e => {
            let (lba, blocks) = match op {
                0x2e => (u64::from(get_u32(cdb, 2)), u32::from(get_u16(cdb, 7))),
                0xae => (u64::from(get_u32(cdb, 2)), get_u32(cdb, 6)),
                _ => (get_u64(cdb, 2), get_u32(cdb, 10)),
            };
            if cdb[1] & 0x06 == 0x04 {
                return Err(Sense::INVALID_FIELD_IN_CDB); // BYTCHK 10b is reserved
            }
            match io(lba, blocks, true)? {
                Command::Write { lba, blocks, .. } => Ok(Command::Write {
                    lba,
                    blocks,
                    fua: true,
                }),
                c => Ok(c),
            }
        }
        0x2f | 0xaf | 0x8f => {
            let (lba, blocks) = match op {
                0x2f => (u64::from(get_u32(cdb, 2)), u32::from(get_u16(cdb, 7))),
                0xaf => (u64::from(get_u32(cdb, 2)), get_u32(cdb, 6)),
                _ => (get_u64(cdb, 2), get_u32(cdb, 10)),
            };
            let bytchk = (cdb[1] >> 1) & 3;
            // VRPROTECT needs protection information; BYTCHK 10b is reserved; a
            // compared range is read in one go, within the transfer limit.
            if protect != 0 || bytchk == 2 || (bytchk != 0 && blocks > MAX_TRANSFER_BLOCKS) {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::Verify {
                lba,
                blocks,
                bytchk,
            })
        }
        0x89 => {
            let blocks = u32::from(cdb[13]);
            if protect != 0 || blocks > MAX_COMPARE_AND_WRITE_BLOCKS {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::CompareAndWrite {
                lba: get_u64(cdb, 2),
                blocks,
                fua,
            })
        }
        0x8b => {
            let blocks = get_u32(cdb, 10);
            if protect != 0 || blocks > MAX_TRANSFER_BLOCKS {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::OrWrite {
                lba: get_u64(cdb, 2),
                blocks,
                fua,
            })
        }
        0x34 => Ok(Command::Prefetch {
            lba: u64::from(get_u32(cdb, 2)),
            blocks: u32::from(get_u16(cdb, 7)),
        }),
        0x90 => Ok(Command::Prefetch {
            lba: get_u64(cdb, 2),
            blocks: get_u32(cdb, 10),
        }),
        0x1b | 0x1e => Ok(Command::NoOp),
        0x5e => {
            let sa = cdb[1] & 0x1f;
            if sa >= PRIN_SERVICE_ACTIONS {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::PersistentReserveIn {
                sa,
                alloc: u32::from(get_u16(cdb, 7)),
            })
        }
        0x5f => {
            let sa = cdb[1] & 0x1f;
            if sa >= PROUT_SERVICE_ACTIONS {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::PersistentReserveOut {
                sa,
                scope: cdb[2] >> 4,
                ptype: cdb[2] & 0x0f,
                param_len: get_u32(cdb, 5),
            })
        }
        0x15 | 0x55 => {
            // SP: saving pages is not supported (there are no saved pages).
            if cdb[1] & 0x01 != 0 {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            let ten = op == 0x55;
            Ok(Command::ModeSelect {
                ten,
                param_len: if ten {
                    u32::from(get_u16(cdb, 7))
                } else {
                    u32::from(cdb[4])
                },
            })
        }
        0xa3 if cdb[1] & 0x1f == 0x0c => {
            let options = cdb[2] & 0x07;
            if options > 3 {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::ReportOpcodes(OpcodeQuery {
                options,
                opcode: cdb[3],
                sa: get_u16(cdb, 4),
                rctd: cdb[2] & 0x80 != 0,
                alloc: get_u32(cdb, 6),
            }))
        }
        0xa3 if cdb[1] & 0x1f == 0x0a => {
            let format = cdb[1] >> 5;
            if format > 1 {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::ReportTargetPortGroups {
                extended: format == 1,
                alloc: get_u32(cdb, 6),
            })
        }
        0xa3 => Err(Sense::INVALID_FIELD_IN_CDB),
        0x37 => Ok(Command::ReadDefectData {
            twelve: false,
            format: cdb[2] & 0x1f,
            alloc: u32::from(get_u16(cdb, 7)),
        }),
        0xb7 => Ok(Command::ReadDefectData {
            twelve: true,
            format: cdb[1] & 0x1f,
            alloc: get_u32(cdb, 6),
        }),
        0x41 => {
            // WRITE SAME(10): as (16), with a 32-bit LBA and a 16-bit count, no NDOB.
            if cdb[1] & 0x10 != 0 || protect != 0 {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            let blocks = u32::from(get_u16(cdb, 7));
            if blocks == 0 {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::WriteSame16 {
                lba: u64::from(get_u32(cdb, 2)),
                blocks,
                unmap: cdb[1] & 0x08 != 0,
                ndob: false,
            })
        }
        0x35 => Ok(Command::SynchronizeCache {
            lba: u64::from(get_u32(cdb, 2)),
            blocks: u32::from(get_u16(cdb, 7)),
        }),
        0x91 => Ok(Command::SynchronizeCache {
            lba: get_u64(cdb, 2),
            blocks: get_u32(cdb, 10),
        }),
        0xa0 => {
            let alloc = get_u32(cdb, 6);
            // SPC-4: an allocation length under 16 is an invalid field; select reports
            // 0, 1 and 2 are the ones defined for a target without well-known LUNs.
            if alloc < 16 || cdb[2] > 2 {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::ReportLuns { alloc })
        }
        0x1a | 0x5a => {
            let ten = op == 0x5a;
            Ok(Command::ModeSense(ModeSense {
                ten,
                dbd: cdb[1] & 0x08 != 0,
                pc: cdb[2] >> 6,
                page: cdb[2] & 0x3f,
                subpage: cdb[3],
                alloc: if ten {
                    u32::from(get_u16(cdb, 7))
                } else {
                    u32::from(cdb[4])
                },
            }))
        }
        0x42 => {
            if cdb[1] & 1 != 0 {
                // ANCHOR: anchored blocks are not supported (ANC_SUP is 0).
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::Unmap {
                param_len: u32::from(get_u16(cdb, 7)),
            })
        }
        0x93 => {
            let unmap = cdb[1] & 0x08 != 0;
            // ANCHOR and protection are not supported.
            if cdb[1] & 0x10 != 0 || protect != 0 {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            let blocks = get_u32(cdb, 10);
            // WSNZ is set: 0 blocks ("to the end") is refused, as is more than the
            // Block Limits page allows.
            if blocks == 0 || blocks > MAX_WRITE_SAME_BLOCKS {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            Ok(Command::WriteSame16 {
                lba: get_u64(cdb, 2),
                blocks,
                unmap,
                ndob: cdb[1] & 0x01 != 0,
            })
        }
        _ => Err(Sense::INVALID_OPCODE),
    }
}

/// `[lba, lba+blocks)` lies within a unit of `capacity` blocks.
pub fn in_range(lba: u64, blocks: u64, capacity: u64) -> bool {
    lba.checked_add(blocks).is_some_and(|end| end <= capacity)
}

/// What the commands answered from data describe of one logical unit.
#[derive(Clone, Debug)]
pub struct Unit {
    /// Capacity in logical blocks.
    pub blocks: u64,
    pub read_only: bool,
    /// VPD 0x80 (ASCII, at most 32 bytes used).
    pub serial: String,
    /// A 64-bit value unique to the unit (target name and LUN), for the NAA designator.
    pub id: u64,
    /// ALUA ([`crate::alua`]): this port's relative target port identifier and target
    /// port group. With it, INQUIRY reports implicit ALUA (TPGS 01b) and the Device
    /// Identification page designates the port and its group.
    pub port: Option<(u16, u16)>,
}

impl Command {
    /// Whether the command may run on a port in the standby state (SPC-4 §5.16.2.4.5,
    /// as implemented: INQUIRY, REPORT LUNS, REPORT SUPPORTED OPERATION CODES, REPORT
    /// TARGET PORT GROUPS, REQUEST SENSE, MODE SENSE/SELECT, and READ CAPACITY, which
    /// hosts read on every path). Every other command (media access, TEST UNIT READY
    /// included) is refused there; so are PERSISTENT RESERVE IN/OUT, which SPC-4 lets
    /// a standby port serve, because the unit's reservation state lives with its owner
    /// (the active port) and follows the volume from there.
    pub fn allowed_in_standby(&self) -> bool {
        matches!(
            self,
            Command::Inquiry { .. }
                | Command::ReportLuns { .. }
                | Command::ReportOpcodes(_)
                | Command::ReportTargetPortGroups { .. }
                | Command::RequestSense { .. }
                | Command::ModeSense(_)
                | Command::ModeSelect { .. }
                | Command::ReadCapacity10
                | Command::ReadCapacity16 { .. }
        )
    }
}

const VENDOR: &[u8; 8] = b"TESSERA ";
const PRODUCT: &[u8; 16] = b"VOLUME          ";
const REVISION: &[u8; 4] = b"0001";

/// INQUIRY data: standard, or the VPD page `page`.
pub fn inquiry(u: &Unit, evpd: bool, page: u8) -> Result<Vec<u8>, Sense> {
    if !evpd {
        let mut d = vec![0u8; 96];
        d[2] = 0x06; // SPC-4
        d[3] = 0x12; // HISUP, response data format 2
        d[4] = 96 - 5;
        if u.port.is_some() {
            d[5] = 0x10; // TPGS 01b: implicit ALUA
        }
        d[7] = 0x02; // CMDQUE
        d[8..16].copy_from_slice(VENDOR);
        d[16..32].copy_from_slice(PRODUCT);
        d[32..36].copy_from_slice(REVISION);
        // Version descriptors: SAM-5, iSCSI (RFC 7143), SPC-4, SBC-3.
        for (i, v) in [0x00a0u16, 0x0960, 0x0460, 0x04c0].iter().enumerate() {
            put_u16(&mut d, 58 + 2 * i, *v);
        }
        return Ok(d);
    }
    let body: Vec<u8> = match page {
        0x00 => vec![0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2],
        0x80 => {
            let s = u.serial.as_bytes();
            s[..s.len().min(32)].to_vec()
        }
        0x83 => {
            let mut v = Vec::new();
            // NAA IEEE Registered (5), binary: a locally administered OUI-less form
            // from the unit's id.
            v.extend_from_slice(&[0x01, 0x03, 0x00, 0x08]);
            let naa = (0x5u64 << 60) | (u.id & 0x0fff_ffff_ffff_ffff);
            v.extend_from_slice(&naa.to_be_bytes());
            // T10 vendor ID, ASCII: vendor then the serial.
            let s = u.serial.as_bytes();
            let s = &s[..s.len().min(32)];
            v.extend_from_slice(&[0x02, 0x01, 0x00, u8_of(8 + s.len())]);
            v.extend_from_slice(VENDOR);
            v.extend_from_slice(s);
            if let Some((rel_port, group)) = u.port {
                // iSCSI (protocol identifier 5), binary, PIV, associated with the
                // target port: relative target port (type 4), target port group
                // (type 5).
                for (kind, value) in [(0x04u8, rel_port), (0x05, group)] {
                    v.extend_from_slice(&[0x51, 0x80 | 0x10 | kind, 0x00, 0x04, 0, 0]);
                    v.extend_from_slice(&value.to_be_bytes());
                }
            }
            v
        }
        0xb0 => {
            let mut b = vec![0u8; 0x3c];
            // Offsets below are of the whole page; the body starts at byte 4.
            let mut p = vec![0u8; 0x40];
            p[4] = 0x01; // WSNZ: WRITE SAME of 0 blocks ("to the end") is refused
            p[5] = u8_of(MAX_COMPARE_AND_WRITE_BLOCKS);
            put_u16(&mut p, 6, 8); // optimal transfer length granularity: 4 KiB
            put_u32(&mut p, 8, MAX_TRANSFER_BLOCKS);
            put_u32(&mut p, 12, MAX_TRANSFER_BLOCKS);
            put_u32(&mut p, 20, MAX_UNMAP_BLOCKS);
            put_u32(&mut p, 24, MAX_UNMAP_DESCRIPTORS);
            put_u32(&mut p, 28, 8); // optimal unmap granularity: 4 KiB
            put_u64(&mut p, 36, u64::from(MAX_WRITE_SAME_BLOCKS));
            b.copy_from_slice(&p[4..]);
            b
        }
        0xb1 => {
            let mut b = vec![0u8; 0x3c];
            put_u16(&mut b, 0, 1); // non-rotating medium
            b
        }
        0xb2 => {
            // LBPU (UNMAP), LBPWS and LBPWS10 (WRITE SAME(16) and (10) with UNMAP),
            // LBPRZ (unmapped blocks read zeros); provisioning type 2: thin.
            vec![0x00, 0x80 | 0x40 | 0x20 | 0x04, 0x02, 0x00]
        }
        _ => return Err(Sense::INVALID_FIELD_IN_CDB),
    };
    let mut d = vec![0x00, page, 0, 0];
    put_u16(&mut d, 2, u16_of(body.len()));
    d.extend_from_slice(&body);
    Ok(d)
}

pub fn read_capacity10(u: &Unit) -> Vec<u8> {
    let mut d = vec![0u8; 8];
    let last = u.blocks.saturating_sub(1);
    put_u32(&mut d, 0, u32::try_from(last).unwrap_or(u32::MAX));
    put_u32(&mut d, 4, BLOCK_SIZE);
    d
}

pub fn read_capacity16(u: &Unit) -> Vec<u8> {
    let mut d = vec![0u8; 32];
    put_u64(&mut d, 0, u.blocks.saturating_sub(1));
    put_u32(&mut d, 8, BLOCK_SIZE);
    d[13] = 3; // 8 logical blocks per 4 KiB physical block
    d[14] = 0x80 | 0x40; // LBPME, LBPRZ
    d
}

pub fn report_luns(luns: &[u16]) -> Vec<u8> {
    let mut d = vec![0u8; 8 + 8 * luns.len()];
    put_u32(&mut d, 0, u32_of(8 * luns.len()));
    for (i, &l) in luns.iter().enumerate() {
        put_u64(&mut d, 8 + 8 * i, crate::pdu::lun_field(l));
    }
    d
}

pub fn request_sense(desc: bool) -> Vec<u8> {
    if desc {
        vec![0x72, NO_SENSE, 0, 0, 0, 0, 0, 0]
    } else {
        Sense {
            key: NO_SENSE,
            asc: 0,
            ascq: 0,
            info: None,
            field: None,
        }
        .fixed()
        .to_vec()
    }
}

/// Mode pages this unit has: caching (0x08) and control (0x0a).
fn mode_page(page: u8, pc: u8) -> Vec<u8> {
    let changeable = pc == 1;
    match page {
        0x08 => {
            let mut p = vec![0u8; 20];
            p[0] = 0x08;
            p[1] = 0x12;
            if !changeable {
                // WCE: writes may sit in a volatile cache until SYNCHRONIZE CACHE or FUA.
                p[2] = 0x04;
            }
            p
        }
        _ => {
            let mut p = vec![0u8; 12];
            p[0] = 0x0a;
            p[1] = 0x0a;
            if !changeable {
                p[3] = 0x10; // queue algorithm modifier 1: unrestricted reordering
                put_u16(&mut p, 8, 0xffff); // busy timeout period: unlimited
            }
            p
        }
    }
}

pub fn mode_sense(u: &Unit, m: &ModeSense) -> Result<Vec<u8>, Sense> {
    if m.pc == 3 {
        return Err(Sense::SAVING_NOT_SUPPORTED);
    }
    if m.subpage != 0 && !(m.subpage == 0xff && m.page == 0x3f) {
        return Err(Sense::INVALID_FIELD_IN_CDB);
    }
    let pages: Vec<u8> = match m.page {
        0x08 => mode_page(0x08, m.pc),
        0x0a => mode_page(0x0a, m.pc),
        0x3f => [mode_page(0x08, m.pc), mode_page(0x0a, m.pc)].concat(),
        _ => return Err(Sense::INVALID_FIELD_IN_CDB),
    };
    // Device-specific parameter: WP when read-only, DPOFUA (FUA is honoured).
    let dsp = if u.read_only { 0x80 } else { 0 } | 0x10;
    let mut bd = Vec::new();
    if !m.dbd {
        bd = vec![0u8; 8];
        put_u32(&mut bd, 0, u32::try_from(u.blocks).unwrap_or(u32::MAX));
        put_u32(&mut bd, 4, BLOCK_SIZE);
    }
    let mut d = if m.ten {
        let mut h = vec![0u8; 8];
        h[3] = dsp;
        put_u16(&mut h, 6, u16_of(bd.len()));
        h
    } else {
        vec![0, 0, dsp, u8_of(bd.len())]
    };
    d.extend_from_slice(&bd);
    d.extend_from_slice(&pages);
    if m.ten {
        let n = u16_of(d.len() - 2);
        put_u16(&mut d, 0, n);
    } else {
        d[0] = u8_of(d.len() - 1);
    }
    Ok(d)
}

/// The (LBA, blocks) descriptors of an UNMAP parameter list, checked against the
/// unit's capacity and the advertised limits.
pub fn unmap_descriptors(list: &[u8], capacity: u64) -> Result<Vec<(u64, u32)>, Sense> {
    if list.is_empty() {
        return Ok(Vec::new());
    }
    if list.len() < 8 {
        return Err(Sense::PARAMETER_LIST_LENGTH_ERROR);
    }
    let desc_len = usize::from(get_u16(list, 2));
    let avail = (list.len() - 8).min(desc_len);
    let n = avail / 16;
    if u32::try_from(n).map_or(true, |n| n > MAX_UNMAP_DESCRIPTORS) {
        return Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let at = 8 + 16 * i;
        let lba = get_u64(list, at);
        let blocks = get_u32(list, at + 8);
        if blocks > MAX_UNMAP_BLOCKS {
            return Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
        }
        if !in_range(lba, u64::from(blocks), capacity) {
            return Err(Sense::LBA_OUT_OF_RANGE);
        }
        if blocks > 0 {
            out.push((lba, blocks));
        }
    }
    Ok(out)
}

/// MODE SELECT's parameter list: the header, at most one block descriptor, pages. No
/// mode parameter is changeable (MODE SENSE's changeable values are all zero), so a
/// page is accepted when it repeats the current values (an initiator writing back what
/// it read, write cache enabled as it is), and any change is refused.
pub fn mode_select(ten: bool, list: &[u8]) -> Result<(), Sense> {
    let header = if ten { 8 } else { 4 };
    if list.is_empty() {
        return Ok(());
    }
    if list.len() < header {
        return Err(Sense::PARAMETER_LIST_LENGTH_ERROR);
    }
    let bd_len = if ten {
        usize::from(get_u16(list, 6))
    } else {
        usize::from(list[3])
    };
    let mut at = header + bd_len;
    if at > list.len() {
        return Err(Sense::PARAMETER_LIST_LENGTH_ERROR);
    }
    match bd_len {
        0 => {}
        // The block length cannot change; the block count is ignored (SBC-3 lets a
        // unit keep its capacity).
        8 if get_u32(list, header + 4) & 0x00ff_ffff == BLOCK_SIZE => {}
        _ => return Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST),
    }
    while at < list.len() {
        if at + 2 > list.len() {
            return Err(Sense::PARAMETER_LIST_LENGTH_ERROR);
        }
        // Subpage format (SPF) pages: none exist here.
        if list[at] & 0x40 != 0 {
            return Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
        }
        let page = list[at] & 0x3f;
        let len = usize::from(list[at + 1]) + 2;
        if at + len > list.len() {
            return Err(Sense::PARAMETER_LIST_LENGTH_ERROR);
        }
        let current = match page {
            0x08 | 0x0a => mode_page(page, 0),
            _ => return Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST),
        };
        if list[at + 1..at + len] != current[1..] {
            return Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
        }
        at += len;
    }
    Ok(())
}

/// The commands this target serves: opcode, service action (for opcodes that have
/// them) and the CDB usage data (the bits the target looks at; byte 0 the opcode).
const SUPPORTED: &[(u8, Option<u16>, &[u8])] = &[
    (0x00, None, &[0x00, 0, 0, 0, 0, 0]),
    (0x03, None, &[0x03, 0x01, 0, 0, 0xff, 0]),
    (0x08, None, &[0x08, 0x1f, 0xff, 0xff, 0xff, 0]),
    (0x0a, None, &[0x0a, 0x1f, 0xff, 0xff, 0xff, 0]),
    (0x12, None, &[0x12, 0x01, 0xff, 0xff, 0xff, 0]),
    (0x15, None, &[0x15, 0x11, 0, 0, 0xff, 0]),
    (0x16, None, &[0x16, 0, 0, 0, 0, 0]),
    (0x17, None, &[0x17, 0, 0, 0, 0, 0]),
    (0x1a, None, &[0x1a, 0x08, 0xff, 0xff, 0xff, 0]),
    (0x1b, None, &[0x1b, 0x01, 0, 0x0f, 0xf7, 0]),
    (0x1e, None, &[0x1e, 0, 0, 0, 0x03, 0]),
    (0x25, None, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
    (
        0x28,
        None,
        &[0x28, 0x18, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0],
    ),
    (
        0x2a,
        None,
        &[0x2a, 0x18, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0],
    ),
    (
        0x2e,
        None,
        &[0x2e, 0x16, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0],
    ),
    (
        0x2f,
        None,
        &[0x2f, 0x16, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0],
    ),
    (
        0x34,
        None,
        &[0x34, 0x02, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0],
    ),
    (
        0x35,
        None,
        &[0x35, 0x06, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0],
    ),
    (0x37, None, &[0x37, 0, 0x1f, 0, 0, 0, 0, 0xff, 0xff, 0]),
    (
        0x41,
        None,
        &[0x41, 0x08, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0],
    ),
    (0x42, None, &[0x42, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    (0x55, None, &[0x55, 0x10, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    (
        0x5a,
        None,
        &[0x5a, 0x08, 0xff, 0xff, 0, 0, 0, 0xff, 0xff, 0],
    ),
    // PERSISTENT RESERVE IN (READ KEYS .. READ FULL STATUS) and OUT (REGISTER ..
    // REGISTER AND MOVE).
    (0x5e, Some(0), &[0x5e, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    (0x5e, Some(1), &[0x5e, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    (0x5e, Some(2), &[0x5e, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    (0x5e, Some(3), &[0x5e, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    (
        0x5f,
        Some(0),
        &[0x5f, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    (
        0x5f,
        Some(1),
        &[0x5f, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    (
        0x5f,
        Some(2),
        &[0x5f, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    (
        0x5f,
        Some(3),
        &[0x5f, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    (
        0x5f,
        Some(4),
        &[0x5f, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    (
        0x5f,
        Some(5),
        &[0x5f, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    (
        0x5f,
        Some(6),
        &[0x5f, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    (
        0x5f,
        Some(7),
        &[0x5f, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    (
        0x88,
        None,
        &[
            0x88, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
            0,
        ],
    ),
    (
        0x89,
        None,
        &[
            0x89, 0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0xff, 0, 0,
        ],
    ),
    (
        0x8a,
        None,
        &[
            0x8a, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
            0,
        ],
    ),
    (
        0x8b,
        None,
        &[
            0x8b, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
            0,
        ],
    ),
    (
        0x8e,
        None,
        &[
            0x8e, 0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
            0,
        ],
    ),
    (
        0x8f,
        None,
        &[
            0x8f, 0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
            0,
        ],
    ),
    (
        0x90,
        None,
        &[
            0x90, 0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
            0,
        ],
    ),
    (
        0x91,
        None,
        &[
            0x91, 0x06, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
            0,
        ],
    ),
    (
        0x93,
        None,
        &[
            0x93, 0x09, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
            0,
        ],
    ),
    (
        0x9e,
        Some(0x10),
        &[
            0x9e, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    (
        0x9e,
        Some(0x12),
        &[
            0x9e, 0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
            0,
        ],
    ),
    (
        0xa0,
        None,
        &[0xa0, 0, 0xff, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0],
    ),
    // REPORT TARGET PORT GROUPS: listed for ALUA targets only (see `report_opcodes`).
    (
        0xa3,
        Some(0x0a),
        &[0xa3, 0xea, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0],
    ),
    (
        0xa3,
        Some(0x0c),
        &[
            0xa3, 0x0c, 0x87, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    (
        0xa8,
        None,
        &[
            0xa8, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    (
        0xaa,
        None,
        &[
            0xaa, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    (
        0xae,
        None,
        &[
            0xae, 0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    (
        0xaf,
        None,
        &[
            0xaf, 0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    (
        0xb7,
        None,
        &[0xb7, 0x1f, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0],
    ),
];

/// The command timeouts descriptor: no nominal or recommended timeout is known (0).
const TIMEOUTS: [u8; 12] = [0, 0x0a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

/// REPORT SUPPORTED OPERATION CODES' data.
pub fn report_opcodes(q: &OpcodeQuery, alua: bool) -> Result<Vec<u8>, Sense> {
    // REPORT TARGET PORT GROUPS is served by ALUA targets only.
    let supported: Vec<(u8, Option<u16>, &[u8])> = SUPPORTED
        .iter()
        .copied()
        .filter(|&(op, sa, _)| alua || (op, sa) != (0xa3, Some(0x0a)))
        .collect();
    if q.options == 0 {
        let mut d = vec![0u8; 4];
        for &(op, sa, usage) in &supported {
            let mut e = [0u8; 8];
            e[0] = op;
            put_u16(&mut e, 2, sa.unwrap_or(0));
            // CTDP (timeouts follow) and SERVACTV (the service action field is valid).
            e[5] = (u8::from(q.rctd) << 1) | u8::from(sa.is_some());
            put_u16(&mut e, 6, u16_of(usage.len()));
            d.extend_from_slice(&e);
            if q.rctd {
                d.extend_from_slice(&TIMEOUTS);
            }
        }
        let n = u32_of(d.len() - 4);
        put_u32(&mut d, 0, n);
        return Ok(d);
    }
    let has_sa = supported
        .iter()
        .any(|&(op, sa, _)| op == q.opcode && sa.is_some());
    // Options 1 names an opcode without service actions, 2 one with them (SPC-4
    // 6.35.2: the other way round is an invalid field); 3 takes either.
    match (q.options, has_sa) {
        (1, true) | (2, false) if supported.iter().any(|&(op, ..)| op == q.opcode) => {
            // The REPORTING OPTIONS field (byte 2, bits 2..0) is what is wrong, not the
            // command: say so, or the initiator reads "not supported".
            return Err(Sense::invalid_cdb_field(2, 2));
        }
        _ => {}
    }
    let found = supported.iter().find(|&&(op, sa, _)| {
        op == q.opcode
            && match q.options {
                1 => sa.is_none(),
                2 => sa == Some(q.sa),
                _ => sa.is_none() || sa == Some(q.sa),
            }
    });
    let mut d = vec![0u8; 4];
    match found {
        Some(&(_, _, usage)) => {
            d[1] = (u8::from(q.rctd) << 7) | 3; // supported, as the standard says
            put_u16(&mut d, 2, u16_of(usage.len()));
            d.extend_from_slice(usage);
            if q.rctd {
                d.extend_from_slice(&TIMEOUTS);
            }
        }
        None => d[1] = 1, // not supported
    }
    Ok(d)
}

/// GET LBA STATUS's data from `runs` ((bytes, allocated) from `lba` on, as the export
/// reports its allocation): one descriptor per run, as many as `alloc` has room for.
pub fn lba_status(lba: u64, runs: &[(u64, bool)], alloc: u32) -> Vec<u8> {
    let room = usize_of_u32(alloc.saturating_sub(8)) / 16;
    let mut d = vec![0u8; 8];
    let mut at = lba;
    for &(len, allocated) in runs.iter().take(room.max(1)) {
        let blocks = len >> BLOCK_SHIFT;
        if blocks == 0 {
            continue;
        }
        let mut e = [0u8; 16];
        put_u64(&mut e, 0, at);
        put_u32(&mut e, 8, u32::try_from(blocks).unwrap_or(u32::MAX));
        // Provisioning status: 0 mapped, 1 deallocated (reads zeros, LBPRZ).
        e[12] = u8::from(!allocated);
        d.extend_from_slice(&e);
        at += blocks;
    }
    let n = u32_of(d.len() - 4);
    put_u32(&mut d, 0, n);
    d
}

fn usize_of_u32(v: u32) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// READ DEFECT DATA(10/12): the header of empty lists in the format asked for.
pub fn read_defect_data(twelve: bool, format: u8) -> Vec<u8> {
    // Byte 1 echoes PLISTV/GLISTV (the lists asked for are valid, and empty) and the
    // list format.
    let flags = format & 0x1f;
    if twelve {
        vec![0, flags, 0, 0, 0, 0, 0, 0]
    } else {
        vec![0, flags, 0, 0]
    }
}

/// The offset of the first byte where `data` differs from `medium`, if any.
pub fn first_difference(data: &[u8], medium: &[u8]) -> Option<u32> {
    data.iter()
        .zip(medium)
        .position(|(a, b)| a != b)
        .map(u32_of)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit() -> Unit {
        Unit {
            port: None,
            blocks: 16384,
            read_only: false,
            serial: "abc".into(),
            id: 42,
        }
    }

    fn cdb(bytes: &[u8]) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[..bytes.len()].copy_from_slice(bytes);
        c
    }

    #[test]
    fn reads_and_writes_decode_in_every_size() {
        assert_eq!(
            decode(&cdb(&[0x08, 0x01, 0x02, 0x03, 0])),
            Ok(Command::Read {
                lba: 0x10203,
                blocks: 256,
                fua: false
            })
        );
        assert_eq!(
            decode(&cdb(&[0x2a, 0x08, 0, 0, 1, 0, 0, 0, 8])),
            Ok(Command::Write {
                lba: 256,
                blocks: 8,
                fua: true
            })
        );
        assert_eq!(
            decode(&cdb(&[0xa8, 0, 0, 0, 0, 9, 0, 0, 0, 4])),
            Ok(Command::Read {
                lba: 9,
                blocks: 4,
                fua: false
            })
        );
        let mut c = cdb(&[0x8a, 0x08]);
        put_u64(&mut c, 2, 1 << 40);
        put_u32(&mut c, 10, 16);
        assert_eq!(
            decode(&c),
            Ok(Command::Write {
                lba: 1 << 40,
                blocks: 16,
                fua: true
            })
        );
        assert_eq!(
            Command::Write {
                lba: 0,
                blocks: 16,
                fua: false
            }
            .data_out_len(),
            8192
        );
    }

    #[test]
    fn malformed_cdbs_get_illegal_request() {
        // Unknown opcode.
        let e = decode(&cdb(&[0xff])).unwrap_err();
        assert_eq!(e, Sense::INVALID_OPCODE);
        let s = e.fixed();
        assert_eq!((s[0], s[2], s[7], s[12], s[13]), (0x70, 5, 10, 0x20, 0));
        // Protection information asked for, a transfer over the limit, a page without
        // EVPD, a short REPORT LUNS, WRITE SAME of 0 blocks, an unknown service action.
        for c in [
            cdb(&[0x28, 0x20, 0, 0, 0, 0, 0, 0, 1]),
            cdb(&[0x28, 0, 0, 0, 0, 0, 0, 0xff, 0xff]),
            cdb(&[0x12, 0, 0x80, 0, 0xff]),
            cdb(&[0xa0, 0, 0, 0, 0, 0, 0, 0, 0, 8]),
            cdb(&[0x93, 0x08]),
            cdb(&[0x9e, 0x11]),
        ] {
            assert_eq!(decode(&c), Err(Sense::INVALID_FIELD_IN_CDB), "{c:02x?}");
        }
        assert!(!in_range(u64::MAX, 2, 100));
        assert!(!in_range(99, 2, 100));
        assert!(in_range(98, 2, 100));
    }

    #[test]
    fn inquiry_pages() {
        let u = unit();
        let std = inquiry(&u, false, 0).unwrap();
        assert_eq!(std.len(), 96);
        assert_eq!(usize::from(std[4]) + 5, std.len());
        assert_eq!(&std[8..16], VENDOR);
        let sup = inquiry(&u, true, 0).unwrap();
        assert_eq!(&sup[4..], &[0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2]);
        for page in [0x80, 0x83, 0xb0, 0xb1, 0xb2] {
            let p = inquiry(&u, true, page).unwrap();
            assert_eq!(p[1], page);
            assert_eq!(usize::from(get_u16(&p, 2)) + 4, p.len(), "page {page:#x}");
        }
        let bl = inquiry(&u, true, 0xb0).unwrap();
        assert_eq!(bl.len(), 0x40);
        assert_eq!(get_u32(&bl, 8), MAX_TRANSFER_BLOCKS);
        assert_eq!(get_u32(&bl, 20), MAX_UNMAP_BLOCKS);
        assert_eq!(inquiry(&u, true, 0x99), Err(Sense::INVALID_FIELD_IN_CDB));
    }

    #[test]
    fn capacity_and_mode_pages() {
        let u = unit();
        let c = read_capacity10(&u);
        assert_eq!((get_u32(&c, 0), get_u32(&c, 4)), (16383, 512));
        let c = read_capacity16(&u);
        assert_eq!(get_u64(&c, 0), 16383);
        assert_eq!(c[14] & 0x80, 0x80, "LBPME");
        let m = ModeSense {
            ten: false,
            dbd: false,
            pc: 0,
            page: 0x3f,
            subpage: 0,
            alloc: 255,
        };
        let d = mode_sense(&u, &m).unwrap();
        assert_eq!(usize::from(d[0]) + 1, d.len());
        assert_eq!(d[3], 8);
        assert_eq!(d[12], 0x08);
        assert_eq!(d[14] & 0x04, 0x04, "WCE");
        let d = mode_sense(
            &u,
            &ModeSense {
                ten: true,
                dbd: true,
                page: 0x08,
                ..m
            },
        )
        .unwrap();
        assert_eq!(usize::from(get_u16(&d, 0)) + 2, d.len());
        assert_eq!(d.len(), 8 + 20);
        assert_eq!(
            mode_sense(&u, &ModeSense { page: 0x19, ..m }),
            Err(Sense::INVALID_FIELD_IN_CDB)
        );
        assert_eq!(
            mode_sense(&u, &ModeSense { pc: 3, ..m }),
            Err(Sense::SAVING_NOT_SUPPORTED)
        );
    }

    #[test]
    fn comparing_and_no_op_commands_decode() {
        // VERIFY(10) BYTCHK 1 and (16) BYTCHK 3; BYTCHK 2 is reserved.
        assert_eq!(
            decode(&cdb(&[0x2f, 0x02, 0, 0, 0, 7, 0, 0, 4])),
            Ok(Command::Verify {
                lba: 7,
                blocks: 4,
                bytchk: 1
            })
        );
        let mut c = cdb(&[0x8f, 0x06]);
        put_u64(&mut c, 2, 9);
        put_u32(&mut c, 10, 3);
        let v = decode(&c).unwrap();
        assert_eq!(v.data_out_len(), 512);
        assert_eq!(v.read_back_len(), 3 * 512);
        assert_eq!(
            decode(&cdb(&[0x2f, 0x04, 0, 0, 0, 7, 0, 0, 4])),
            Err(Sense::INVALID_FIELD_IN_CDB)
        );
        // COMPARE AND WRITE: twice the blocks of Data-Out; over the limit refused.
        let mut c = cdb(&[0x89, 0x08]);
        put_u64(&mut c, 2, 100);
        c[13] = 2;
        let caw = decode(&c).unwrap();
        assert_eq!(
            caw,
            Command::CompareAndWrite {
                lba: 100,
                blocks: 2,
                fua: true
            }
        );
        assert_eq!(caw.data_out_len(), 2048);
        // WRITE SAME(10) is WRITE SAME(16) with a short LBA; 0 blocks refused (WSNZ).
        assert_eq!(
            decode(&cdb(&[0x41, 0x08, 0, 0, 1, 0, 0, 0, 8])),
            Ok(Command::WriteSame16 {
                lba: 256,
                blocks: 8,
                unmap: true,
                ndob: false
            })
        );
        assert_eq!(
            decode(&cdb(&[0x41, 0, 0, 0, 1, 0, 0, 0, 0])),
            Err(Sense::INVALID_FIELD_IN_CDB)
        );
        // WRITE AND VERIFY is a FUA write.
        assert_eq!(
            decode(&cdb(&[0x2e, 0, 0, 0, 0, 1, 0, 0, 2])),
            Ok(Command::Write {
                lba: 1,
                blocks: 2,
                fua: true
            })
        );
        assert_eq!(decode(&cdb(&[0x1b, 0, 0, 0, 1])), Ok(Command::NoOp));
        assert_eq!(
            decode(&cdb(&[0x34, 0, 0, 0, 0, 5, 0, 0, 1])),
            Ok(Command::Prefetch { lba: 5, blocks: 1 })
        );
        // MODE SELECT with SP: no saved pages.
        assert_eq!(
            decode(&cdb(&[0x15, 0x11, 0, 0, 24])),
            Err(Sense::INVALID_FIELD_IN_CDB)
        );
    }

    #[test]
    fn miscompare_sense_carries_the_offset() {
        let s = Sense::miscompare(0x1234).fixed();
        assert_eq!((s[0], s[2], s[12], s[13]), (0xf0, MISCOMPARE, 0x1d, 0));
        assert_eq!(get_u32(&s, 3), 0x1234);
        assert_eq!(Sense::LBA_OUT_OF_RANGE.fixed()[0], 0x70, "no INFORMATION");
        assert_eq!(first_difference(b"abcd", b"abXd"), Some(2));
        assert_eq!(first_difference(b"abcd", b"abcd"), None);
    }

    #[test]
    fn mode_select_takes_the_current_values_only() {
        let u = unit();
        let m = ModeSense {
            ten: false,
            dbd: false,
            pc: 0,
            page: 0x08,
            subpage: 0,
            alloc: 255,
        };
        // What MODE SENSE(6) returned, written back (mode data length is reserved).
        let mut list = mode_sense(&u, &m).unwrap();
        list[0] = 0;
        assert_eq!(mode_select(false, &list), Ok(()));
        assert_eq!(mode_select(false, &[]), Ok(()));
        // Write cache off: not changeable.
        let mut off = list.clone();
        off[4 + 8 + 2] &= !0x04;
        assert_eq!(
            mode_select(false, &off),
            Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST)
        );
        // Another block length; a page that does not exist; a cut page.
        let mut bl = list.clone();
        put_u32(&mut bl, 8, 4096);
        assert_eq!(
            mode_select(false, &bl),
            Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST)
        );
        let mut other = list.clone();
        other[12] = 0x19;
        assert_eq!(
            mode_select(false, &other),
            Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST)
        );
        assert_eq!(
            mode_select(false, &list[..list.len() - 1]),
            Err(Sense::PARAMETER_LIST_LENGTH_ERROR)
        );
        // MODE SELECT(10) of the control page from MODE SENSE(10).
        let mut ten = mode_sense(
            &u,
            &ModeSense {
                ten: true,
                dbd: true,
                page: 0x0a,
                ..m
            },
        )
        .unwrap();
        put_u16(&mut ten, 0, 0);
        assert_eq!(mode_select(true, &ten), Ok(()));
    }

    #[test]
    fn a_wrong_reporting_option_points_at_its_field() {
        // TEST UNIT READY has no service actions: asking for one (options 2) is a bad
        // field, said with a pointer to it (byte 2, bits 2..0), not "not supported".
        let q = OpcodeQuery {
            options: 2,
            opcode: 0x00,
            sa: 0,
            rctd: false,
            alloc: 512,
        };
        let s = report_opcodes(&q, false).unwrap_err().fixed();
        assert_eq!((s[2], s[12], s[13]), (ILLEGAL_REQUEST, 0x24, 0));
        assert_eq!(&s[15..18], &[0x80 | 0x40 | 0x08 | 2, 0, 2]);
        // Other senses carry no field pointer.
        assert_eq!(&Sense::INVALID_FIELD_IN_CDB.fixed()[15..18], &[0, 0, 0]);
        // RESERVE(6) / RELEASE(6) decode; their third-party forms do not.
        assert_eq!(decode(&cdb(&[0x16, 0, 0, 0, 0, 0])), Ok(Command::Reserve6));
        assert_eq!(decode(&cdb(&[0x17, 0, 0, 0, 0, 0])), Ok(Command::Release6));
        assert!(decode(&cdb(&[0x16, 0x10, 0, 0, 0, 0])).is_err());
    }

    #[test]
    fn alua_port_data_and_report_target_port_groups_decode() {
        // INQUIRY: TPGS only with a port; VPD 83h gains the port and group designators.
        let plain = inquiry(&unit(), false, 0).unwrap();
        assert_eq!(plain[5] & 0x30, 0);
        let u = Unit {
            port: Some((0x1234, 0x5678)),
            ..unit()
        };
        assert_eq!(inquiry(&u, false, 0).unwrap()[5] & 0x30, 0x10);
        let without = inquiry(&unit(), true, 0x83).unwrap();
        let with = inquiry(&u, true, 0x83).unwrap();
        assert_eq!(with.len(), without.len() + 16);
        assert_eq!(usize::from(get_u16(&with, 2)), with.len() - 4);
        let extra = &with[without.len()..];
        assert_eq!(extra[..8], [0x51, 0x94, 0, 4, 0, 0, 0x12, 0x34]);
        assert_eq!(extra[8..], [0x51, 0x95, 0, 4, 0, 0, 0x56, 0x78]);
        // REPORT TARGET PORT GROUPS: both parameter data formats; others refused.
        let mut c = cdb(&[0xa3, 0x0a]);
        put_u32(&mut c, 6, 1024);
        assert_eq!(
            decode(&c),
            Ok(Command::ReportTargetPortGroups {
                extended: false,
                alloc: 1024
            })
        );
        c[1] = 0x2a;
        assert!(matches!(
            decode(&c),
            Ok(Command::ReportTargetPortGroups { extended: true, .. })
        ));
        c[1] = 0x4a;
        assert_eq!(decode(&c), Err(Sense::INVALID_FIELD_IN_CDB));
        // What a standby port serves.
        for ok in [0x12u8, 0xa0, 0x03, 0x1a, 0x5a, 0x25] {
            let mut c = cdb(&[ok]);
            put_u32(&mut c, 6, 64);
            let cmd = decode(&c).unwrap();
            assert!(cmd.allowed_in_standby(), "{ok:#x}");
        }
        // Persistent reservations are served where the unit's state lives, the active
        // port (it follows the volume to its next owner).
        for refused in [0x00u8, 0x28, 0x2a, 0x35, 0x88, 0x8a, 0x42, 0x1b, 0x5e, 0x5f] {
            let cmd = decode(&cdb(&[refused])).unwrap();
            assert!(!cmd.allowed_in_standby(), "{refused:#x}");
        }
    }

    #[test]
    fn supported_opcodes_all_and_one() {
        let q = OpcodeQuery {
            options: 0,
            opcode: 0,
            sa: 0,
            rctd: false,
            alloc: 65535,
        };
        let all = report_opcodes(&q, false).unwrap();
        assert_eq!(usize_of_u32(get_u32(&all, 0)), all.len() - 4);
        assert_eq!((all.len() - 4) / 8, SUPPORTED.len() - 1);
        // An ALUA target lists REPORT TARGET PORT GROUPS too.
        let alua = report_opcodes(&q, true).unwrap();
        assert_eq!((alua.len() - 4) / 8, SUPPORTED.len());
        // Every listed command decodes (a listed opcode is one the target serves).
        for &(op, sa, usage) in SUPPORTED {
            assert_eq!(usage[0], op);
            assert!([6, 10, 12, 16].contains(&usage.len()), "{op:#x}");
            let mut c = [0u8; 16];
            c[0] = op;
            if let Some(sa) = sa {
                c[1] = u8_of(usize::from(sa));
            }
            assert_ne!(decode(&c), Err(Sense::INVALID_OPCODE), "{op:#x}");
        }
        let with_t = report_opcodes(&OpcodeQuery { rctd: true, ..q }, false).unwrap();
        assert_eq!(with_t.len() - 4, (SUPPORTED.len() - 1) * 20);
        // One command: READ(10) supported with its usage data; 0xff not; READ
        // CAPACITY(16) needs its service action (options 2), not options 1.
        let one = report_opcodes(
            &OpcodeQuery {
                options: 1,
                opcode: 0x28,
                ..q
            },
            false,
        )
        .unwrap();
        assert_eq!((one[1], get_u16(&one, 2), one[4]), (3, 10, 0x28));
        let none = report_opcodes(
            &OpcodeQuery {
                options: 1,
                opcode: 0xff,
                ..q
            },
            false,
        )
        .unwrap();
        assert_eq!(none[1], 1);
        assert_eq!(
            report_opcodes(
                &OpcodeQuery {
                    options: 1,
                    opcode: 0x9e,
                    ..q
                },
                false
            ),
            Err(Sense::invalid_cdb_field(2, 2))
        );
        let rc16 = report_opcodes(
            &OpcodeQuery {
                options: 2,
                opcode: 0x9e,
                sa: 0x10,
                ..q
            },
            false,
        )
        .unwrap();
        assert_eq!((rc16[1], rc16[5]), (3, 0x10));
    }

    #[test]
    fn lba_status_descriptors_follow_the_runs() {
        let d = lba_status(100, &[(4096, true), (1 << 20, false)], 1024);
        assert_eq!(get_u32(&d, 0), 4 + 32);
        assert_eq!((get_u64(&d, 8), get_u32(&d, 16), d[20]), (100, 8, 0));
        assert_eq!((get_u64(&d, 24), get_u32(&d, 32), d[36]), (108, 2048, 1));
        // Room for one descriptor: the first run only.
        let d = lba_status(0, &[(4096, true), (4096, false)], 24);
        assert_eq!(d.len(), 24);
    }

    #[test]
    fn report_luns_and_unmap_lists() {
        let d = report_luns(&[0, 1]);
        assert_eq!(get_u32(&d, 0), 16);
        assert_eq!(get_u64(&d, 16), 0x0001_0000_0000_0000);
        let mut list = vec![0u8; 8 + 32];
        put_u16(&mut list, 0, 38);
        put_u16(&mut list, 2, 32);
        put_u64(&mut list, 8, 10);
        put_u32(&mut list, 16, 5);
        put_u64(&mut list, 24, 16380);
        put_u32(&mut list, 32, 4);
        assert_eq!(
            unmap_descriptors(&list, 16384),
            Ok(vec![(10, 5), (16380, 4)])
        );
        put_u32(&mut list, 32, 5);
        assert_eq!(
            unmap_descriptors(&list, 16384),
            Err(Sense::LBA_OUT_OF_RANGE)
        );
        assert_eq!(
            unmap_descriptors(&[0; 4], 16384),
            Err(Sense::PARAMETER_LIST_LENGTH_ERROR)
        );
    }
}
