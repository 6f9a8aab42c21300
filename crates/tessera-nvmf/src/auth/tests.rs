//! Known-answer vectors (computed from the spec's definitions with an independent
//! implementation: Python's hmac/hashlib/zlib/base64) and whole transactions between the
//! two ends.

use super::*;

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:12345678-1234-1234-1234-123456789abc";
const SUBNQN: &str = "nqn.2024-01.io.tessera:vol1";
/// Key bytes 0x00..0x1f, transformed with SHA-256.
const SECRET_SHA256: &str = "DHHC-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";
/// Key bytes (7i+3) mod 256, 48 of them, transformed with SHA-384.
const SECRET_SHA384: &str =
    "DHHC-1:02:AwoRGB8mLTQ7QklQV15lbHN6gYiPlp2kq7K5wMfO1dzj6vH4/wYNFBsiKTA3PkVMRdxyRQ==:";
/// Key bytes 255-i, 64 of them, not transformed.
const SECRET_PLAIN64: &str = "DHHC-1:00://79/Pv6+fj39vX08/Lx8O/u7ezr6uno5+bl5OPi4eDf3t3c29rZ2NfW1dTT0tHQz87NzMvKycjHxsXEw8LBwAAq4mo=:";

fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

#[test]
fn secrets_parse_and_round_trip() {
    let s = Secret::parse(SECRET_SHA256).unwrap();
    assert_eq!(s.key, (0u8..32).collect::<Vec<_>>());
    assert_eq!(s.transform, Some(Hash::Sha256));
    assert_eq!(s.encode(), SECRET_SHA256);
    let s = Secret::parse(SECRET_SHA384).unwrap();
    assert_eq!(s.key.len(), 48);
    assert_eq!(s.encode(), SECRET_SHA384);
    let s = Secret::parse(SECRET_PLAIN64).unwrap();
    assert_eq!(s.transform, None);
    assert_eq!(s.key[0], 255);
    assert_eq!(s.encode(), SECRET_PLAIN64);
    // Whitespace around it (a file with a newline) is fine.
    assert!(Secret::parse(&format!("{SECRET_SHA256}\n")).is_ok());
    let g = Secret::generate(Some(Hash::Sha512), 64);
    assert_eq!(Secret::parse(&g.encode()).unwrap(), g);
    assert_eq!(format!("{g:?}"), "Secret(<redacted>)");
}

#[test]
fn bad_secrets_are_refused_with_a_reason() {
    // One character of the key changed: the CRC catches it.
    let typo = SECRET_SHA256.replace("AAEC", "AAED");
    assert!(Secret::parse(&typo)
        .unwrap_err()
        .to_string()
        .contains("CRC"));
    for bad in [
        "",
        "DHHC-1:01:AAEC",
        "DHHC-2:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
        "DHHC-1:07:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
        "DHHC-1:1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
        "DHHC-1:01:not base64!:",
        "DHHC-1:01:AAECAwQF:",
        // A 48-byte key cannot be transformed with SHA-256.
        "DHHC-1:01:AwoRGB8mLTQ7QklQV15lbHN6gYiPlp2kq7K5wMfO1dzj6vH4/wYNFBsiKTA3PkVMRdxyRQ==:",
    ] {
        assert!(Secret::parse(bad).is_err(), "{bad} was accepted");
    }
}

#[test]
fn key_transformation_known_answers() {
    let s = Secret::parse(SECRET_SHA256).unwrap();
    assert_eq!(
        s.transformed(HOSTNQN),
        hex("be9ab7edfb82ddd5e5ac574178bde5e79ad95f97eb94f2c02fa5e2594701b362")
    );
    let s = Secret::parse(SECRET_SHA384).unwrap();
    assert_eq!(
        s.transformed(SUBNQN),
        hex("e1484587ebc4675c91f4c5181f44f1faca4655db6e32a8345f1e41e6ce54ca15c32922c3523eec735815581e90d90d21")
    );
    let s = Secret::parse(SECRET_PLAIN64).unwrap();
    assert_eq!(s.transformed(HOSTNQN), s.key);
}

