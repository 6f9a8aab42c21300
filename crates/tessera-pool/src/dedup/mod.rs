//! Deduplication (issue 25, docs/format.md §17): the block fingerprint and the
//! fingerprint index with its RAM filter (`index`), the bytes of map and refcount pages
//! (`pages`), a dedup pool's metadata with its commit (`store`), and the scrub of that
//! metadata (`scrub`). The datapath of block-mapped volumes is `volume::dedup_io`.

pub mod index;
pub mod pages;
mod scrub;
pub mod store;

pub use index::{BucketArea, Fingerprint, FingerprintIndex, IndexStats, OnDevice};
pub use store::DedupCore;
