//! The multiplexed form ([`SessionForm::Multiplexed`]): any number of
//! session-level locks over a few connections, each connection inside a
//! transaction held open for as long as it lives.
//!
//! # Why it cannot leak
//!
//! Each connection opens a transaction first and keeps it while it may
//! hold a lock. An open transaction pins its server connection in a
//! transaction-mode pooler, so every `pg_advisory_lock` taken inside stays
//! on a backend no other client can be handed; and when the client goes (a
//! crash, a `kill -9`, a lost network, a connection given up after a
//! failure), the pooler cannot give a backend that is inside a transaction
//! to anyone else: it closes it, and the server releases the session's
//! locks. No statement that ends the transaction (`COMMIT`, `ROLLBACK`) is
//! sent on such a connection while anything refers to it (a guard, a
//! claim, a statement in flight): only once nothing does, and then behind
//! `pg_advisory_unlock_all()` in the same query, so that no pooler can
//! hand the server connection on between the two; the connection then
//! ends while idle (leased from a pool, it is detached, never returned),
//! and the pooler keeps its server connection for its other clients.
//!
//! # Exactly one holder per key and connection
//!
//! Session-level locks are re-entrant: a session that takes a key twice
//! holds it twice. So a [`SessionLock`](super::SessionLock) claims a key in its own table
//! before it sends anything for it, and keeps the claim until the server
//! has answered the statement that ends it: a key is claimed at most once
//! on all of its connections. A try for a key this `SessionLock` holds
//! answers busy without a round trip; a wait for it (and a shared lock of a
//! key held shared here) takes a connection of its own, where the server
//! orders it behind the holder.
//!
//! # A statement cut off
//!
//! A future dropped while its statement is in flight leaves the outcome
//! unknown (the server may have granted the key). The claim is then kept,
//! and a task sends the key's unlock after it on the same connection (the
//! server answers in order): the key is released if it was granted, and
//! the claim ends with the unlock's answer. With no runtime to run that
//! task, or when the unlock fails, the connection is closed.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::watch;

use super::claims::{Claim, Mux, Refused};
use super::conn::Settings;
#[cfg(doc)]
use super::form::SessionForm;
use super::keeper::Keeper;
use super::mux_conn::{MuxConn, Op};
use super::wire::holds_now;
use crate::engine::error::{Error, ErrorKind};
use crate::engine::facts::ServerFacts;
use crate::engine::plan::Mode;
use crate::fencing::FencingToken;
use crate::key::{AdvisoryKey, KeyForm, LockKey};

/// What a multiplexed try found.
pub(super) enum MuxTry<K> {
    /// Granted on a multiplexed connection.
    Held(K, MuxHold),
    /// Another session holds the key, or this `SessionLock` holds it in a
    /// mode that excludes the request.
    Busy(K),
    /// This `SessionLock` holds the key shared, and the request is shared:
    /// the server admits it, on a connection of its own.
    Elsewhere(K),
}

/// The refusal of a multiplexed take past the budget, `held` keys held.
fn over_budget(held: usize, budget: usize, facts: &ServerFacts) -> Error {
    Error::with_message(
        ErrorKind::BudgetExceeded,
        format!(
            "a multiplexed SessionLock holds {held} keys, and one more would pass its budget of \
             {budget} (the server's shared lock table has {} entries, shared by every session); \
             nothing was sent: release some, or raise max_locks_per_transaction, or set \
             SessionLock::multiplexed_budget",
            facts.lock_table_capacity()
        ),
    )
}

/// A claim with a statement in flight for it: dropped before
/// [`InFlight::done`], the statement's outcome is unknown, and the key is
/// settled ([`settle`]).
struct InFlight {
    conn: Arc<MuxConn>,
    claim: Option<Claim<MuxConn>>,
}

impl InFlight {
    fn done(mut self) -> Claim<MuxConn> {
        self.claim.take().expect("taken once")
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(claim) = self.claim.take() {
            settle(self.conn.clone(), claim);
        }
    }
}

