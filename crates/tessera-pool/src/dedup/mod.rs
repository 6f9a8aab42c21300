//! Deduplication (issue 25, docs/format.md §17). Built so far: the block fingerprint and
//! the fingerprint index with its RAM filter. The block-mapped volumes, the store with its
//! reference counts and the write path that uses them come next, on this format.

pub mod index;

pub use index::{Fingerprint, FingerprintIndex, IndexStats};
