//! The reading of a run's table, in one paragraph, as BENCHMARKS.md's "An
//! honest reading" gives it, but computed from the run's own figures: each
//! comparison is made only when both strategies ran, and its words (ahead,
//! behind, level) follow the ratio, so the text cannot contradict the table.

use std::fmt::Write as _;

use super::report::{Outcome, Report};
use super::strategy::Strategy;

/// A ratio of two throughputs that this close to 1 (either way) is read as
/// noise: the study runs its strategies one after another on a machine
/// whose load comes and goes (BENCHMARKS.md: "read differences under about
/// 30 % as noise").
pub(crate) const NOISE: f64 = 1.3;

/// How a throughput ratio reads.
fn verdict(ratio: f64) -> &'static str {
    if ratio >= NOISE {
        "ahead"
    } else if ratio <= 1.0 / NOISE {
        "behind"
    } else {
        "level within the noise"
    }
}

/// What a ratio of lockkit's throughput to its hand-written reference's
/// says of lockkit's cost: a change only outside the noise; inside it, the
/// difference is named as the noise it is, not as lockkit's doing.
fn lockkit_change(ratio: f64) -> String {
    let percent = (ratio - 1.0) * 100.0;
    if verdict(ratio) == "level within the noise" {
        format!(
            "a difference of {percent:+.0} %, inside this run's noise (ratios between {:.2}× and {NOISE:.2}×), so the run cannot tell what lockkit changes",
            1.0 / NOISE
        )
    } else {
        format!("so lockkit changes the throughput by {percent:+.0} %")
    }
}

impl Report {
    fn outcome(&self, strategy: Strategy) -> Option<&Outcome> {
        self.outcomes.iter().find(|o| o.strategy == strategy)
    }

    /// The one-paragraph reading of the table, from this run's figures
    /// (empty when no comparison applies to the strategies run).
    pub fn reading(&self) -> String {
        let mut out = String::new();
        let advisory = self.outcome(Strategy::Advisory);
        let for_update = self.outcome(Strategy::ForUpdate);
        if let (Some(a), Some(f)) = (advisory, for_update) {
            let ratio = a.events_per_second / f.events_per_second;
            let _ = write!(
                out,
                "Against check-then-insert that writes to take its lock (for-update), advisory locks are {} at {ratio:.2}× its throughput, with an event p99 of {:.1} against {:.1} ms, {:.2}× its WAL per event, {} dead tuples against {} and {} retries against {}. ",
                verdict(ratio),
                a.event_p99_ms,
                f.event_p99_ms,
                a.wal_bytes_per_event / f.wal_bytes_per_event,
                dead(a),
                dead(f),
                a.retries(),
                f.retries(),
            );
        }
        let lock_only = self.outcome(Strategy::LockOnly);
        let no_lock = self.outcome(Strategy::NoLock);
        if let (Some(l), Some(n)) = (lock_only, no_lock) {
            let held = if l.exactly_once() {
                "they carry exactly-once"
            } else {
                "they did NOT carry exactly-once"
            };
            let _ = write!(
                out,
                "When the locks alone carry exactly-once (lock-only: no unique index), {held}: {} duplicate and {} missing rows, against {} duplicates for the same statements without the locks (no-lock), at {:.2}× no-lock's throughput (the lock statement and the waits of concurrent copies). ",
                l.duplicates,
                l.missing,
                n.duplicates,
                l.events_per_second / n.events_per_second,
            );
        }
        for reference in [Strategy::HandAdvisory, Strategy::HandLockOnly] {
            let mirrored = reference.mirrors().and_then(|m| self.outcome(m));
            if let (Some(l), Some(h)) = (mirrored, self.outcome(reference)) {
                let ratio = l.events_per_second / h.events_per_second;
                let _ = write!(
                    out,
                    "{} through lockkit against the same locks in the same transactions sent by hand with no lockkit ({}): {} at {ratio:.2}× its throughput, {}{}. ",
                    l.strategy.name(),
                    h.strategy.name(),
                    verdict(ratio),
                    lockkit_change(ratio),
                    difference(l, h),
                );
            }
        }
        let on_conflict = self.outcome(Strategy::OnConflict);
        if let (Some(a), Some(c)) = (advisory, on_conflict) {
            let ratio = a.events_per_second / c.events_per_second;
            let why = match verdict(ratio) {
                "behind" => "where the invariant is a unique index, the index already makes a concurrent copy wait, and the locks add a statement and lock-table work per key",
                "ahead" => "the locks only add work, so this run's load, not the locks, made the difference",
                _ => "the locks' statement and lock-table work did not show against this run's noise",
            };
            let _ = write!(
                out,
                "Against a plain INSERT … ON CONFLICT DO NOTHING on a unique index (on-conflict), advisory locks are {} at {ratio:.2}× its throughput: {why}. ",
                verdict(ratio),
            );
        }
        if !out.is_empty() {
            let _ = write!(
                out,
                "Compare strategies within one run only: they ran one after another, and differences under about {:.0} % are noise on a loaded machine.",
                (NOISE - 1.0) * 100.0
            );
        }
        out
    }
}

