//! AVX2 kernels. Each processes the largest prefix it handles in whole vectors and returns its
//! length; the caller finishes the tail with the scalar kernels.
//!
//! Techniques (as in Linux `lib/raid6/avx2.c` and ISA-L, written afresh here):
//! - XOR over several sources keeps the accumulator in registers and stores once.
//! - Q by Horner's rule, q = 2q ^ D_i: multiplying 32 bytes by 2 is `vpaddb` (shift each byte
//!   left) plus `vpcmpgtb` against zero to get 0xff where the top bit was set, masked to 0x1d.
//! - Multiplication by any other constant c uses the split-nibble tables: c*x =
//!   T_lo[x & 15] ^ T_hi[x >> 4], each a `vpshufb` of a 16-byte table broadcast to both lanes.
//!
//! Safety: every function requires AVX2 (the dispatcher checks) and that every slice it is given
//! is at least as long as the first destination.

// Lint exception for this module only: every function is a `#[target_feature]` kernel made
// of vector loads, stores and intrinsics on raw pointers derived from slices the caller
// checked (the "Safety" paragraph above is the whole contract). Marking each of the ~90
// intrinsic calls `unsafe { }` with its own comment would repeat that one argument at every
// line and hide the arithmetic, so the contract is stated once, here and on each `unsafe fn`.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use crate::gf::NIB;

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn ld(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn st(p: *mut u8, v: __m256i) {
    _mm256_storeu_si256(p as *mut __m256i, v)
}

/// Low and high nibble tables of constant `c`, broadcast to both 128-bit lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn tables(c: u8) -> (__m256i, __m256i) {
    let t = NIB.as_ptr().add(c as usize) as *const u8;
    let lo = _mm256_broadcastsi128_si256(_mm_load_si128(t as *const __m128i));
    let hi = _mm256_broadcastsi128_si256(_mm_load_si128(t.add(16) as *const __m128i));
    (lo, hi)
}

/// c*x for 32 bytes, given x already split into nibbles.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn gmul(t: (__m256i, __m256i), lo: __m256i, hi: __m256i) -> __m256i {
    _mm256_xor_si256(_mm256_shuffle_epi8(t.0, lo), _mm256_shuffle_epi8(t.1, hi))
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(x: __m256i) -> (__m256i, __m256i) {
    let mask = _mm256_set1_epi8(0x0f);
    (
        _mm256_and_si256(x, mask),
        _mm256_and_si256(_mm256_srli_epi64(x, 4), mask),
    )
}

/// 2*x for 32 bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn mul2(x: __m256i) -> __m256i {
    let top = _mm256_cmpgt_epi8(_mm256_setzero_si256(), x);
    _mm256_xor_si256(
        _mm256_add_epi8(x, x),
        _mm256_and_si256(top, _mm256_set1_epi8(0x1d)),
    )
}

const U: usize = 4; // vectors per iteration of the XOR / P+Q loops (128 bytes)

#[target_feature(enable = "avx2")]
pub(crate) unsafe fn xor_into(dst: &mut [u8], src: &[u8]) -> usize {
    let n = dst.len() / (32 * U) * (32 * U);
    let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
    let mut off = 0;
    while off < n {
        for u in 0..U {
            let o = off + 32 * u;
            st(d.add(o), _mm256_xor_si256(ld(d.add(o)), ld(s.add(o))));
        }
        off += 32 * U;
    }
    n
}

#[target_feature(enable = "avx2")]
pub(crate) unsafe fn xor_gen(dst: &mut [u8], srcs: &[&[u8]]) -> usize {
    let Some((first, rest)) = srcs.split_first() else {
        return 0;
    };
    let n = dst.len() / (32 * U) * (32 * U);
    let d = dst.as_mut_ptr();
    let mut off = 0;
    while off < n {
        let f = first.as_ptr().add(off);
        let mut acc = [_mm256_setzero_si256(); U];
        for (u, a) in acc.iter_mut().enumerate() {
            *a = ld(f.add(32 * u));
        }
        for s in rest {
            let p = s.as_ptr().add(off);
            for (u, a) in acc.iter_mut().enumerate() {
                *a = _mm256_xor_si256(*a, ld(p.add(32 * u)));
            }
        }
        for (u, a) in acc.iter().enumerate() {
            st(d.add(off + 32 * u), *a);
        }
        off += 32 * U;
    }
    n
}

#[target_feature(enable = "avx2")]
pub(crate) unsafe fn pq_gen(srcs: &[&[u8]], p: &mut [u8], q: &mut [u8]) -> usize {
    let Some((last, rest)) = srcs.split_last() else {
        return 0;
    };
    let n = p.len() / (32 * U) * (32 * U);
    let (pp, qp) = (p.as_mut_ptr(), q.as_mut_ptr());
    let mut off = 0;
    while off < n {
        let l = last.as_ptr().add(off);
        let mut pv = [_mm256_setzero_si256(); U];
        for (u, v) in pv.iter_mut().enumerate() {
            *v = ld(l.add(32 * u));
        }
        let mut qv = pv;
        for s in rest.iter().rev() {
            let sp = s.as_ptr().add(off);
            for u in 0..U {
                let d = ld(sp.add(32 * u));
                pv[u] = _mm256_xor_si256(pv[u], d);
                qv[u] = _mm256_xor_si256(mul2(qv[u]), d);
            }
        }
        for u in 0..U {
            st(pp.add(off + 32 * u), pv[u]);
            st(qp.add(off + 32 * u), qv[u]);
        }
        off += 32 * U;
    }
    n
}

