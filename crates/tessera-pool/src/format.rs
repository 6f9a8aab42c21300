//! Byte-exact codecs for the structures of `docs/format.md`. Little-endian throughout;
//! every 4 KiB metadata block ends with a CRC32C of the bytes before it.

use crate::error::{Error, Result};
use tessera_io::cast::{u32_of, u8_of};

pub const BLOCK: usize = 4096;
pub const FORMAT_VERSION: u32 = 1;
pub const DEV_DATA_START: u64 = 1 << 20;
/// Version of device labels written with two slots (docs/format.md §1); labels of
/// [`FORMAT_VERSION`] 1 (one slot) are read too.
pub const LABEL_VERSION: u32 = 2;
/// Device offsets of a device's two label slots (docs/format.md §1): generation `g` is
/// written to slot `g % 2`, so a torn label write leaves the previous generation whole.
pub const LABEL_SLOTS: [u64; 2] = [0, BLOCK as u64];
/// Bytes of a device's label area (both slots): what reading or wiping a label covers.
pub const LABEL_AREA: usize = 2 * BLOCK;
pub const JOURNAL_OFFSET: u64 = 4096;
pub const JOURNAL_BLOCKS: u64 = 1024;
pub const CATALOG_MAX: usize = 1 << 20;
/// Version 2 adds per-volume QoS limits, version 3 their scheduling extension (share
/// weight, reads first); version 1 and 2 catalogs are still read.
pub const CATALOG_VERSION: u32 = 3;
/// Version 4 adds each volume's chain record and the partial units (§3.4); written only
/// when the pool has a snapshot, a clone or a partial unit, so pools that use none stay
/// readable by software that knows version 3.
pub const CATALOG_VERSION_CHAIN: u32 = 4;
/// Version 5 adds the pool flags word and the dedup index size after the exports (§17);
/// written only by dedup pools.
pub const CATALOG_VERSION_DEDUP: u32 = 5;
/// Journal records with this layer id are presence records (§3.4), not ownership.
pub const PRESENCE_RECORD: u32 = 0xFFFF_FFFE;
/// Bytes of a partial unit's presence bitmap: at most 256 blocks per unit.
pub const PRESENCE_BYTES: usize = 32;
/// Chain record kind flags.
pub const CHAIN_SNAPSHOT: u8 = 1;
pub const CHAIN_HIDDEN: u8 = 2;
/// A dedup volume: its units are map units (§17).
pub const CHAIN_BLOCK_MAPPED: u8 = 4;
/// Pool flags word bit: new volumes are block-mapped (§17).
const POOL_FLAG_DEDUP: u32 = 1;
pub const RECORDS_PER_BLOCK: usize = (BLOCK - 4 - 40) / 12;
pub const OWNER_FREE: u32 = 0;
pub const OWNER_META: u32 = u32::MAX;
/// Owner table entry and journal record layer id of a unit in a parity pool's allocation
/// reserve (§3.5): free, zeroed unless a power loss came after it was handed out.
pub const OWNER_RESERVED: u32 = 0xFFFF_FFFD;

pub const LABEL_MAGIC: &[u8; 8] = b"TSRDEV01";
pub const SUPER_MAGIC: &[u8; 8] = b"TSRPOOL1";
pub const CKPT_MAGIC: &[u8; 8] = b"TSRCKPT1";
pub const JOURNAL_MAGIC: &[u8; 8] = b"TSRJRNL1";

pub type Uuid = [u8; 16];

/// Little-endian cursor writer over a fixed buffer.
struct W<'a> {
    b: &'a mut [u8],
    at: usize,
}
impl W<'_> {
    fn put(&mut self, v: &[u8]) {
        self.b[self.at..self.at + v.len()].copy_from_slice(v);
        self.at += v.len();
    }
    fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes())
    }
}

/// Little-endian reader that reports truncation as corruption instead of panicking.
pub struct R<'a> {
    b: &'a [u8],
    at: usize,
}
impl<'a> R<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        R { b, at: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| Error::corrupt("metadata record is truncated"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn uuid(&mut self) -> Result<Uuid> {
        Ok(self.take(16)?.try_into().expect("16 bytes"))
    }
    fn qos_sched(&mut self, q: &mut tessera_qos::QosLimits) -> Result<()> {
        let used = q
            .decode_sched(&self.b[self.at..])
            .map_err(|e| Error::corrupt(format!("volume QoS record: {e}")))?;
        self.at += used;
        Ok(())
    }

    fn qos(&mut self) -> Result<tessera_qos::QosLimits> {
        let (l, used) = tessera_qos::QosLimits::decode(&self.b[self.at..])
            .map_err(|e| Error::corrupt(format!("volume QoS record: {e}")))?;
        self.at += used;
        Ok(l)
    }
    fn string(&mut self, len: usize) -> Result<String> {
        String::from_utf8(self.take(len)?.to_vec())
            .map_err(|_| Error::corrupt("metadata name is not UTF-8"))
    }
}

fn seal(block: &mut [u8; BLOCK]) {
    let crc = crc32c::crc32c(&block[..BLOCK - 4]);
    block[BLOCK - 4..].copy_from_slice(&crc.to_le_bytes());
}