/// Where `a`'s time per event differs from `b`'s, from their breakdowns
/// (empty without them): worker time, the backend states that make it up,
/// the server's time in the lock statements, and the client's CPU.
fn difference(a: &Outcome, b: &Outcome) -> String {
    let (Some(x), Some(y)) = (&a.breakdown, &b.breakdown) else {
        return String::new();
    };
    let mut parts = vec![format!("worker time {:+.1} µs", x.worker_us - y.worker_us)];
    if let (Some(p), Some(q)) = (x.backends, y.backends) {
        parts.push(format!(
            "of which running {:+.1}, lock wait {:+.1}, other waits {:+.1}, idle in transaction {:+.1}, idle between transactions {:+.1}",
            p.running_us - q.running_us,
            p.lock_wait_us - q.lock_wait_us,
            p.other_wait_us - q.other_wait_us,
            p.idle_in_transaction_us - q.idle_in_transaction_us,
            p.idle_us - q.idle_us,
        ));
    }
    if let (Some(p), Some(q)) = (x.statements, y.statements) {
        parts.push(format!(
            "server time in the lock statement {:+.1} µs",
            p.lock_us - q.lock_us
        ));
    }
    if let (Some(p), Some(q)) = (x.client_cpu_us, y.client_cpu_us) {
        parts.push(format!("client CPU {:+.1} µs", p - q));
    }
    format!(" (per event: {})", parts.join("; "))
}

