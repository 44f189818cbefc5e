//! The checks of the fleet, shared by the fleet test and its controls: each
//! says `Ok` or what failed.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::fleet::{short, Report};

/// How long the server may take, once the clients stopped, to end their
/// sessions and release what they held (a killed process's connection
/// closed by pgbouncer, a terminated backend's exit): a bound, no timing
/// claim.
pub(crate) const SETTLE: Duration = Duration::from_secs(30);

/// No worker met an unexpected error: a lockkit error of no expected
/// cause, a statement name clash, a pooled connection handed out inside a
/// transaction, a worker that exited without its final line.
pub(crate) fn errors(report: &Report) -> Result<(), String> {
    let unexpected = report.sum("unexpected");
    if unexpected == 0 && report.unexpected.is_empty() {
        return Ok(());
    }
    let first: Vec<String> = report.unexpected.iter().take(5).map(|e| short(e)).collect();
    Err(format!(
        "{} unexpected errors (by role: {:?}); the first: {first:#?}",
        unexpected.max(report.unexpected.len() as u64),
        report.by_role("unexpected"),
    ))
}

/// No error of the foreign applications that lockkit may have caused
/// (`lockkit_tests::harm`): the pooler never refused them nor went away,
/// and none of their transactions took longer than
/// `harm::HOSTAGE_BOUND`, as one would behind server connections held
/// hostage by lockkit's waits.
pub(crate) fn harm(report: &Report) -> Result<(), String> {
    let harmed = report.harmed_count();
    if harmed == 0 {
        return Ok(());
    }
    let first: Vec<String> = report.harmed.iter().take(5).map(|e| short(e)).collect();
    Err(format!(
        "{harmed} errors of the foreign applications caused by lockkit (by role: {:?}); \
         the first: {first:#?}",
        report.by_role("harmed"),
    ))
}

/// Exclusion held: for every key, its counter equals its log rows (a lost
/// update, two holders at once, leaves it below), and the sampler never saw
/// a key granted exclusive to two sessions at once.
pub(crate) async fn exclusion(observer: &Client, report: &Report) -> Result<(), String> {
    let rows = observer
        .query(
            "SELECT c.id, c.n, (SELECT count(*) FROM fleet_log l WHERE l.id = c.id) \
             FROM fleet_counters c ORDER BY c.id",
            &[],
        )
        .await
        .map_err(|e| format!("reading the counters: {e}"))?;
    let mut lost = Vec::new();
    let mut writes = 0;
    for row in &rows {
        let (id, n, logged): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        writes += logged;
        if n != logged {
            lost.push(format!("key {id}: counter {n}, {logged} writes logged"));
        }
    }
    eprintln!(
        "exclusion: {writes} critical sections over {} keys; the sampler looked {} times",
        rows.len(),
        report.samples
    );
    let mut failures = Vec::new();
    if !lost.is_empty() {
        failures.push(format!("lost updates: {}", lost.join("; ")));
    }
    if !report.double_holders.is_empty() {
        failures.push(format!(
            "keys granted exclusive to two sessions at once: {:?}",
            report.double_holders
        ));
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

/// Nothing left once the clients stopped: within `bound`, no advisory lock
/// in `pg_locks` and no backend inside a transaction (`idle in
/// transaction`, or active in one) other than the observer.
pub(crate) async fn nothing_left(observer: &Client, bound: Duration) -> Result<(), String> {
    let deadline = Instant::now() + bound;
    loop {
        let locks: Vec<String> = observer
            .query(
                "SELECT format('pid %s %s %s/%s/%s granted %s', pid, mode, classid, objid, \
                 objsubid, granted) FROM pg_locks WHERE locktype = 'advisory'",
                &[],
            )
            .await
            .map_err(|e| format!("reading pg_locks: {e}"))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let open: Vec<String> = observer
            .query(
                "SELECT format('pid %s %s (%s): %s', pid, state, application_name, left(query, 80)) \
                 FROM pg_stat_activity WHERE backend_type = 'client backend' \
                 AND pid <> pg_backend_pid() AND xact_start IS NOT NULL",
                &[],
            )
            .await
            .map_err(|e| format!("reading pg_stat_activity: {e}"))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if locks.is_empty() && open.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{bound:?} after the clients stopped: {} advisory locks left {:?}; \
                 {} backends inside a transaction {:?}",
                locks.len(),
                &locks[..locks.len().min(10)],
                open.len(),
                &open[..open.len().min(10)],
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
