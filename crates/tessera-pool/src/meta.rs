//! Reading and writing the metadata region (superblock, checkpoints, journal) through a
//! layout's synchronous face. Used by the control plane and the commit thread only.

use std::io;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::*;
use crate::layout::Layout;
use tessera_io::cast::{u32_of, usize_of};

pub struct MetaStore {
    pub layout: Arc<Layout>,
    pub sb: Superblock,
}

pub struct LoadedCheckpoint {
    pub header: CheckpointHeader,
    pub slot_is_a: bool,
    pub catalog: Catalog,
    pub owners: Vec<(u32, u32)>,
}

impl MetaStore {
    pub fn write_superblock(&self) -> io::Result<()> {
        self.layout.write_at(0, &self.sb.encode())
    }

    pub fn read_superblock(layout: &Layout) -> Result<Superblock> {
        let mut b = vec![0u8; BLOCK];
        layout
            .read_at(0, &mut b)
            .map_err(|e| Error::io("reading the pool superblock", e))?;
        Superblock::decode(&b)
    }

    fn slot_offset(&self, a: bool) -> u64 {
        if a {
            self.sb.slot_a
        } else {
            self.sb.slot_b
        }
    }

    /// Invalidate a slot (used at creation so a stale checkpoint can never win).
    pub fn clear_slot(&self, a: bool) -> io::Result<()> {
        self.layout.write_at(self.slot_offset(a), &[0u8; BLOCK])
    }

    /// Write a full checkpoint into slot A or B. The header goes last, so a torn write
    /// leaves a slot whose header (or payload CRC) does not validate. `flags`:
    /// `CKPT_FLAG_*`.
    pub fn write_checkpoint(
        &self,
        a: bool,
        flags: u32,
        generation: u64,
        journal_seq: u64,
        catalog: &[u8],
        owners: &[(u32, u32)],
    ) -> io::Result<()> {
        let base = self.slot_offset(a);
        // Invalidate the old header first: the payload is about to change underneath it.
        self.layout.write_at(base, &[0u8; BLOCK])?;
        let mut cat = catalog.to_vec();
        cat.resize(catalog.len().next_multiple_of(BLOCK), 0);
        self.layout.write_at(base + BLOCK as u64, &cat)?;
        let mut table = encode_owner_table(owners);
        let owner_crc = crc(&table);
        table.resize(table.len().next_multiple_of(BLOCK), 0);
        self.layout
            .write_at(base + BLOCK as u64 + CATALOG_MAX as u64, &table)?;
        let h = CheckpointHeader {
            flags,
            generation,
            journal_seq,
            catalog_len: u32_of(catalog.len()),
            catalog_crc: crc(catalog),
            owner_entries: owners.len() as u64,
            owner_crc,
            uuid: self.sb.uuid,
        };
        self.layout.write_at(base, &h.encode())
    }

    fn read_checkpoint(&self, a: bool) -> Option<LoadedCheckpoint> {
        let base = self.slot_offset(a);
        let mut hb = vec![0u8; BLOCK];
        self.layout.read_at(base, &mut hb).ok()?;
        let header = CheckpointHeader::decode(&hb)?;
        if header.uuid != self.sb.uuid
            || header.owner_entries != self.sb.total_units
            || header.catalog_len as usize > CATALOG_MAX
        {
            return None;
        }
        let mut cat = vec![0u8; header.catalog_len as usize];
        self.layout.read_at(base + BLOCK as u64, &mut cat).ok()?;
        if crc(&cat) != header.catalog_crc {
            return None;
        }
        let mut table = vec![0u8; usize_of(header.owner_entries) * 8];
        self.layout
            .read_at(base + BLOCK as u64 + CATALOG_MAX as u64, &mut table)
            .ok()?;
        if crc(&table) != header.owner_crc {
            return None;
        }
        let catalog = Catalog::decode(&cat).ok()?;
        Some(LoadedCheckpoint {
            header,
            slot_is_a: a,
            catalog,
            owners: decode_owner_table(&table),
        })
    }

    /// The valid checkpoint with the highest generation.
    pub fn load_newest_checkpoint(&self) -> Result<LoadedCheckpoint> {
        let a = self.read_checkpoint(true);
        let b = self.read_checkpoint(false);
        match (a, b) {
            (Some(a), Some(b)) => Ok(if a.header.generation >= b.header.generation {
                a
            } else {
                b
            }),
            (Some(x), None) | (None, Some(x)) => Ok(x),
            (None, None) => Err(Error::corrupt(
                "no valid metadata checkpoint in either slot: the pool metadata is damaged",
            )),
        }
    }

    fn journal_offset(&self, seq: u64) -> u64 {
        JOURNAL_OFFSET + (seq % self.sb.journal_blocks) * BLOCK as u64
    }

    /// Append `records` as journal blocks starting at sequence `seq`; returns the number of
    /// blocks written.
    pub fn write_journal(&self, seq: u64, records: &[Record]) -> io::Result<u64> {
        let blocks: Vec<[u8; BLOCK]> = records
            .chunks(RECORDS_PER_BLOCK)
            .enumerate()
            .map(|(i, c)| encode_journal_block(&self.sb.uuid, seq + i as u64, c))
            .collect();
        // Write runs of blocks that are contiguous in the ring in one go.
        let mut i = 0;
        while i < blocks.len() {
            let pos = (seq + i as u64) % self.sb.journal_blocks;
            let run = (blocks.len() - i).min(usize_of(self.sb.journal_blocks - pos));
            let mut buf = Vec::with_capacity(run * BLOCK);
            for b in &blocks[i..i + run] {
                buf.extend_from_slice(b);
            }
            self.layout
                .write_at(self.journal_offset(seq + i as u64), &buf)?;
            i += run;
        }
        Ok(blocks.len() as u64)
    }

    /// Apply journal blocks from `seq` on until the first invalid one; returns the
    /// sequence number after the last valid block.
    pub fn replay(&self, mut seq: u64, mut apply: impl FnMut(Record)) -> Result<u64> {
        let mut b = vec![0u8; BLOCK];
        for _ in 0..self.sb.journal_blocks {
            self.layout
                .read_at(self.journal_offset(seq), &mut b)
                .map_err(|e| Error::io("reading the journal", e))?;
            let Some(records) = decode_journal_block(&b, &self.sb.uuid, seq) else {
                break;
            };
            records.into_iter().for_each(&mut apply);
            seq += 1;
        }
        Ok(seq)
    }
}
