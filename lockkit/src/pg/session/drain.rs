//! A take's connection that ends up holding nothing while a statement of
//! its may still be in flight (the take was cut off, or gave up at its
//! bound): drained on a task ([`Taking`]), never closed under the
//! statement.
//!
//! Closing a connection with a statement in flight is what hurts a
//! transaction-mode pooler: the statement, queued there for a server
//! connection, still reaches PostgreSQL, the pooler then finds its client
//! gone and closes that server connection ("client disconnect while server
//! was not ready"), and opens another for its next client; and a client
//! waiting for a server connection is one pgbouncer 1.18 reads nothing
//! from, so the closed client keeps its slot there until a server
//! connection frees. Drained, the statement ends on the server (a lock
//! waits there in bounded slices: [`Policy::bounds_waits`]), what it took
//! is let go, and the connection then goes back to its pool, or, opened by
//! lockkit, ends with a `Terminate` while idle: the pooler keeps its server
//! connection for its other clients.
//!
//! [`Policy::bounds_waits`]: crate::engine::Policy::bounds_waits

use std::time::Duration;

use super::conn::Lease;
use super::wire::key_query;
use crate::engine::error::Error;
use crate::engine::plan::Mode;
use crate::engine::sql;
use crate::key::LockKey;

/// How long a drain waits at most for what is in flight to end, and for
/// its own clean-up: a guard against a path that hangs, never reached
/// otherwise. A lock statement that runs on the server ends within one
/// slice of its wait (the server's `deadlock_timeout` and one second), and
/// the clean-up takes a round trip; one still queued in a pooler waits for
/// a free server connection, which pgbouncer bounds by its
/// `query_wait_timeout` (120 s by default) and then ends the client. Past
/// this guard the connection is closed at once.
pub(super) const DRAIN_GUARD: Duration = Duration::from_secs(150);

/// [`Cleanup::EndHeld`]'s query.
const END_HELD: &str = "SELECT pg_advisory_unlock_all(); ROLLBACK";

/// What lets go of what a cut-off take may have taken.
#[derive(Clone, Copy, Debug)]
pub(super) enum Cleanup {
    /// The take's transaction (the default form's, or a multiplexed
    /// connection's being opened): rolled back.
    Rollback,
    /// A session-level lock of a key in a mode, granted or not: unlocked,
    /// and what the lock set on the session for its time reset.
    Unlock(LockKey, Mode),
    /// A multiplexed connection's held transaction, once nothing refers to
    /// the connection: every session-level lock let go, then rolled back,
    /// in one query, so that no pooler can hand the server connection on
    /// between the two.
    EndHeld,
}

/// A take's connection while the take runs. Dropped before
/// [`keep`](Self::keep) (the take cut off, or given up), it is drained on
/// a task ([`drain`]).
pub(super) struct Taking {
    lease: Option<Lease>,
    cleanup: Cleanup,
}

impl Taking {
    /// `lease`, drained with `cleanup` unless kept.
    pub(super) fn new(lease: Lease, cleanup: Cleanup) -> Self {
        Taking {
            lease: Some(lease),
            cleanup,
        }
    }

    /// The connection.
    pub(super) fn lease(&self) -> &Lease {
        self.lease.as_ref().expect("taken only by keep")
    }

    /// The connection, no longer drained when this drops: nothing is in
    /// flight on it.
    pub(super) fn keep(mut self) -> Lease {
        self.lease.take().expect("kept once")
    }
}

impl Drop for Taking {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            drain(lease, self.cleanup);
        }
    }
}

/// Drains `lease` on a task of the current runtime: waits (at most
/// [`DRAIN_GUARD`]) for what is in flight to end and runs `cleanup` behind
/// it, then gives the connection back clean (to its pool, or ended by a
/// `Terminate` while idle). When the clean-up fails or the guard passes,
/// or with no runtime to run the task, the connection is closed at once
/// (a pool's detached), which ends its session on the server.
///
/// The connection keeps its pending slot until then
/// ([`PENDING_CONNECTIONS_PER_SESSION_LOCK`](super::PENDING_CONNECTIONS_PER_SESSION_LOCK)):
/// a connection being drained is one the pooler still counts.
pub(super) fn drain(lease: Lease, cleanup: Cleanup) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(drained(lease, cleanup));
        }
        Err(_) => drop(lease),
    }
}

async fn drained(mut lease: Lease, cleanup: Cleanup) {
    let ended = tokio::time::timeout(DRAIN_GUARD, clean_up(&lease, cleanup)).await;
    let done = matches!(ended, Ok(Ok(())));
    // A multiplexed connection leased from a pool never goes back to it,
    // even ended cleanly: detached, it closes while idle.
    let returns = !matches!(cleanup, Cleanup::EndHeld) || lease.is_owned();
    lease.clean = done && returns;
    if !done {
        tracing::debug!(?cleanup, answer = ?ended,
            "lockkit: a cut-off session lock's connection could not be drained; closing it");
    }
}

/// `cleanup` on `lease`, sent behind whatever is in flight there (a
/// connection answers in order), so its answer comes once that ended.
async fn clean_up(lease: &Lease, cleanup: Cleanup) -> Result<(), Error> {
    let client = lease.client();
    match cleanup {
        Cleanup::Rollback => client.batch_execute(sql::SESSION_ROLLBACK).await?,
        Cleanup::EndHeld => client.batch_execute(END_HELD).await?,
        Cleanup::Unlock(key, mode) => {
            // `false` (with a warning) when the cut-off lock was not
            // granted.
            key_query(client, sql::session_unlock(key, mode), key).await?;
            client.batch_execute(sql::RESET_LOCK_TIMEOUT).await?;
            lease.reset_session_lease().await?;
        }
    }
    Ok(())
}
