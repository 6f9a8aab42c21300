//! Per-volume QoS limits, their validation and their catalog encoding.

use serde::{Deserialize, Serialize};

use crate::Invalid;

/// Default refilling burst: this many milliseconds of the rate.
pub const DEFAULT_BURST_MS: u64 = 100;
/// Default one-time burst: none.
pub const DEFAULT_ONE_TIME_BURST_MS: u64 = 0;
/// Largest accepted `burst_ms`.
pub const MAX_BURST_MS: u64 = 60_000;
/// Largest accepted `one_time_burst_ms` (one hour).
pub const MAX_ONE_TIME_BURST_MS: u64 = 3_600_000;

/// Per-volume QoS limits. `None` means "no limit" for a rate.
///
/// Rates are per second for the whole volume, however many cores serve it.
/// `iops`/`bps` limit reads and writes combined; `read_*`/`write_*` limit one
/// direction; a request must fit every limit that applies to it.
///
/// # Catalog encoding
///
/// [`QosLimits::encode`] writes, and [`QosLimits::decode`] reads:
///
/// ```text
/// offset 0: u8 presence bitmask, bit i (LSB = bit 0) set if field i is Some:
///             bit 0 iops          bit 4 read_bps
///             bit 1 read_iops     bit 5 write_bps
///             bit 2 write_iops    bit 6 burst_ms
///             bit 3 bps           bit 7 one_time_burst_ms
/// then:     for each bit set, in increasing bit order (= declaration order),
///           the field's value as a little-endian u64 (8 bytes).
/// ```
///
/// The encoding is `1 + 8 * popcount(mask)` bytes long (1 byte for unlimited
/// limits). All eight bits are assigned, so there are no reserved bits.
/// Decoding does not validate the values (see [`QosLimits::validate`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct QosLimits {
    pub iops: Option<u64>,
    pub read_iops: Option<u64>,
    pub write_iops: Option<u64>,
    pub bps: Option<u64>,
    pub read_bps: Option<u64>,
    pub write_bps: Option<u64>,
    /// Refilling bucket size as this many ms of the rate; default 100.
    pub burst_ms: Option<u64>,
    /// One-time burst as this many ms of the rate; default 0.
    pub one_time_burst_ms: Option<u64>,
    /// Share weight when volumes compete for a saturated core (see
    /// `tessera_qos::ShareScheduler`); default [`DEFAULT_WEIGHT`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    /// Serve this volume's reads before its writes: reads are never held by
    /// the share scheduler, only writes are.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reads_first: bool,
}

/// Share weight of a volume that sets none.
pub const DEFAULT_WEIGHT: u32 = 100;
/// Largest accepted share weight.
pub const MAX_WEIGHT: u32 = 10_000;

impl QosLimits {
    fn fields(&self) -> [Option<u64>; 8] {
        [
            self.iops,
            self.read_iops,
            self.write_iops,
            self.bps,
            self.read_bps,
            self.write_bps,
            self.burst_ms,
            self.one_time_burst_ms,
        ]
    }

    fn from_fields(f: [Option<u64>; 8]) -> Self {
        QosLimits {
            weight: None,
            reads_first: false,
            iops: f[0],
            read_iops: f[1],
            write_iops: f[2],
            bps: f[3],
            read_bps: f[4],
            write_bps: f[5],
            burst_ms: f[6],
            one_time_burst_ms: f[7],
        }
    }

    /// The six rates, in the order iops, read_iops, write_iops, bps,
    /// read_bps, write_bps.
    pub fn rates(&self) -> [Option<u64>; 6] {
        [
            self.iops,
            self.read_iops,
            self.write_iops,
            self.bps,
            self.read_bps,
            self.write_bps,
        ]
    }

    /// True when no rate is limited (burst settings alone limit nothing).
    pub fn is_unlimited(&self) -> bool {
        self.rates().iter().all(Option::is_none)
    }

    /// The share weight, defaulted.
    pub fn weight_or_default(&self) -> u32 {
        self.weight.unwrap_or(DEFAULT_WEIGHT)
    }

    /// True when the volume asks the share scheduler for anything beyond the
    /// default (a weight or reads-first).
    pub fn has_scheduling(&self) -> bool {
        self.weight.is_some() || self.reads_first
    }

