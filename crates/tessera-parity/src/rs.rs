//! Systematic Reed-Solomon erasure coding, k data shards + m parity shards.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use crate::gf;
use crate::kernels::{self, Backend};
use crate::matrix::Matrix;
use crate::ParityError;

/// Decode matrices kept per erasure pattern before the cache is emptied and refilled.
const CACHE_LIMIT: usize = 4096;

/// A k+m Reed-Solomon code over GF(2^8) (polynomial 0x11d).
///
/// # The matrix
///
/// The generator is `[I_k; C]`: the identity on top (so the data shards are stored as they
/// are — the code is systematic) and an m×k **Cauchy** matrix below,
/// `C[i][j] = 1 / (x_i + y_j)` with `x_i = k + i` and `y_j = j` (all distinct field elements,
/// hence k + m ≤ 256; this type accepts k + m ≤ 255). Every square submatrix of a Cauchy
/// matrix is invertible, and that makes every k×k submatrix of `[I; C]` invertible: any k
/// surviving shards determine the data, which is the MDS property. A Cauchy matrix is used
/// rather than a Vandermonde matrix because the plain systematic Vandermonde construction
/// `[I; V]` is *not* MDS in general (it has to be derived by multiplying with an inverse,
/// and mistakes there are a known source of undecodable patterns); Cauchy has the property
/// by construction.
///
/// Each column of C is then divided by its first entry, so the first parity row is all ones:
/// scaling columns of C by non-zero constants keeps every square submatrix of `[I; C]`
/// invertible, and it makes parity shard 0 the plain XOR of the data — the same block a
/// RAID5 P would be. (Parity shard 1 is *not* the RAID6 Q; use [`crate::pq_gen`] for that.)
///
/// # Decoding
///
/// To rebuild erased shards, the first k surviving shards are taken, the matching k rows of
/// the generator inverted, and each erased shard is one row of (generator row × inverse)
/// applied to the survivors in a single pass. These decode rows are cached per erasure pattern
/// (up to 4096 patterns), so a degraded read does not invert a matrix each time.
pub struct ReedSolomon {
    k: usize,
    m: usize,
    gen: Matrix,
    cache: RwLock<HashMap<[u64; 4], Arc<Plan>>>,
}

/// How to rebuild one erasure pattern: which shards to read and the coefficient rows.
struct Plan {
    /// The k shards read, in increasing index order.
    survivors: Vec<usize>,
    /// One row of k coefficients per erased shard (erased shards in increasing order).
    coeffs: Vec<u8>,
}

impl std::fmt::Debug for ReedSolomon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReedSolomon")
            .field("k", &self.k)
            .field("m", &self.m)
            .finish_non_exhaustive()
    }
}

impl ReedSolomon {
    /// A code with `k ≥ 1` data shards and `m ≥ 1` parity shards, `k + m ≤ 255`.
    #[allow(clippy::cast_possible_truncation)] // k + m <= 255 is checked first: shard indices are field elements
    pub fn new(k: usize, m: usize) -> Result<ReedSolomon, ParityError> {
        if k == 0 || m == 0 || k + m > 255 {
            return Err(ParityError::InvalidGeometry);
        }
        let mut gen = Matrix::zero(k + m, k);
        for i in 0..k {
            gen.set(i, i, 1);
        }
        for j in 0..k {
            let first = gf::inv(k as u8 ^ j as u8);
            for i in 0..m {
                let c = gf::inv((k + i) as u8 ^ j as u8);
                gen.set(k + i, j, gf::div(c, first));
            }
        }
        Ok(ReedSolomon {
            k,
            m,
            gen,
            cache: RwLock::new(HashMap::new()),
        })
    }

    /// Number of data shards.
    pub fn data_shards(&self) -> usize {
        self.k
    }

    /// Number of parity shards.
    pub fn parity_shards(&self) -> usize {
        self.m
    }

