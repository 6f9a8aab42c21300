//! Kernel dispatch: one [`Backend`] chosen at run time (AVX-512 with GFNI, else AVX2, else
//! portable), and explicit `*_with` entry points so tests and benchmarks can compare
//! backends on the same input.
//!
//! The SIMD kernels handle whole vectors; the scalar kernels finish any tail, so every length
//! is accepted (including lengths that are not multiples of 32).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod scalar;

use std::sync::atomic::{AtomicU8, Ordering};

/// Which implementation of the kernels runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Portable: 64-bit words for XOR and multiply-by-2, a product table otherwise.
    Scalar,
    /// x86_64 AVX2: 256-bit XOR, `vpshufb` split-nibble multiplication.
    Avx2,
    /// x86_64 AVX-512 F+BW with GFNI: 512-bit XOR, multiplication by a constant with one
    /// `vgf2p8affineqb` (Ice Lake, Sapphire Rapids, Zen 4 and later).
    Avx512Gfni,
}

static DETECTED: AtomicU8 = AtomicU8::new(0);

impl Backend {
    /// Every backend, available on this CPU or not.
    pub const ALL: [Backend; 3] = [Backend::Scalar, Backend::Avx2, Backend::Avx512Gfni];

    /// Whether this CPU can run the backend (checked with `is_x86_feature_detected!`).
    pub fn is_available(self) -> bool {
        match self {
            Backend::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512Gfni => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("gfni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Backend::Avx2 | Backend::Avx512Gfni => false,
        }
    }

    /// The backend the crate's functions use, chosen once and cached: the environment variable
    /// `TESSERA_PARITY_BACKEND` (`scalar`, `avx2`, `avx512`) if set and available on this
    /// CPU, else the fastest available.
    pub fn detect() -> Backend {
        match DETECTED.load(Ordering::Relaxed) {
            1 => Backend::Scalar,
            2 => Backend::Avx2,
            3 => Backend::Avx512Gfni,
            _ => {
                let wanted = match std::env::var("TESSERA_PARITY_BACKEND").as_deref() {
                    Ok("scalar") => Some(Backend::Scalar),
                    Ok("avx2") => Some(Backend::Avx2),
                    Ok("avx512") => Some(Backend::Avx512Gfni),
                    _ => None,
                };
                let b = wanted
                    .filter(|b| b.is_available())
                    .or_else(|| Backend::ALL.into_iter().rev().find(|b| b.is_available()))
                    .unwrap_or(Backend::Scalar);
                let code = match b {
                    Backend::Scalar => 1,
                    Backend::Avx2 => 2,
                    Backend::Avx512Gfni => 3,
                };
                DETECTED.store(code, Ordering::Relaxed);
                b
            }
        }
    }

    /// The backends this CPU can run, scalar first.
    pub fn available() -> Vec<Backend> {
        Backend::ALL
            .into_iter()
            .filter(|b| b.is_available())
            .collect()
    }

    fn check(self) {
        assert!(self.is_available(), "{self:?} is not available on this CPU");
    }
}

fn same_len(len: usize, slices: &[&[u8]], what: &str) {
    for s in slices {
        assert_eq!(s.len(), len, "{what}: block lengths differ");
    }
}

/// dst ^= src.
pub fn xor_into_with(be: Backend, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "xor_into: block lengths differ");
    be.check();
    let done = match be {
        Backend::Scalar => 0,
        // SAFETY: the CPU features were checked above; lengths checked.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => unsafe { avx2::xor_into(dst, src) },
        // SAFETY: as for AVX2 above (the backend is chosen only when the CPU has it).
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512Gfni => unsafe { avx512::xor_into(dst, src) },
        #[cfg(not(target_arch = "x86_64"))]
        Backend::Avx2 | Backend::Avx512Gfni => unreachable!(),
    };
    scalar::xor_into(dst, src, done);
}

/// dst = xor of all srcs (zero if there are none).
pub fn xor_gen_with(be: Backend, dst: &mut [u8], srcs: &[&[u8]]) {
    same_len(dst.len(), srcs, "xor_parity");
    be.check();
    let done = match be {
        Backend::Scalar => 0,
        // SAFETY: the CPU features were checked above; lengths checked.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => unsafe { avx2::xor_gen(dst, srcs) },
        // SAFETY: as for AVX2 above (the backend is chosen only when the CPU has it).
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512Gfni => unsafe { avx512::xor_gen(dst, srcs) },
        #[cfg(not(target_arch = "x86_64"))]
        Backend::Avx2 | Backend::Avx512Gfni => unreachable!(),
    };
    scalar::xor_gen(dst, srcs, done);
}

