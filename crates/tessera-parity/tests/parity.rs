//! Correctness of the parity math: SIMD kernels against the scalar ones, RAID6 recovery and
//! Reed-Solomon reconstruction for every erasure pattern, and read-modify-write updates
//! against full regeneration.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use proptest::prelude::*;
use tessera_parity::kernels::{self, Backend};
use tessera_parity::{gf, pq_gen, pq_recover, pq_update, xor_parity, ParityError, ReedSolomon};
use tessera_testkit::data::Rng;

fn blocks(seed: u64, n: usize, len: usize) -> Vec<Vec<u8>> {
    // xorshift, so cases are reproducible without pulling in a RNG crate
    let mut r = Rng(seed | 1);
    (0..n)
        .map(|_| (0..len).map(|_| (r.next() >> 24) as u8).collect())
        .collect()
}

fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(|b| b.as_slice()).collect()
}

fn muts(v: &mut [Vec<u8>]) -> Vec<&mut [u8]> {
    v.iter_mut().map(|b| b.as_mut_slice()).collect()
}

/// Every subset of 0..n with at most `max` elements, as sorted index lists.
fn patterns(n: usize, max: usize) -> Vec<Vec<usize>> {
    (0u32..1 << n)
        .filter(|m| m.count_ones() as usize <= max)
        .map(|m| (0..n).filter(|&i| m & (1 << i) != 0).collect())
        .collect()
}

fn naive_q(data: &[Vec<u8>], len: usize) -> Vec<u8> {
    let mut q = vec![0u8; len];
    for (i, d) in data.iter().enumerate() {
        for (qb, db) in q.iter_mut().zip(d) {
            *qb ^= gf::mul(gf::exp(i), *db);
        }
    }
    q
}

fn simd_backends() -> Vec<Backend> {
    Backend::available()
        .into_iter()
        .filter(|b| *b != Backend::Scalar)
        .collect()
}

