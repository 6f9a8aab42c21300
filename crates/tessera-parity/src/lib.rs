//! Parity and erasure-coding math for Tessera's redundant pools.
//!
//! - RAID5: [`xor_parity`] (P = XOR of the data) and [`xor_into`].
//! - RAID6: [`pq_gen`], [`pq_recover`] (any one or two of data/P/Q) and [`pq_update`] for
//!   read-modify-write — the same P and Q as Linux md raid6.
//! - k+m erasure coding: [`ReedSolomon`] (systematic, Cauchy-based, so any k of the k+m
//!   shards rebuild the rest), with [`ReedSolomon::update_parity`] for read-modify-write.
//!
//! All arithmetic is in GF(2^8) with the polynomial 0x11d ([`gf`]), chosen because Linux md
//! raid6 and Intel ISA-L use it: blocks written by this crate can be checked against theirs,
//! and 2 generates the whole multiplicative group.
//!
//! The kernels ([`kernels`]) are chosen at run time: AVX-512 with GFNI when the CPU has it
//! (512-bit XOR, one `vgf2p8affineqb` per 64-byte multiply-by-constant), else AVX2 (256-bit
//! XOR, `vpshufb` split-nibble multiplication), else portable code on 64-bit words. Q is
//! computed by Horner's rule with a masked multiply-by-2 in every backend. Blocks may have any length; the
//! vector kernels finish odd tails with the portable code. Nothing allocates on the encode
//! or update paths.
//!
//! ```
//! use tessera_parity::{pq_gen, pq_recover, ReedSolomon};
//!
//! // RAID6, 4 data blocks: lose two of them and get them back.
//! let mut stripe: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i * 17; 4096]).collect();
//! let (data, pq) = stripe.split_at_mut(4);
//! let (p, q) = pq.split_at_mut(1);
//! pq_gen(&[&data[0], &data[1], &data[2], &data[3]], &mut p[0], &mut q[0]);
//! let expected = stripe.clone();
//! stripe[1].fill(0);
//! stripe[3].fill(0);
//! let mut blocks: Vec<&mut [u8]> = stripe.iter_mut().map(|b| b.as_mut_slice()).collect();
//! pq_recover(&mut blocks, &[1, 3]).unwrap();
//! assert_eq!(stripe, expected);
//!
//! // Reed-Solomon 8+3: any 8 of the 11 shards rebuild the others.
//! let rs = ReedSolomon::new(8, 3).unwrap();
//! let mut shards: Vec<Vec<u8>> = (0..11u8).map(|i| vec![i; 512]).collect();
//! let (data, parity) = shards.split_at_mut(8);
//! let data: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
//! let mut parity: Vec<&mut [u8]> = parity.iter_mut().map(|p| p.as_mut_slice()).collect();
//! rs.encode(&data, &mut parity).unwrap();
//! let expected = shards.clone();
//! let mut opt: Vec<Option<Vec<u8>>> = shards.into_iter().map(Some).collect();
//! opt[0] = None;
//! opt[5] = None;
//! opt[9] = None;
//! rs.reconstruct_opt(&mut opt).unwrap();
//! assert_eq!(opt.into_iter().map(Option::unwrap).collect::<Vec<_>>(), expected);
//! ```

pub mod gf;
pub mod kernels;
pub mod matrix;
mod raid;
mod rs;

pub use raid::{pq_gen, pq_recover, pq_update, xor_into, xor_parity};
pub use rs::ReedSolomon;

/// Why a parity operation was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParityError {
    /// Unsupported shape: k or m is zero, k + m > 255, or a RAID6 stripe with fewer than one
    /// data block or more than 255.
    InvalidGeometry,
    /// The number of shards passed does not match the code.
    WrongShardCount { expected: usize, got: usize },
    /// Blocks of one stripe have different lengths.
    LengthMismatch,
    /// An index appears twice in an erasure list.
    DuplicateIndex,
    /// An index is beyond the stripe.
    IndexOutOfRange(usize),
    /// More blocks are missing than the code can rebuild.
    TooManyErasures { erased: usize, max: usize },
}

impl std::fmt::Display for ParityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParityError::InvalidGeometry => write!(f, "unsupported stripe geometry"),
            ParityError::WrongShardCount { expected, got } => {
                write!(f, "expected {expected} shards, got {got}")
            }
            ParityError::LengthMismatch => write!(f, "blocks of a stripe differ in length"),
            ParityError::DuplicateIndex => write!(f, "an erased index is listed twice"),
            ParityError::IndexOutOfRange(i) => write!(f, "index {i} is beyond the stripe"),
            ParityError::TooManyErasures { erased, max } => {
                write!(f, "{erased} blocks missing, at most {max} can be rebuilt")
            }
        }
    }
}

impl std::error::Error for ParityError {}