    /// Total shards, k + m.
    pub fn total_shards(&self) -> usize {
        self.k + self.m
    }

    /// The (k+m)×k generator matrix: identity rows, then the parity rows.
    pub fn generator(&self) -> &Matrix {
        &self.gen
    }

    /// The coefficient data shard `data_index` is multiplied by in parity shard `parity_index`.
    pub fn coefficient(&self, parity_index: usize, data_index: usize) -> u8 {
        self.gen.get(self.k + parity_index, data_index)
    }

    fn parity_rows(&self) -> &[u8] {
        &self.gen.as_slice()[self.k * self.k..]
    }

    /// Computes all m parity shards from the k data shards (all of one length).
    pub fn encode(&self, data: &[&[u8]], parity: &mut [&mut [u8]]) -> Result<(), ParityError> {
        if data.len() != self.k || parity.len() != self.m {
            return Err(ParityError::WrongShardCount {
                expected: self.k + self.m,
                got: data.len() + parity.len(),
            });
        }
        let len = parity[0].len();
        if data.iter().any(|d| d.len() != len) || parity.iter().any(|p| p.len() != len) {
            return Err(ParityError::LengthMismatch);
        }
        kernels::dot_prod_with(Backend::detect(), self.parity_rows(), data, parity, false);
        Ok(())
    }

    /// Read-modify-write of one data shard (or a sub-range of it): XORs
    /// `coefficient(j, data_index) · delta` into each parity shard j, where
    /// `delta = old ^ new` for the range being written. A small write therefore reads the old
    /// data and the old parity only. `delta` can be made in place in the old-data buffer with
    /// [`crate::xor_into`]. Each parity slice must cover the same range as `delta`.
    pub fn update_parity(
        &self,
        delta: &[u8],
        data_index: usize,
        parity: &mut [&mut [u8]],
    ) -> Result<(), ParityError> {
        if data_index >= self.k {
            return Err(ParityError::IndexOutOfRange(data_index));
        }
        if parity.len() != self.m {
            return Err(ParityError::WrongShardCount {
                expected: self.m,
                got: parity.len(),
            });
        }
        if parity.iter().any(|p| p.len() != delta.len()) {
            return Err(ParityError::LengthMismatch);
        }
        let mut col = [0u8; 255];
        for (j, c) in col[..self.m].iter_mut().enumerate() {
            *c = self.coefficient(j, data_index);
        }
        kernels::dot_prod_with(Backend::detect(), &col[..self.m], &[delta], parity, true);
        Ok(())
    }

    /// Rebuilds the shards listed in `erasures` (at most m, data or parity, in any order).
    ///
    /// `shards` holds all k + m buffers, data first, all the same length; the erased ones'
    /// contents are ignored and overwritten, the others are only read (the first k survivors).
    pub fn reconstruct(
        &self,
        shards: &mut [&mut [u8]],
        erasures: &[usize],
    ) -> Result<(), ParityError> {
        let n = self.k + self.m;
        if shards.len() != n {
            return Err(ParityError::WrongShardCount {
                expected: n,
                got: shards.len(),
            });
        }
        let len = shards[0].len();
        if shards.iter().any(|s| s.len() != len) {
            return Err(ParityError::LengthMismatch);
        }
        let mut key = [0u64; 4];
        for &e in erasures {
            if e >= n {
                return Err(ParityError::IndexOutOfRange(e));
            }
            if key[e / 64] & (1 << (e % 64)) != 0 {
                return Err(ParityError::DuplicateIndex);
            }
            key[e / 64] |= 1 << (e % 64);
        }
        if erasures.is_empty() {
            return Ok(());
        }
        if erasures.len() > self.m {
            return Err(ParityError::TooManyErasures {
                erased: erasures.len(),
                max: self.m,
            });
        }
        let plan = self.plan(key);
        let mut srcs: Vec<&[u8]> = Vec::with_capacity(self.k);
        let mut dsts: Vec<&mut [u8]> = Vec::with_capacity(erasures.len());
        let mut next = plan.survivors.iter().peekable();
        for (i, s) in shards.iter_mut().enumerate() {
            if key[i / 64] & (1 << (i % 64)) != 0 {
                dsts.push(&mut **s);
            } else if next.peek() == Some(&&i) {
                next.next();
                srcs.push(&**s);
            }
        }
        kernels::dot_prod_with(Backend::detect(), &plan.coeffs, &srcs, &mut dsts, false);
        Ok(())
    }