    /// `burst_ms`, defaulted.
    pub fn burst_ms_or_default(&self) -> u64 {
        self.burst_ms.unwrap_or(DEFAULT_BURST_MS)
    }

    /// `one_time_burst_ms`, defaulted.
    pub fn one_time_burst_ms_or_default(&self) -> u64 {
        self.one_time_burst_ms.unwrap_or(DEFAULT_ONE_TIME_BURST_MS)
    }

    pub fn validate(&self) -> Result<(), Invalid> {
        for (name, v) in [
            ("iops", self.iops),
            ("read_iops", self.read_iops),
            ("write_iops", self.write_iops),
        ] {
            if v == Some(0) {
                return Err(Invalid::ZeroIops { field: name });
            }
        }
        for (name, v) in [
            ("bps", self.bps),
            ("read_bps", self.read_bps),
            ("write_bps", self.write_bps),
        ] {
            if v == Some(0) {
                return Err(Invalid::ZeroBandwidth { field: name });
            }
        }
        if let Some(w) = self.weight {
            if w == 0 || w > MAX_WEIGHT {
                return Err(Invalid::OutsideRange {
                    field: "weight",
                    value: u64::from(w),
                    min: 1,
                    max: u64::from(MAX_WEIGHT),
                });
            }
        }
        if let Some(b) = self.burst_ms {
            if b > MAX_BURST_MS {
                return Err(Invalid::AboveMax {
                    field: "burst_ms",
                    value: b,
                    max: MAX_BURST_MS,
                });
            }
        }
        if let Some(b) = self.one_time_burst_ms {
            if b > MAX_ONE_TIME_BURST_MS {
                return Err(Invalid::AboveMax {
                    field: "one_time_burst_ms",
                    value: b,
                    max: MAX_ONE_TIME_BURST_MS,
                });
            }
        }
        Ok(())
    }

