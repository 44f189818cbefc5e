//! A held lock's guard, [`SessionGuard`], whichever way it is held: on a
//! connection of its own ([`Holding`]) or on a multiplexed one
//! ([`MuxHold`]).

use std::fmt;
use std::future::Future;
use std::ops::Deref;

use super::form::SessionForm;
use super::held::Holding;
use super::mux::MuxHold;
use super::simple::Granted;
use crate::engine::error::Error;
#[cfg(doc)]
use crate::engine::error::ErrorKind;
use crate::engine::plan::Mode;
use crate::fencing::FencingToken;
use crate::key::LockKey;

/// A session-duration advisory lock, held by a connection of its own.
///
/// The lock is held until [`release`](Self::release), until the guard drops
/// (its task rolls the transaction back, or closes the connection), or
/// until the connection is lost (a network failure, a server restart,
/// `pg_terminate_backend`, the end of its [lease](super#the-lease) when the
/// holder stopped answering): then the server has released the lock and
/// another session may hold it. A leader must therefore stop acting as one
/// as soon as [`lost`](Self::lost) resolves, and can ask
/// [`is_held`](Self::is_held) at any time; where a stale holder's write
/// must not land, fence it with a token
/// ([`fencing_token`](Self::fencing_token)).
///
/// Its [`SessionLock`](super::SessionLock)'s keeper task runs the keepalive on the connection
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
    value: K,
    key: LockKey,
    mode: Mode,
    form: SessionForm,
    backend_pid: i32,
    token: Option<FencingToken>,
    hold: Hold,
}

/// How a guard holds its lock: on a connection of its own, or on a
/// multiplexed one.
enum Hold {
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
            .field("fencing_token", &self.token)
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

    /// The fencing token the server minted with this grant, when its
    /// [`SessionLock`](super::SessionLock) mints them
    /// ([`fencing_tokens`](super::SessionLock::fencing_tokens)): larger
    /// than every token minted before, for the protected resource to refuse
    /// an older holder's write ([`crate::fencing`]). `None` otherwise.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.token
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
        match &self.hold {
            Hold::Own(held) => held.check().await,
            Hold::Mux(held) => held.check().await,
        }
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
        match self.hold {
            Hold::Own(held) => held.release().await,
            Hold::Mux(held) => held.release().await,
        }
    }
}

impl<K> SessionGuard<K> {
    /// The guard of `value`'s lock held on a connection of its own.
    pub(super) fn own(
        value: K,
        (key, token): Granted,
        mode: Mode,
        form: SessionForm,
        backend_pid: i32,
        held: Holding,
    ) -> Self {
        SessionGuard {
            value,
            key,
            mode,
            form,
            backend_pid,
            token,
            hold: Hold::Own(held),
        }
    }

    /// The guard of `value`'s lock held on a multiplexed connection.
    pub(super) fn multiplexed(value: K, held: MuxHold) -> Self {
        SessionGuard {
            value,
            key: held.key(),
            mode: held.mode(),
            form: SessionForm::Multiplexed,
            backend_pid: held.backend_pid(),
            token: held.token(),
            hold: Hold::Mux(held),
        }
    }
}

/// The guard of a waiting lock call, which is granted or fails.
pub(super) fn expect_granted<K>(result: Result<SessionGuard<K>, K>) -> SessionGuard<K> {
    match result {
        Ok(guard) => guard,
        Err(_) => unreachable!("a waiting lock is granted or fails"),
    }
}
