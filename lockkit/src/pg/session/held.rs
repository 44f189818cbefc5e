//! A lock held on a connection of its own (the default and the
//! session-level forms): what its guard shares with the keeper
//! ([`Shared`]), and the ways the lock ends (release, a dropped guard, a
//! failed check, a failed keepalive).

use std::borrow::Cow;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::conn::Lease;
use super::form::SessionForm;
use super::keeper::{Kept, Tick};
use super::wire::{holds_now, key_query, one_bool, within_cadence};
use crate::engine::error::{Error, ErrorKind};
use crate::engine::plan::Mode;
use crate::engine::sql;
use crate::key::LockKey;

/// A guard's share of its lock. Its drop (the guard's, without a
/// release) ends the lock on a task: a rollback; a pooled connection goes
/// back only if it completes within one cadence, otherwise it is closed.
/// Nothing to do after a release. (On this field, not on the generic
/// guard, so that the guard's key type needs not outlive it.)
pub(super) struct Holding(pub(super) Arc<Shared>);

impl Deref for Holding {
    type Target = Arc<Shared>;

    fn deref(&self) -> &Arc<Shared> {
        &self.0
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        if let Ok(slot) = self.0.lease.try_lock() {
            if slot.is_none() {
                return; // released, or already gone
            }
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(end_dropped(self.0.clone()));
            }
            // No runtime to roll back on: close the connection now (never
            // back to a pool unclean). Should a statement be in flight, its
            // task drops the last `Shared`, and the lease closes with it.
            Err(_) => {
                if let Ok(slot) = self.0.lease.try_lock() {
                    self.0.give_up(slot);
                }
            }
        }
    }
}

impl Holding {
    /// [`SessionGuard::check`](super::SessionGuard::check) on the lock's
    /// connection, on a task of its own, so that a check dropped half-way
    /// still reads its replies and sends the keepalive that closes its
    /// portal.
    pub(super) async fn check(&self) -> Result<bool, Error> {
        tokio::spawn(check_now(self.0.clone()))
            .await
            .unwrap_or(Ok(false))
    }

    /// [`SessionGuard::release`](super::SessionGuard::release) on the lock's
    /// connection: the rollback (or unlock) on the caller's task, bounded
    /// by one cadence.
    pub(super) async fn release(self) -> Result<bool, Error> {
        let lease = self.0.lease.lock().await.take();
        let Some(lease) = lease else {
            // The keeper, a check or the connection's end gave the
            // connection up: the lock is gone.
            return Err(gone());
        };
        let mut ending = Ending {
            lease: Some(lease),
            lost: &self.0.lost,
        };
        let lease = ending.lease.as_mut().expect("just put");
        within_cadence(
            self.0.cadence,
            end_lock(lease, self.0.form, self.0.key, self.0.mode),
        )
        .await
        // `ending` drops the lease (closed, or back to its pool if clean),
        // then flips `lost`; the keeper forgets the lock at its next tick.
    }
}

fn gone() -> Error {
    Error::with_message(
        ErrorKind::ConnectionLost,
        "the session lock's connection had already ended; its lock is released",
    )
}

/// What a held lock's guard, its keeper and (on a connection lockkit
/// opened) its connection watcher share.
pub(super) struct Shared {
    /// The lock's connection, while the lock is held: every statement on
    /// it runs under this mutex. Whoever ends the lock (the release, the
    /// task a drop starts, or the keeper, a check or the connection
    /// watcher after a failed statement or a lost connection) takes it
    /// out, in an [`Ending`]; an empty slot means the lock is gone.
    pub(super) lease: tokio::sync::Mutex<Option<Lease>>,
    /// Flipped to `true` once the lock is gone.
    pub(super) lost: watch::Sender<bool>,
    pub(super) key: LockKey,
    pub(super) mode: Mode,
    pub(super) form: SessionForm,
    pub(super) cadence: Duration,
    pub(super) backend_pid: i32,
    /// The keepalive: [`sql::KEEPALIVE`], or, for a lock with a fencing
    /// token, the one that names its token for `lockkit inspect`
    /// ([`sql::keepalive_announcing`]).
    pub(super) keepalive: Cow<'static, str>,
}

impl Shared {
    /// Gives the lock up: takes the connection out of `slot` (so that no
    /// release can use it after whatever failed on it), closes it, and
    /// flips `lost`.
    pub(super) fn give_up(&self, mut slot: tokio::sync::MutexGuard<'_, Option<Lease>>) {
        let lease = slot.take();
        drop(slot);
        drop(Ending {
            lease,
            lost: &self.lost,
        });
    }
}