/// Releases `claim`'s key, whose last statement was cut off, by sending
/// its unlock after it on the same connection, then ends the claim; closes
/// the connection when that cannot be done (no runtime, the unlock failed
/// or was itself cut off).
fn settle(conn: Arc<MuxConn>, claim: Claim<MuxConn>) {
    if conn.is_lost() {
        return; // the session's end released the key
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        conn.give_up(&"a lock call was cut off with no runtime to settle it");
        return;
    };
    runtime.spawn(async move {
        struct CloseUnlessDone(Option<Arc<MuxConn>>);
        impl Drop for CloseUnlessDone {
            fn drop(&mut self) {
                if let Some(conn) = self.0.take() {
                    conn.give_up(&"the unlock of a cut-off lock call was itself cut off");
                }
            }
        }
        let mut guard = CloseUnlessDone(Some(conn.clone()));
        // Answered `false` when the cut-off statement left nothing held.
        let _ = conn.run(Op::Unlock, claim.key, claim.mode).await;
        guard.0 = None;
        drop(claim);
    });
}

/// The multiplexed form's settings: the [`SessionLock`](super::SessionLock)'s
/// own, its keeper, its connections and claimed keys, and its
/// budget ([`SessionLock::multiplexed_budget`](super::SessionLock::multiplexed_budget)).
pub(super) struct Multiplexed<'a> {
    settings: &'a Settings,
    keeper: &'a Arc<Keeper>,
    mux: &'a Arc<Mux<MuxConn>>,
    mux_budget: Option<usize>,
}

impl<'a> Multiplexed<'a> {
    /// The multiplexed form of a lock with `settings`, kept alive by `keeper`, on
    /// `mux`'s connections, holding at most `mux_budget` keys.
    pub(super) fn new(
        settings: &'a Settings,
        keeper: &'a Arc<Keeper>,
        mux: &'a Arc<Mux<MuxConn>>,
        mux_budget: Option<usize>,
    ) -> Self {
        Multiplexed {
            settings,
            keeper,
            mux,
            mux_budget,
        }
    }

    /// Tries `value`'s key on a multiplexed connection, in one round trip
    /// on an open connection: the form's one entry.
    ///
    /// A connection opened earlier may have ended unseen (a restart, a
    /// terminated backend, before its keeper noticed): a try that finds it
    /// so ([`ErrorKind::ConnectionLost`]) is made once more, on a new
    /// connection. Safe whatever the dead connection did with the first
    /// try: a lock it was granted ended with its session, and the second
    /// try reports only what the new connection's server answers (busy,
    /// while the old backend has not ended yet).
    pub(super) async fn try_lock<K: AdvisoryKey>(
        &self,
        value: K,
        mode: Mode,
    ) -> Result<MuxTry<K>, Error> {
        let key = value.lock_key();
        let mut again = true;
        loop {
            let claim = match self.mux.claim(key, mode) {
                Ok(claim) => claim,
                Err(Refused::Elsewhere) => return Ok(MuxTry::Elsewhere(value)),
                Err(Refused::Busy) => return Ok(MuxTry::Busy(value)),
            };
            let opened_before = claim.cell.initialized();
            // Dropped here, the claim ends: nothing was sent for it yet.
            let conn = claim
                .cell
                .get_or_try_init(|| MuxConn::open(self.settings, self.keeper, self.mux, claim.slot))
                .await?
                .clone();
            if conn.in_recovery && !self.settings.allow_standby {
                return Err(Error::new(ErrorKind::HotStandby));
            }
            if K::KEY_SPEC.form() == KeyForm::HashText {
                conn.facts.check_hashtext()?;
            }
            // The budget, before anything is sent for the key: the claims
            // (this one among them) are what is held or being taken.
            let budget = self
                .mux_budget
                .unwrap_or(conn.facts.lock_table_capacity() / 2);
            let claimed = self.mux.claimed();
            if claimed > budget {
                return Err(over_budget(claimed - 1, budget, &conn.facts));
            }
            conn.used.store(true, Ordering::Relaxed);
            let flight = InFlight {
                conn: conn.clone(),
                claim: Some(claim),
            };
            let mint = self.settings.fencing;
            let granted = conn.run(Op::Try { mint }, key, mode).await;
            let claim = flight.done();
            let (granted, token) = match granted {
                // `run` gave the connection up: its slot opens a new one.
                Err(e) if again && opened_before && e.is_connection_lost() => {
                    drop(claim);
                    again = false;
                    continue;
                }
                Err(e) if mint => return Err(Error::not_installed_or(e, "a fencing token")),
                granted => granted?,
            };
            if !granted {
                return Ok(MuxTry::Busy(value));
            }
            if let Some(token) = token {
                conn.announce(key, token);
            }
            let held = MuxHold(Some(Held { conn, claim, token }));
            return Ok(MuxTry::Held(value, held));
        }
    }
}

