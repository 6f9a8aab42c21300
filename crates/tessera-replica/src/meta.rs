//! The replica-set file (docs/format.md §11): two header slots, the activity log and one
//! dirty-region bitmap per leg. [`MetaFile`] keeps the whole file in memory and writes
//! back only the 4 KiB pages a change touched, then `fdatasync`s once per batch.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tessera_io::cast::usize_of;

pub const MAGIC: [u8; 8] = *b"TSRSET\0\x01";
pub const VERSION: u32 = 1;
const SLOT: usize = 4096;
const PAGE: usize = 4096;
const BITMAPS_AT: u64 = 2 * SLOT as u64;
/// Most legs a replica set has (one byte of state each in the header, bits in a mask).
pub const MAX_LEGS: usize = 8;
/// Most regions a volume is cut into; larger volumes get larger regions.
pub const MAX_REGIONS: u64 = 1 << 22;
const MIN_REGION: u64 = 64 << 10;
const MAX_REGION: u64 = 1 << 30;
const DESC_AT: usize = 256;
const DESC_MAX: usize = SLOT - 4 - DESC_AT;
/// Header flag: closed cleanly, the activity log is empty.
pub const FLAG_CLEAN: u32 = 1;

/// What a leg holds, as persisted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LegState {
    /// Identical to the volume: receives every write, may serve reads.
    InSync,
    /// Lacks the regions its dirty bitmap marks.
    OutOfSync,
    /// Lacks everything (a new replica): gets a copy of the allocated space.
    NeedsFull,
    /// A removed replica's slot, free for the next one added.
    Vacant,
}

impl LegState {
    fn byte(self) -> u8 {
        match self {
            LegState::InSync => 0,
            LegState::OutOfSync => 1,
            LegState::NeedsFull => 2,
            LegState::Vacant => 3,
        }
    }

    fn from_byte(b: u8) -> io::Result<LegState> {
        match b {
            0 => Ok(LegState::InSync),
            1 => Ok(LegState::OutOfSync),
            2 => Ok(LegState::NeedsFull),
            3 => Ok(LegState::Vacant),
            _ => Err(bad(format!("unknown leg state {b}"))),
        }
    }
}

/// Where one replica lives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LegDesc {
    /// A thin volume of a pool of the owning node.
    Local { pool: String, volume: String },
    /// A thin volume of another node, exported to the owner over NVMe/TCP.
    Remote {
        node: String,
        pool: String,
        volume: String,
        spec: String,
    },
    /// The slot of a removed replica.
    Vacant,
}

impl LegDesc {
    /// `NODE:POOL` (the owner's own legs say `local:POOL`).
    pub fn place(&self) -> String {
        match self {
            LegDesc::Local { pool, .. } => format!("local:{pool}"),
            LegDesc::Remote { node, pool, .. } => format!("{node}:{pool}"),
            LegDesc::Vacant => "vacant".into(),
        }
    }
}

/// The description stored as JSON in the header.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetDesc {
    pub name: String,
    pub legs: Vec<LegDesc>,
}

