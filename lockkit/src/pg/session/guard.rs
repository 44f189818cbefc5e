//! A held lock's life: its guard, what the guard shares with the keeper,
//! and the ways the lock ends (release, a dropped guard, a failed check).

use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::conn::Lease;
use super::mux::MuxHold;
use super::wire::{holds_now, key_query, one_bool, within_cadence};
use super::SessionForm;
#[cfg(doc)]
use super::SessionLock;
use crate::engine::error::{Error, ErrorKind};
use crate::engine::plan::Mode;
use crate::engine::sql;
use crate::key::LockKey;

/// A session-duration advisory lock, held by a connection of its own.
///
/// The lock is held until [`release`](Self::release), until the guard drops
/// (its task rolls the transaction back, or closes the connection), or
/// until the connection is lost (a network failure, a server restart,
/// `pg_terminate_backend`, `idle_in_transaction_session_timeout`): then the
/// server has released the lock and another session may hold it. A leader
/// must therefore stop acting as one as soon as [`lost`](Self::lost)
/// resolves, and can ask [`is_held`](Self::is_held) at any time.
///
/// Its [`SessionLock`]'s keeper task runs the keepalive on the connection
/// (see the [module docs](super)); the guard is `Send + Sync` and
/// dereferences to the key value.
///
/// ```no_run
/// use lockkit::SessionLock;
/// use lockkit::key::HashText;
///
/// # async fn payroll() -> Result<(), lockkit::Error> { Ok(()) }
/// # async fn run(config: tokio_postgres::Config) -> Result<(), lockkit::Error> {
/// let sessions = SessionLock::new(config);
/// // One payroll run at a time across the fleet; the others skip.
/// let Ok(guard) = sessions.try_lock(HashText("payroll-1405-01")).await? else {
///     return Ok(()); // another instance runs it
/// };
/// tokio::select! {
///     result = payroll() => result?,
///     // The lock is gone (connection lost): stop acting as the leader.
///     () = guard.lost() => return Ok(()),
/// }
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[must_use = "the session lock is released when the guard drops; bind it to a variable for as long as the work needs the lock"]
pub struct SessionGuard<K> {
    pub(super) value: K,
    pub(super) key: LockKey,
    pub(super) mode: Mode,
    pub(super) form: SessionForm,
    pub(super) backend_pid: i32,
    pub(super) hold: Hold,
}

/// How a guard holds its lock: on a connection of its own, or on a
/// multiplexed one.
pub(super) enum Hold {
    Own(Holding),
    Mux(MuxHold),
}

impl<K: fmt::Debug> fmt::Debug for SessionGuard<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionGuard")
            .field("value", &self.value)
            .field("key", &self.key)
            .field("mode", &self.mode)
            .field("form", &self.form)
            .field("backend_pid", &self.backend_pid)
            .field("held", &self.is_held())
            .finish()
    }
}

impl<K> Deref for SessionGuard<K> {
    type Target = K;

    fn deref(&self) -> &K {
        &self.value
    }
}

impl<K> SessionGuard<K> {
    /// The lock key.
    pub fn key(&self) -> LockKey {
        self.key
    }

    /// The mode the key is held in.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// How the lock is held.
    pub fn form(&self) -> SessionForm {
        self.form
    }

    /// The key value.
    pub fn value(&self) -> &K {
        &self.value
    }

    /// The server process holding the lock (`pg_locks.pid`, also behind a
    /// pooler: the backend the lock's transaction is pinned to).
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// Whether the lock is still held as far as the client knows: `false`
    /// once the connection ended or a keepalive failed (the lock is gone).
    /// Use [`check`](Self::check) to ask the server.
    pub fn is_held(&self) -> bool {
        match &self.hold {
            Hold::Own(shared) => !*shared.lost.borrow(),
            Hold::Mux(held) => held.is_held(),
        }
    }

    /// A future that resolves when the lock is gone: its connection ended
    /// or a keepalive failed or got no reply within one cadence (and after
    /// a release). It owns what it needs (`'static`), so a leader can
    /// `select!` on it while it works.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut lost = match &self.hold {
            Hold::Own(shared) => shared.lost.subscribe(),
            Hold::Mux(held) => held.lost(),
        };
        async move {
            // An error means the lock's state is gone: lost as well.
            let _ = lost.wait_for(|lost| *lost).await;
        }
    }

    /// Asks the server whether the lock's backend holds the lock
    /// (`pg_locks`), waiting at most one keepalive cadence for the answer.
    /// Any answer but `true` gives the lock up (its connection is closed,
    /// and [`lost`](Self::lost) resolves): the lock is not the caller's any
    /// more.
    ///
    /// # Errors
    ///
    /// A server error other than a lost connection. A lost connection, or
    /// no answer within one cadence (a path gone silent), answers `false`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn check(&self) -> Result<bool, Error> {
        let shared = match &self.hold {
            Hold::Own(shared) => shared,
            Hold::Mux(held) => return held.check().await,
        };
        // On a task of its own, so that a check dropped half-way still
        // reads its replies and sends the keepalive that closes its portal.
        tokio::spawn(check_now(shared.0.clone()))
            .await
            .unwrap_or(Ok(false))
    }

    /// Releases the lock: rolls its transaction back (default form) or
    /// unlocks (session-level form), then closes the connection or returns
    /// it to its pool. Answers whether the server really held the lock
    /// until then: in the default form, the rollback's success (every
    /// statement on the lock's connection runs while it is in the guard's
    /// hands, and the first failed one gives the connection up, so the
    /// transaction, and its lock, lived until the rollback);
    /// `pg_advisory_unlock`'s result in the session-level form.
    ///
    /// The release runs on the caller's task, on the connection it takes
    /// out of the guard (waiting for a keepalive in flight): no hop to
    /// another task and back.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::ConnectionLost`] when the connection was already gone: the
    /// server released the lock when the session ended, possibly long ago;
    /// and when the server did not answer within one keepalive cadence (a
    /// path gone silent): the connection is closed, and the server releases
    /// the lock when it sees the session end. Other server errors; the lock
    /// is gone either way (a connection that could not be cleaned is
    /// closed).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropped before the answer, the connection is closed (a
    /// pooled one detached from its pool, never returned), which ends the
    /// session's transaction and the lock on the server.
    pub async fn release(self) -> Result<bool, Error> {
        let shared = match self.hold {
            Hold::Own(shared) => shared,
            Hold::Mux(held) => return held.release().await,
        };
        let lease = shared.lease.lock().await.take();
        let Some(lease) = lease else {
            // The keeper, a check or the connection's end gave the
            // connection up: the lock is gone.
            return Err(gone());
        };
        let mut ending = Ending {
            lease: Some(lease),
            lost: &shared.lost,
        };
        let lease = ending.lease.as_mut().expect("just put");
        within_cadence(
            shared.cadence,
            end_lock(lease, shared.form, shared.key, shared.mode),
        )
        .await
        // `ending` drops the lease (closed, or back to its pool if clean),
        // then flips `lost`; the keeper forgets the lock at its next tick.
    }
}

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

/// [`SessionGuard::check`] on the lock's connection: a failed check (or a
/// lock found gone) gives the connection up, since a failed statement
/// aborts the lock's transaction, and with it the lock.
async fn check_now(shared: Arc<Shared>) -> Result<bool, Error> {
    let slot = shared.lease.lock().await;
    let answer = match slot.as_ref() {
        Some(lease) => holds_now(lease.client(), shared.key, shared.cadence).await,
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
            // Unlocked what it took: nothing of this lock is left.
            lease.clean = was_held;
            Ok(was_held)
        }
    }
}
