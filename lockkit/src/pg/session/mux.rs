//! The multiplexed form ([`SessionForm::Multiplexed`]): any number of
//! session-level locks over a few connections, each connection inside a
//! transaction held open for as long as it lives.
//!
//! # Why it cannot leak
//!
//! Each connection opens a transaction first and never ends it: it is
//! closed instead, once it holds nothing (or when anything fails on it).
//! An open transaction pins its server connection in a transaction-mode
//! pooler, so every `pg_advisory_lock` taken inside stays on a backend no
//! other client can be handed; and when the client goes (a close, a
//! crash, a `kill -9`, a lost network), the pooler cannot give a backend
//! that is inside a transaction to anyone else: it closes it, and the
//! server releases the session's locks. No statement that ends the
//! transaction (`COMMIT`, `ROLLBACK`) is ever sent on such a connection.
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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use futures_util::future::join;
use tokio::sync::{watch, OnceCell};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_postgres::types::{ToSql, Type};

use super::conn::{Lease, Settings};
#[cfg(doc)]
use super::form::SessionForm;
use super::simple::{begin_held, renew_held};
use super::wire::{holds_now, one_bool, within_cadence, within_take};
use crate::engine::error::{Error, ErrorKind};
use crate::engine::facts::ServerFacts;
use crate::engine::plan::Mode;
use crate::engine::sql;
use crate::key::{AdvisoryKey, KeyForm, LockKey};
use crate::pg::locker::server_facts;

/// The `application_name` of a multiplexed connection (it holds many
/// keys, of any namespace).
pub const MULTIPLEXED_NAME: &str = "lockkit session locks";

/// How long a multiplexed connection runs no statement before the
/// snapshot its last one left open is dropped ([`drop_snapshot`]).
pub(super) const QUIET: Duration = Duration::from_millis(100);

/// An open connection's users below which a lock is taken on it rather than
/// on a connection not yet opened.
const SHARE_BEFORE_OPENING: usize = 16;

/// How many connections the [`SessionForm::Multiplexed`] form opens at most
/// unless [`SessionLock::connections`](super::SessionLock::connections)
/// says otherwise.
pub const DEFAULT_CONNECTIONS: usize = 4;

/// The multiplexed connections of a [`SessionLock`](super::SessionLock)
/// (shared by its clones), and the keys claimed on them.
pub(super) struct Mux {
    max: usize,
    state: std::sync::Mutex<State>,
}

impl std::fmt::Debug for Mux {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state();
        f.debug_struct("Mux")
            .field("max", &self.max)
            .field("claimed", &state.keys.len())
            .finish()
    }
}

/// One connection slot: the connection (opened on first use) and the
/// claims on it. A connection that ends leaves a new, empty cell.
type Cell = Arc<OnceCell<Arc<MuxConn>>>;

struct Slot {
    cell: Cell,
    users: usize,
}

struct State {
    slots: Vec<Slot>,
    /// Every key claimed: held, or with a statement for it in flight.
    keys: HashMap<LockKey, (Mode, Cell)>,
}

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

impl Mux {
    pub(super) fn new(max: usize) -> Arc<Self> {
        Arc::new(Mux {
            max,
            state: std::sync::Mutex::new(State {
                slots: (0..max)
                    .map(|_| Slot {
                        cell: Cell::default(),
                        users: 0,
                    })
                    .collect(),
                keys: HashMap::new(),
            }),
        })
    }

    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// How many keys are claimed: held, or with a statement in flight.
    fn claimed(&self) -> usize {
        self.state().keys.len()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Nothing under this mutex can panic half-way.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `key` on the connection slot with the fewest claims (one not
    /// yet opened counts as [`SHARE_BEFORE_OPENING`]), or says why not.
    fn claim(self: &Arc<Self>, key: LockKey, mode: Mode) -> Result<Claim, MuxTry<()>> {
        let mut state = self.state();
        if let Some((held, _)) = state.keys.get(&key) {
            return Err(match (held, mode) {
                (Mode::Shared, Mode::Shared) => MuxTry::Elsewhere(()),
                _ => MuxTry::Busy(()),
            });
        }
        let score = |slot: &Slot| {
            slot.users
                + if slot.cell.initialized() {
                    0
                } else {
                    SHARE_BEFORE_OPENING
                }
        };
        let (index, slot) = state
            .slots
            .iter_mut()
            .enumerate()
            .min_by_key(|(_, slot)| score(slot))
            .expect("at least one connection");
        slot.users += 1;
        let cell = slot.cell.clone();
        state.keys.insert(key, (mode, cell.clone()));
        Ok(Claim {
            mux: self.clone(),
            key,
            mode,
            slot: index,
            cell,
        })
    }

    /// Forgets `conn`, which ended or is closing: its slot gets a new cell.
    fn forget(&self, slot: usize, conn: &Arc<MuxConn>) {
        let mut state = self.state();
        let slot = &mut state.slots[slot];
        if slot.cell.get().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            *slot = Slot {
                cell: Cell::default(),
                users: 0,
            };
        }
    }
}

/// A key claimed on one connection slot; dropped, the claim ends.
pub(super) struct Claim {
    mux: Arc<Mux>,
    key: LockKey,
    mode: Mode,
    slot: usize,
    cell: Cell,
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut state = self.mux.state();
        if state
            .keys
            .get(&self.key)
            .is_some_and(|(_, cell)| Arc::ptr_eq(cell, &self.cell))
        {
            state.keys.remove(&self.key);
        }
        let slot = &mut state.slots[self.slot];
        if Arc::ptr_eq(&slot.cell, &self.cell) {
            slot.users -= 1;
        }
    }
}

