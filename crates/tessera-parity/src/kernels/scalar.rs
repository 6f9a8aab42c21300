//! Portable kernels: 64-bit words for XOR and for multiplication by 2 (the SWAR trick of
//! Linux's `int.uc`), a 64 KiB product table for multiplication by other constants. Every
//! function works on `[start..]` so the SIMD kernels can hand it their tails.

use crate::gf::{mul2, MUL};

#[inline(always)]
fn rd(s: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(s[off..off + 8].try_into().unwrap())
}

#[inline(always)]
fn wr(d: &mut [u8], off: usize, v: u64) {
    d[off..off + 8].copy_from_slice(&v.to_ne_bytes());
}

/// Multiplies each of the eight bytes of `v` by 2 in GF(2^8).
#[inline(always)]
fn mul2_u64(v: u64) -> u64 {
    let hi = v & 0x8080_8080_8080_8080;
    // 0xff in every byte whose top bit was set.
    let mask = (hi << 1).wrapping_sub(hi >> 7);
    ((v << 1) & 0xfefe_fefe_fefe_fefe) ^ (mask & 0x1d1d_1d1d_1d1d_1d1d)
}

pub(crate) fn xor_into(dst: &mut [u8], src: &[u8], start: usize) {
    let n = dst.len();
    let mut off = start;
    while off + 8 <= n {
        let v = rd(dst, off) ^ rd(src, off);
        wr(dst, off, v);
        off += 8;
    }
    while off < n {
        dst[off] ^= src[off];
        off += 1;
    }
}

pub(crate) fn xor_gen(dst: &mut [u8], srcs: &[&[u8]], start: usize) {
    let n = dst.len();
    let Some((first, rest)) = srcs.split_first() else {
        dst[start..].fill(0);
        return;
    };
    let mut off = start;
    while off + 8 <= n {
        let mut acc = rd(first, off);
        for s in rest {
            acc ^= rd(s, off);
        }
        wr(dst, off, acc);
        off += 8;
    }
    while off < n {
        let mut acc = first[off];
        for s in rest {
            acc ^= s[off];
        }
        dst[off] = acc;
        off += 1;
    }
}

/// P = xor of all, Q by Horner's rule from the highest index down: q = 2q ^ D_i.
pub(crate) fn pq_gen(srcs: &[&[u8]], p: &mut [u8], q: &mut [u8], start: usize) {
    let n = p.len();
    let Some((last, rest)) = srcs.split_last() else {
        p[start..].fill(0);
        q[start..].fill(0);
        return;
    };
    let mut off = start;
    while off + 8 <= n {
        let mut pv = rd(last, off);
        let mut qv = pv;
        for s in rest.iter().rev() {
            let d = rd(s, off);
            pv ^= d;
            qv = mul2_u64(qv) ^ d;
        }
        wr(p, off, pv);
        wr(q, off, qv);
        off += 8;
    }
    while off < n {
        let mut pv = last[off];
        let mut qv = pv;
        for s in rest.iter().rev() {
            let d = s[off];
            pv ^= d;
            qv = mul2(qv) ^ d;
        }
        p[off] = pv;
        q[off] = qv;
        off += 1;
    }
}

/// dst ^= c * src over `[start..]`.
pub(crate) fn mul_add(c: u8, src: &[u8], dst: &mut [u8], start: usize) {
    match c {
        0 => {}
        1 => xor_into(dst, src, start),
        _ => {
            let row = &MUL[c as usize];
            for (d, s) in dst[start..].iter_mut().zip(&src[start..]) {
                *d ^= row[*s as usize];
            }
        }
    }
}

pub(crate) fn mul_inplace(c: u8, buf: &mut [u8], start: usize) {
    let row = &MUL[c as usize];
    for b in &mut buf[start..] {
        *b = row[*b as usize];
    }
}

/// dsts[j] (^)= sum over i of coeffs[j * k + i] * srcs[i], where k = srcs.len().
pub(crate) fn dot_prod(
    coeffs: &[u8],
    srcs: &[&[u8]],
    dsts: &mut [&mut [u8]],
    start: usize,
    accumulate: bool,
) {
    let k = srcs.len();
    for (j, dst) in dsts.iter_mut().enumerate() {
        if !accumulate {
            dst[start..].fill(0);
        }
        for (i, src) in srcs.iter().enumerate() {
            mul_add(coeffs[j * k + i], src, dst, start);
        }
    }
}

/// delta = old ^ new; p ^= delta; q ^= c * delta.
pub(crate) fn pq_update(old: &[u8], new: &[u8], c: u8, p: &mut [u8], q: &mut [u8], start: usize) {
    let row = &MUL[c as usize];
    for i in start..p.len() {
        let d = old[i] ^ new[i];
        p[i] ^= d;
        q[i] ^= row[d as usize];
    }
}