fn crc_ok(block: &[u8]) -> bool {
    block.len() == BLOCK && crc32c::crc32c(&block[..BLOCK - 4]).to_le_bytes() == block[BLOCK - 4..]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutCode {
    Concat = 1,
    Raid0 = 2,
    Raid1 = 3,
    Raid10 = 4,
    Raid5 = 5,
    Raid6 = 6,
    Ec = 7,
}

impl LayoutCode {
    pub fn is_parity(self) -> bool {
        matches!(self, LayoutCode::Raid5 | LayoutCode::Raid6 | LayoutCode::Ec)
    }

    /// Survives a device loss: a missing device's label can be done without at open.
    pub fn is_redundant(self, copies: u32) -> bool {
        self.is_parity() || copies > 1
    }

    /// Device offset where the layout's data begins (parity layouts keep their stripe
    /// journal between the label and the data, docs/format.md §2.1).
    pub fn data_start(self) -> u64 {
        if self.is_parity() {
            DEV_DATA_START + (16 << 20)
        } else {
            DEV_DATA_START
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label {
    pub uuid: Uuid,
    pub index: u32,
    pub count: u32,
    pub layout: LayoutCode,
    pub stripe: u64,
    pub data_len: u64,
    pub unit_size: u64,
    pub pool_name: String,
    /// Mirrors: copies of each block (0 in labels of concat/raid0 pools).
    pub copies: u32,
    /// Device state: the labels with the highest generation tell which devices failed.
    pub state_gen: u64,
    pub failed: u64,
    /// Per device (index < 64): why it failed (`layout::FAIL_*`).
    pub fail_reason: [u8; 64],
}

impl Label {
    pub fn encode(&self) -> [u8; BLOCK] {
        let mut b = [0u8; BLOCK];
        let mut w = W { b: &mut b, at: 0 };
        w.put(LABEL_MAGIC);
        w.u32(LABEL_VERSION);
        w.u32(0);
        w.put(&self.uuid);
        w.u32(self.index);
        w.u32(self.count);
        w.u32(self.layout as u32);
        w.u32(self.copies);
        w.u64(self.stripe);
        w.u64(self.layout.data_start());
        w.u64(self.data_len);
        w.u64(self.unit_size);
        let name = self.pool_name.as_bytes();
        w.put(&name[..name.len().min(64)]);
        w.at = 144;
        w.u64(self.state_gen);
        w.u64(self.failed);
        w.put(&self.fail_reason);
        seal(&mut b);
        b
    }

    /// The device offset of the slot this label's generation is written to.
    pub fn slot(&self) -> u64 {
        LABEL_SLOTS[usize::from(self.state_gen % 2 == 1)]
    }

    /// The label of a device's label area (its [`LABEL_AREA`] first bytes, both slots):
    /// the valid slot of the higher generation, with that slot's offset. Slot 1 counts
    /// only when it names the same pool and device index as a valid slot 0, or slot 0 is
    /// not a valid label, so a stale label another use of the device left there never
    /// wins. `Ok(None)`: neither slot holds a Tessera label; `Err`: one does, damaged
    /// (the error of slot 0 when both are), and the other none.
    pub fn decode_area(area: &[u8]) -> Result<Option<(Label, u64)>> {
        if area.len() < LABEL_AREA {
            return Err(Error::corrupt("device label area is short"));
        }
        let first = Label::decode(&area[..BLOCK]);
        let second = Label::decode(&area[BLOCK..LABEL_AREA]);
        Ok(match (first, second) {
            (Ok(Some(a)), Ok(Some(b)))
                if b.uuid == a.uuid && b.index == a.index && b.state_gen > a.state_gen =>
            {
                Some((b, LABEL_SLOTS[1]))
            }
            (Ok(Some(a)), _) => Some((a, LABEL_SLOTS[0])),
            (_, Ok(Some(b))) => Some((b, LABEL_SLOTS[1])),
            (Err(e), _) => return Err(e),
            (Ok(None), Err(e)) => return Err(e),
            (Ok(None), Ok(None)) => None,
        })
    }

    /// Both slots holding this label (a new pool's first label).
    pub fn encode_area(&self) -> Vec<u8> {
        let b = self.encode();
        let mut area = Vec::with_capacity(LABEL_AREA);
        area.extend_from_slice(&b);
        area.extend_from_slice(&b);
        area
    }

    /// `Ok(None)` when the block is not a Tessera label at all.
    pub fn decode(b: &[u8]) -> Result<Option<Label>> {
        if b.len() < BLOCK || &b[..8] != LABEL_MAGIC {
            return Ok(None);
        }
        if !crc_ok(&b[..BLOCK]) {
            return Err(Error::corrupt("device label checksum mismatch"));
        }
        let mut r = R::new(&b[8..]);
        let version = r.u32()?;
        if version != FORMAT_VERSION && version != LABEL_VERSION {
            return Err(Error::corrupt(format!("device label has format version {version}; this Tessera reads versions {FORMAT_VERSION} and {LABEL_VERSION}")));
        }
        r.u32()?;
        let uuid = r.uuid()?;
        let index = r.u32()?;
        let count = r.u32()?;
        let layout = match r.u32()? {
            1 => LayoutCode::Concat,
            2 => LayoutCode::Raid0,
            3 => LayoutCode::Raid1,
            4 => LayoutCode::Raid10,
            5 => LayoutCode::Raid5,
            6 => LayoutCode::Raid6,
            7 => LayoutCode::Ec,
            n => {
                return Err(Error::corrupt(format!(
                    "device label names unknown layout {n}"
                )))
            }
        };
        let copies = r.u32()?;
        let stripe = r.u64()?;
        let _data_start = r.u64()?;
        let data_len = r.u64()?;
        let unit_size = r.u64()?;
        let name = &b[80..144];
        let end = name.iter().position(|&c| c == 0).unwrap_or(64);
        let pool_name = String::from_utf8_lossy(&name[..end]).into_owned();
        let mut r = R::new(&b[144..]);
        let state_gen = r.u64()?;
        let failed = r.u64()?;
        let fail_reason: [u8; 64] = b[160..224].try_into().expect("64 bytes");
        Ok(Some(Label {
            copies,
            state_gen,
            failed,
            fail_reason,
            uuid,
            index,
            count,
            layout,
            stripe,
            data_len,
            unit_size,
            pool_name,
        }))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub uuid: Uuid,
    pub unit_size: u64,
    pub total_units: u64,
    pub meta_units: u64,
    pub journal_blocks: u64,
    pub slot_a: u64,
    pub slot_b: u64,
    pub slot_size: u64,
    pub created: u64,
}

impl Superblock {
    /// Compute the metadata geometry for a pool of `total_units` units.
    pub fn plan(uuid: Uuid, unit_size: u64, total_units: u64, created: u64) -> Superblock {
        let slot_size =
            BLOCK as u64 + CATALOG_MAX as u64 + (8 * total_units).next_multiple_of(BLOCK as u64);
        let slot_a = JOURNAL_OFFSET + JOURNAL_BLOCKS * BLOCK as u64;
        let slot_b = slot_a + slot_size;
        let meta_units = (slot_b + slot_size).div_ceil(unit_size);
        Superblock {
            uuid,
            unit_size,
            total_units,
            meta_units,
            journal_blocks: JOURNAL_BLOCKS,
            slot_a,
            slot_b,
            slot_size,
            created,
        }
    }

    pub fn encode(&self) -> [u8; BLOCK] {
        let mut b = [0u8; BLOCK];
        let mut w = W { b: &mut b, at: 0 };
        w.put(SUPER_MAGIC);
        w.u32(FORMAT_VERSION);
        w.u32(u32_of(BLOCK));
        w.put(&self.uuid);
        for v in [
            self.unit_size,
            self.total_units,
            self.meta_units,
            JOURNAL_OFFSET,
            self.journal_blocks,
            self.slot_a,
            self.slot_b,
            self.slot_size,
            self.created,
        ] {
            w.u64(v);
        }
        seal(&mut b);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Superblock> {
        if b.len() < BLOCK || &b[..8] != SUPER_MAGIC {
            return Err(Error::corrupt("pool superblock not found (bad magic)"));
        }
        if !crc_ok(&b[..BLOCK]) {
            return Err(Error::corrupt("pool superblock checksum mismatch"));
        }
        let mut r = R::new(&b[8..]);
        let version = r.u32()?;
        if version != FORMAT_VERSION {
            return Err(Error::corrupt(format!(
                "pool superblock has format version {version}"
            )));
        }
        r.u32()?;
        let uuid = r.uuid()?;
        let unit_size = r.u64()?;
        let total_units = r.u64()?;
        let meta_units = r.u64()?;
        let _journal_offset = r.u64()?;
        let journal_blocks = r.u64()?;
        let slot_a = r.u64()?;
        let slot_b = r.u64()?;
        let slot_size = r.u64()?;
        let created = r.u64()?;
        let sb = Superblock {
            uuid,
            unit_size,
            total_units,
            meta_units,
            journal_blocks,
            slot_a,
            slot_b,
            slot_size,
            created,
        };
        let expect = Superblock::plan(uuid, unit_size, total_units, created);
        if sb != expect || !unit_size.is_power_of_two() {
            return Err(Error::corrupt("pool superblock geometry is inconsistent"));
        }
        Ok(sb)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointHeader {
    /// `CKPT_FLAG_*` (offset 12; 0 in checkpoints written before flags existed).
    pub flags: u32,
    pub generation: u64,
    pub journal_seq: u64,
    pub catalog_len: u32,
    pub catalog_crc: u32,
    pub owner_entries: u64,
    pub owner_crc: u32,
    pub uuid: Uuid,
}

/// Checkpoint flag: written by a clean shutdown (docs/format.md §3.2).
pub const CKPT_FLAG_CLEAN: u32 = 1;

impl CheckpointHeader {
    pub fn encode(&self) -> [u8; BLOCK] {
        let mut b = [0u8; BLOCK];
        let mut w = W { b: &mut b, at: 0 };
        w.put(CKPT_MAGIC);
        w.u32(FORMAT_VERSION);
        w.u32(self.flags);
        w.u64(self.generation);
        w.u64(self.journal_seq);
        w.u32(self.catalog_len);
        w.u32(self.catalog_crc);
        w.u64(self.owner_entries);
        w.u32(self.owner_crc);
        w.put(&self.uuid);
        seal(&mut b);
        b
    }

    /// `None` for anything that is not a complete, valid header.
    pub fn decode(b: &[u8]) -> Option<CheckpointHeader> {
        if b.len() < BLOCK || &b[..8] != CKPT_MAGIC || !crc_ok(&b[..BLOCK]) {
            return None;
        }
        let mut r = R::new(&b[8..]);
        if r.u32().ok()? != FORMAT_VERSION {
            return None;
        }
        let flags = r.u32().ok()?;
        Some(CheckpointHeader {
            flags,
            generation: r.u64().ok()?,
            journal_seq: r.u64().ok()?,
            catalog_len: r.u32().ok()?,
            catalog_crc: r.u32().ok()?,
            owner_entries: r.u64().ok()?,
            owner_crc: r.u32().ok()?,
            uuid: r.uuid().ok()?,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeRecord {
    pub id: u32,
    pub size: u64,
    pub created: u64,
    pub name: String,
    pub qos: tessera_qos::QosLimits,
    /// Snapshot and clone relations (catalog version 4, §3.4).
    pub chain: ChainRecord,
}

/// A volume's place in a chain (docs/format.md §3.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainRecord {
    /// `CHAIN_SNAPSHOT`, `CHAIN_HIDDEN`.
    pub flags: u8,
    /// The id its own units carry in the owner table and the journal.
    pub layer: u32,
    /// The snapshot it reads through where it has no data, 0 for none.
    pub parent: u32,
}

impl ChainRecord {
    /// A volume outside any chain, as every volume of a version 1-3 catalog is.
    pub fn plain(id: u32) -> ChainRecord {
        ChainRecord {
            flags: 0,
            layer: id,
            parent: 0,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportRecord {
    pub name: String,
    pub volume_id: u32,
    pub read_only: bool,
    /// NBD TLS policy: `Some(true)` TLS-only, `Some(false)` TLS optional, `None` the
    /// node's default.
    pub tls_required: Option<bool>,
}

/// Export flags byte (format §3.2): bit 0 read-only, bits 1-2 the TLS policy.
const EXPORT_READ_ONLY: u8 = 1;
const EXPORT_TLS_OPTIONAL: u8 = 1 << 1;
const EXPORT_TLS_REQUIRED: u8 = 2 << 1;
const EXPORT_TLS_MASK: u8 = 3 << 1;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Catalog {
    pub next_volume_id: u32,
    pub volumes: Vec<VolumeRecord>,
    pub exports: Vec<ExportRecord>,
    /// Partial units (§3.4): pool unit and presence bitmap.
    pub partial: Vec<(u32, [u8; PRESENCE_BYTES])>,
    /// Dedup is on: new volumes are block-mapped (version 5, §17).
    pub dedup: bool,
    /// Buckets of the fingerprint index, 0 for none (version 5).
    pub index_buckets: u64,
}

impl Catalog {
    pub fn encode(&self) -> Result<Vec<u8>> {
        let chained = !self.partial.is_empty()
            || self
                .volumes
                .iter()
                .any(|v| v.chain != ChainRecord::plain(v.id));
        let dedup = self.dedup || self.index_buckets > 0;
        let chained = chained || dedup;
        let version = if dedup {
            CATALOG_VERSION_DEDUP
        } else if chained {
            CATALOG_VERSION_CHAIN
        } else {
            CATALOG_VERSION
        };
        let mut v = Vec::new();
        v.extend_from_slice(&version.to_le_bytes());
        v.extend_from_slice(&self.next_volume_id.to_le_bytes());
        v.extend_from_slice(&u32_of(self.volumes.len()).to_le_bytes());
        for vol in &self.volumes {
            v.extend_from_slice(&vol.id.to_le_bytes());
            v.extend_from_slice(&vol.size.to_le_bytes());
            v.extend_from_slice(&vol.created.to_le_bytes());
            v.extend_from_slice(&name_len(&vol.name).to_le_bytes());
            v.extend_from_slice(vol.name.as_bytes());
            vol.qos.encode(&mut v);
            vol.qos.encode_sched(&mut v);
            if chained {
                v.push(vol.chain.flags);
                v.extend_from_slice(&vol.chain.layer.to_le_bytes());
                v.extend_from_slice(&vol.chain.parent.to_le_bytes());
            }
        }
        v.extend_from_slice(&u32_of(self.exports.len()).to_le_bytes());
        for e in &self.exports {
            v.extend_from_slice(&name_len(&e.name).to_le_bytes());
            v.extend_from_slice(e.name.as_bytes());
            v.extend_from_slice(&e.volume_id.to_le_bytes());
            let tls = match e.tls_required {
                None => 0,
                Some(false) => EXPORT_TLS_OPTIONAL,
                Some(true) => EXPORT_TLS_REQUIRED,
            };
            let read_only = if e.read_only { EXPORT_READ_ONLY } else { 0 };
            v.push(read_only | tls);
        }
        if dedup {
            let flags = if self.dedup { POOL_FLAG_DEDUP } else { 0 };
            v.extend_from_slice(&flags.to_le_bytes());
            v.extend_from_slice(&self.index_buckets.to_le_bytes());
        }
        if chained {
            v.extend_from_slice(&u32_of(self.partial.len()).to_le_bytes());
            for (p, bits) in &self.partial {
                v.extend_from_slice(&p.to_le_bytes());
                v.extend_from_slice(bits);
            }
        }
        if v.len() > CATALOG_MAX {
            return Err(Error::new(
                crate::ErrorKind::NoSpace,
                "the pool catalog is full (too many volumes or exports)",
            ));
        }
        Ok(v)
    }

    pub fn decode(b: &[u8]) -> Result<Catalog> {
        let mut r = R::new(b);
        let version = r.u32()?;
        if !(1..=CATALOG_VERSION_DEDUP).contains(&version) {
            return Err(Error::corrupt(format!(
                "catalog version {version} is not supported"
            )));
        }
        let next_volume_id = r.u32()?;
        let nv = r.u32()? as usize;
        let mut volumes = Vec::with_capacity(nv.min(4096));
        for _ in 0..nv {
            let id = r.u32()?;
            let size = r.u64()?;
            let created = r.u64()?;
            let len = r.u16()? as usize;
            let name = r.string(len)?;
            // Version 1 catalogs predate QoS: no limits.
            let mut qos = if version >= 2 {
                r.qos()?
            } else {
                tessera_qos::QosLimits::default()
            };
            if version >= 3 {
                r.qos_sched(&mut qos)?;
            }
            let chain = if version >= CATALOG_VERSION_CHAIN {
                let flags = r.u8()?;
                let known = if version >= CATALOG_VERSION_DEDUP {
                    CHAIN_SNAPSHOT | CHAIN_HIDDEN | CHAIN_BLOCK_MAPPED
                } else {
                    CHAIN_SNAPSHOT | CHAIN_HIDDEN
                };
                if flags & !known != 0 {
                    return Err(Error::corrupt(format!(
                        "volume {name}: chain flags {flags:#04x} are not defined"
                    )));
                }
                ChainRecord {
                    flags,
                    layer: r.u32()?,
                    parent: r.u32()?,
                }
            } else {
                ChainRecord::plain(id)
            };
            volumes.push(VolumeRecord {
                id,
                size,
                created,
                name,
                qos,
                chain,
            });
        }
        let ne = r.u32()? as usize;
        let mut exports = Vec::with_capacity(ne.min(4096));
        for _ in 0..ne {
            let len = r.u16()? as usize;
            let name = r.string(len)?;
            let volume_id = r.u32()?;
            let flags = r.u8()?;
            let tls_required = match flags & EXPORT_TLS_MASK {
                0 => None,
                EXPORT_TLS_OPTIONAL => Some(false),
                EXPORT_TLS_REQUIRED => Some(true),
                _ => {
                    return Err(Error::corrupt(format!(
                        "export {name}: TLS policy bits {flags:#04x} are not defined"
                    )))
                }
            };
            exports.push(ExportRecord {
                name,
                volume_id,
                read_only: flags & EXPORT_READ_ONLY != 0,
                tls_required,
            });
        }
        let (mut dedup, mut index_buckets) = (false, 0);
        if version >= CATALOG_VERSION_DEDUP {
            let flags = r.u32()?;
            if flags & !POOL_FLAG_DEDUP != 0 {
                return Err(Error::corrupt(format!(
                    "pool flags {flags:#x} are not defined"
                )));
            }
            dedup = flags & POOL_FLAG_DEDUP != 0;
            index_buckets = r.u64()?;
        }
        let mut partial = Vec::new();
        if version >= CATALOG_VERSION_CHAIN {
            let np = r.u32()? as usize;
            partial.reserve(np.min(1 << 16));
            for _ in 0..np {
                let p = r.u32()?;
                let bits: [u8; PRESENCE_BYTES] =
                    r.take(PRESENCE_BYTES)?.try_into().expect("32 bytes");
                partial.push((p, bits));
            }
        }
        Ok(Catalog {
            next_volume_id,
            volumes,
            exports,
            partial,
            dedup,
            index_buckets,
        })
    }
}

/// One thin-map change: unit `pool_unit` now belongs to (`volume_id`, `volume_unit`),
/// or is free when `volume_id` is 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub pool_unit: u32,
    pub volume_id: u32,
    pub volume_unit: u32,
}

pub fn encode_journal_block(uuid: &Uuid, seq: u64, records: &[Record]) -> [u8; BLOCK] {
    assert!(records.len() <= RECORDS_PER_BLOCK);
    let mut b = [0u8; BLOCK];
    let mut w = W { b: &mut b, at: 0 };
    w.put(JOURNAL_MAGIC);
    w.u64(seq);
    w.put(uuid);
    w.u32(u32_of(records.len()));
    w.u32(0);
    for r in records {
        w.u32(r.pool_unit);
        w.u32(r.volume_id);
        w.u32(r.volume_unit);
    }
    seal(&mut b);
    b
}

/// The records of a journal block, if it is the valid block `seq` of pool `uuid`.
pub fn decode_journal_block(b: &[u8], uuid: &Uuid, seq: u64) -> Option<Vec<Record>> {
    if b.len() < BLOCK || &b[..8] != JOURNAL_MAGIC || !crc_ok(&b[..BLOCK]) {
        return None;
    }
    let mut r = R::new(&b[8..]);
    if r.u64().ok()? != seq || &r.uuid().ok()? != uuid {
        return None;
    }
    let n = r.u32().ok()? as usize;
    r.u32().ok()?;
    if n > RECORDS_PER_BLOCK {
        return None;
    }
    (0..n)
        .map(|_| {
            Some(Record {
                pool_unit: r.u32().ok()?,
                volume_id: r.u32().ok()?,
                volume_unit: r.u32().ok()?,
            })
        })
        .collect()
}

pub fn encode_owner_table(owners: &[(u32, u32)]) -> Vec<u8> {
    let mut v = Vec::with_capacity(owners.len() * 8);
    for &(vol, unit) in owners {
        v.extend_from_slice(&vol.to_le_bytes());
        v.extend_from_slice(&unit.to_le_bytes());
    }
    v
}

pub fn decode_owner_table(b: &[u8]) -> Vec<(u32, u32)> {
    b.chunks_exact(8)
        .map(|c| {
            (
                u32::from_le_bytes(c[..4].try_into().expect("4")),
                u32::from_le_bytes(c[4..].try_into().expect("4")),
            )
        })
        .collect()
}

pub fn crc(b: &[u8]) -> u32 {
    crc32c::crc32c(b)
}

// Stripe journal records of parity pools (§2.1): the parity module writes and replays
// them; their bytes are defined here with the other codecs.

/// Bytes of a record header covered by its CRC (the CRC follows them).
const HEADER_FIELDS: usize = 80;
pub const STRIPE_JOURNAL_MAGIC: &[u8; 8] = b"TSRSJ001";
pub(crate) const KIND_CHUNK: u8 = 1;
pub(crate) const KIND_FULL: u8 = 2;
/// Record header flag: bytes 48..52 hold the payload's CRC32C.
const FLAG_PAYLOAD_CRC: u8 = 1;

/// One journal record as recovery reads it (docs/format.md §2.1): its header's fixed
/// fields and its entries (shard, offset in the chunk, length), whose bytes follow the
/// header, each starting on a journal block.
pub(crate) struct StripeRecord {
    pub head: RecordHead,
    pub entries: Vec<(u8, u32, u32)>,
}

/// Bytes of a header with `n` entries, before its CRC.
#[inline]
pub(crate) fn header_fields(n: usize) -> usize {
    HEADER_FIELDS + 16 * n
}

/// A record header's fixed fields.
pub(crate) struct RecordHead {
    /// The record's sequence number in its slice, and the slice's watermark then.
    pub seq: u64,
    pub watermark: u64,
    pub row: u64,
    pub version: u64,
    pub kind: u8,
    /// Total payload bytes (entries padded to journal blocks).
    pub payload: u32,
    /// Devices holding a copy of this record.
    pub holders: u64,
    /// CRC32C of the payload, when the writer set one (journal flushes on: a power loss
    /// may tear a record that never reached its flush).
    pub payload_crc: Option<u32>,
}

/// Write a record header with `entries` (shard, offset in chunk, length) into `out`.
pub(crate) fn encode_header(
    uuid: &[u8; 16],
    r: RecordHead,
    entries: &[(u8, u32, u32)],
    out: &mut [u8],
) {
    let h = out;
    let f = header_fields(entries.len());
    h[..f + 4].fill(0);
    h[0..8].copy_from_slice(STRIPE_JOURNAL_MAGIC);
    h[8..24].copy_from_slice(uuid);
    h[24..32].copy_from_slice(&r.row.to_le_bytes());
    h[32..40].copy_from_slice(&r.version.to_le_bytes());
    h[40] = r.kind;
    h[41] = u8_of(entries.len());
    h[44..48].copy_from_slice(&r.payload.to_le_bytes());
    if let Some(c) = r.payload_crc {
        h[42] = FLAG_PAYLOAD_CRC;
        h[48..52].copy_from_slice(&c.to_le_bytes());
    }
    h[56..64].copy_from_slice(&r.holders.to_le_bytes());
    h[64..72].copy_from_slice(&r.seq.to_le_bytes());
    h[72..80].copy_from_slice(&r.watermark.to_le_bytes());
    for (i, &(shard, off, len)) in entries.iter().enumerate() {
        let e = &mut h[HEADER_FIELDS + 16 * i..HEADER_FIELDS + 16 * i + 16];
        e[0] = shard;
        e[4..8].copy_from_slice(&off.to_le_bytes());
        e[8..12].copy_from_slice(&len.to_le_bytes());
    }
    let c = crc32c::crc32c(&h[..f]);
    h[f..f + 4].copy_from_slice(&c.to_le_bytes());
}

impl StripeRecord {
    pub(crate) fn decode(uuid: &[u8; 16], h: &[u8]) -> Option<StripeRecord> {
        if h.len() < HEADER_FIELDS + 4 || &h[0..8] != STRIPE_JOURNAL_MAGIC || &h[8..24] != uuid {
            return None;
        }
        let n = h[41] as usize;
        let f = header_fields(n);
        if h.len() < f + 4 {
            return None;
        }
        let c = u32::from_le_bytes(h[f..f + 4].try_into().ok()?);
        if crc32c::crc32c(&h[..f]) != c {
            return None;
        }
        let u64at = |a: usize| u64::from_le_bytes(h[a..a + 8].try_into().expect("8 bytes"));
        let u32at = |a: usize| u32::from_le_bytes(h[a..a + 4].try_into().expect("4 bytes"));
        Some(StripeRecord {
            head: RecordHead {
                seq: u64at(64),
                watermark: u64at(72),
                row: u64at(24),
                version: u64at(32),
                kind: h[40],
                payload: u32at(44),
                holders: u64at(56),
                payload_crc: (h[42] & FLAG_PAYLOAD_CRC != 0).then(|| u32at(48)),
            },
            entries: (0..n)
                .map(|i| {
                    let e = HEADER_FIELDS + 16 * i;
                    (h[e], u32at(e + 4), u32at(e + 8))
                })
                .collect(),
        })
    }
}

/// A catalog name's length field: names are at most 64 bytes (`validate_name`).
fn name_len(name: &str) -> u16 {
    u16::try_from(name.len()).expect("catalog names are validated to at most 64 bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_round_trip_and_crc() {
        let l = Label {
            uuid: [7; 16],
            index: 1,
            count: 4,
            layout: LayoutCode::Raid0,
            stripe: 65536,
            data_len: 1 << 30,
            unit_size: 1 << 20,
            pool_name: "p".into(),
            copies: 0,
            state_gen: 0,
            failed: 0,
            fail_reason: [0; 64],
        };
        let mut b = l.encode();
        // Old labels (reserved bytes zero) decode as "no device failed".
        assert_eq!(&b[144..224], &[0u8; 80][..]);
        let mut m = l.clone();
        m.layout = LayoutCode::Raid10;
        m.copies = 2;
        m.state_gen = 3;
        m.failed = 0b100;
        m.fail_reason[2] = 2;
        assert_eq!(Label::decode(&m.encode()).unwrap(), Some(m));
        assert_eq!(Label::decode(&b).unwrap(), Some(l));
        b[100] ^= 1;
        assert!(Label::decode(&b).is_err());
        assert_eq!(Label::decode(&[0u8; BLOCK]).unwrap(), None);
    }

    /// The label area's two slots (docs/format.md §1): the higher valid generation wins,
    /// a torn slot falls back to the other, a stale label of another pool in slot 1 never
    /// overrides slot 0, and version 1 labels still read.
    #[test]
    fn label_area_takes_the_newest_whole_slot() {
        let l = |gen: u64, uuid: u8| Label {
            uuid: [uuid; 16],
            index: 2,
            count: 4,
            layout: LayoutCode::Raid6,
            stripe: 16384,
            data_len: 1 << 30,
            unit_size: 1 << 20,
            pool_name: "p".into(),
            copies: 2,
            state_gen: gen,
            failed: gen,
            fail_reason: [0; 64],
        };
        let area = |a: &[u8], b: &[u8]| [a, b].concat();
        let zero = [0u8; BLOCK];
        // A new pool: generation 0 in both slots.
        let (got, slot) = Label::decode_area(&l(0, 1).encode_area()).unwrap().unwrap();
        assert_eq!((got, slot), (l(0, 1), 0));
        assert_eq!(l(4, 1).slot(), 0);
        assert_eq!(l(5, 1).slot(), LABEL_SLOTS[1]);
        // Generation 5 in slot 1 beats 4 in slot 0, and the reverse.
        let both = area(&l(4, 1).encode(), &l(5, 1).encode());
        assert_eq!(Label::decode_area(&both).unwrap().unwrap(), (l(5, 1), 4096));
        let both = area(&l(6, 1).encode(), &l(5, 1).encode());
        assert_eq!(Label::decode_area(&both).unwrap().unwrap(), (l(6, 1), 0));
        // The write of generation 6 to slot 0 torn (its last sector old): 5 is read.
        let mut torn = l(6, 1).encode();
        torn[3584..].copy_from_slice(&l(4, 1).encode()[3584..]);
        let t = area(&torn, &l(5, 1).encode());
        assert!(Label::decode(&t[..BLOCK]).is_err());
        assert_eq!(Label::decode_area(&t).unwrap().unwrap(), (l(5, 1), 4096));
        // Torn slot 1 with slot 0 whole.
        let t = area(&l(6, 1).encode(), &torn);
        assert_eq!(Label::decode_area(&t).unwrap().unwrap(), (l(6, 1), 0));
        // Another pool's label left in slot 1, newer: slot 0 still wins.
        let stale = area(&l(2, 1).encode(), &l(9, 7).encode());
        assert_eq!(Label::decode_area(&stale).unwrap().unwrap(), (l(2, 1), 0));
        // No label at all; a damaged label with nothing else.
        assert_eq!(Label::decode_area(&area(&zero, &zero)).unwrap(), None);
        assert!(Label::decode_area(&area(&torn, &zero)).is_err());
        assert!(Label::decode_area(&area(&zero, &torn)).is_err());
        // A version 1 label (one slot, written before slot 1 existed) reads.
        let mut v1 = l(3, 1).encode();
        v1[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        seal(&mut v1);
        assert_eq!(
            Label::decode_area(&area(&v1, &zero)).unwrap().unwrap(),
            (l(3, 1), 0)
        );
        // A version this Tessera does not know is refused, not skipped.
        let mut v9 = l(3, 1).encode();
        v9[8..12].copy_from_slice(&9u32.to_le_bytes());
        seal(&mut v9);
        assert!(Label::decode_area(&area(&v9, &zero)).is_err());
    }

    #[test]
    fn journal_block_checks_seq_and_uuid() {
        let recs = vec![
            Record {
                pool_unit: 9,
                volume_id: 2,
                volume_unit: 3
            };
            RECORDS_PER_BLOCK
        ];
        let b = encode_journal_block(&[1; 16], 42, &recs);
        assert_eq!(decode_journal_block(&b, &[1; 16], 42).unwrap(), recs);
        assert!(decode_journal_block(&b, &[1; 16], 43).is_none());
        assert!(decode_journal_block(&b, &[2; 16], 42).is_none());
    }

    #[test]
    fn catalog_round_trip_and_truncation() {
        let c = Catalog {
            next_volume_id: 3,
            volumes: vec![VolumeRecord {
                id: 1,
                size: 1 << 30,
                created: 5,
                name: "vol0".into(),
                qos: tessera_qos::QosLimits {
                    iops: Some(500),
                    write_bps: Some(1 << 20),
                    weight: Some(300),
                    reads_first: true,
                    ..Default::default()
                },
                chain: ChainRecord::plain(1),
            }],
            exports: vec![ExportRecord {
                name: "e".into(),
                volume_id: 1,
                read_only: true,
                tls_required: None,
            }],
            partial: Vec::new(),
            ..Default::default()
        };
        let b = c.encode().unwrap();
        assert_eq!(Catalog::decode(&b).unwrap(), c);
        for cut in 0..b.len() {
            assert!(Catalog::decode(&b[..cut]).is_err());
        }
    }

    #[test]
    fn export_tls_policy_round_trips_in_the_flags_byte() {
        for (read_only, tls, byte) in [
            (true, None, 1u8),
            (false, Some(false), 2),
            (true, Some(true), 5),
        ] {
            let c = Catalog {
                next_volume_id: 2,
                volumes: Vec::new(),
                exports: vec![ExportRecord {
                    name: "e".into(),
                    volume_id: 1,
                    read_only,
                    tls_required: tls,
                }],
                partial: Vec::new(),
                ..Default::default()
            };
            let mut b = c.encode().unwrap();
            assert_eq!(*b.last().unwrap(), byte);
            assert_eq!(Catalog::decode(&b).unwrap(), c);
            // Bits 1-2 = 3 is not a policy: refused, not guessed.
            *b.last_mut().unwrap() |= 6;
            assert!(Catalog::decode(&b).is_err());
        }
    }

    /// A catalog with a chain is version 4 and carries chain records and partial units;
    /// one without stays version 3 byte for byte (older software still reads it).
    #[test]
    fn chain_catalogs_are_version_4_and_plain_ones_version_3() {
        let vol = |id: u32, chain: ChainRecord| VolumeRecord {
            id,
            size: 1 << 30,
            created: 5,
            name: format!("v{id}"),
            qos: Default::default(),
            chain,
        };
        let mut c = Catalog {
            next_volume_id: 5,
            volumes: vec![vol(1, ChainRecord::plain(1))],
            exports: Vec::new(),
            partial: Vec::new(),
            ..Default::default()
        };
        let b = c.encode().unwrap();
        assert_eq!(b[..4], CATALOG_VERSION.to_le_bytes());
        assert_eq!(Catalog::decode(&b).unwrap(), c);
        c.volumes[0].chain = ChainRecord {
            flags: 0,
            layer: 4,
            parent: 3,
        };
        c.volumes.push(vol(
            3,
            ChainRecord {
                flags: CHAIN_SNAPSHOT | CHAIN_HIDDEN,
                layer: 1,
                parent: 0,
            },
        ));
        let mut bits = [0u8; PRESENCE_BYTES];
        bits[0] = 0b101;
        bits[31] = 0x80;
        c.partial.push((77, bits));
        let b = c.encode().unwrap();
        assert_eq!(b[..4], CATALOG_VERSION_CHAIN.to_le_bytes());
        assert_eq!(Catalog::decode(&b).unwrap(), c);
        for cut in 0..b.len() {
            assert!(Catalog::decode(&b[..cut]).is_err());
        }
        // Undefined chain flags are refused, not guessed: the first volume's flags byte
        // follows its name and its (empty) QoS fields.
        let mut bad = b.clone();
        let at = 12 + 4 + 8 + 8 + 2 + 2 + 2;
        assert_eq!(bad[at], 0);
        bad[at] = 4;
        assert!(Catalog::decode(&bad).is_err());
    }

    #[test]
    fn dedup_catalogs_are_version_5_and_carry_the_block_mapped_flag() {
        let mut c = Catalog {
            next_volume_id: 3,
            volumes: vec![VolumeRecord {
                id: 2,
                size: 1 << 30,
                created: 1,
                name: "d".into(),
                qos: Default::default(),
                chain: ChainRecord {
                    flags: CHAIN_BLOCK_MAPPED,
                    layer: 2,
                    parent: 0,
                },
            }],
            dedup: true,
            index_buckets: 391,
            ..Default::default()
        };
        let b = c.encode().unwrap();
        assert_eq!(b[..4], CATALOG_VERSION_DEDUP.to_le_bytes());
        assert_eq!(Catalog::decode(&b).unwrap(), c);
        for cut in 0..b.len() {
            assert!(Catalog::decode(&b[..cut]).is_err());
        }
        // Undefined pool flags are refused: the flags word follows the empty export list.
        let mut bad = b.clone();
        let at = b.len() - 4 - 8 - 4;
        assert_eq!(bad[at], 1);
        bad[at] = 3;
        assert!(Catalog::decode(&bad).is_err());
        c.dedup = false;
        let b = c.encode().unwrap();
        assert_eq!(
            b[..4],
            CATALOG_VERSION_DEDUP.to_le_bytes(),
            "the index is still there"
        );
    }

    #[test]
    fn version_2_catalogs_are_read_without_scheduling() {
        let qos = tessera_qos::QosLimits {
            iops: Some(7),
            ..Default::default()
        };
        let mut b = Vec::new();
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&(1u64 << 30).to_le_bytes());
        b.extend_from_slice(&5u64.to_le_bytes());
        b.extend_from_slice(&4u16.to_le_bytes());
        b.extend_from_slice(b"vol0");
        qos.encode(&mut b);
        b.extend_from_slice(&0u32.to_le_bytes());
        let c = Catalog::decode(&b).unwrap();
        assert_eq!(c.volumes[0].qos, qos);
        assert_eq!(c.volumes[0].qos.weight, None);
    }

    #[test]
    fn superblock_round_trip() {
        let s = Superblock::plan([3; 16], 1 << 20, 4096, 9);
        assert_eq!(Superblock::decode(&s.encode()).unwrap(), s);
        assert!(s.meta_units < 20);
    }
}
