//! A single-threaded token bucket with a refilling burst, a one-time burst
//! and debt for oversized requests.
//!
//! All arithmetic is integer. Refill is computed as
//! `elapsed_ns * rate + remainder`, of which whole multiples of 10^9 become
//! tokens and the rest is carried in `rem_nanotokens` (a fraction of a token,
//! in units of 10^-9 token). Nothing is lost to rounding however often the
//! bucket is refilled, so the long-run average is exactly the rate.

use std::time::{Duration, Instant};

const NANOS_PER_SEC: u128 = 1_000_000_000;

/// A token bucket.
///
/// * `capacity` tokens of refilling burst, refilled at `rate_per_sec`.
/// * a one-time burst budget, consumed before the regular tokens and never
///   refilled.
/// * a request costing more than `capacity` is admitted when the bucket is
///   full and leaves the balance negative (debt); nothing else is admitted
///   until the refill has repaid the debt (and, for a request of cost `c`,
///   until `c` tokens are available again).
///
/// No atomics, no allocation: one bucket belongs to one core.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    rate_per_sec: u64,
    capacity: u64,
    /// Regular balance; negative while in debt. Never above `capacity`.
    balance: i64,
    /// One-time burst still available.
    one_time: u64,
    /// Fraction of a token carried between refills, in 10^-9 tokens
    /// (always `< 10^9`).
    rem_nanotokens: u128,
    last: Instant,
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl TokenBucket {
    /// A bucket that starts full (`capacity`) plus `one_time_burst`.
    pub fn new(rate_per_sec: u64, capacity: u64, one_time_burst: u64, now: Instant) -> Self {
        TokenBucket {
            rate_per_sec,
            capacity,
            balance: to_i64(capacity),
            one_time: one_time_burst,
            rem_nanotokens: 0,
            last: now,
        }
    }

    pub fn rate_per_sec(&self) -> u64 {
        self.rate_per_sec
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Regular balance (negative while in debt), as of the last refill.
    pub fn balance(&self) -> i64 {
        self.balance
    }

    /// One-time burst still available.
    pub fn one_time(&self) -> u64 {
        self.one_time
    }

    /// Add to the one-time budget (used by the sharded limiter, which hands
    /// out a volume-wide one-time burst to cores in chunks).
    pub fn add_one_time(&mut self, tokens: u64) {
        self.one_time = self.one_time.saturating_add(tokens);
    }

    /// Drop whatever is left of the one-time budget.
    pub fn clear_one_time(&mut self) {
        self.one_time = 0;
    }

    /// Credit the tokens accrued since the last refill. Time going backwards
    /// is treated as no time passing.
    pub fn refill(&mut self, now: Instant) {
        let Some(elapsed) = now.checked_duration_since(self.last) else {
            return;
        };
        self.last = now;
        let cap = to_i64(self.capacity);
        if self.balance >= cap {
            // Full: fractions do not accumulate beyond a full bucket.
            self.rem_nanotokens = 0;
            return;
        }
        let acc = elapsed.as_nanos() * u128::from(self.rate_per_sec) + self.rem_nanotokens;
        let whole = acc / NANOS_PER_SEC;
        let room = (i128::from(cap) - i128::from(self.balance)) as u128;
        if whole >= room {
            self.balance = cap;
            self.rem_nanotokens = 0;
        } else {
            #[allow(
                clippy::cast_possible_truncation,
                reason = "whole < room <= 2^64, and balance + whole < cap: fits in i64"
            )]
            let whole = whole as i64;
            self.balance += whole;
            self.rem_nanotokens = acc % NANOS_PER_SEC;
        }
    }

    /// Advance the clock to `now` without crediting the elapsed time (the
    /// remainder is kept). Used by the sharded limiter for time during which
    /// this core's share was handed to other cores.
    pub fn skip_to(&mut self, now: Instant) {
        if now > self.last {
            self.last = now;
        }
    }

    /// Regular balance needed before a request of `cost` can be admitted.
    fn needed_balance(&self, cost: u64) -> i128 {
        if cost > self.capacity {
            // Oversized: admitted when full, whatever the one-time budget.
            // (If one-time + balance already covers it, `wait_for` admits
            // it earlier.)
            i128::from(self.capacity)
        } else {
            i128::from(cost) - i128::from(self.one_time)
        }
    }

    /// Without refilling or consuming: `None` if a request of `cost` would be
    /// admitted now (as of the last refill), else how long until it would be
    /// (at the current rate). `Duration::MAX` if the rate is zero.
    pub fn wait_for(&self, cost: u64) -> Option<Duration> {
        let available = i128::from(self.one_time) + i128::from(self.balance);
        if i128::from(cost) <= available {
            return None;
        }
        let deficit = self.needed_balance(cost) - i128::from(self.balance);
        if deficit <= 0 {
            // Oversized request and the bucket is full.
            return None;
        }
        if self.rate_per_sec == 0 {
            return Some(Duration::MAX);
        }
        // Smallest t (ns) with t * rate + rem >= deficit * 10^9.
        let need = deficit as u128 * NANOS_PER_SEC - self.rem_nanotokens;
        let rate = u128::from(self.rate_per_sec);
        let ns = need.div_ceil(rate);
        let secs = ns / NANOS_PER_SEC;
        let sub = (ns % NANOS_PER_SEC) as u32;
        Some(u64::try_from(secs).map_or(Duration::MAX, |s| Duration::new(s, sub)))
    }

    /// Take `cost` unconditionally: one-time budget first, then the regular
    /// balance (which may go negative). Call only after `wait_for` said yes.
    pub fn commit(&mut self, cost: u64) {
        let from_one_time = cost.min(self.one_time);
        self.one_time -= from_one_time;
        let rest = to_i64(cost - from_one_time);
        self.balance = self.balance.saturating_sub(rest);
    }

    /// Refill, then admit `cost` if possible; otherwise return how long until
    /// it would be admitted (admission at exactly `now + wait` succeeds,
    /// provided nothing else consumed tokens and the rate did not change).
    pub fn try_consume(&mut self, cost: u64, now: Instant) -> Result<(), Duration> {
        self.refill(now);
        match self.wait_for(cost) {
            None => {
                self.commit(cost);
                Ok(())
            }
            Some(wait) => Err(wait),
        }
    }

    /// Change rate and capacity live. Tokens accrued so far are credited at
    /// the old rate; the balance is clamped to the new capacity (debt is
    /// preserved); the one-time budget is untouched.
    pub fn set_rate(&mut self, rate_per_sec: u64, capacity: u64, now: Instant) {
        self.refill(now);
        self.rate_per_sec = rate_per_sec;
        self.capacity = capacity;
        let cap = to_i64(capacity);
        if self.balance >= cap {
            self.balance = cap;
            self.rem_nanotokens = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn long_run_average_equals_rate() {
        let t0 = Instant::now();
        // Awkward rate and step so that every refill leaves a remainder.
        let rate = 7_777;
        let mut b = TokenBucket::new(rate, 100, 0, t0);
        // Drain the initial burst.
        b.commit(100);
        let mut now = t0;
        let step = Duration::from_nanos(37_013);
        let end = t0 + Duration::from_secs(100);
        let mut admitted = 0u64;
        while now < end {
            while b.try_consume(1, now).is_ok() {
                admitted += 1;
            }
            now += step;
        }
        let expected = rate * 100;
        let err = (admitted as f64 - expected as f64).abs() / expected as f64;
        assert!(err < 0.0001, "admitted {admitted} expected {expected}");
    }

    #[test]
    fn burst_of_capacity_then_throttled() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, 50, 0, t0);
        for _ in 0..50 {
            b.try_consume(1, t0).unwrap();
        }
        let w = b.try_consume(1, t0).unwrap_err();
        assert_eq!(w, ms(1));
        // 10 ms later exactly 10 more.
        let t = t0 + ms(10);
        for _ in 0..10 {
            b.try_consume(1, t).unwrap();
        }
        assert!(b.try_consume(1, t).is_err());
    }

    #[test]
    fn one_time_burst_served_once() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, 10, 500, t0);
        let mut n = 0;
        while b.try_consume(1, t0).is_ok() {
            n += 1;
        }
        assert_eq!(n, 510);
        assert_eq!(b.one_time(), 0);
        // After a long idle period only the refilling capacity is back.
        let t = t0 + Duration::from_secs(60);
        let mut n = 0;
        while b.try_consume(1, t).is_ok() {
            n += 1;
        }
        assert_eq!(n, 10);
    }

    #[test]
    fn oversized_request_admitted_then_repaid() {
        let t0 = Instant::now();
        let (rate, cap) = (1000u64, 100u64);
        let mut b = TokenBucket::new(rate, cap, 0, t0);
        b.try_consume(10 * cap, t0).unwrap();
        assert_eq!(b.balance(), -900);
        // Nothing (not even 1 token) until the debt is repaid: 901 tokens.
        let w = b.try_consume(1, t0).unwrap_err();
        assert_eq!(w, ms(901));
        assert!(b.try_consume(1, t0 + ms(900)).is_err());
        b.try_consume(1, t0 + ms(901)).unwrap();
        // The next oversized request waits until the bucket is full again.
        let w = b.try_consume(10 * cap, t0 + ms(901)).unwrap_err();
        assert_eq!(w, ms(100));
        b.try_consume(10 * cap, t0 + ms(1001)).unwrap();
    }

    #[test]
    fn oversized_request_when_not_full_waits_for_full() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, 100, 0, t0);
        b.try_consume(1, t0).unwrap();
        assert_eq!(b.try_consume(1000, t0).unwrap_err(), ms(1));
        b.try_consume(1000, t0 + ms(1)).unwrap();
    }

    #[test]
    fn wait_times_are_exact() {
        let t0 = Instant::now();
        // Capacity 10 so the bucket never fills (a full bucket drops the
        // fractional remainder, by design).
        let mut b = TokenBucket::new(3, 10, 0, t0);
        b.try_consume(10, t0).unwrap();
        let mut now = t0;
        for _ in 0..1000 {
            let w = b.try_consume(1, now).unwrap_err();
            // One nanosecond early is too early.
            assert!(b.try_consume(1, now + w - Duration::from_nanos(1)).is_err());
            now += w;
            b.try_consume(1, now).unwrap();
        }
        // 1000 tokens at 3/s take 333.33.. s: accumulated waits are exact.
        let total = now - t0;
        assert!(total >= Duration::from_nanos(333_333_333_333));
        assert!(total <= Duration::from_nanos(333_333_333_334));
    }

    #[test]
    fn rate_change_takes_effect_immediately() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, 100, 0, t0);
        b.commit(100);
        assert_eq!(b.try_consume(1, t0).unwrap_err(), ms(1));
        b.set_rate(10, 100, t0);
        assert_eq!(b.try_consume(1, t0).unwrap_err(), ms(100));
        // Tokens accrued before the change are credited at the old rate.
        let t1 = t0 + ms(5);
        b.set_rate(1000, 100, t1);
        assert_eq!(b.balance(), 0);
        // 5 ms at 10/s left 0.05 token carried in the remainder.
        b.set_rate(100_000, 100, t1);
        assert_eq!(
            b.try_consume(10, t1).unwrap_err(),
            Duration::from_nanos(99_500)
        );
    }

    #[test]
    fn set_rate_clamps_balance_and_keeps_debt() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, 100, 0, t0);
        b.set_rate(1000, 10, t0);
        assert_eq!(b.balance(), 10);
        b.try_consume(50, t0).unwrap();
        assert_eq!(b.balance(), -40);
        b.set_rate(1, 1, t0);
        assert_eq!(b.balance(), -40);
    }

    #[test]
    fn zero_rate_never_refills() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(0, 1, 0, t0);
        b.try_consume(1, t0).unwrap();
        assert_eq!(b.try_consume(1, t0).unwrap_err(), Duration::MAX);
        assert!(b.try_consume(1, t0 + Duration::from_secs(1000)).is_err());
    }

    proptest! {
        /// Admission at exactly the returned wait succeeds, and never more
        /// than capacity + one-time + rate * elapsed (+1 oversized request)
        /// is admitted.
        #[test]
        fn waits_exact_and_bounded(
            rate in 1u64..1_000_000,
            cap in 1u64..10_000,
            one_time in 0u64..10_000,
            ops in proptest::collection::vec((1u64..20_000, 0u64..5_000_000), 1..200),
        ) {
            let t0 = Instant::now();
            let mut b = TokenBucket::new(rate, cap, one_time, t0);
            let mut now = t0;
            let mut admitted: u128 = 0;
            let mut max_cost: u128 = 0;
            for (cost, dt) in ops {
                now += Duration::from_nanos(dt);
                match b.try_consume(cost, now) {
                    Ok(()) => admitted += u128::from(cost),
                    Err(w) => {
                        now += w;
                        prop_assert!(b.try_consume(cost, now).is_ok());
                        admitted += u128::from(cost);
                    }
                }
                max_cost = max_cost.max(u128::from(cost));
                let elapsed = (now - t0).as_nanos();
                let bound = u128::from(cap) + u128::from(one_time)
                    + elapsed * u128::from(rate) / NANOS_PER_SEC
                    + max_cost;
                prop_assert!(admitted <= bound);
                prop_assert!(b.balance() <= cap as i64);
            }
        }
    }
}