/// A multiplexed lock's share of its guard: the connection and the claim.
/// Dropped without a release, the key is unlocked on a task.
pub(super) struct MuxHold(Option<Held>);

struct Held {
    conn: Arc<MuxConn>,
    claim: Claim<MuxConn>,
    token: Option<FencingToken>,
}

impl MuxHold {
    /// The key held.
    pub(super) fn key(&self) -> LockKey {
        self.held().claim.key
    }

    /// The mode the key is held in.
    pub(super) fn mode(&self) -> Mode {
        self.held().claim.mode
    }

    /// The backend of the lock's connection.
    pub(super) fn backend_pid(&self) -> i32 {
        self.held().conn.backend_pid
    }

    /// The fencing token minted with the grant, if it minted one.
    pub(super) fn token(&self) -> Option<FencingToken> {
        self.held().token
    }

    fn held(&self) -> &Held {
        self.0.as_ref().expect("held until released or dropped")
    }

    pub(super) fn is_held(&self) -> bool {
        self.0.as_ref().is_some_and(|held| !held.conn.is_lost())
    }

    pub(super) fn lost(&self) -> watch::Receiver<bool> {
        match &self.0 {
            Some(held) => held.conn.lost.subscribe(),
            None => watch::channel(true).1,
        }
    }

    /// [`SessionGuard::check`]: whether the connection's backend holds the
    /// key; any other answer gives the connection (and its other locks) up.
    pub(super) async fn check(&self) -> Result<bool, Error> {
        let Some(held) = &self.0 else {
            return Ok(false);
        };
        let conn = held.conn.clone();
        let key = held.claim.key;
        // On a task of its own, as the one-connection form's check.
        tokio::spawn(async move {
            if conn.is_lost() {
                return Ok(false);
            }
            let keepalive = conn.keepalive_text();
            let answer = holds_now(conn.lease.client(), key, conn.cadence, &keepalive).await;
            if !matches!(answer, Ok(true)) {
                conn.give_up(&"a check did not find the lock held");
            }
            answer
        })
        .await
        .unwrap_or(Ok(false))
    }

    /// [`SessionGuard::release`]: `pg_advisory_unlock`'s answer.
    pub(super) async fn release(mut self) -> Result<bool, Error> {
        let held = self.0.take().expect("released once");
        if held.conn.is_lost() {
            return Err(Error::with_message(
                ErrorKind::ConnectionLost,
                "the multiplexed session lock's connection had already ended; its lock is released",
            ));
        }
        let (key, mode) = (held.claim.key, held.claim.mode);
        if held.token.is_some() {
            held.conn.forget_token(key);
        }
        let flight = InFlight {
            conn: held.conn.clone(),
            claim: Some(held.claim),
        };
        let was_held = held.conn.run(Op::Unlock, key, mode).await;
        drop(flight.done());
        was_held.map(|(was_held, _)| was_held)
    }
}

impl Drop for MuxHold {
    fn drop(&mut self) {
        if let Some(held) = self.0.take() {
            if held.token.is_some() {
                held.conn.forget_token(held.claim.key);
            }
            // Unlocked on a task, the claim ending with its answer.
            settle(held.conn, held.claim);
        }
    }
}