#[test]
fn response_known_answers() {
    let key = Secret::parse(SECRET_SHA256).unwrap().transformed(HOSTNQN);
    let c1: Vec<u8> = (100u8..132).collect();
    let r1 = host_response(
        Hash::Sha256,
        &key,
        &c1,
        0x0102_0304,
        0xBEEF,
        HOSTNQN,
        SUBNQN,
    );
    assert_eq!(
        r1,
        hex("51928e6e2af28658d1ad1cf51ac45cb55387985943a13887132b42f5096b3967")
    );
    let session: Vec<u8> = (0..256u32).map(|i| (i * 13).to_le_bytes()[0]).collect();
    let aug = augmented_challenge(Hash::Sha256, Some(&session), &c1);
    assert_eq!(
        aug,
        hex("8495052db3dc44acc044ad1a35e5bd1c6415490abfeccf4d480cfd6928ff0833")
    );
    assert_eq!(augmented_challenge(Hash::Sha256, None, &c1), c1);
    let r2 = controller_response(
        Hash::Sha256,
        &key,
        &aug,
        0x0102_0304,
        0xBEEF,
        SUBNQN,
        HOSTNQN,
    );
    assert_eq!(
        r2,
        hex("defd3f8b97ab0a5d07a97da780b42428117c712af7200b767a87e7e484cc5eaa")
    );
}

/// The primes are RFC 7919's: p = 2^b - 2^(b-64) + (floor(2^(b-130) e) + X) 2^64 - 1.
#[test]
fn ffdhe_primes_match_their_definition() {
    // e * 2^n as the sum of 2^n / k!, with 64 guard bits.
    fn e_scaled(n: u32) -> BigUint {
        let mut term = BigUint::from(1u8) << (n + 64);
        let mut sum = BigUint::from(0u8);
        let mut k = 0u32;
        while term > BigUint::from(0u8) {
            sum += &term;
            k += 1;
            term /= k;
        }
        sum >> 64u32
    }
    for (g, bits, x) in [
        (DhGroup::Ffdhe2048, 2048u32, 560316u32),
        (DhGroup::Ffdhe3072, 3072, 2625351),
        (DhGroup::Ffdhe4096, 4096, 5736041),
        (DhGroup::Ffdhe6144, 6144, 15705020),
        (DhGroup::Ffdhe8192, 8192, 10965728),
    ] {
        let one = BigUint::from(1u8);
        let p =
            (&one << bits) - (&one << (bits - 64)) + ((e_scaled(bits - 130) + x) << 64u32) - &one;
        assert_eq!(g.prime().unwrap(), &p, "{}", g.name());
        assert_eq!(g.value_len() * 8, bits as usize);
    }
}

#[test]
fn dh_agrees() {
    let a = DhKey::generate(DhGroup::Ffdhe2048).unwrap();
    let b = DhKey::generate(DhGroup::Ffdhe2048).unwrap();
    assert_eq!(a.public.len(), 256);
    let s1 = a.shared(&b.public).unwrap();
    assert_eq!(s1, b.shared(&a.public).unwrap());
    assert_ne!(a.public, b.public);
    // Degenerate public values are refused.
    let mut one = vec![0u8; 256];
    one[255] = 1;
    assert!(a.shared(&one).is_err());
    assert!(a.shared(&vec![0xFF; 256]).is_err());
    assert!(a.shared(&[2]).is_err());
}

fn keys(host: &str, ctrl: Option<&str>, group: DhGroup) -> Arc<HostKeys> {
    Arc::new(HostKeys {
        host: Secret::parse(host).unwrap(),
        ctrl: ctrl.map(|c| Secret::parse(c).unwrap()),
        hash: Hash::Sha256,
        group,
    })
}

