//! RAID5 (P = XOR) and RAID6 (P + Q) parity over a stripe of equal-length blocks.
//!
//! RAID6 follows Linux md: P = D_0 ^ D_1 ^ .. and Q = g^0·D_0 ^ g^1·D_1 ^ .. in GF(2^8) with
//! g = 2 and the polynomial 0x11d, so at most 255 data blocks per stripe.

use crate::gf;
use crate::kernels::{self, Backend};
use crate::ParityError;

/// `dst ^= src`. Panics if the lengths differ.
///
/// RAID5 read-modify-write is `xor_into(p, old); xor_into(p, new)`; for Reed-Solomon,
/// `xor_into(old, new)` turns the old-data buffer into the delta that
/// [`ReedSolomon::update_parity`](crate::ReedSolomon::update_parity) takes.
pub fn xor_into(dst: &mut [u8], src: &[u8]) {
    kernels::xor_into_with(Backend::detect(), dst, src);
}

/// RAID5 parity: `dst = data[0] ^ data[1] ^ ..` in one pass (the accumulator stays in
/// registers, `dst` is written once). Zero when `data` is empty. Panics if lengths differ.
pub fn xor_parity(dst: &mut [u8], data: &[&[u8]]) {
    kernels::xor_gen_with(Backend::detect(), dst, data);
}

/// RAID6 syndromes: `p = xor of data`, `q = sum of 2^i · data[i]`, computed in one pass by
/// Horner's rule (`q = 2q ^ D_i` from the last block down), which needs only
/// multiplication by 2 — a shift and a masked XOR — rather than a table lookup per byte.
///
/// Panics if lengths differ or `data.len() > 255`.
pub fn pq_gen(data: &[&[u8]], p: &mut [u8], q: &mut [u8]) {
    assert!(data.len() <= 255, "RAID6 supports at most 255 data blocks");
    kernels::pq_gen_with(Backend::detect(), data, p, q);
}

/// Read-modify-write of one RAID6 data block: given the block's old and new contents and its
/// index in the stripe, updates P and Q in place (`P ^= Δ`, `Q ^= 2^index · Δ` with
/// `Δ = old ^ new`), so a small write reads only the old data, P and Q. One pass, no
/// temporary buffer. Works on any sub-range as long as all four slices cover the same one.
///
/// Panics if lengths differ or `index >= 255`.
pub fn pq_update(old: &[u8], new: &[u8], index: usize, p: &mut [u8], q: &mut [u8]) {
    assert!(index < 255, "RAID6 data index must be < 255");
    kernels::pq_update_with(Backend::detect(), old, new, gf::exp(index), p, q);
}