/// One multiplexed connection, inside its held transaction.
pub(super) struct MuxConn {
    lease: Lease,
    slot: usize,
    mux: Weak<Mux>,
    backend_pid: i32,
    in_recovery: bool,
    facts: ServerFacts,
    cadence: Duration,
    /// Flipped once the connection is gone (closed, ended, or given up):
    /// every lock on it is gone.
    lost: watch::Sender<bool>,
    /// Whether a key was claimed on it since the keeper last looked: an
    /// idle connection is closed only after a cadence without claims.
    used: AtomicBool,
    /// How many of them ran, for [`drop_snapshot`] to see the connection
    /// quiet.
    statements_run: AtomicU64,
    /// Whether a statement's snapshot may be open, with a
    /// [`drop_snapshot`] started for it.
    snapshot: AtomicBool,
    /// How many times the held transaction was made anew after a
    /// statement's error aborted it ([`MuxConn::renew`]).
    renewed: AtomicU64,
    /// Held while the held transaction is made anew, so that the statements
    /// an error failed together renew it once.
    renewing: tokio::sync::Mutex<()>,
    /// Whether the server has `client_connection_check_interval`, for the
    /// set-up of a renewed transaction (shared with the `SessionLock`).
    check_interval_known: Arc<std::sync::atomic::AtomicBool>,
}

/// What a statement on a multiplexed connection does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Try,
    Unlock,
}

/// The statement of `op` for `key`.
fn statement(op: Op, key: LockKey, mode: Mode) -> &'static str {
    match op {
        Op::Try => sql::session_lock(key, mode, true),
        Op::Unlock => sql::session_unlock(key, mode),
    }
}

impl MuxConn {
    /// Opens a connection for `slot` and its held transaction, and starts
    /// its keeper.
    async fn open(
        settings: &Settings,
        cadence: Duration,
        mux: &Arc<Mux>,
        slot: usize,
    ) -> Result<Arc<Self>, Error> {
        let (lease, _canceller) = settings.source.lease().await?;
        let client = lease.client();
        // The facts first, outside the transaction (they are the server's).
        // Bounded as every statement on the connection is; on a silent
        // path, or behind a pooler with no free server connection, the
        // lease drops here, closing the connection.
        let ((in_recovery, backend_pid), facts) = within_take(cadence, async {
            let (facts, setup) = join(
                server_facts(client),
                begin_held(client, MULTIPLEXED_NAME, &settings.check_interval_known),
            )
            .await;
            Ok((setup?, facts?))
        })
        .await?;
        let facts = ServerFacts::from(&facts);
        let ended = lease.ended.clone();
        let conn = Arc::new(MuxConn {
            lease,
            slot,
            mux: Arc::downgrade(mux),
            backend_pid,
            in_recovery,
            facts,
            cadence,
            lost: watch::Sender::new(false),
            used: AtomicBool::new(true),
            statements_run: AtomicU64::new(0),
            renewed: AtomicU64::new(0),
            renewing: tokio::sync::Mutex::new(()),
            check_interval_known: settings.check_interval_known.clone(),
            snapshot: AtomicBool::new(false),
        });
        tokio::spawn(keep(Arc::downgrade(&conn), ended));
        Ok(conn)
    }

    fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Gives the connection up: its slot forgets it, it is closed, and
    /// every lock on it is gone (`lost()` resolves).
    ///
    /// In that order: whoever sees a lock lost (and takes it again at once)
    /// must find the slot already without this connection, or the new lock
    /// call would be claimed on it and fail.
    fn give_up(self: &Arc<Self>, why: &dyn std::fmt::Display) {
        if let Some(mux) = self.mux.upgrade() {
            mux.forget(self.slot, self);
        }
        self.lease.close();
        let was = self.lost.send_replace(true);
        if !was {
            tracing::warn!(backend_pid = self.backend_pid, error = %why,
                "lockkit: a multiplexed session lock connection is given up; its locks are gone");
        }
    }

    /// Runs `op` for `key`, bounded by one cadence: what the server
    /// answered (`pg_try_advisory_lock`'s or `pg_advisory_unlock`'s
    /// `bool`).
    ///
    /// A server's error of the statement aborts the held transaction, and
    /// every statement sent behind it fails with `25P02`: the transaction is
    /// made anew ([`renew`](Self::renew)), which keeps every lock on the
    /// connection (they are session-level). Then a statement that failed
    /// only behind another's error is made again ([`attempt`](Self::attempt));
    /// a try the server
    /// refused itself (its lock table full, `53200`) fails alone, after an
    /// unlock of its key in case the error came after the grant; an unlock
    /// the server refused gives the connection up, as does any other
    /// failure (a connection lost, no answer within the cadence, a renewal
    /// that failed): every lock on it is then gone.
    ///
    /// The statement is sent unnamed (parsed, bound and run in one round
    /// trip): a named one could meet another client's statement of the same
    /// name on a server connection that a transaction-mode pooler shared
    /// (`42P05`). Its portal, and the snapshot the portal holds, stay open
    /// in the held transaction until the connection's next statement: once
    /// the connection is quiet, [`drop_snapshot`] runs a simple query that
    /// drops them, so that the backend does not hold back VACUUM.
    async fn run(self: &Arc<Self>, op: Op, key: LockKey, mode: Mode) -> Result<bool, Error> {
        let e = match self.attempt(op, key, mode).await? {
            Ok(answer) => return Ok(answer),
            Err(refused) => refused,
        };
        match op {
            Op::Try => {
                // Its key let go, in case the server granted it before the
                // error; a failure there gave the connection up.
                let _ = self.attempt(Op::Unlock, key, mode).await;
                Err(e)
            }
            Op::Unlock => {
                self.give_up(&e);
                Err(e)
            }
        }
    }

    /// Sends `op` for `key` until the server answers it or refuses it
    /// itself: `Ok(Ok(answer))`, or `Ok(Err(its error))` with the held
    /// transaction made anew.
    ///
    /// A statement that failed only behind another's error (`25P02`) is
    /// made again, now one at a time under [`MuxConn::renewing`], so that
    /// statements made again cannot fail behind one another: each is either
    /// answered or refused itself, and a refusal renews the transaction
    /// before the next one goes. It can still fail behind a statement sent
    /// meanwhile for the first time, and is then made again, at most
    /// [`ATTEMPTS`] times.
    ///
    /// # Errors
    ///
    /// Any other failure (a lost connection, no answer within the cadence,
    /// a renewal that failed), after giving the connection up.
    async fn attempt(
        self: &Arc<Self>,
        op: Op,
        key: LockKey,
        mode: Mode,
    ) -> Result<Result<bool, Error>, Error> {
        let renewed = self.renewed.load(Ordering::Acquire);
        let first = within_cadence(self.cadence, self.send(op, key, mode)).await;
        let mut e = match first {
            Ok(answer) => return Ok(Ok(answer)),
            Err(e) => e,
        };
        let mut seen = renewed;
        let renewing = self.renewing.lock().await;
        for _ in 0..ATTEMPTS {
            if !is_statement_error(&e) {
                self.give_up(&e);
                return Err(e);
            }
            if let Err(renewal) = self.renew(&renewing, seen).await {
                self.give_up(&renewal);
                return Err(e);
            }
            if e.kind() != ErrorKind::TransactionAborted {
                return Ok(Err(e));
            }
            seen = self.renewed.load(Ordering::Acquire);
            e = match within_cadence(self.cadence, self.send(op, key, mode)).await {
                Ok(answer) => return Ok(Ok(answer)),
                Err(e) => e,
            };
        }
        Ok(Err(e))
    }