/// Dead tuples, or `n/a` when the statistics were discarded (`--chaos`).
fn dead(o: &Outcome) -> String {
    o.dead_tuples
        .map_or_else(|| "n/a".to_owned(), |n| n.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ingest::Budgeting;

    pub(crate) fn outcome(strategy: Strategy, events_per_second: f64) -> Outcome {
        Outcome {
            strategy,
            seconds: 1.0,
            events_per_second,
            batches: 1,
            transactions: 1,
            p50_ms: 1.0,
            p95_ms: 1.0,
            p99_ms: 1.0,
            max_ms: 1.0,
            event_p50_ms: 1.0,
            event_p95_ms: 1.0,
            event_p99_ms: 1.0,
            wal_bytes: 1.0,
            wal_bytes_per_event: 200.0,
            checkpointed: true,
            live_tuples: Some(1),
            dead_tuples: Some(0),
            table_bytes: 1,
            deadlocks: 0,
            retried: Vec::new(),
            lost_events: 0,
            reconnects: 0,
            acked_then_failed: 0,
            survived: None,
            rows: 1,
            duplicates: 0,
            missing: 0,
            breakdown: None,
        }
    }

    pub(crate) fn report(outcomes: Vec<Outcome>) -> Report {
        Report {
            server_version: "15".into(),
            throwaway_server: true,
            durability: String::new(),
            chaos: false,
            cores: 2,
            workers: 8,
            batch: 500,
            duplicate_rate: 0.1,
            seed: 1405,
            events: 1,
            distinct: 1,
            duplicates: 0,
            budget: 64,
            budgeting: Budgeting::Fits,
            budget_note: String::new(),
            breakdown_note: None,
            outcomes,
        }
    }

    /// The words follow the figures: the same comparisons with the
    /// throughputs swapped read the other way.
    #[test]
    fn the_reading_follows_the_figures() {
        let text = report(vec![
            outcome(Strategy::Advisory, 27_726.0),
            outcome(Strategy::OnConflict, 31_394.0),
            outcome(Strategy::ForUpdate, 10_970.0),
        ])
        .reading();
        assert!(
            text.contains("advisory locks are ahead at 2.53× its throughput"),
            "{text}"
        );
        assert!(
            text.contains("advisory locks are level within the noise at 0.88×"),
            "{text}"
        );
        assert!(
            !text.contains("lock-only"),
            "only the strategies run: {text}"
        );
        assert!(!text.contains("by hand"), "only the strategies run: {text}");
        let swapped = report(vec![
            outcome(Strategy::Advisory, 10_970.0),
            outcome(Strategy::OnConflict, 31_394.0),
            outcome(Strategy::ForUpdate, 27_726.0),
        ])
        .reading();
        assert!(
            swapped.contains("advisory locks are behind at 0.40×"),
            "{swapped}"
        );
        assert!(
            swapped.contains("are behind at 0.35× its throughput: where the invariant"),
            "{swapped}"
        );
    }

    /// lock-only's verdict is its own exactly-once check, not a given.
    #[test]
    fn lock_only_is_read_from_its_duplicates() {
        let mut no_lock = outcome(Strategy::NoLock, 22_832.0);
        no_lock.duplicates = 14_934;
        let lock_only = outcome(Strategy::LockOnly, 17_760.0);
        let text = report(vec![lock_only.clone(), no_lock.clone()]).reading();
        assert!(
            text.contains(
                "they carry exactly-once: 0 duplicate and 0 missing rows, against 14934 duplicates"
            ),
            "{text}"
        );
        assert!(text.contains("at 0.78× no-lock's throughput"), "{text}");
        let mut broken = lock_only;
        broken.duplicates = 3;
        let text = report(vec![broken, no_lock]).reading();
        assert!(
            text.contains("they did NOT carry exactly-once: 3 duplicate"),
            "{text}"
        );
        assert_eq!(report(vec![outcome(Strategy::Advisory, 1.0)]).reading(), "");
    }

    /// Each lockkit strategy is compared with its hand-written reference,
    /// and only with its own.
    #[test]
    fn lockkit_is_read_against_its_hand_written_reference() {
        let text = report(vec![
            outcome(Strategy::Advisory, 60_000.0),
            outcome(Strategy::HandAdvisory, 62_500.0),
            outcome(Strategy::HandLockOnly, 50_000.0),
        ])
        .reading();
        assert!(
            text.contains("advisory through lockkit against the same locks in the same transactions sent by hand with no lockkit (hand-advisory): level within the noise at 0.96× its throughput, a difference of -4 %, inside this run's noise (ratios between 0.77× and 1.30×), so the run cannot tell what lockkit changes"),
            "{text}"
        );
        assert!(!text.contains("(hand-lock-only)"), "{text}");
        assert!(!text.contains("per event:"), "no breakdown: {text}");
    }

    /// Issue 47's run: 0.82× is inside the noise, so the reading does not
    /// say lockkit changes the throughput by -18 %; outside the noise
    /// (either way) it does, with the verdict that matches.
    #[test]
    fn lockkit_changes_the_throughput_only_outside_the_noise() {
        let read = |lockkit: f64, hand: f64| {
            report(vec![
                outcome(Strategy::Advisory, lockkit),
                outcome(Strategy::HandAdvisory, hand),
            ])
            .reading()
        };
        let inside = read(41_000.0, 50_000.0);
        assert!(
            inside.contains("level within the noise at 0.82× its throughput, a difference of -18 %, inside this run's noise"),
            "{inside}"
        );
        assert!(
            !inside.contains("lockkit changes the throughput"),
            "{inside}"
        );
        let below = read(35_000.0, 50_000.0);
        assert!(
            below.contains(
                "behind at 0.70× its throughput, so lockkit changes the throughput by -30 %"
            ),
            "{below}"
        );
        let above = read(70_000.0, 50_000.0);
        assert!(
            above.contains(
                "ahead at 1.40× its throughput, so lockkit changes the throughput by +40 %"
            ),
            "{above}"
        );
    }

    /// With breakdowns, the comparison says where the difference is.
    #[test]
    fn the_difference_is_broken_down() {
        use crate::ingest::{BackendTimes, Breakdown, StatementTimes};
        let breakdown = |running_us, lock_us, cpu| Breakdown {
            worker_us: 100.0 + running_us,
            round_wait_us: 10.0,
            client_cpu_us: Some(cpu),
            backends: Some(BackendTimes {
                samples: 100,
                running_us,
                lock_wait_us: 30.0,
                other_wait_us: 5.0,
                idle_in_transaction_us: 30.0,
                idle_us: 35.0,
            }),
            statements: Some(StatementTimes {
                calls: 0.01,
                total_us: 50.0,
                lock_us,
                data_us: 20.0,
                transaction_us: 1.0,
            }),
            commits: 0.002,
            rollbacks: 0.0,
        };
        let mut lockkit = outcome(Strategy::Advisory, 60_000.0);
        lockkit.breakdown = Some(breakdown(32.0, 12.0, 9.0));
        let mut hand = outcome(Strategy::HandAdvisory, 62_500.0);
        hand.breakdown = Some(breakdown(30.0, 11.5, 6.5));
        let text = report(vec![lockkit, hand]).reading();
        assert!(
            text.contains("(per event: worker time +2.0 µs; of which running +2.0, lock wait +0.0, other waits +0.0, idle in transaction +0.0, idle between transactions +0.0; server time in the lock statement +0.5 µs; client CPU +2.5 µs)"),
            "{text}"
        );
    }
}