/// Rebuilds up to two missing blocks of a RAID6 stripe.
///
/// `blocks` is the whole stripe in order: data blocks `0..n`, then P (index `n`), then Q
/// (index `n + 1`), all the same length. `missing` lists the indices to rebuild; their
/// contents on entry are ignored and overwritten. Present blocks are only read, never
/// written.
///
/// Every missing block is a fixed linear combination of the present ones, so each case is
/// one pass over the survivors (the matrix-times-blocks kernel, or plain XOR when all
/// coefficients are 1):
/// - one data block D_x: `P ^ (other data)`;
/// - D_x and P: `D_x = g^-x · (Q ^ sum of g^i D_i over the others)`, and P follows;
/// - D_x and Q: D_x from P as above, and `Q = g^x P ^ sum of (g^i ^ g^x) D_i`;
/// - D_x and D_y: with `dp = P ^ (others) = D_x ^ D_y` and `dq = Q ^ sum g^i D_i =
///   g^x D_x ^ g^y D_y`, `D_x = (g^y dp ^ dq) / (g^x ^ g^y)` and `D_y = dp ^ D_x`;
/// - P and/or Q alone: regenerated from the data.
pub fn pq_recover(blocks: &mut [&mut [u8]], missing: &[usize]) -> Result<(), ParityError> {
    let be = Backend::detect();
    if blocks.len() < 3 {
        return Err(ParityError::InvalidGeometry);
    }
    let n = blocks.len() - 2;
    if n > 255 {
        return Err(ParityError::InvalidGeometry);
    }
    let len = blocks[0].len();
    if blocks.iter().any(|b| b.len() != len) {
        return Err(ParityError::LengthMismatch);
    }
    let mut miss: Vec<usize> = missing.to_vec();
    miss.sort_unstable();
    miss.dedup();
    if miss.len() != missing.len() {
        return Err(ParityError::DuplicateIndex);
    }
    if let Some(&i) = miss.iter().find(|&&i| i >= n + 2) {
        return Err(ParityError::IndexOutOfRange(i));
    }
    if miss.len() > 2 {
        return Err(ParityError::TooManyErasures {
            erased: miss.len(),
            max: 2,
        });
    }
    if miss.is_empty() {
        return Ok(());
    }
    let (pi, qi) = (n, n + 1);
    // One row of n + 2 coefficients (over the whole stripe) per missing block.
    let width = n + 2;
    let mut rows = vec![0u8; miss.len() * width];
    let g = gf::exp;
    match miss[..] {
        [p, q] if p == pi && q == qi => {
            // Both syndromes: Horner's rule beats two matrix rows.
            let mut srcs: Vec<&[u8]> = Vec::with_capacity(n);
            let mut outs: Vec<&mut [u8]> = Vec::with_capacity(2);
            for (i, b) in blocks.iter_mut().enumerate() {
                if i < n {
                    srcs.push(&**b);
                } else {
                    outs.push(&mut **b);
                }
            }
            let (po, qo) = outs.split_at_mut(1);
            kernels::pq_gen_with(be, &srcs, po[0], qo[0]);
            return Ok(());
        }
        [p] if p == pi => rows[..n].fill(1),
        [q] if q == qi => (0..n).for_each(|i| rows[i] = g(i)),
        [x] => {
            rows[..n].fill(1);
            rows[x] = 0;
            rows[pi] = 1;
        }
        [x, p] if p == pi => {
            let ginv = gf::inv(g(x));
            let (dx, pr) = rows.split_at_mut(width);
            for i in (0..n).filter(|&i| i != x) {
                dx[i] = gf::mul(ginv, g(i));
                pr[i] = 1 ^ dx[i];
            }
            dx[qi] = ginv;
            pr[qi] = ginv;
        }
        [x, q] if q == qi => {
            let (dx, qr) = rows.split_at_mut(width);
            for i in (0..n).filter(|&i| i != x) {
                dx[i] = 1;
                qr[i] = g(i) ^ g(x);
            }
            dx[pi] = 1;
            qr[pi] = g(x);
        }
        [x, y] => {
            let denom = g(x) ^ g(y);
            let (a, b) = (gf::div(g(y), denom), gf::inv(denom));
            let (dx, dy) = rows.split_at_mut(width);
            for i in (0..n).filter(|&i| i != x && i != y) {
                dx[i] = a ^ gf::mul(b, g(i));
                dy[i] = 1 ^ dx[i];
            }
            (dx[pi], dx[qi]) = (a, b);
            (dy[pi], dy[qi]) = (1 ^ a, b);
        }
        _ => unreachable!("missing set {miss:?} not handled"),
    }
    // Read only the blocks some row needs; compact the rows to those columns.
    let used: Vec<usize> = (0..width)
        .filter(|&c| (0..miss.len()).any(|r| rows[r * width + c] != 0))
        .collect();
    let mut coeffs = Vec::with_capacity(miss.len() * used.len());
    for r in 0..miss.len() {
        coeffs.extend(used.iter().map(|&c| rows[r * width + c]));
    }
    let mut srcs: Vec<&[u8]> = Vec::with_capacity(used.len());
    let mut outs: Vec<&mut [u8]> = Vec::with_capacity(miss.len());
    for (i, b) in blocks.iter_mut().enumerate() {
        if miss.contains(&i) {
            outs.push(&mut **b);
        } else if used.binary_search(&i).is_ok() {
            srcs.push(&**b);
        }
    }
    if outs.len() == 1 && coeffs.iter().all(|&c| c == 1) {
        kernels::xor_gen_with(be, outs[0], &srcs);
    } else {
        kernels::dot_prod_with(be, &coeffs, &srcs, &mut outs, false);
    }
    Ok(())
}