    /// The keepalive, a simple query, bounded by one cadence; made again
    /// once after the held transaction is made anew when it was sent behind
    /// a statement whose error aborted it (`25P02`).
    ///
    /// # Errors
    ///
    /// Any other failure, or a second one: the caller gives the connection
    /// up.
    async fn keepalive(self: &Arc<Self>) -> Result<(), Error> {
        let send = || async {
            let client = self.lease.client();
            within_cadence(self.cadence, async {
                Ok(client.batch_execute(sql::KEEPALIVE).await?)
            })
            .await
        };
        let renewed = self.renewed.load(Ordering::Acquire);
        match send().await {
            Err(e) if e.kind() == ErrorKind::TransactionAborted => {
                let renewing = self.renewing.lock().await;
                self.renew(&renewing, renewed).await?;
                send().await
            }
            answer => answer,
        }
    }

    /// Sends `op` for `key`, once.
    async fn send(self: &Arc<Self>, op: Op, key: LockKey, mode: Mode) -> Result<bool, Error> {
        let sql = statement(op, key, mode);
        let client = self.lease.client();
        let run = self.statements_run.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.snapshot.swap(true, Ordering::AcqRel) {
            tokio::spawn(drop_snapshot(Arc::downgrade(self), run));
        }
        let rows = match key {
            LockKey::BigInt(v) => client.query_typed(sql, &[(&v, Type::INT8)]).await?,
            LockKey::Pair(class, object) => {
                let params: [(&(dyn ToSql + Sync), Type); 2] =
                    [(&class, Type::INT4), (&object, Type::INT4)];
                client.query_typed(sql, &params).await?
            }
        };
        one_bool(&rows)
    }

    /// Makes the held transaction anew after a statement's error aborted
    /// it: `ROLLBACK` and the held transaction's `BEGIN` and set-up in one
    /// query ([`renew_held`]), which keeps the connection pinned behind a
    /// pooler and keeps every session-level lock on it. `seen` is how many
    /// renewals the caller's statement was sent after: when another
    /// statement's failure renewed it since, nothing is sent.
    ///
    /// # Errors
    ///
    /// When the renewal fails, or gets no answer within the cadence: the
    /// caller gives the connection up.
    async fn renew(
        self: &Arc<Self>,
        _renewing: &tokio::sync::MutexGuard<'_, ()>,
        seen: u64,
    ) -> Result<(), Error> {
        if self.renewed.load(Ordering::Acquire) != seen {
            return Ok(());
        }
        let client = self.lease.client();
        within_cadence(self.cadence, async {
            renew_held(client, MULTIPLEXED_NAME, &self.check_interval_known).await
        })
        .await?;
        self.renewed.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

/// Whether `e` is the server's error of a statement, which aborts the held
/// transaction and leaves the connection (and its session-level locks) as
/// they were; not a lost connection, nor an answer that never came.
fn is_statement_error(e: &Error) -> bool {
    e.code().is_some() && !e.is_connection_lost()
}

/// How many times a statement on a multiplexed connection is made again
/// when it keeps failing behind statements sent for the first time whose
/// errors aborted the held transaction (`25P02`).
const ATTEMPTS: u32 = 64;

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

/// Drops the snapshot a connection's prepared statements left open, once
/// the connection has run none for [`QUIET`]: a simple query replaces the
/// last statement's portal. Started by the first statement after the
/// previous drop (the `seen`th the connection ran).
async fn drop_snapshot(conn: Weak<MuxConn>, mut seen: u64) {
    loop {
        tokio::time::sleep(QUIET).await;
        let Some(conn) = conn.upgrade() else {
            return;
        };
        if conn.is_lost() {
            return;
        }
        let now = conn.statements_run.load(Ordering::Relaxed);
        if std::mem::replace(&mut seen, now) != now {
            continue; // statements ran meanwhile: each replaced the portal
        }
        // Cleared first: a statement from now on starts another drop.
        conn.snapshot.store(false, Ordering::Release);
        if let Err(e) = conn.keepalive().await {
            conn.give_up(&e);
        }
        return;
    }
}

/// A claim with a statement in flight for it: dropped before
/// [`InFlight::done`], the statement's outcome is unknown, and the key is
/// settled ([`settle`]).
struct InFlight {
    conn: Arc<MuxConn>,
    claim: Option<Claim>,
}

impl InFlight {
    fn done(mut self) -> Claim {
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
fn settle(conn: Arc<MuxConn>, claim: Claim) {
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
/// own, its keepalive cadence, its connections and claimed keys, and its
/// budget ([`SessionLock::multiplexed_budget`](super::SessionLock::multiplexed_budget)).
pub(super) struct Multiplexed<'a> {
    pub(super) settings: &'a Settings,
    pub(super) cadence: Duration,
    pub(super) mux: &'a Arc<Mux>,
    pub(super) mux_budget: Option<usize>,
}

impl Multiplexed<'_> {
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
                Err(MuxTry::Elsewhere(())) => return Ok(MuxTry::Elsewhere(value)),
                Err(_) => return Ok(MuxTry::Busy(value)),
            };
            let opened_before = claim.cell.initialized();
            // Dropped here, the claim ends: nothing was sent for it yet.
            let conn = claim
                .cell
                .get_or_try_init(|| {
                    MuxConn::open(self.settings, self.cadence, self.mux, claim.slot)
                })
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
            let granted = conn.run(Op::Try, key, mode).await;
            let claim = flight.done();
            let granted = match granted {
                // `run` gave the connection up: its slot opens a new one.
                Err(e) if again && opened_before && e.is_connection_lost() => {
                    drop(claim);
                    again = false;
                    continue;
                }
                granted => granted?,
            };
            if !granted {
                return Ok(MuxTry::Busy(value));
            }
            let held = MuxHold(Some(Held { conn, claim }));
            return Ok(MuxTry::Held(value, held));
        }
    }
}