/// buf = c * buf.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn mul_inplace(c: u8, buf: &mut [u8]) -> usize {
    let n = buf.len() / 64 * 64;
    let t = tables(c);
    let b = buf.as_mut_ptr();
    let mut off = 0;
    while off < n {
        let (l0, h0) = nibbles(ld(b.add(off)));
        let (l1, h1) = nibbles(ld(b.add(off + 32)));
        st(b.add(off), gmul(t, l0, h0));
        st(b.add(off + 32), gmul(t, l1, h1));
        off += 64;
    }
    n
}

/// delta = old ^ new; p ^= delta; q ^= c * delta.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn pq_update(old: &[u8], new: &[u8], c: u8, p: &mut [u8], q: &mut [u8]) -> usize {
    let n = p.len() / 64 * 64;
    let t = tables(c);
    let (o, w, pp, qp) = (old.as_ptr(), new.as_ptr(), p.as_mut_ptr(), q.as_mut_ptr());
    let mut off = 0;
    while off < n {
        for u in 0..2 {
            let x = off + 32 * u;
            let d = _mm256_xor_si256(ld(o.add(x)), ld(w.add(x)));
            st(pp.add(x), _mm256_xor_si256(ld(pp.add(x)), d));
            let (lo, hi) = nibbles(d);
            st(qp.add(x), _mm256_xor_si256(ld(qp.add(x)), gmul(t, lo, hi)));
        }
        off += 64;
    }
    n
}

/// dsts[j] (^)= sum over i of coeffs[j * k + i] * srcs[i] over `[from..to]`, N outputs at
/// once so each source vector is loaded and split into nibbles once for all N products, and
/// U vectors per step for instruction-level parallelism. A coefficient of 1 (the whole first
/// parity row of [`crate::ReedSolomon`]) is a plain XOR.
// Parallel fixed-size arrays indexed by output and vector: index loops read clearest.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2")]
unsafe fn dot_prod_n<const N: usize, const U: usize>(
    coeffs: &[u8],
    srcs: &[&[u8]],
    dsts: &mut [&mut [u8]],
    from: usize,
    to: usize,
    accumulate: bool,
) {
    let k = srcs.len();
    debug_assert!(dsts.len() == N && coeffs.len() >= N * k);
    let mut dp = [std::ptr::null_mut::<u8>(); N];
    for (p, d) in dp.iter_mut().zip(dsts.iter_mut()) {
        *p = d.as_mut_ptr();
    }
    let cp = coeffs.as_ptr();
    let mut off = from;
    while off < to {
        let mut acc = [[_mm256_setzero_si256(); U]; N];
        if accumulate {
            for j in 0..N {
                for u in 0..U {
                    acc[j][u] = ld(dp[j].add(off + 32 * u));
                }
            }
        }
        for (i, s) in srcs.iter().enumerate() {
            let sp = s.as_ptr().add(off);
            let mut d = [_mm256_setzero_si256(); U];
            let mut lo = [_mm256_setzero_si256(); U];
            let mut hi = [_mm256_setzero_si256(); U];
            for u in 0..U {
                d[u] = ld(sp.add(32 * u));
                (lo[u], hi[u]) = nibbles(d[u]);
            }
            for (j, a) in acc.iter_mut().enumerate() {
                let c = *cp.add(j * k + i);
                if c == 1 {
                    for u in 0..U {
                        a[u] = _mm256_xor_si256(a[u], d[u]);
                    }
                } else {
                    let t = tables(c);
                    for u in 0..U {
                        a[u] = _mm256_xor_si256(a[u], gmul(t, lo[u], hi[u]));
                    }
                }
            }
        }
        for j in 0..N {
            for u in 0..U {
                st(dp[j].add(off + 32 * u), acc[j][u]);
            }
        }
        off += 32 * U;
    }
}

#[target_feature(enable = "avx2")]
unsafe fn dot_prod_group<const N: usize>(
    coeffs: &[u8],
    srcs: &[&[u8]],
    dsts: &mut [&mut [u8]],
    n: usize,
    accumulate: bool,
) {
    let n2 = n / 64 * 64;
    dot_prod_n::<N, 2>(coeffs, srcs, dsts, 0, n2, accumulate);
    dot_prod_n::<N, 1>(coeffs, srcs, dsts, n2, n, accumulate);
}

/// Up to four outputs per pass over the sources; more outputs take more passes.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn dot_prod(
    coeffs: &[u8],
    srcs: &[&[u8]],
    dsts: &mut [&mut [u8]],
    accumulate: bool,
) -> usize {
    let Some(first) = dsts.first() else {
        return 0;
    };
    let n = first.len() / 32 * 32;
    let k = srcs.len();
    if k == 0 {
        return 0;
    }
    let mut row = 0;
    for group in dsts.chunks_mut(4) {
        let c = &coeffs[row * k..];
        match group.len() {
            4 => dot_prod_group::<4>(c, srcs, group, n, accumulate),
            3 => dot_prod_group::<3>(c, srcs, group, n, accumulate),
            2 => dot_prod_group::<2>(c, srcs, group, n, accumulate),
            _ => dot_prod_group::<1>(c, srcs, group, n, accumulate),
        }
        row += group.len();
    }
    n
}
