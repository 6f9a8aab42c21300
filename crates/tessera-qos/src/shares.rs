//! Shares: how a core that cannot keep up splits its work between volumes.
//!
//! A reactor core serves every volume whose connections it holds. When one
//! volume sends a deep queue (a noisy neighbour) it can fill the core's whole
//! batch, and a request of another volume that arrives meanwhile waits for
//! that batch: its reply leaves only at the next ring submission. The share
//! scheduler bounds that wait and splits a saturated core by weight.
//!
//! # Rounds
//!
//! Work on a core is cut into *rounds*: the span between two polls of the
//! io_uring (the reactor's [`CoreIo::round`](tessera_io::CoreIo::round)).
//! While more than one volume is active on the core (seen within
//! [`ACTIVE_WINDOW`]), each volume dispatches at most [`ROUND_BUDGET`] cost
//! units per round (a 4 KiB request costs 1; see [`cost`]); a request beyond
//! that is deferred to the next round, which starts right after the ring has been
//! polled and the replies produced so far submitted. New arrivals (reaped in
//! that poll) are handled before the deferred work, so a light volume's
//! request waits for at most one round of the heavy volume's work instead of
//! its whole queue.
//!
//! # Weights
//!
//! A volume that had a request deferred in the last [`BACKLOG_ROUNDS`] rounds
//! is *backlogged*. While
//! other volumes are backlogged too, a volume may use only its weighted part
//! of the round, `ROUND_BUDGET * w / (w + sum of the other backlogged
//! weights)`; so volumes that all want more than the core gives split it in
//! proportion to their weights. A volume that is not backlogged is never
//! capped by its weight (it asks for less than its share, which is what
//! max-min fairness gives it), only by the per-round budget.
//!
//! Weights also set how long a round may be: a volume may use at most
//! `ROUND_BUDGET * w / (highest active weight)` units per round (at least
//! [`MIN_ROUND`]), so a high-weight volume's requests wait behind shorter
//! rounds of the others even when it asks for little (a latency-sensitive
//! volume given a high weight is served sooner, not only more).
//!
//! With a single active volume nothing is deferred: the scheduler costs one
//! comparison per request and never adds a system call.
//!
//! # Reads first
//!
//! A volume that asks for reads first has its reads pass the scheduler
//! unconditionally (they still count toward the round); only its writes
//! wait.

use std::time::{Duration, Instant};

use tessera_io::cast::u32_of;

/// Cost units one volume may dispatch per round while several are active.
pub const ROUND_BUDGET: u32 = 16;
/// The shortest round a lighter volume is cut to by a heavier one's weight.
pub const MIN_ROUND: u32 = 4;
/// A volume counts as backlogged for this many rounds after one of its
/// requests was deferred: its client may not have refilled its queue in
/// every round, and its weight must still hold the others back meanwhile.
pub const BACKLOG_ROUNDS: u64 = 8;
/// A volume counts as active on a core while it dispatched (or tried to)
/// within this window.
pub const ACTIVE_WINDOW: Duration = Duration::from_millis(2);

/// The cost of a request of `bytes`: 1 for anything up to 16 KiB, then one
/// more per 16 KiB (copying and checksumming grow with the size).
#[inline]
pub fn cost(bytes: u64) -> u32 {
    let units = (bytes / 16384).min(u64::from(u32::MAX / 2));
    // Exact after the min (the optimiser drops the check).
    1 + u32::try_from(units).unwrap_or(u32::MAX / 2)
}

/// What [`ShareScheduler::admit`] decided for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Dispatch now; the volume was not competing for a split round (alone on the core,
    /// reads first, or not backlogged itself, or nobody else backlogged).
    Free,
    /// Dispatch now, within this volume's weighted part of a round in which it and
    /// another volume were both backlogged: the units admitted this way split in
    /// proportion to the weights, which is what the node reports as shared units.
    Shared,
    /// Defer the request to the next round.
    Deferred,
}

impl Admit {
    /// Whether the request may be dispatched now.
    #[inline]
    pub fn dispatched(self) -> bool {
        self != Admit::Deferred
    }
}

