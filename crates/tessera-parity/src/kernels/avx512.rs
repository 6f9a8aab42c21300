//! AVX-512 (F + BW) with GFNI kernels: the AVX2 algorithms on 512-bit vectors, with
//! multiplication by a constant done by one `vgf2p8affineqb` per 64 bytes (see
//! [`crate::gf`]'s affine tables) instead of two nibble lookups.
//!
//! Same contract as the AVX2 kernels: each handles a whole-vector prefix and returns its
//! length; the caller finishes the tail. Safety: requires avx512f, avx512bw and gfni (the
//! dispatcher checks) and slices at least as long as the first destination.

// Lint exception for this module only: every function is a `#[target_feature]` kernel made
// of vector loads, stores and intrinsics on raw pointers derived from slices the caller
// checked (the "Safety" paragraph above is the whole contract). Marking each of the ~90
// intrinsic calls `unsafe { }` with its own comment would repeat that one argument at every
// line and hide the arithmetic, so the contract is stated once, here and on each `unsafe fn`.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use crate::gf::AFFINE;

#[inline]
#[target_feature(enable = "avx512f,avx512bw,gfni")]
unsafe fn ld(p: *const u8) -> __m512i {
    _mm512_loadu_si512(p as *const __m512i)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,gfni")]
unsafe fn st(p: *mut u8, v: __m512i) {
    _mm512_storeu_si512(p as *mut __m512i, v)
}

/// The affine matrix of constant `c` in every qword.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,gfni")]
unsafe fn matrix(c: u8) -> __m512i {
    _mm512_set1_epi64(*AFFINE.as_ptr().add(c as usize) as i64)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,gfni")]
unsafe fn gmul(m: __m512i, x: __m512i) -> __m512i {
    _mm512_gf2p8affine_epi64_epi8::<0>(x, m)
}

const U: usize = 4; // vectors per iteration of the XOR / P+Q loops (256 bytes)
const W: usize = 64 * U;

#[target_feature(enable = "avx512f,avx512bw,gfni")]
pub(crate) unsafe fn xor_into(dst: &mut [u8], src: &[u8]) -> usize {
    let n = dst.len() / W * W;
    let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
    let mut off = 0;
    while off < n {
        for u in 0..U {
            let o = off + 64 * u;
            st(d.add(o), _mm512_xor_si512(ld(d.add(o)), ld(s.add(o))));
        }
        off += W;
    }
    n
}

#[target_feature(enable = "avx512f,avx512bw,gfni")]
pub(crate) unsafe fn xor_gen(dst: &mut [u8], srcs: &[&[u8]]) -> usize {
    let Some((first, rest)) = srcs.split_first() else {
        return 0;
    };
    let n = dst.len() / W * W;
    let d = dst.as_mut_ptr();
    let mut off = 0;
    while off < n {
        let f = first.as_ptr().add(off);
        let mut acc = [_mm512_setzero_si512(); U];
        for (u, a) in acc.iter_mut().enumerate() {
            *a = ld(f.add(64 * u));
        }
        for s in rest {
            let p = s.as_ptr().add(off);
            for (u, a) in acc.iter_mut().enumerate() {
                *a = _mm512_xor_si512(*a, ld(p.add(64 * u)));
            }
        }
        for (u, a) in acc.iter().enumerate() {
            st(d.add(off + 64 * u), *a);
        }
        off += W;
    }
    n
}

#[target_feature(enable = "avx512f,avx512bw,gfni")]
pub(crate) unsafe fn pq_gen(srcs: &[&[u8]], p: &mut [u8], q: &mut [u8]) -> usize {
    let Some((first, rest)) = srcs.split_first() else {
        return 0;
    };
    // Q = sum of g^i D_i with each product one independent `vgf2p8affineqb` (D_0's
    // coefficient is 1: a plain XOR), rather than Horner's rule (Q = 2Q ^ D_i), whose
    // multiply-by-2 is four instructions on one dependency chain per vector.
    let mut mats = [0u64; 255];
    for (i, m) in mats.iter_mut().enumerate().take(srcs.len()).skip(1) {
        *m = AFFINE[crate::gf::exp(i) as usize];
    }
    let n = p.len() / W * W;
    let (pp, qp) = (p.as_mut_ptr(), q.as_mut_ptr());
    let mut off = 0;
    while off < n {
        let f = first.as_ptr().add(off);
        let mut pv = [_mm512_setzero_si512(); U];
        for (u, v) in pv.iter_mut().enumerate() {
            *v = ld(f.add(64 * u));
        }
        let mut qv = pv;
        for (i, s) in rest.iter().enumerate() {
            let sp = s.as_ptr().add(off);
            let m = _mm512_set1_epi64(mats[i + 1] as i64);
            for u in 0..U {
                let d = ld(sp.add(64 * u));
                pv[u] = _mm512_xor_si512(pv[u], d);
                qv[u] = _mm512_xor_si512(qv[u], gmul(m, d));
            }
        }
        for u in 0..U {
            st(pp.add(off + 64 * u), pv[u]);
            st(qp.add(off + 64 * u), qv[u]);
        }
        off += W;
    }
    n
}

/// buf = c * buf.
#[target_feature(enable = "avx512f,avx512bw,gfni")]
pub(crate) unsafe fn mul_inplace(c: u8, buf: &mut [u8]) -> usize {
    let n = buf.len() / 128 * 128;
    let m = matrix(c);
    let b = buf.as_mut_ptr();
    let mut off = 0;
    while off < n {
        let (x0, x1) = (ld(b.add(off)), ld(b.add(off + 64)));
        st(b.add(off), gmul(m, x0));
        st(b.add(off + 64), gmul(m, x1));
        off += 128;
    }
    n
}

/// delta = old ^ new; p ^= delta; q ^= c * delta.
#[target_feature(enable = "avx512f,avx512bw,gfni")]
pub(crate) unsafe fn pq_update(old: &[u8], new: &[u8], c: u8, p: &mut [u8], q: &mut [u8]) -> usize {
    let n = p.len() / 128 * 128;
    let m = matrix(c);
    let (o, w, pp, qp) = (old.as_ptr(), new.as_ptr(), p.as_mut_ptr(), q.as_mut_ptr());
    let mut off = 0;
    while off < n {
        for u in 0..2 {
            let x = off + 64 * u;
            let d = _mm512_xor_si512(ld(o.add(x)), ld(w.add(x)));
            st(pp.add(x), _mm512_xor_si512(ld(pp.add(x)), d));
            st(qp.add(x), _mm512_xor_si512(ld(qp.add(x)), gmul(m, d)));
        }
        off += 128;
    }
    n
}

/// dsts[j] (^)= sum over i of coeffs[j * k + i] * srcs[i] over `[from..to]`: N outputs and
/// UN vectors per step, a coefficient of 1 as a plain XOR (see the AVX2 version).
// Parallel fixed-size arrays indexed by output and vector: index loops read clearest.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,gfni")]
unsafe fn dot_prod_n<const N: usize, const UN: usize>(
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
        let mut acc = [[_mm512_setzero_si512(); UN]; N];
        if accumulate {
            for j in 0..N {
                for u in 0..UN {
                    acc[j][u] = ld(dp[j].add(off + 64 * u));
                }
            }
        }
        for (i, s) in srcs.iter().enumerate() {
            let sp = s.as_ptr().add(off);
            let mut d = [_mm512_setzero_si512(); UN];
            for u in 0..UN {
                d[u] = ld(sp.add(64 * u));
            }
            for (j, a) in acc.iter_mut().enumerate() {
                let c = *cp.add(j * k + i);
                if c == 1 {
                    for u in 0..UN {
                        a[u] = _mm512_xor_si512(a[u], d[u]);
                    }
                } else {
                    let m = matrix(c);
                    for u in 0..UN {
                        a[u] = _mm512_xor_si512(a[u], gmul(m, d[u]));
                    }
                }
            }
        }
        for j in 0..N {
            for u in 0..UN {
                st(dp[j].add(off + 64 * u), acc[j][u]);
            }
        }
        off += 64 * UN;
    }
}

#[target_feature(enable = "avx512f,avx512bw,gfni")]
unsafe fn dot_prod_group<const N: usize>(
    coeffs: &[u8],
    srcs: &[&[u8]],
    dsts: &mut [&mut [u8]],
    n: usize,
    accumulate: bool,
) {
    let n2 = n / 128 * 128;
    dot_prod_n::<N, 2>(coeffs, srcs, dsts, 0, n2, accumulate);
    dot_prod_n::<N, 1>(coeffs, srcs, dsts, n2, n, accumulate);
}

/// Up to four outputs per pass over the sources; more outputs take more passes.
#[target_feature(enable = "avx512f,avx512bw,gfni")]
pub(crate) unsafe fn dot_prod(
    coeffs: &[u8],
    srcs: &[&[u8]],
    dsts: &mut [&mut [u8]],
    accumulate: bool,
) -> usize {
    let Some(first) = dsts.first() else {
        return 0;
    };
    let n = first.len() / 64 * 64;
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
