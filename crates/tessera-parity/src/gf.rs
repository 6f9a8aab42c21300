//! Arithmetic in GF(2^8), the field every parity scheme of this crate works in.
//!
//! The field is built from the polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11d). That is the
//! polynomial of Linux md raid6 and of Intel ISA-L, so a Q block computed here is
//! bit-for-bit the Q that Linux writes, and 2 (the polynomial `x`) is a primitive element:
//! its powers g^0..g^254 are all distinct, which is what lets RAID6 tell up to 255 data
//! blocks apart and what makes multiplying by 2 a shift plus a conditional XOR of 0x1d.
//!
//! Tables are computed at compile time by `const fn`s, so there is no initialisation at run
//! time and no lazy-init check on the datapath.

/// The field polynomial, x^8 + x^4 + x^3 + x^2 + 1.
pub const POLY: u16 = 0x11d;

/// The generator used for RAID6 Q: Q = sum over i of g^i * D_i.
pub const GENERATOR: u8 = 2;

#[allow(clippy::cast_possible_truncation)] // x < 0x100 after reduction; i < 255
const fn build_exp_log() -> ([u8; 512], [u8; 256]) {
    let mut exp = [0u8; 512];
    let mut log = [0u8; 256];
    let mut x: u16 = 1;
    let mut i = 0;
    while i < 255 {
        exp[i] = x as u8;
        exp[i + 255] = x as u8;
        log[x as usize] = i as u8;
        x <<= 1;
        if x & 0x100 != 0 {
            x ^= POLY;
        }
        i += 1;
    }
    // exp[510..512] are never reached by log(a) + log(b) (at most 508); keep them defined.
    exp[510] = exp[0];
    exp[511] = exp[1];
    (exp, log)
}

const EXP_LOG: ([u8; 512], [u8; 256]) = build_exp_log();
/// exp[i] = g^i for i in 0..510 (doubled so that exp[log a + log b] needs no reduction).
const EXP_C: [u8; 512] = EXP_LOG.0;
/// log[a] for a != 0; log[0] is meaningless (0).
const LOG_C: [u8; 256] = EXP_LOG.1;

/// Product of `a` and `b` in GF(2^8).
#[inline]
pub const fn mul(a: u8, b: u8) -> u8 {
    if a == 0 || b == 0 {
        0
    } else {
        EXP_C[LOG_C[a as usize] as usize + LOG_C[b as usize] as usize]
    }
}

/// Multiplicative inverse of `a`. Panics if `a == 0`.
#[inline]
pub const fn inv(a: u8) -> u8 {
    assert!(a != 0, "0 has no inverse in GF(2^8)");
    EXP_C[255 - LOG_C[a as usize] as usize]
}

/// `a / b`. Panics if `b == 0`.
#[inline]
pub const fn div(a: u8, b: u8) -> u8 {
    assert!(b != 0, "division by 0 in GF(2^8)");
    if a == 0 {
        0
    } else {
        EXP_C[LOG_C[a as usize] as usize + 255 - LOG_C[b as usize] as usize]
    }
}

/// g^n for the generator g = 2 (n is taken modulo 255).
#[inline]
pub const fn exp(n: usize) -> u8 {
    EXP_C[n % 255]
}

/// Discrete logarithm base g = 2. Panics if `a == 0`.
#[inline]
pub const fn log(a: u8) -> u8 {
    assert!(a != 0, "log of 0 in GF(2^8)");
    LOG_C[a as usize]
}

/// Multiplication by 2 without tables: shift left and, when the top bit falls out, reduce by
/// the low byte of the polynomial (0x1d).
#[inline]
pub const fn mul2(a: u8) -> u8 {
    (a << 1) ^ (((a as i8) >> 7) as u8 & 0x1d)
}

/// 32-byte split-nibble table for one constant: `[c*0, c*1, .., c*15, c*0x00, c*0x10, ..,
/// c*0xf0]`. A product c*x is `t[x & 15] ^ t[16 + (x >> 4)]` because multiplication by a
/// constant is linear over GF(2); the two 16-entry halves are exactly what one PSHUFB looks up.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub(crate) struct NibTable(pub [u8; 32]);