#[test]
fn detected_backend_is_available() {
    assert!(Backend::detect().is_available());
    if std::env::var_os("TESSERA_PARITY_BACKEND").is_none() {
        // the fastest available: the last of ALL this CPU can run
        assert_eq!(
            Some(Backend::detect()),
            Backend::available().last().copied()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn simd_kernels_equal_scalar(
        seed in any::<u64>(),
        len in 0usize..700,
        n in 1usize..9,
        outs in 1usize..7,
        c in any::<u8>(),
        acc in any::<bool>(),
    ) {
        let src = blocks(seed, n + 2, len);
        let srcs = refs(&src[..n]);
        let coeffs: Vec<u8> = blocks(seed ^ 0x55, 1, outs * n)[0].clone();
        for be in simd_backends() {
            // xor_into
            let (mut a, mut b) = (src[n].clone(), src[n].clone());
            kernels::xor_into_with(Backend::Scalar, &mut a, &src[0]);
            kernels::xor_into_with(be, &mut b, &src[0]);
            prop_assert_eq!(&a, &b);
            // xor_gen
            kernels::xor_gen_with(Backend::Scalar, &mut a, &srcs);
            kernels::xor_gen_with(be, &mut b, &srcs);
            prop_assert_eq!(&a, &b);
            // pq_gen
            let (mut p1, mut q1, mut p2, mut q2) = (vec![0; len], vec![0; len], vec![1; len], vec![1; len]);
            kernels::pq_gen_with(Backend::Scalar, &srcs, &mut p1, &mut q1);
            kernels::pq_gen_with(be, &srcs, &mut p2, &mut q2);
            prop_assert_eq!(&p1, &p2);
            prop_assert_eq!(&q1, &q2);
            prop_assert_eq!(&q1, &naive_q(&src[..n], len));
            // mul_inplace, mul_add
            let (mut a, mut b) = (src[0].clone(), src[0].clone());
            kernels::mul_inplace_with(Backend::Scalar, c, &mut a);
            kernels::mul_inplace_with(be, c, &mut b);
            prop_assert_eq!(&a, &b);
            prop_assert!(a.iter().zip(&src[0]).all(|(x, y)| *x == gf::mul(c, *y)));
            kernels::mul_add_with(Backend::Scalar, c, &src[1], &mut a);
            kernels::mul_add_with(be, c, &src[1], &mut b);
            prop_assert_eq!(&a, &b);
            // pq_update
            let (mut pa, mut qa, mut pb, mut qb) = (p1.clone(), q1.clone(), p1.clone(), q1.clone());
            kernels::pq_update_with(Backend::Scalar, &src[n], &src[n + 1], c, &mut pa, &mut qa);
            kernels::pq_update_with(be, &src[n], &src[n + 1], c, &mut pb, &mut qb);
            prop_assert_eq!(&pa, &pb);
            prop_assert_eq!(&qa, &qb);
            // dot_prod with 1..6 outputs, overwrite or accumulate
            let mut da: Vec<Vec<u8>> = blocks(seed ^ 0xaa, outs, len);
            let mut db = da.clone();
            kernels::dot_prod_with(Backend::Scalar, &coeffs, &srcs, &mut muts(&mut da), acc);
            kernels::dot_prod_with(be, &coeffs, &srcs, &mut muts(&mut db), acc);
            prop_assert_eq!(&da, &db);
        }
    }

    #[test]
    fn raid6_recovers_every_pattern_of_two(
        seed in any::<u64>(),
        n in 1usize..11,
        len in 0usize..400,
    ) {
        let data = blocks(seed, n, len);
        let (mut p, mut q) = (vec![0; len], vec![0; len]);
        pq_gen(&refs(&data), &mut p, &mut q);
        let mut x = vec![0; len];
        xor_parity(&mut x, &refs(&data));
        prop_assert_eq!(&x, &p);
        prop_assert_eq!(&q, &naive_q(&data, len));
        let mut stripe = data.clone();
        stripe.push(p);
        stripe.push(q);
        for missing in patterns(n + 2, 2) {
            let mut s = stripe.clone();
            for &i in &missing {
                s[i].iter_mut().for_each(|b| *b = 0xa5);
            }
            pq_recover(&mut muts(&mut s), &missing).unwrap();
            prop_assert!(s == stripe, "missing {:?}", missing);
        }
    }

    #[test]
    fn pq_update_equals_regeneration(
        seed in any::<u64>(),
        n in 1usize..12,
        len in 1usize..600,
        index in any::<prop::sample::Index>(),
        a in any::<prop::sample::Index>(),
        b in any::<prop::sample::Index>(),
    ) {
        let mut data = blocks(seed, n, len);
        let (mut p, mut q) = (vec![0; len], vec![0; len]);
        pq_gen(&refs(&data), &mut p, &mut q);
        let i = index.index(n);
        let (lo, hi) = {
            let (x, y) = (a.index(len + 1), b.index(len + 1));
            (x.min(y), x.max(y))
        };
        let new = blocks(seed ^ 7, 1, hi - lo).pop().unwrap();
        pq_update(&data[i][lo..hi], &new, i, &mut p[lo..hi], &mut q[lo..hi]);
        data[i][lo..hi].copy_from_slice(&new);
        let (mut p2, mut q2) = (vec![0; len], vec![0; len]);
        pq_gen(&refs(&data), &mut p2, &mut q2);
        prop_assert_eq!(p, p2);
        prop_assert_eq!(q, q2);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn rs_reconstructs_every_pattern_up_to_m(
        seed in any::<u64>(),
        k in 1usize..11,
        m in 1usize..5,
        len in 0usize..300,
    ) {
        let rs = ReedSolomon::new(k, m).unwrap();
        let data = blocks(seed, k, len);
        let mut parity = vec![vec![0u8; len]; m];
        rs.encode(&refs(&data), &mut muts(&mut parity)).unwrap();
        // parity 0 is the XOR of the data (first row all ones)
        let mut x = vec![0; len];
        xor_parity(&mut x, &refs(&data));
        prop_assert_eq!(&x, &parity[0]);
        let mut stripe = data.clone();
        stripe.extend(parity);
        prop_assert!(rs.verify(&refs(&stripe)).unwrap());
        for erased in patterns(k + m, m) {
            let mut s = stripe.clone();
            for &i in &erased {
                s[i].iter_mut().for_each(|b| *b = 0x3c);
            }
            // erasure order must not matter
            let mut order = erased.clone();
            order.reverse();
            rs.reconstruct(&mut muts(&mut s), &order).unwrap();
            prop_assert!(s == stripe, "k={} m={} erased {:?}", k, m, erased);
        }
        let mut opt: Vec<Option<Vec<u8>>> = stripe.iter().cloned().map(Some).collect();
        for i in (0..k + m).step_by(2).take(m) {
            opt[i] = None;
        }
        rs.reconstruct_opt(&mut opt).unwrap();
        prop_assert!(opt.into_iter().map(Option::unwrap).collect::<Vec<_>>() == stripe);
    }

    #[test]
    fn rs_update_parity_equals_reencode(
        seed in any::<u64>(),
        k in 1usize..12,
        m in 1usize..6,
        len in 1usize..500,
        index in any::<prop::sample::Index>(),
        a in any::<prop::sample::Index>(),
        b in any::<prop::sample::Index>(),
    ) {
        let rs = ReedSolomon::new(k, m).unwrap();
        let mut data = blocks(seed, k, len);
        let mut parity = vec![vec![0u8; len]; m];
        rs.encode(&refs(&data), &mut muts(&mut parity)).unwrap();
        let i = index.index(k);
        let (x, y) = (a.index(len + 1), b.index(len + 1));
        let (lo, hi) = (x.min(y), x.max(y));
        let new = blocks(seed ^ 9, 1, hi - lo).pop().unwrap();
        let mut delta = data[i][lo..hi].to_vec();
        tessera_parity::xor_into(&mut delta, &new);
        let mut sub: Vec<&mut [u8]> = parity.iter_mut().map(|p| &mut p[lo..hi]).collect();
        rs.update_parity(&delta, i, &mut sub).unwrap();
        data[i][lo..hi].copy_from_slice(&new);
        let mut full = vec![vec![0u8; len]; m];
        rs.encode(&refs(&data), &mut muts(&mut full)).unwrap();
        prop_assert_eq!(parity, full);
    }
}

#[test]
fn rs_wide_codes_decode() {
    // The largest geometries: every k×k submatrix must still be invertible.
    for (k, m) in [(251, 4), (128, 127), (1, 254), (200, 55)] {
        let rs = ReedSolomon::new(k, m).unwrap();
        let len = 40;
        let data = blocks(k as u64 * 31 + m as u64, k, len);
        let mut parity = vec![vec![0u8; len]; m];
        rs.encode(&refs(&data), &mut muts(&mut parity)).unwrap();
        let mut stripe = data.clone();
        stripe.extend(parity);
        let n = k + m;
        for t in 0..8usize {
            // a spread of erasure patterns of size m
            let erased: Vec<usize> = (0..m).map(|j| (j * 7 + t * 13) % n).collect();
            let mut erased_sorted = erased.clone();
            erased_sorted.sort_unstable();
            erased_sorted.dedup();
            let mut s = stripe.clone();
            for &i in &erased_sorted {
                s[i].fill(0);
            }
            rs.reconstruct(&mut muts(&mut s), &erased_sorted).unwrap();
            assert!(s == stripe, "k={k} m={m} pattern {t}");
        }
    }
}

#[test]
fn errors_are_reported() {
    assert_eq!(
        ReedSolomon::new(0, 2).unwrap_err(),
        ParityError::InvalidGeometry
    );
    assert_eq!(
        ReedSolomon::new(250, 6).unwrap_err(),
        ParityError::InvalidGeometry
    );
    let rs = ReedSolomon::new(4, 2).unwrap();
    let mut v = vec![vec![0u8; 64]; 6];
    assert!(matches!(
        rs.reconstruct(&mut muts(&mut v), &[0, 1, 2]),
        Err(ParityError::TooManyErasures { erased: 3, max: 2 })
    ));
    assert_eq!(
        rs.reconstruct(&mut muts(&mut v), &[1, 1]),
        Err(ParityError::DuplicateIndex)
    );
    assert_eq!(
        rs.reconstruct(&mut muts(&mut v), &[6]),
        Err(ParityError::IndexOutOfRange(6))
    );
    v[5].pop();
    assert_eq!(
        rs.reconstruct(&mut muts(&mut v), &[0]),
        Err(ParityError::LengthMismatch)
    );
    let mut s = vec![vec![0u8; 64]; 6];
    assert!(matches!(
        pq_recover(&mut muts(&mut s), &[0, 1, 2]),
        Err(ParityError::TooManyErasures { .. })
    ));
    assert_eq!(
        pq_recover(&mut muts(&mut s), &[0, 0]),
        Err(ParityError::DuplicateIndex)
    );
}

#[test]
fn raid6_large_blocks_cross_the_zero_buffer() {
    // Large, odd-length blocks: whole vectors plus a scalar tail.
    let (n, len) = (5, 200 * 1024 + 3);
    let data = blocks(42, n, len);
    let (mut p, mut q) = (vec![0; len], vec![0; len]);
    pq_gen(&refs(&data), &mut p, &mut q);
    let mut stripe = data;
    stripe.push(p);
    stripe.push(q);
    for missing in [
        vec![1, 3],
        vec![2, n],
        vec![0, n + 1],
        vec![n, n + 1],
        vec![4],
    ] {
        let mut s = stripe.clone();
        for &i in &missing {
            s[i].fill(0);
        }
        pq_recover(&mut muts(&mut s), &missing).unwrap();
        assert!(s == stripe, "missing {missing:?}");
    }
}