    /// Like [`reconstruct`](Self::reconstruct) for owned shards: `None` marks an erasure and is
    /// replaced by a freshly allocated, rebuilt shard.
    pub fn reconstruct_opt(&self, shards: &mut [Option<Vec<u8>>]) -> Result<(), ParityError> {
        let Some(len) = shards.iter().flatten().map(|s| s.len()).next() else {
            return Err(ParityError::TooManyErasures {
                erased: shards.len(),
                max: self.m,
            });
        };
        let erasures: Vec<usize> = (0..shards.len()).filter(|&i| shards[i].is_none()).collect();
        if erasures.len() > self.m {
            return Err(ParityError::TooManyErasures {
                erased: erasures.len(),
                max: self.m,
            });
        }
        for &e in &erasures {
            shards[e] = Some(vec![0; len]);
        }
        let mut bufs: Vec<&mut [u8]> = shards
            .iter_mut()
            .map(|s| s.as_mut().expect("filled above").as_mut_slice())
            .collect();
        let r = self.reconstruct(&mut bufs, &erasures);
        if r.is_err() {
            for &e in &erasures {
                shards[e] = None;
            }
        }
        r
    }

    /// Whether the parity shards match the data (for scrub). Allocates one scratch shard.
    pub fn verify(&self, shards: &[&[u8]]) -> Result<bool, ParityError> {
        if shards.len() != self.k + self.m {
            return Err(ParityError::WrongShardCount {
                expected: self.k + self.m,
                got: shards.len(),
            });
        }
        let len = shards[0].len();
        if shards.iter().any(|s| s.len() != len) {
            return Err(ParityError::LengthMismatch);
        }
        let mut scratch = vec![0u8; len];
        for j in 0..self.m {
            let row = &self.parity_rows()[j * self.k..(j + 1) * self.k];
            kernels::dot_prod_with(
                Backend::detect(),
                row,
                &shards[..self.k],
                &mut [&mut scratch[..]],
                false,
            );
            if scratch[..] != *shards[self.k + j] {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn plan(&self, key: [u64; 4]) -> Arc<Plan> {
        // The workspace's lock policy (`tessera_io::sync`: a poisoned lock is still taken),
        // written out here because this crate depends on nothing: the cache holds only
        // complete plans, so whatever a panicking thread left in it is valid.
        if let Some(p) = self
            .cache
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&key)
        {
            return p.clone();
        }
        let erased = |i: usize| key[i / 64] & (1 << (i % 64)) != 0;
        let n = self.k + self.m;
        let survivors: Vec<usize> = (0..n).filter(|&i| !erased(i)).take(self.k).collect();
        let inv = self
            .gen
            .select_rows(&survivors)
            .invert()
            .expect("every k×k submatrix of a Cauchy-based generator is invertible");
        let mut coeffs = Vec::new();
        for e in (0..n).filter(|&i| erased(i)) {
            if e < self.k {
                coeffs.extend_from_slice(inv.row(e));
            } else {
                let row = self.gen.select_rows(&[e]).mul(&inv);
                coeffs.extend_from_slice(row.row(0));
            }
        }
        let plan = Arc::new(Plan { survivors, coeffs });
        let mut cache = self
            .cache
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if cache.len() >= CACHE_LIMIT {
            cache.clear();
        }
        cache.insert(key, plan.clone());
        plan
    }
}
