//! Which errors of an application that shares a pooler with lockkit, and
//! knows nothing of it, lockkit could have caused: the pooler refusing the
//! application (pgbouncer's own `FATAL`s when its client slots are full,
//! when PostgreSQL refuses it logins, when no server connection came free in
//! time) or gone (the connection refused). The fleet test (`tests/fleet`)
//! counts them apart from the application's own errors (its statement names
//! meeting another process's, a backend the runner terminated), and the
//! cut-off stress step (`.ci/cutoff-stress`) counts them beside its cut-off
//! calls.
//!
//! The texts are pgbouncer 1.18's and tokio-postgres's and sqlx's as they
//! arrive, observed for real by the fleet test's
//! `the_harm_classifier_reads_what_pgbouncer_sends`.

use std::time::Duration;

/// Texts (lower case) of the errors a pooler that refuses or is gone
/// gives its clients, with what each means.
const CAUSED: [(&str, &str); 10] = [
    // pgbouncer: its client slots are full.
    (
        "no more connections allowed",
        "pooler full (max_client_conn)",
    ),
    // pgbouncer: PostgreSQL refused its last login (too many backends).
    ("server_login_retry", "pooler refused (server_login_retry)"),
    (
        "too many clients already",
        "PostgreSQL full (max_connections)",
    ),
    ("cannot connect to server", "pooler cannot reach PostgreSQL"),
    // pgbouncer: no server connection came free within the bound.
    (
        "query_wait_timeout",
        "no server connection (query_wait_timeout)",
    ),
    (
        "client_login_timeout",
        "no server connection (client_login_timeout)",
    ),
    // sqlx's pool: no connection within its acquire timeout.
    (
        "pool timed out while waiting for an open connection",
        "no connection (sqlx pool timeout)",
    ),
    // The pooler is gone: nothing listens.
    ("connection refused", "pooler gone (connection refused)"),
    ("pooler error", "pooler error"),
    ("pgbouncer cannot connect", "pooler cannot reach PostgreSQL"),
];

/// What an error of a foreign application says lockkit may have caused
/// (`Some`, with the cause), or `None` for one of the application's own:
/// a statement name clash, a terminated backend, a closed connection
/// (which a pooler that died also gives, but then every reconnection is
/// refused, and counted).
pub fn caused_by_lockkit(error_text: &str) -> Option<&'static str> {
    let text = error_text.to_lowercase();
    CAUSED
        .iter()
        .find(|(needle, _)| text.contains(needle))
        .map(|&(_, cause)| cause)
}

/// The longest a foreign application's short transaction may take, from
/// its first statement to its commit's reply, before it counts as held
/// hostage: 30 s, fifteen of lockkit's server-side slices at PostgreSQL's
/// default `deadlock_timeout` (1 s + 1 s each). Behind a pooler whose
/// server connections are all taken by lockkit's waits, each freed within
/// a slice, a foreign transaction is served within a few; a wait with no
/// bound on the server keeps it until the key's holder lets go. Generous,
/// so that a loaded 2-core machine does not trip it.
pub const HOSTAGE_BOUND: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::caused_by_lockkit;

    /// The texts as they arrive (tokio-postgres's `Display` of pgbouncer's
    /// `FATAL`s and of a refused connection; sqlx's pool timeout), and
    /// texts of the application's own errors, which are not lockkit's.
    #[test]
    fn pooler_refusals_are_lockkits_and_own_errors_are_not() {
        for caused in [
            "db error: FATAL: no more connections allowed (max_client_conn)",
            "db error: FATAL: server login has been failing, try again later (server_login_retry)",
            "db error: FATAL: query_wait_timeout",
            "error connecting to server: Connection refused (os error 111)",
            "pool timed out while waiting for an open connection",
        ] {
            assert!(caused_by_lockkit(caused).is_some(), "{caused}");
        }
        for own in [
            "db error: ERROR: prepared statement \"s3\" already exists",
            "db error: FATAL: terminating connection due to administrator command",
            "db error: ERROR: server conn crashed?",
            "connection closed",
        ] {
            assert_eq!(caused_by_lockkit(own), None, "{own}");
        }
    }
}