#[derive(Clone, Debug)]
pub struct Header {
    pub flags: u32,
    pub seq: u64,
    pub uuid: [u8; 16],
    pub size: u64,
    pub region_size: u64,
    pub regions: u64,
    pub bitmap_bytes: u64,
    pub al_capacity: u32,
    pub states: Vec<LegState>,
    pub desc: SetDesc,
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The region size for a volume of `size` bytes when `wanted` was asked for: a power of
/// two in range, large enough that the volume has at most [`MAX_REGIONS`] regions.
pub fn region_size_for(size: u64, wanted: u64) -> u64 {
    let mut r = wanted.clamp(MIN_REGION, MAX_REGION).next_power_of_two();
    while size.div_ceil(r) > MAX_REGIONS && r < MAX_REGION {
        r *= 2;
    }
    r
}

impl Header {
    fn encode(&self) -> io::Result<Vec<u8>> {
        let mut b = vec![0u8; SLOT];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.flags.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..40].copy_from_slice(&self.uuid);
        b[40..48].copy_from_slice(&self.size.to_le_bytes());
        b[48..56].copy_from_slice(&self.region_size.to_le_bytes());
        b[56..64].copy_from_slice(&self.regions.to_le_bytes());
        b[64..72].copy_from_slice(&self.bitmap_bytes.to_le_bytes());
        let legs = u32::try_from(self.states.len()).map_err(|_| bad("too many legs".into()))?;
        b[72..76].copy_from_slice(&legs.to_le_bytes());
        b[76..80].copy_from_slice(&self.al_capacity.to_le_bytes());
        for (i, s) in self.states.iter().enumerate() {
            b[80 + 8 * i] = s.byte();
        }
        let desc = serde_json::to_vec(&self.desc).map_err(|e| bad(e.to_string()))?;
        if desc.len() > DESC_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the replica set's description is {} bytes, more than the {DESC_MAX} its \
                     header holds (shorter names?)",
                    desc.len()
                ),
            ));
        }
        let n = u32::try_from(desc.len()).map_err(|_| bad("description too long".into()))?;
        b[252..256].copy_from_slice(&n.to_le_bytes());
        b[DESC_AT..DESC_AT + desc.len()].copy_from_slice(&desc);
        let crc = crc32c::crc32c(&b[..SLOT - 4]);
        b[SLOT - 4..].copy_from_slice(&crc.to_le_bytes());
        Ok(b)
    }

    fn decode(b: &[u8]) -> io::Result<Header> {
        if b.len() != SLOT || b[0..8] != MAGIC {
            return Err(bad("not a replica-set header".into()));
        }
        let crc = u32::from_le_bytes(b[SLOT - 4..].try_into().expect("4 bytes"));
        if crc32c::crc32c(&b[..SLOT - 4]) != crc {
            return Err(bad("replica-set header CRC mismatch".into()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        if u32_at(8) != VERSION {
            return Err(bad(format!(
                "replica-set format version {} (this build reads {VERSION})",
                u32_at(8)
            )));
        }
        let legs = usize_of(u64::from(u32_at(72)));
        if legs == 0 || legs > MAX_LEGS {
            return Err(bad(format!("replica set with {legs} legs")));
        }
        let states = (0..legs)
            .map(|i| LegState::from_byte(b[80 + 8 * i]))
            .collect::<io::Result<Vec<_>>>()?;
        let n = usize_of(u64::from(u32_at(252)));
        if n > DESC_MAX {
            return Err(bad("replica-set description overruns its header".into()));
        }
        let desc: SetDesc = serde_json::from_slice(&b[DESC_AT..DESC_AT + n])
            .map_err(|e| bad(format!("replica-set description: {e}")))?;
        if desc.legs.len() != legs {
            return Err(bad("replica-set description and leg count disagree".into()));
        }
        let vacant_agrees = desc
            .legs
            .iter()
            .zip(&states)
            .all(|(d, s)| (*d == LegDesc::Vacant) == (*s == LegState::Vacant));
        if !vacant_agrees {
            return Err(bad(
                "replica-set description and leg states disagree on vacant slots".into(),
            ));
        }
        let h = Header {
            flags: u32_at(12),
            seq: u64_at(16),
            uuid: b[24..40].try_into().expect("16 bytes"),
            size: u64_at(40),
            region_size: u64_at(48),
            regions: u64_at(56),
            bitmap_bytes: u64_at(64),
            al_capacity: u32_at(76),
            states,
            desc,
        };
        let regions_ok = h.region_size.is_power_of_two()
            && h.regions == h.size.div_ceil(h.region_size)
            && h.regions <= MAX_REGIONS
            && h.bitmap_bytes == bitmap_bytes(h.regions);
        if !regions_ok {
            return Err(bad(
                "replica-set header has inconsistent region geometry".into()
            ));
        }
        Ok(h)
    }
}

fn bitmap_bytes(regions: u64) -> u64 {
    regions.div_ceil(8).div_ceil(PAGE as u64).max(1) * PAGE as u64
}

pub fn bit(map: &[u8], r: u64) -> bool {
    map[usize_of(r / 8)] & (1 << (r % 8)) != 0
}

/// The replica-set file, held in memory.
pub struct MetaFile {
    file: File,
    pub header: Header,
    /// The activity log as on disk (after the next [`MetaFile::commit`]).
    pub hot: Vec<u8>,
    pub dirty: Vec<Vec<u8>>,
    /// Pages to write back: (bitmap: 0 = activity log, 1 + L = leg L, page index).
    pages: BTreeSet<(usize, usize)>,
    header_changed: bool,
}

impl MetaFile {
    /// Create a new file (refusing to overwrite one).
    pub fn create(
        path: &Path,
        desc: SetDesc,
        uuid: [u8; 16],
        size: u64,
        region_size: u64,
        al_capacity: u32,
        states: Vec<LegState>,
    ) -> io::Result<MetaFile> {
        if desc.legs.is_empty() || desc.legs.len() > MAX_LEGS || states.len() != desc.legs.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a replica set has 1 to {MAX_LEGS} replicas"),
            ));
        }
        let region_size = region_size_for(size, region_size);
        let regions = size.div_ceil(region_size);
        let bb = bitmap_bytes(regions);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        let legs = desc.legs.len();
        file.set_len(BITMAPS_AT + bb * (1 + legs as u64))?;
        let mut m = MetaFile {
            file,
            header: Header {
                flags: FLAG_CLEAN,
                seq: 0,
                uuid,
                size,
                region_size,
                regions,
                bitmap_bytes: bb,
                al_capacity,
                states,
                desc,
            },
            hot: vec![0; usize_of(bb)],
            dirty: vec![vec![0; usize_of(bb)]; legs],
            pages: BTreeSet::new(),
            header_changed: true,
        };
        m.commit()?;
        if let Some(dir) = path.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(m)
    }

    /// Read an existing file.
    pub fn open(path: &Path) -> io::Result<MetaFile> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let mut slots = [vec![0u8; SLOT], vec![0u8; SLOT]];
        for (i, s) in slots.iter_mut().enumerate() {
            file.read_exact_at(s, (i * SLOT) as u64)?;
        }
        let header = match (Header::decode(&slots[0]), Header::decode(&slots[1])) {
            (Ok(a), Ok(b)) => {
                if a.seq >= b.seq {
                    a
                } else {
                    b
                }
            }
            (Ok(a), Err(_)) => a,
            (Err(_), Ok(b)) => b,
            (Err(e), Err(_)) => {
                return Err(bad(format!("{}: no valid header: {e}", path.display())));
            }
        };
        let bb = usize_of(header.bitmap_bytes);
        let mut hot = vec![0u8; bb];
        file.read_exact_at(&mut hot, BITMAPS_AT)?;
        let mut dirty = Vec::new();
        for l in 0..header.states.len() {
            let mut d = vec![0u8; bb];
            file.read_exact_at(&mut d, BITMAPS_AT + (1 + l as u64) * header.bitmap_bytes)?;
            dirty.push(d);
        }
        Ok(MetaFile {
            file,
            header,
            hot,
            dirty,
            pages: BTreeSet::new(),
            header_changed: false,
        })
    }

    /// Set or clear bit `r`; true if it changed.
    fn flip(
        map: &mut [u8],
        pages: &mut BTreeSet<(usize, usize)>,
        which: usize,
        r: u64,
        on: bool,
    ) -> bool {
        let byte = usize_of(r / 8);
        let mask = 1u8 << (r % 8);
        let old = map[byte];
        map[byte] = if on { old | mask } else { old & !mask };
        let changed = map[byte] != old;
        if changed {
            pages.insert((which, byte / PAGE));
        }
        changed
    }

    pub fn set_hot(&mut self, r: u64, on: bool) -> bool {
        Self::flip(&mut self.hot, &mut self.pages, 0, r, on)
    }

    pub fn set_dirty(&mut self, leg: usize, r: u64, on: bool) -> bool {
        Self::flip(&mut self.dirty[leg], &mut self.pages, 1 + leg, r, on)
    }

    /// Mark every hot region dirty for `leg`.
    pub fn dirty_from_hot(&mut self, leg: usize) {
        for (i, h) in self.hot.iter().enumerate() {
            let old = self.dirty[leg][i];
            if old | h != old {
                self.dirty[leg][i] = old | h;
                self.pages.insert((1 + leg, i / PAGE));
            }
        }
    }

    /// Put `desc` in slot `slot` with `state` and an empty dirty bitmap: a vacant slot,
    /// or one past the last (the file grows by one bitmap).
    pub fn set_leg(&mut self, slot: usize, desc: LegDesc, state: LegState) -> io::Result<()> {
        let n = self.header.states.len();
        if slot == n && n < MAX_LEGS {
            let bb = self.header.bitmap_bytes;
            self.file.set_len(BITMAPS_AT + bb * (2 + n as u64))?;
            self.header.states.push(LegState::Vacant);
            self.header.desc.legs.push(LegDesc::Vacant);
            self.dirty.push(vec![0; usize_of(bb)]);
            // The new bitmap reads as zeros (set_len), as in memory.
        } else if slot >= n {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a replica set has at most {MAX_LEGS} replicas"),
            ));
        }
        self.clear_dirty_all(slot);
        self.header.states[slot] = state;
        self.header.desc.legs[slot] = desc;
        self.header_changed = true;
        Ok(())
    }

    pub fn clear_dirty_all(&mut self, leg: usize) {
        for i in 0..self.dirty[leg].len() {
            if self.dirty[leg][i] != 0 {
                self.dirty[leg][i] = 0;
                self.pages.insert((1 + leg, i / PAGE));
            }
        }
    }

    pub fn set_state(&mut self, leg: usize, s: LegState) {
        if self.header.states[leg] != s {
            self.header.states[leg] = s;
            self.header_changed = true;
        }
    }

    pub fn set_flags(&mut self, flags: u32) {
        if self.header.flags != flags {
            self.header.flags = flags;
            self.header_changed = true;
        }
    }

    /// Regions set in a bitmap (0 = activity log, 1 + L = leg L).
    pub fn count(&self, which: usize) -> u64 {
        let map = if which == 0 {
            &self.hot
        } else {
            &self.dirty[which - 1]
        };
        map.iter().map(|b| u64::from(b.count_ones())).sum()
    }

    /// Write every changed page (bitmaps first, then the header), then `fdatasync`.
    pub fn commit(&mut self) -> io::Result<()> {
        if self.pages.is_empty() && !self.header_changed {
            return Ok(());
        }
        let bb = self.header.bitmap_bytes;
        for &(which, page) in &self.pages {
            let map = if which == 0 {
                &self.hot
            } else {
                &self.dirty[which - 1]
            };
            let at = page * PAGE;
            let end = (at + PAGE).min(map.len());
            let off = BITMAPS_AT + which as u64 * bb + at as u64;
            self.file.write_all_at(&map[at..end], off)?;
        }
        if !self.pages.is_empty() && self.header_changed {
            // Rule 7: the bitmaps a new header relies on are on disk first.
            self.file.sync_data()?;
        }
        self.pages.clear();
        if self.header_changed {
            self.header.seq += 1;
            let b = self.header.encode()?;
            let slot = (self.header.seq % 2) as usize;
            self.file.write_all_at(&b, (slot * SLOT) as u64)?;
            self.header_changed = false;
        }
        self.file.sync_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc() -> SetDesc {
        SetDesc {
            name: "db".into(),
            legs: vec![
                LegDesc::Local {
                    pool: "p".into(),
                    volume: "db".into(),
                },
                LegDesc::Remote {
                    node: "b".into(),
                    pool: "p".into(),
                    volume: "db-r".into(),
                    spec: "nvme-tcp://127.0.0.1:4420/nqn.x?nsid=1".into(),
                },
            ],
        }
    }

    #[test]
    fn a_file_reads_back_what_was_committed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("db.rset");
        let states = vec![LegState::InSync, LegState::NeedsFull];
        let mut m = MetaFile::create(&p, desc(), [7; 16], 100 << 20, 1 << 20, 64, states).unwrap();
        assert_eq!(m.header.regions, 100);
        m.set_hot(3, true);
        m.set_dirty(1, 99, true);
        m.set_state(1, LegState::OutOfSync);
        m.set_flags(0);
        m.commit().unwrap();
        assert!(
            MetaFile::create(
                &p,
                desc(),
                [7; 16],
                1 << 20,
                1 << 20,
                64,
                vec![LegState::InSync; 2]
            )
            .is_err(),
            "an existing file is never overwritten"
        );
        let r = MetaFile::open(&p).unwrap();
        assert!(bit(&r.hot, 3) && !bit(&r.hot, 4));
        assert!(bit(&r.dirty[1], 99) && !bit(&r.dirty[0], 99));
        assert_eq!(r.header.states, vec![LegState::InSync, LegState::OutOfSync]);
        assert_eq!(r.header.flags, 0);
        assert_eq!(r.header.desc, desc());
        assert_eq!(r.count(0), 1);
    }

    #[test]
    fn a_torn_header_falls_back_to_the_other_slot() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("db.rset");
        let mut m = MetaFile::create(
            &p,
            desc(),
            [1; 16],
            8 << 20,
            1 << 20,
            64,
            vec![LegState::InSync; 2],
        )
        .unwrap();
        m.set_state(1, LegState::OutOfSync);
        m.commit().unwrap();
        let seq = m.header.seq;
        // Garble the slot just written: the previous header (both legs in sync) is read.
        let f = OpenOptions::new().write(true).open(&p).unwrap();
        f.write_all_at(&[0xAB; 64], (seq % 2) * SLOT as u64 + 100)
            .unwrap();
        let r = MetaFile::open(&p).unwrap();
        assert_eq!(r.header.seq, seq - 1);
        assert_eq!(r.header.states, vec![LegState::InSync; 2]);
    }

    #[test]
    fn replicas_are_added_into_vacant_slots_and_removed_durably() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("db.rset");
        let mut m = MetaFile::create(
            &p,
            desc(),
            [2; 16],
            8 << 20,
            1 << 20,
            64,
            vec![LegState::InSync; 2],
        )
        .unwrap();
        let c = LegDesc::Remote {
            node: "c".into(),
            pool: "p".into(),
            volume: "db-c".into(),
            spec: "nvme-tcp://127.0.0.1:4421/nqn.y?nsid=1".into(),
        };
        // A third leg grows the file by one bitmap.
        m.set_leg(2, c.clone(), LegState::NeedsFull).unwrap();
        m.set_dirty(2, 5, true);
        m.commit().unwrap();
        let r = MetaFile::open(&p).unwrap();
        assert_eq!(r.header.desc.legs[2], c);
        assert_eq!(r.header.states[2], LegState::NeedsFull);
        assert!(bit(&r.dirty[2], 5));
        // Removing the second leaves its slot vacant; the third keeps its number.
        m.set_leg(1, LegDesc::Vacant, LegState::Vacant).unwrap();
        m.commit().unwrap();
        let r = MetaFile::open(&p).unwrap();
        assert_eq!(
            r.header.states,
            vec![LegState::InSync, LegState::Vacant, LegState::NeedsFull]
        );
        assert_eq!(r.header.desc.legs[1], LegDesc::Vacant);
        assert_eq!(r.count(2), 0, "a vacant slot's bitmap is cleared");
        // Beyond the last slot + 1, or past the most legs, is refused.
        assert!(m.set_leg(5, c.clone(), LegState::NeedsFull).is_err());
        // A state and description that disagree on vacancy are refused on read.
        m.header.states[1] = LegState::OutOfSync;
        m.header_changed = true;
        m.commit().unwrap();
        assert!(
            MetaFile::open(&p).is_err() || MetaFile::open(&p).unwrap().header.seq < m.header.seq
        );
    }

    #[test]
    fn huge_volumes_get_larger_regions() {
        assert_eq!(region_size_for(1 << 30, 1 << 20), 1 << 20);
        assert_eq!(region_size_for(1 << 30, 1000), MIN_REGION);
        let r = region_size_for(1 << 50, 1 << 20);
        assert!((1u64 << 50).div_ceil(r) <= MAX_REGIONS);
    }
}