/// `p` = xor of `srcs`, `q` = sum of `2^i * srcs[i]`.
pub fn pq_gen_with(be: Backend, srcs: &[&[u8]], p: &mut [u8], q: &mut [u8]) {
    same_len(p.len(), srcs, "pq_gen");
    assert_eq!(p.len(), q.len(), "pq_gen: block lengths differ");
    be.check();
    let done = match be {
        Backend::Scalar => 0,
        // SAFETY: the CPU features were checked above; lengths checked.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => unsafe { avx2::pq_gen(srcs, p, q) },
        // SAFETY: as for AVX2 above (the backend is chosen only when the CPU has it).
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512Gfni => unsafe { avx512::pq_gen(srcs, p, q) },
        #[cfg(not(target_arch = "x86_64"))]
        Backend::Avx2 | Backend::Avx512Gfni => unreachable!(),
    };
    scalar::pq_gen(srcs, p, q, done);
}

/// dst ^= c * src.
pub fn mul_add_with(be: Backend, c: u8, src: &[u8], dst: &mut [u8]) {
    dot_prod_with(be, &[c], &[src], &mut [dst], true);
}

/// buf = c * buf.
pub fn mul_inplace_with(be: Backend, c: u8, buf: &mut [u8]) {
    be.check();
    let done = match be {
        Backend::Scalar => 0,
        // SAFETY: the CPU features were checked above.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => unsafe { avx2::mul_inplace(c, buf) },
        // SAFETY: as for AVX2 above (the backend is chosen only when the CPU has it).
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512Gfni => unsafe { avx512::mul_inplace(c, buf) },
        #[cfg(not(target_arch = "x86_64"))]
        Backend::Avx2 | Backend::Avx512Gfni => unreachable!(),
    };
    scalar::mul_inplace(c, buf, done);
}

/// delta = old ^ new; p ^= delta; q ^= c * delta — one pass, no delta buffer.
pub fn pq_update_with(be: Backend, old: &[u8], new: &[u8], c: u8, p: &mut [u8], q: &mut [u8]) {
    same_len(p.len(), &[old, new, q], "pq_update");
    be.check();
    let done = match be {
        Backend::Scalar => 0,
        // SAFETY: the CPU features were checked above; lengths checked.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => unsafe { avx2::pq_update(old, new, c, p, q) },
        // SAFETY: as for AVX2 above (the backend is chosen only when the CPU has it).
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512Gfni => unsafe { avx512::pq_update(old, new, c, p, q) },
        #[cfg(not(target_arch = "x86_64"))]
        Backend::Avx2 | Backend::Avx512Gfni => unreachable!(),
    };
    scalar::pq_update(old, new, c, p, q, done);
}

/// Matrix-times-blocks: `dsts[j] = sum over i of coeffs[j * k + i] * srcs[i]` with
/// k = `srcs.len()`, or `^=` that sum into `dsts[j]` when `accumulate`.
///
/// `coeffs` is row-major, one row of k coefficients per destination.
pub fn dot_prod_with(
    be: Backend,
    coeffs: &[u8],
    srcs: &[&[u8]],
    dsts: &mut [&mut [u8]],
    accumulate: bool,
) {
    let Some(len) = dsts.first().map(|d| d.len()) else {
        return;
    };
    for d in dsts.iter() {
        assert_eq!(d.len(), len, "dot_prod: block lengths differ");
    }
    same_len(len, srcs, "dot_prod");
    assert!(
        coeffs.len() >= dsts.len() * srcs.len(),
        "dot_prod: {} coefficients for {}x{}",
        coeffs.len(),
        dsts.len(),
        srcs.len()
    );
    be.check();
    let done = match be {
        Backend::Scalar => 0,
        // SAFETY: the CPU features were checked above; lengths checked.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => unsafe { avx2::dot_prod(coeffs, srcs, dsts, accumulate) },
        // SAFETY: as for AVX2 above (the backend is chosen only when the CPU has it).
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512Gfni => unsafe { avx512::dot_prod(coeffs, srcs, dsts, accumulate) },
        #[cfg(not(target_arch = "x86_64"))]
        Backend::Avx2 | Backend::Avx512Gfni => unreachable!(),
    };
    scalar::dot_prod(coeffs, srcs, dsts, done, accumulate);
}