    /// Append the catalog encoding (see the type's documentation) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let fields = self.fields();
        let mut mask = 0u8;
        for (i, f) in fields.iter().enumerate() {
            if f.is_some() {
                mask |= 1 << i;
            }
        }
        out.push(mask);
        for v in fields.iter().flatten() {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    /// Append the scheduling extension (catalog version 3): a u8 mask, bit 0
    /// `weight` present (then a little-endian u32 follows), bit 1
    /// `reads_first`; other bits are reserved and written as 0.
    pub fn encode_sched(&self, out: &mut Vec<u8>) {
        let mask = u8::from(self.weight.is_some()) | (u8::from(self.reads_first) << 1);
        out.push(mask);
        if let Some(w) = self.weight {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }

    /// Read the scheduling extension written by [`encode_sched`](Self::encode_sched)
    /// into `self`; returns the number of bytes consumed.
    pub fn decode_sched(&mut self, bytes: &[u8]) -> Result<usize, Invalid> {
        let (&mask, rest) = bytes.split_first().ok_or(Invalid::Empty {
            what: "QoS scheduling",
        })?;
        if mask & !0b11 != 0 {
            return Err(Invalid::ReservedBits(mask));
        }
        let mut used = 1;
        self.weight = None;
        if mask & 1 != 0 {
            let head = rest.first_chunk::<4>().ok_or(Invalid::TruncatedWeight)?;
            self.weight = Some(u32::from_le_bytes(*head));
            used += 4;
        }
        self.reads_first = mask & 2 != 0;
        Ok(used)
    }

    /// Decode from the start of `bytes`; returns the limits and the number of
    /// bytes consumed. Truncated input is an error.
    pub fn decode(bytes: &[u8]) -> Result<(QosLimits, usize), Invalid> {
        let (&mask, mut rest) = bytes
            .split_first()
            .ok_or(Invalid::Empty { what: "QoS limits" })?;
        let mut fields = [None; 8];
        let mut used = 1;
        for (i, f) in fields.iter_mut().enumerate() {
            if mask & (1 << i) == 0 {
                continue;
            }
            let Some((head, tail)) = rest.split_first_chunk::<8>() else {
                return Err(Invalid::TruncatedLimits {
                    field: i,
                    offset: used,
                    left: rest.len(),
                });
            };
            *f = Some(u64::from_le_bytes(*head));
            rest = tail;
            used += 8;
        }
        Ok((QosLimits::from_fields(fields), used))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn unlimited() {
        assert!(QosLimits::default().is_unlimited());
        let l = QosLimits {
            burst_ms: Some(5),
            ..Default::default()
        };
        assert!(l.is_unlimited());
        let l = QosLimits {
            write_bps: Some(5),
            ..Default::default()
        };
        assert!(!l.is_unlimited());
    }

    #[test]
    fn validation() {
        assert!(QosLimits::default().validate().is_ok());
        let l = QosLimits {
            read_iops: Some(0),
            ..Default::default()
        };
        let e = l.validate().unwrap_err();
        assert!(
            e.to_string().contains("an IOPS limit must be at least 1"),
            "{e}"
        );
        let l = QosLimits {
            bps: Some(0),
            ..Default::default()
        };
        assert!(l.validate().is_err());
        let l = QosLimits {
            iops: Some(1),
            burst_ms: Some(60_000),
            ..Default::default()
        };
        assert!(l.validate().is_ok());
        let l = QosLimits {
            burst_ms: Some(60_001),
            ..Default::default()
        };
        assert!(l.validate().is_err());
        let l = QosLimits {
            one_time_burst_ms: Some(MAX_ONE_TIME_BURST_MS + 1),
            ..Default::default()
        };
        assert!(l.validate().is_err());
    }

    #[test]
    fn encoding_layout() {
        let mut out = vec![0xAA];
        QosLimits::default().encode(&mut out);
        assert_eq!(out, [0xAA, 0]);
        let l = QosLimits {
            read_iops: Some(0x0102),
            burst_ms: Some(7),
            ..Default::default()
        };
        let mut out = Vec::new();
        l.encode(&mut out);
        let mut want = vec![0b0100_0010];
        want.extend_from_slice(&0x0102u64.to_le_bytes());
        want.extend_from_slice(&7u64.to_le_bytes());
        assert_eq!(out, want);
        assert_eq!(QosLimits::decode(&out).unwrap(), (l, 17));
    }

    #[test]
    fn decode_errors() {
        assert!(QosLimits::decode(&[]).is_err());
        assert!(QosLimits::decode(&[1]).is_err());
        assert!(QosLimits::decode(&[1, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(QosLimits::decode(&[0xFF; 64]).is_err());
        assert_eq!(QosLimits::decode(&[0xFF; 65]).unwrap().1, 65);
    }

    fn arb_opt() -> impl Strategy<Value = Option<u64>> {
        prop_oneof![Just(None), any::<u64>().prop_map(Some)]
    }

    proptest! {
        #[test]
        fn round_trip(f in proptest::array::uniform8(arb_opt()), trailer in proptest::collection::vec(any::<u8>(), 0..8)) {
            let l = QosLimits::from_fields(f);
            let mut out = Vec::new();
            l.encode(&mut out);
            let n = out.len();
            prop_assert_eq!(n, 1 + 8 * f.iter().flatten().count());
            out.extend_from_slice(&trailer);
            let (d, used) = QosLimits::decode(&out).unwrap();
            prop_assert_eq!(&d, &l);
            prop_assert_eq!(used, n);
            // Every strict prefix is an error, never a panic.
            for cut in 0..n {
                prop_assert!(QosLimits::decode(&out[..cut]).is_err());
            }
        }

        #[test]
        fn sched_round_trip(weight in proptest::option::of(any::<u32>()), reads_first: bool, trailer in proptest::collection::vec(any::<u8>(), 0..8)) {
            let l = QosLimits { weight, reads_first, ..Default::default() };
            let mut out = Vec::new();
            l.encode_sched(&mut out);
            let n = out.len();
            out.extend_from_slice(&trailer);
            let mut d = QosLimits::default();
            prop_assert_eq!(d.decode_sched(&out).unwrap(), n);
            prop_assert_eq!(&d, &l);
            for cut in 0..n {
                prop_assert!(QosLimits::default().decode_sched(&out[..cut]).is_err());
            }
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Ok((l, used)) = QosLimits::decode(&bytes) {
                let mut out = Vec::new();
                l.encode(&mut out);
                prop_assert_eq!(&out[..], &bytes[..used]);
            }
        }
    }
}