/// Run a whole transaction; Ok(()) when both ends agree it succeeded.
fn transact(c: &mut ControllerAuth, h: &mut HostAuth, tid: u16) -> Result<(), HostAuthError> {
    c.send(&h.negotiate(tid)).unwrap();
    let challenge = c.receive(MAX_MESSAGE).unwrap();
    let reply = h.reply(&challenge)?;
    c.send(&reply).unwrap();
    let s1 = c.receive(MAX_MESSAGE).unwrap();
    match h.success1(&s1) {
        Ok(Some(s2)) => {
            c.send(&s2).unwrap();
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(e) => {
            if let HostAuthError::Rejected {
                failure2: Some(f), ..
            } = &e
            {
                c.send(f).unwrap();
            }
            Err(e)
        }
    }
}

#[test]
fn transactions_with_every_group() {
    for g in [DhGroup::Null, DhGroup::Ffdhe2048, DhGroup::Ffdhe3072] {
        let mut c = ControllerAuth::new(keys(SECRET_SHA256, None, g), HOSTNQN, SUBNQN);
        let mut h = HostAuth::new(Secret::parse(SECRET_SHA256).unwrap(), None, HOSTNQN, SUBNQN);
        transact(&mut c, &mut h, 7).unwrap();
        assert!(c.authenticated(), "{}", g.name());
        assert_eq!(c.chosen(), (Hash::Sha256, g));
    }
}

#[test]
fn wrong_secret_gets_failure1() {
    let mut c = ControllerAuth::new(
        keys(SECRET_SHA256, None, DhGroup::Ffdhe2048),
        HOSTNQN,
        SUBNQN,
    );
    let other = Secret::generate(Some(Hash::Sha256), 32);
    let mut h = HostAuth::new(other, None, HOSTNQN, SUBNQN);
    assert_eq!(
        transact(&mut c, &mut h, 1),
        Err(HostAuthError::Refused(Reason::Failed))
    );
    assert!(!c.authenticated());
    // The right secret under another host NQN is wrong too (the NQN is in the response).
    let mut c = ControllerAuth::new(keys(SECRET_SHA256, None, DhGroup::Null), HOSTNQN, SUBNQN);
    let mut h = HostAuth::new(
        Secret::parse(SECRET_SHA256).unwrap(),
        None,
        "nqn.2014-08.org.example:other",
        SUBNQN,
    );
    assert!(transact(&mut c, &mut h, 1).is_err());
    assert!(!c.authenticated());
}

#[test]
fn bidirectional() {
    // Right controller secret: both ends authenticated.
    let mut c = ControllerAuth::new(
        keys(SECRET_SHA256, Some(SECRET_SHA384), DhGroup::Ffdhe2048),
        HOSTNQN,
        SUBNQN,
    );
    let mut h = HostAuth::new(
        Secret::parse(SECRET_SHA256).unwrap(),
        Some(Secret::parse(SECRET_SHA384).unwrap()),
        HOSTNQN,
        SUBNQN,
    );
    transact(&mut c, &mut h, 3).unwrap();
    assert!(c.authenticated());
    // The host expects another controller secret: it rejects the controller (Failure2)
    // and the controller does not count the queue as authenticated.
    let mut c = ControllerAuth::new(
        keys(SECRET_SHA256, Some(SECRET_SHA384), DhGroup::Null),
        HOSTNQN,
        SUBNQN,
    );
    let mut h = HostAuth::new(
        Secret::parse(SECRET_SHA256).unwrap(),
        Some(Secret::parse(SECRET_PLAIN64).unwrap()),
        HOSTNQN,
        SUBNQN,
    );
    let e = transact(&mut c, &mut h, 4).unwrap_err();
    assert!(
        matches!(
            e,
            HostAuthError::Rejected {
                reason: Reason::Failed,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(!c.authenticated());
    // The host asks for bidirectional authentication; the subsystem has no controller
    // secret for it: refused.
    let mut c = ControllerAuth::new(keys(SECRET_SHA256, None, DhGroup::Null), HOSTNQN, SUBNQN);
    let mut h = HostAuth::new(
        Secret::parse(SECRET_SHA256).unwrap(),
        Some(Secret::parse(SECRET_PLAIN64).unwrap()),
        HOSTNQN,
        SUBNQN,
    );
    assert_eq!(
        transact(&mut c, &mut h, 5),
        Err(HostAuthError::Refused(Reason::NotUsable))
    );
}

#[test]
fn host_without_the_required_group_is_refused() {
    let mut c = ControllerAuth::new(
        keys(SECRET_SHA256, None, DhGroup::Ffdhe2048),
        HOSTNQN,
        SUBNQN,
    );
    let n = Message::Negotiate {
        tid: 9,
        sc_c: 0,
        hashes: vec![1],
        groups: vec![0],
    };
    c.send(&n.encode()).unwrap();
    let m = Message::parse(&c.receive(MAX_MESSAGE).unwrap()).unwrap();
    assert_eq!(
        m,
        Message::Failure1 {
            tid: 9,
            reason: Reason::DhGroupUnusable
        }
    );
}

#[test]
fn messages_round_trip() {
    let ms = [
        Message::Negotiate {
            tid: 1,
            sc_c: 0,
            hashes: vec![1, 2, 3],
            groups: vec![0, 1, 2, 3, 4, 5],
        },
        Message::Challenge {
            tid: 2,
            hash: 1,
            group: 1,
            seq: 77,
            challenge: vec![5; 32],
            dh: vec![9; 256],
        },
        Message::Reply {
            tid: 3,
            response: vec![1; 48],
            ctrl_challenge: Some((vec![2; 48], 99)),
            dh: vec![],
        },
        Message::Reply {
            tid: 3,
            response: vec![1; 32],
            ctrl_challenge: None,
            dh: vec![3; 384],
        },
        Message::Success1 {
            tid: 4,
            hl: 32,
            response: Some(vec![7; 32]),
        },
        Message::Success1 {
            tid: 4,
            hl: 64,
            response: None,
        },
        Message::Success2 { tid: 5 },
        Message::Failure1 {
            tid: 6,
            reason: Reason::HashUnusable,
        },
        Message::Failure2 {
            tid: 6,
            reason: Reason::Failed,
        },
    ];
    for m in ms {
        assert_eq!(Message::parse(&m.encode()).unwrap(), m);
    }
    // The sizes the layouts give: header and one protocol descriptor; header, two
    // hash-sized fields and the DH value.
    let mut h = HostAuth::new(Secret::generate(None, 32), None, HOSTNQN, SUBNQN);
    assert_eq!(h.negotiate(1).len(), 8 + 64);
    let r = Message::Reply {
        tid: 1,
        response: vec![0; 32],
        ctrl_challenge: None,
        dh: vec![0; 256],
    };
    assert_eq!(r.encode().len(), 16 + 2 * 32 + 256);
}

proptest::proptest! {
    /// Whatever the host sends, the controller answers without panicking, and garbage
    /// never authenticates.
    #[test]
    fn garbage_never_authenticates(msgs in proptest::collection::vec(
        proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600), 1..6)) {
        let mut c = ControllerAuth::new(keys(SECRET_SHA256, None, DhGroup::Null), HOSTNQN, SUBNQN);
        for m in &msgs {
            let _ = c.send(m);
            let _ = c.receive(MAX_MESSAGE);
        }
        proptest::prop_assert!(!c.authenticated());
    }

    /// Truncations of a real Reply and any change to its response never authenticate.
    #[test]
    fn corrupted_replies_never_authenticate(cut in 0usize..80, flip in 16usize..48, bit in 0u8..8, truncate: bool) {
        let mut c = ControllerAuth::new(keys(SECRET_SHA256, None, DhGroup::Null), HOSTNQN, SUBNQN);
        let mut h = HostAuth::new(Secret::parse(SECRET_SHA256).unwrap(), None, HOSTNQN, SUBNQN);
        c.send(&h.negotiate(1)).unwrap();
        let ch = c.receive(MAX_MESSAGE).unwrap();
        let mut reply = h.reply(&ch).unwrap();
        if truncate {
            reply.truncate(cut);
        } else {
            reply[flip] ^= 1 << bit;
        }
        c.send(&reply).unwrap();
        let _ = c.receive(MAX_MESSAGE);
        proptest::prop_assert!(!c.authenticated());
    }
}