#[allow(clippy::cast_possible_truncation)] // c < 256 and i < 16: table indices are field elements
const fn build_nib() -> [NibTable; 256] {
    let mut t = [NibTable([0u8; 32]); 256];
    let mut c = 0;
    while c < 256 {
        let mut i = 0;
        while i < 16 {
            t[c].0[i] = mul(c as u8, i as u8);
            t[c].0[16 + i] = mul(c as u8, (i as u8) << 4);
            i += 1;
        }
        c += 1;
    }
    t
}

/// Split-nibble tables for every constant (8 KiB), used by the SIMD kernels.
pub(crate) static NIB: [NibTable; 256] = build_nib();

#[allow(clippy::cast_possible_truncation)] // c < 256: table indices are field elements
const fn build_affine() -> [u64; 256] {
    let mut t = [0u64; 256];
    let mut c = 0;
    while c < 256 {
        let mut m = 0u64;
        let mut i = 0;
        while i < 8 {
            // Row for output bit i: bit j set when bit i of c * 2^j is set.
            let mut row = 0u64;
            let mut j = 0;
            while j < 8 {
                if (mul(c as u8, 1 << j) >> i) & 1 != 0 {
                    row |= 1 << j;
                }
                j += 1;
            }
            m |= row << (8 * (7 - i));
            i += 1;
        }
        t[c] = m;
        c += 1;
    }
    t
}

/// For each constant c, the 8×8 bit matrix of "multiply by c" in the layout GFNI's
/// `gf2p8affineqb` takes (byte 7 - i of the qword produces output bit i). Multiplication by
/// a constant is linear over GF(2), so one affine instruction multiplies 64 bytes by c in
/// *this* field, even though GFNI's own `gf2p8mulb` is hard-wired to AES's 0x11b.
pub(crate) static AFFINE: [u64; 256] = build_affine();

#[allow(clippy::cast_possible_truncation)] // a, b < 256: table indices are field elements
const fn build_mul_table() -> [[u8; 256]; 256] {
    let mut t = [[0u8; 256]; 256];
    let mut a = 1;
    while a < 256 {
        let mut b = 1;
        while b < 256 {
            t[a][b] = mul(a as u8, b as u8);
            b += 1;
        }
        a += 1;
    }
    t
}

/// Full product table (64 KiB), used by the scalar kernels: `MUL[c]` is the row of c*x.
pub(crate) static MUL: [[u8; 256]; 256] = build_mul_table();

#[cfg(test)]
mod tests {
    use super::*;

    fn slow_mul(mut a: u8, mut b: u8) -> u8 {
        let mut r = 0u8;
        while b != 0 {
            if b & 1 != 0 {
                r ^= a;
            }
            a = mul2(a);
            b >>= 1;
        }
        r
    }

    #[test]
    fn tables_match_carryless_multiplication() {
        for a in 0..=255u8 {
            for b in 0..=255u8 {
                let m = slow_mul(a, b);
                assert_eq!(mul(a, b), m, "{a} * {b}");
                assert_eq!(MUL[a as usize][b as usize], m);
                let t = &NIB[a as usize].0;
                assert_eq!(t[(b & 15) as usize] ^ t[16 + (b >> 4) as usize], m);
            }
        }
    }

    #[test]
    fn generator_is_primitive_and_inverses_hold() {
        let mut seen = [false; 256];
        for i in 0..255 {
            let v = exp(i);
            assert!(!seen[v as usize], "g^{i} repeats");
            seen[v as usize] = true;
            assert_eq!(log(v) as usize, i);
        }
        for a in 1..=255u8 {
            assert_eq!(mul(a, inv(a)), 1);
            for b in 1..=255u8 {
                assert_eq!(mul(div(a, b), b), a);
            }
        }
        assert_eq!(mul2(0x80), 0x1d);
        assert_eq!(exp(log(7) as usize), 7);
    }
}