/// A volume's handle in a core's [`ShareScheduler`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowId(u32);

struct Flow {
    key: usize,
    refs: u32,
    weight: u32,
    reads_first: bool,
    /// Round in which `used` was counted.
    round: u64,
    used: u32,
    /// Last round in which this flow had a request deferred.
    deferred_round: Option<u64>,
    last_seen: Option<Instant>,
}

fn is_backlogged(f: &Flow, round: u64) -> bool {
    f.deferred_round
        .is_some_and(|r| round.wrapping_sub(r) <= BACKLOG_ROUNDS)
}

/// One core's share scheduler (single-threaded; see the module docs).
#[derive(Default)]
pub struct ShareScheduler {
    flows: Vec<Flow>,
    round: u64,
    /// Recomputed at each round start: flows active within the window, the
    /// summed weight of backlogged flows, and the highest active weight.
    active: u32,
    max_active_weight: u32,
    backlogged_weight: u64,
}

impl ShareScheduler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Register a user of the flow for `key` (one per volume per core;
    /// connections to the same volume share it).
    pub fn register(&mut self, key: usize) -> FlowId {
        if let Some(i) = self.flows.iter().position(|f| f.key == key && f.refs > 0) {
            self.flows[i].refs += 1;
            return FlowId(u32_of(i));
        }
        let flow = Flow {
            key,
            refs: 1,
            weight: crate::DEFAULT_WEIGHT,
            reads_first: false,
            round: 0,
            used: 0,
            deferred_round: None,
            last_seen: None,
        };
        match self.flows.iter().position(|f| f.refs == 0) {
            Some(i) => {
                self.flows[i] = flow;
                FlowId(u32_of(i))
            }
            None => {
                self.flows.push(flow);
                FlowId(u32_of(self.flows.len() - 1))
            }
        }
    }

    pub fn unregister(&mut self, id: FlowId) {
        let f = &mut self.flows[id.0 as usize];
        f.refs = f.refs.saturating_sub(1);
    }

    pub fn configure(&mut self, id: FlowId, weight: u32, reads_first: bool) {
        let f = &mut self.flows[id.0 as usize];
        f.weight = weight.max(1);
        f.reads_first = reads_first;
    }

    fn start_round(&mut self, round: u64, now: Instant) {
        self.round = round;
        let (mut active, mut backlogged, mut max_weight) = (0, 0u64, 0u32);
        for f in self.flows.iter().filter(|f| f.refs > 0) {
            if f.last_seen
                .is_some_and(|t| now.saturating_duration_since(t) < ACTIVE_WINDOW)
            {
                active += 1;
                max_weight = max_weight.max(f.weight);
            }
            if is_backlogged(f, round) {
                backlogged += u64::from(f.weight);
            }
        }
        self.active = active;
        self.backlogged_weight = backlogged;
        self.max_active_weight = max_weight;
    }

    /// May a request of `cost` units from `id` be dispatched in `round`
    /// (the core's current round) at `now`? [`Admit::Deferred`] means: defer it to
    /// the next round and ask again then.
    pub fn admit(&mut self, id: FlowId, write: bool, cost: u32, round: u64, now: Instant) -> Admit {
        if round != self.round {
            self.start_round(round, now);
        }
        let f = &mut self.flows[id.0 as usize];
        if f.last_seen
            .is_none_or(|t| now.saturating_duration_since(t) >= ACTIVE_WINDOW)
        {
            // Becoming active: count it at once rather than at the next round.
            self.active += 1;
            self.max_active_weight = self.max_active_weight.max(f.weight);
        }
        f.last_seen = Some(now);
        if f.round != round {
            f.round = round;
            f.used = 0;
        }
        if self.active <= 1 || (f.reads_first && !write) {
            f.used = f.used.saturating_add(cost);
            return Admit::Free;
        }
        // A heavier volume active on the core shortens this one's rounds in proportion
        // (never below MIN_ROUND): the weight buys the heavier volume's requests a
        // shorter wait behind this one's, whether or not it is backlogged.
        let round_cap = (u64::from(ROUND_BUDGET) * u64::from(f.weight)
            / u64::from(self.max_active_weight.max(f.weight)))
        .max(u64::from(MIN_ROUND));
        let fits_round = u64::from(f.used) < round_cap;
        let mine_backlogged = is_backlogged(f, round);
        let others = self.backlogged_weight.saturating_sub(if mine_backlogged {
            u64::from(f.weight)
        } else {
            0
        });
        let fits_share = others == 0 || {
            let cap =
                u64::from(ROUND_BUDGET) * u64::from(f.weight) / (u64::from(f.weight) + others);
            u64::from(f.used) < cap.max(1)
        };
        if fits_round && fits_share {
            f.used = f.used.saturating_add(cost);
            if mine_backlogged && others > 0 {
                Admit::Shared
            } else {
                Admit::Free
            }
        } else {
            if f.deferred_round != Some(round) {
                f.deferred_round = Some(round);
                if !mine_backlogged {
                    self.backlogged_weight += u64::from(f.weight);
                }
            }
            Admit::Deferred
        }
    }

    /// Volumes active on this core now (for status and tests).
    pub fn active(&self) -> u32 {
        self.active
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Saturated flows offering `want` requests per round each; returns what
    /// each got over `rounds` rounds.
    fn run(s: &mut ShareScheduler, flows: &[(FlowId, u32)], rounds: u64, write: bool) -> Vec<u64> {
        let t0 = Instant::now();
        let mut got = vec![0u64; flows.len()];
        for r in 1..=rounds {
            let now = t0 + Duration::from_micros(r * 10);
            // Alternate who goes first, as arrival order does on a real core.
            for k in 0..flows.len() {
                let i = (k + tessera_io::cast::usize_of(r)) % flows.len();
                let (id, want) = flows[i];
                for _ in 0..want {
                    if s.admit(id, write, 1, r, now).dispatched() {
                        got[i] += 1;
                    } else {
                        break;
                    }
                }
            }
        }
        got
    }

    #[test]
    fn a_single_volume_is_never_deferred() {
        let mut s = ShareScheduler::new();
        let a = s.register(1);
        let got = run(&mut s, &[(a, 500)], 100, true);
        assert_eq!(got, vec![50_000]);
    }

    #[test]
    fn saturated_volumes_split_by_weight() {
        let mut s = ShareScheduler::new();
        let a = s.register(1);
        let b = s.register(2);
        s.configure(a, 300, false);
        s.configure(b, 100, false);
        let got = run(&mut s, &[(a, 1000), (b, 1000)], 10_000, true);
        let ratio = got[0] as f64 / got[1] as f64;
        assert!((ratio - 3.0).abs() < 0.2, "got {got:?}, ratio {ratio}");
        // The round budget is used in full.
        assert!(
            got[0] + got[1] >= 10_000 * u64::from(ROUND_BUDGET) * 95 / 100,
            "{got:?}"
        );
    }

    #[test]
    fn shared_admissions_are_those_of_a_split_round() {
        // Alone on the core: everything is free, nothing shared.
        let mut s = ShareScheduler::new();
        let t0 = Instant::now();
        let a = s.register(1);
        for r in 1..=10 {
            for _ in 0..100 {
                assert_eq!(s.admit(a, true, 1, r, t0), Admit::Free);
            }
        }
        // Two saturated volumes weighted 3:1: once both are backlogged, what each is
        // admitted is shared, in the weights' proportion.
        let b = s.register(2);
        s.configure(a, 300, false);
        s.configure(b, 100, false);
        let mut shared = [0u64; 2];
        for r in 11..=2000u64 {
            let now = t0 + Duration::from_micros(r * 10);
            for k in 0..2 {
                let i = (k + tessera_io::cast::usize_of(r)) % 2;
                let id = [a, b][i];
                loop {
                    match s.admit(id, true, 1, r, now) {
                        Admit::Shared => shared[i] += 1,
                        Admit::Free => {}
                        Admit::Deferred => break,
                    }
                }
            }
        }
        let ratio = shared[0] as f64 / shared[1] as f64;
        assert!(
            (ratio - 3.0).abs() < 0.2,
            "shared {shared:?}, ratio {ratio}"
        );
        assert!(shared[0] + shared[1] >= 1990 * u64::from(ROUND_BUDGET) * 9 / 10);
    }

    #[test]
    fn equal_weights_split_equally() {
        let mut s = ShareScheduler::new();
        let ids: Vec<_> = (0..3).map(|k| s.register(k)).collect();
        let flows: Vec<_> = ids.iter().map(|&i| (i, 1000)).collect();
        let got = run(&mut s, &flows, 6000, false);
        let min = *got.iter().min().unwrap() as f64;
        let max = *got.iter().max().unwrap() as f64;
        assert!(max / min < 1.1, "got {got:?}");
    }

    #[test]
    fn a_light_volume_is_not_deferred_behind_a_heavy_one() {
        let mut s = ShareScheduler::new();
        let heavy = s.register(1);
        let light = s.register(2);
        let t0 = Instant::now();
        for r in 1..=1000u64 {
            let now = t0 + Duration::from_micros(r * 10);
            // The heavy volume goes first and would take everything.
            let mut h = 0;
            while h < 128 && s.admit(heavy, true, 1, r, now).dispatched() {
                h += 1;
            }
            assert!(
                s.admit(light, false, 1, r, now).dispatched(),
                "light deferred in round {r}"
            );
            if r > 2 {
                // Two volumes active: the heavy one is held to the round budget.
                assert!(h <= ROUND_BUDGET, "heavy got {h} in round {r}");
            }
        }
    }

    #[test]
    fn a_heavier_light_volume_shortens_the_others_rounds() {
        let mut s = ShareScheduler::new();
        let heavy = s.register(1);
        let light = s.register(2);
        s.configure(heavy, 100, false);
        s.configure(light, 1000, false);
        let t0 = Instant::now();
        for r in 1..=100u64 {
            let now = t0 + Duration::from_micros(r * 10);
            assert!(s.admit(light, false, 1, r, now).dispatched());
            let mut h = 0;
            while h < 128 && s.admit(heavy, true, 1, r, now).dispatched() {
                h += 1;
            }
            if r > 1 {
                assert_eq!(h, MIN_ROUND, "round {r}");
            }
        }
    }

    #[test]
    fn reads_first_passes_reads_only() {
        let mut s = ShareScheduler::new();
        let a = s.register(1);
        let b = s.register(2);
        s.configure(b, 100, true);
        let t0 = Instant::now();
        let mut reads = 0;
        let mut writes = 0;
        for r in 1..=100u64 {
            let now = t0 + Duration::from_micros(r);
            // The heavy writer `a` takes what the scheduler gives it.
            let mut n = 0;
            while n < 128 && s.admit(a, true, 1, r, now).dispatched() {
                n += 1;
            }
            for _ in 0..8 {
                if s.admit(b, false, 1, r, now).dispatched() {
                    reads += 1;
                }
                if s.admit(b, true, 1, r, now).dispatched() {
                    writes += 1;
                }
            }
        }
        assert_eq!(reads, 800);
        assert!(writes < 800, "writes {writes}");
    }

    #[test]
    fn idle_flows_drop_out() {
        let mut s = ShareScheduler::new();
        let a = s.register(1);
        let b = s.register(2);
        let t0 = Instant::now();
        assert!(s.admit(b, false, 1, 1, t0).dispatched());
        // Long after b's last request, a alone is not capped.
        let later = t0 + ACTIVE_WINDOW * 2;
        let mut n = 0;
        while n < 1000 && s.admit(a, true, 1, 2, later).dispatched() {
            n += 1;
        }
        assert_eq!(n, 1000);
        s.unregister(b);
        let c = s.register(3);
        assert_eq!(c, b, "freed slots are reused");
    }
}