/// A multiplexed lock's share of its guard: the connection and the claim.
/// Dropped without a release, the key is unlocked on a task.
pub(super) struct MuxHold(Option<Held>);

struct Held {
    conn: Arc<MuxConn>,
    claim: Claim,
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
            let answer = holds_now(conn.lease.client(), key, conn.cadence).await;
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
        let flight = InFlight {
            conn: held.conn.clone(),
            claim: Some(held.claim),
        };
        let was_held = held.conn.run(Op::Unlock, key, mode).await;
        drop(flight.done());
        was_held
    }
}

impl Drop for MuxHold {
    fn drop(&mut self) {
        if let Some(held) = self.0.take() {
            // Unlocked on a task, the claim ending with its answer.
            settle(held.conn, held.claim);
        }
    }
}

/// A multiplexed connection's keeper: the keepalive at the cadence (each
/// bounded by one cadence), the end of the connection noticed at once, and
/// the close of a connection that held nothing for a whole cadence.
async fn keep(conn: Weak<MuxConn>, ended: Option<watch::Receiver<bool>>) {
    let Some(cadence) = conn.upgrade().map(|c| c.cadence) else {
        return;
    };
    let mut ticks = tokio::time::interval_at(Instant::now() + cadence, cadence);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let ended = async move {
        match ended {
            Some(mut ended) => {
                let _ = ended.wait_for(|ended| *ended).await;
            }
            None => std::future::pending().await,
        }
    };
    let mut ended = std::pin::pin!(ended);
    loop {
        let gone = tokio::select! {
            _ = ticks.tick() => false,
            () = &mut ended => true,
        };
        let Some(conn) = conn.upgrade() else {
            return;
        };
        if conn.is_lost() {
            return;
        }
        if gone {
            conn.give_up(&"the connection ended");
            return;
        }
        if idle(&conn) {
            // Nothing held and nothing claimed: closed, and the slot opens
            // a new one when needed. (Closing ends the session, so the
            // backend never goes back to a pooler's pool.)
            conn.lease.close();
            let _ = conn.lost.send_replace(true);
            return;
        }
        if let Err(e) = conn.keepalive().await {
            conn.give_up(&e);
            return;
        }
    }
}

/// Whether `conn` held nothing and had no claim for a whole cadence; if
/// so, its slot forgets it (under the table's lock, so that no claim can
/// reach it after).
fn idle(conn: &Arc<MuxConn>) -> bool {
    let used = conn.used.swap(false, Ordering::Relaxed);
    let Some(mux) = conn.mux.upgrade() else {
        return true;
    };
    let mut state = mux.state();
    let slot = &mut state.slots[conn.slot];
    let ours = slot.cell.get().is_some_and(|c| Arc::ptr_eq(c, conn));
    if !ours {
        return true;
    }
    if used || slot.users > 0 {
        return false;
    }
    *slot = Slot {
        cell: Cell::default(),
        users: 0,
    };
    true
}