impl Kept for Shared {
    /// One keepalive on the lock's connection, bounded by one cadence; when
    /// it fails or gets no reply in time, the lock is given up.
    fn tick(self: Arc<Self>) -> Tick {
        Box::pin(async move {
            let slot = self.lease.lock().await;
            let Some(lease) = slot.as_ref() else {
                return; // released meanwhile
            };
            let reply = within_cadence(self.cadence, async {
                Ok(lease.client().batch_execute(&self.keepalive).await?)
            })
            .await;
            let Err(e) = reply else {
                return;
            };
            tracing::warn!(key = %self.key, backend_pid = self.backend_pid, error = %e,
                "lockkit: a session lock's keepalive failed; the lock is gone");
            // Under the same lock as the statement that failed on it, so
            // that no release can run a ROLLBACK (and report the lock held)
            // after a failure. The connection is closed, never back to a
            // pool unclean.
            self.give_up(slot);
        })
    }

    fn connection_ended(self: Arc<Self>) -> Tick {
        Box::pin(async move {
            let slot = self.lease.lock().await;
            if slot.is_some() {
                tracing::warn!(key = %self.key, backend_pid = self.backend_pid,
                    "lockkit: a session lock's connection ended; the lock is gone");
                self.give_up(slot);
            }
        })
    }

    fn abandon(&self) -> bool {
        let Ok(slot) = self.lease.try_lock() else {
            return true; // in use: whoever uses it ends it
        };
        if slot.is_some() {
            tracing::warn!(key = %self.key, backend_pid = self.backend_pid,
                "lockkit: the runtime of the session locks' keeper shut down; giving the lock up");
            self.give_up(slot);
        }
        false
    }
}

/// A lease taken out of [`Shared::lease`] to end the lock: dropping it
/// (after the rollback, or when a release is cancelled or fails) closes the
/// connection or returns it to its pool if clean, then flips `lost`.
struct Ending<'a> {
    lease: Option<Lease>,
    lost: &'a watch::Sender<bool>,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        drop(self.lease.take());
        // Wakes watchers only when there are some (`lost()` futures): a
        // watch's wake costs more than the rest of a release's bookkeeping.
        // The value is set either way, under the watch's lock, so a
        // receiver made after this (or `is_held`) reads `true`.
        self.lost.send_if_modified(|lost| {
            *lost = true;
            self.lost.receiver_count() > 0
        });
    }
}

/// [`SessionGuard::check`](super::SessionGuard::check) on the lock's
/// connection: a failed check (or a lock found gone) gives the connection
/// up, since a failed statement aborts the lock's transaction, and with it
/// the lock.
async fn check_now(shared: Arc<Shared>) -> Result<bool, Error> {
    let slot = shared.lease.lock().await;
    let answer = match slot.as_ref() {
        Some(lease) => {
            let client = lease.client();
            holds_now(client, shared.key, shared.cadence, &shared.keepalive).await
        }
        None => return Ok(false),
    };
    if !matches!(answer, Ok(true)) {
        shared.give_up(slot);
    }
    answer
}

/// A guard dropped without release: the rollback (or unlock), bounded by
/// one cadence; a pooled connection goes back only if it completed.
async fn end_dropped(shared: Arc<Shared>) {
    let lease = shared.lease.lock().await.take();
    if lease.is_none() {
        return;
    }
    let mut ending = Ending {
        lease,
        lost: &shared.lost,
    };
    let lease = ending.lease.as_mut().expect("just put");
    let _ = within_cadence(
        shared.cadence,
        end_lock(lease, shared.form, shared.key, shared.mode),
    )
    .await;
}

/// Ends a held lock on its connection: the rollback (default form) or the
/// unlock (session-level form). Marks the lease clean, so that a pooled
/// connection may go back, only when nothing of the lock is left on it.
async fn end_lock(
    lease: &mut Lease,
    form: SessionForm,
    key: LockKey,
    mode: Mode,
) -> Result<bool, Error> {
    let client = lease.client();
    match form {
        SessionForm::Transaction => {
            // An xact lock ends only with its transaction, or when an error
            // aborts the transaction. Every statement on the connection
            // runs under the guard's mutex, and the first failure takes
            // the connection out of it, so a successful ROLLBACK proves the
            // transaction, and its lock, lived until now. (Reading
            // pg_locks, as `check()` does, costs ten round trips here.)
            client.batch_execute(sql::SESSION_ROLLBACK).await?;
            lease.clean = true;
            Ok(true)
        }
        // (A multiplexed lock's guard holds no lease of its own.)
        SessionForm::SessionLevel | SessionForm::Multiplexed => {
            let rows = key_query(client, sql::session_unlock(key, mode), key).await?;
            let was_held = one_bool(&rows)?;
            lease.reset_session_lease().await?;
            // Unlocked what it took, and its lease reset: nothing of this
            // lock is left.
            lease.clean = was_held;
            Ok(was_held)
        }
    }
}
