//! One connection of the multiplexed form: opened inside a transaction it
//! holds for as long as it lives, the statements sent on it (a try, an
//! unlock, the keepalive), the transaction made anew after a statement's
//! error, and what its keeper's tick does on it.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Statement;

use super::claims::Mux;
use super::conn::{Lease, Settings};
use super::drain::{drain, Cleanup, Taking};
use super::keeper::lease_of;
use super::keeper::{watch_connection, Keeper, Kept, Tick};
use super::simple::{begin_held, renew_held, HeldTx};
use super::wire::{granted_with_token, one_bool, within_cadence, within_take};
use crate::engine::error::{Error, ErrorKind};
use crate::engine::facts::ServerFacts;
use crate::engine::plan::Mode;
use crate::engine::sql;
use crate::fencing::FencingToken;
use crate::key::LockKey;
use crate::pg::locker::server_facts;
use crate::StatementMode;

/// The `application_name` of a multiplexed connection (it holds many
/// keys, of any namespace).
pub const MULTIPLEXED_NAME: &str = "lockkit session locks";

/// How long a multiplexed connection runs no statement before the
/// snapshot its last one left open is dropped ([`drop_snapshot`]).
pub(super) const QUIET: Duration = Duration::from_millis(100);

/// One multiplexed connection, inside its held transaction.
pub(super) struct MuxConn {
    pub(super) lease: Lease,
    slot: usize,
    mux: Weak<Mux<MuxConn>>,
    pub(super) backend_pid: i32,
    pub(super) in_recovery: bool,
    pub(super) facts: ServerFacts,
    pub(super) cadence: Duration,
    /// Flipped once the connection is gone (closed, ended, or given up):
    /// every lock on it is gone.
    pub(super) lost: watch::Sender<bool>,
    /// Whether it was given up ([`MuxConn::give_up`]): closed at once, its
    /// state unknown. Otherwise, once nothing refers to it, its held
    /// transaction is ended cleanly ([`Cleanup::EndHeld`]).
    given_up: AtomicBool,
    /// Whether a key was claimed on it since the keeper last looked: an
    /// idle connection is closed only after a cadence without claims.
    pub(super) used: AtomicBool,
    /// How many of them ran, for [`drop_snapshot`] to see the connection
    /// quiet.
    statements_run: AtomicU64,
    /// Whether a statement's snapshot may be open, with a
    /// [`drop_snapshot`] started for it.
    snapshot: AtomicBool,
    /// How many times the held transaction was made anew after a
    /// statement's error aborted it ([`MuxConn::renew`]).
    renewed: AtomicU64,
    /// The statements prepared on this connection, by text, when the
    /// `SessionLock` prepares them ([`StatementMode::Prepared`]); `None`
    /// when they go unnamed.
    prepared: Option<std::sync::Mutex<HashMap<&'static str, Statement>>>,
    /// Held while the held transaction is made anew, so that the statements
    /// an error failed together renew it once.
    renewing: tokio::sync::Mutex<()>,
    /// Whether the server has `client_connection_check_interval`, for the
    /// set-up of a renewed transaction (shared with the `SessionLock`).
    check_interval_known: Arc<std::sync::atomic::AtomicBool>,
    /// The fencing tokens of the locks held on it, named by its keepalive
    /// for `lockkit inspect` ([`MuxConn::keepalive_text`]).
    tokens: std::sync::Mutex<HashMap<LockKey, FencingToken>>,
}

/// What a statement on a multiplexed connection does.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    /// A try, minting a fencing token with the grant when `mint`.
    Try {
        mint: bool,
    },
    Unlock,
}

/// The statement of `op` for `key`.
fn statement(op: Op, key: LockKey, mode: Mode) -> &'static str {
    match op {
        Op::Try { mint: false } => sql::session_lock(key, mode, true),
        Op::Try { mint: true } => sql::session_lock_minting(key, mode, true),
        Op::Unlock => sql::session_unlock(key, mode),
    }
}

/// What the server answered a statement: `pg_try_advisory_lock`'s or
/// `pg_advisory_unlock`'s `bool`, and the token minted with a grant.
pub(super) type Answer = (bool, Option<FencingToken>);

impl MuxConn {
    /// Opens a connection for `slot` and its held transaction, kept alive
    /// by `keeper` (and, when lockkit opened it, watched for its end).
    pub(super) async fn open(
        settings: &Settings,
        keeper: &Arc<Keeper>,
        mux: &Arc<Mux<MuxConn>>,
        slot: usize,
    ) -> Result<Arc<Self>, Error> {
        let cadence = keeper.cadence;
        // A try's bound: a slot within one cadence, and the set-up within
        // another.
        let lease = settings.pending_lease(Some(cadence)).await?;
        // Dropped before it is kept (the try cut off, or its bound passed),
        // the connection is drained: its held transaction rolled back
        // behind whatever is in flight.
        let taking = Taking::new(lease, Cleanup::Rollback);
        let client = taking.lease().client();
        // The facts first, outside the transaction (they are the server's),
        // answered before the transaction is begun: a statement sent behind
        // an answer that leaves the connection idle is one a
        // transaction-mode pooler may hand, still running, to its next
        // client should this connection close meanwhile. Bounded as every
        // statement on the connection is; on a silent path, or behind a
        // pooler with no free server connection, the connection is drained.
        let ((in_recovery, backend_pid), facts) = within_take(cadence, async {
            let facts = server_facts(client).await?;
            let setup = begin_held(
                client,
                MULTIPLEXED_NAME,
                conn_held(&settings.check_interval_known, cadence),
            )
            .await?;
            Ok((setup, facts))
        })
        .await?;
        let mut lease = taking.keep();
        // Held for as long as it lives: bounded by the form's connections.
        lease.hold();
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
            given_up: AtomicBool::new(false),
            used: AtomicBool::new(true),
            statements_run: AtomicU64::new(0),
            renewed: AtomicU64::new(0),
            renewing: tokio::sync::Mutex::new(()),
            check_interval_known: settings.check_interval_known.clone(),
            snapshot: AtomicBool::new(false),
            tokens: std::sync::Mutex::new(HashMap::new()),
            prepared: (settings.statements == StatementMode::Prepared)
                .then(|| std::sync::Mutex::new(HashMap::new())),
        });
        let kept: Arc<dyn Kept> = conn.clone();
        if let Some(ended) = ended {
            tokio::spawn(watch_connection(Arc::downgrade(&kept), ended));
        }
        keeper.register(kept);
        Ok(conn)
    }

    pub(super) fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    fn tokens(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, FencingToken>> {
        // Nothing under this mutex can panic half-way.
        self.tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Names `key`'s fencing token in the keepalives from now on, while
    /// `key` is held on this connection (a key is claimed once per
    /// `SessionLock`).
    pub(super) fn announce(&self, key: LockKey, token: FencingToken) {
        self.tokens().insert(key, token);
    }

    /// Stops naming `key`'s token: its lock ends.
    pub(super) fn forget_token(&self, key: LockKey) {
        self.tokens().remove(&key);
    }

    /// The keepalive: [`sql::KEEPALIVE`], or the one that names the tokens
    /// of the locks held ([`sql::keepalive_announcing`]).
    pub(super) fn keepalive_text(&self) -> Cow<'static, str> {
        let tokens = self.tokens();
        match tokens.is_empty() {
            true => Cow::Borrowed(sql::KEEPALIVE),
            false => Cow::Owned(sql::keepalive_announcing(
                tokens.iter().map(|(&key, &token)| (key, token)),
            )),
        }
    }

    /// Gives the connection up: its slot forgets it, it is closed, and
    /// every lock on it is gone (`lost()` resolves).
    ///
    /// In that order: whoever sees a lock lost (and takes it again at once)
    /// must find the slot already without this connection, or the new lock
    /// call would be claimed on it and fail.
    pub(super) fn give_up(&self, why: &dyn std::fmt::Display) {
        if let Some(mux) = self.mux.upgrade() {
            mux.forget(self.slot, self);
        }
        self.given_up.store(true, Ordering::Release);
        self.lease.close();
        let was = self.lost.send_replace(true);
        if !was {
            tracing::warn!(backend_pid = self.backend_pid, error = %why,
                "lockkit: a multiplexed session lock connection is given up; its locks are gone");
        }
    }

    /// Runs `op` for `key`, bounded by one cadence: what the server
    /// answered ([`Answer`]).
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
    pub(super) async fn run(
        self: &Arc<Self>,
        op: Op,
        key: LockKey,
        mode: Mode,
    ) -> Result<Answer, Error> {
        let e = match self.attempt(op, key, mode).await? {
            Ok(answer) => return Ok(answer),
            Err(refused) => refused,
        };
        match op {
            Op::Try { .. } => {
                // Its key let go, in case the server granted it before the
                // error (or its token failed after the grant); a failure
                // there gave the connection up.
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
    ) -> Result<Result<Answer, Error>, Error> {
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
            let keepalive = self.keepalive_text();
            within_cadence(self.cadence, async {
                Ok(client.batch_execute(&keepalive).await?)
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
    async fn send(self: &Arc<Self>, op: Op, key: LockKey, mode: Mode) -> Result<Answer, Error> {
        let sql = statement(op, key, mode);
        let client = self.lease.client();
        let run = self.statements_run.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.snapshot.swap(true, Ordering::AcqRel) {
            tokio::spawn(drop_snapshot(Arc::downgrade(self), run));
        }
        let rows = match (key, self.prepared(sql, key).await?) {
            (LockKey::BigInt(v), None) => client.query_typed(sql, &[(&v, Type::INT8)]).await?,
            (LockKey::Pair(class, object), None) => {
                let params: [(&(dyn ToSql + Sync), Type); 2] =
                    [(&class, Type::INT4), (&object, Type::INT4)];
                client.query_typed(sql, &params).await?
            }
            (LockKey::BigInt(v), Some(statement)) => client.query(&statement, &[&v]).await?,
            (LockKey::Pair(class, object), Some(statement)) => {
                client.query(&statement, &[&class, &object]).await?
            }
        };
        match op {
            Op::Try { mint: true } => {
                let token = granted_with_token(&rows)?;
                Ok((token.is_some(), token))
            }
            Op::Try { mint: false } | Op::Unlock => Ok((one_bool(&rows)?, None)),
        }
    }

    /// `sql` prepared on this connection (once: kept by text), when the
    /// `SessionLock` prepares its statements; `None` when they go unnamed.
    ///
    /// # Errors
    ///
    /// When the server refuses the `Parse` (behind a transaction-mode
    /// pooler, a name that meets another client's statement, `42P05`).
    async fn prepared(&self, sql: &'static str, key: LockKey) -> Result<Option<Statement>, Error> {
        let Some(prepared) = &self.prepared else {
            return Ok(None);
        };
        // Nothing under this mutex can panic half-way.
        let cache = || {
            prepared
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        let known = cache().get(sql).cloned();
        if let Some(statement) = known {
            return Ok(Some(statement));
        }
        let types: &[Type] = match key {
            LockKey::BigInt(_) => &[Type::INT8],
            LockKey::Pair(..) => &[Type::INT4, Type::INT4],
        };
        let statement = self.lease.client().prepare_typed(sql, types).await?;
        cache().insert(sql, statement.clone());
        Ok(Some(statement))
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
            let held = conn_held(&self.check_interval_known, self.cadence);
            renew_held(client, MULTIPLEXED_NAME, held).await
        })
        .await?;
        self.renewed.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

/// The set-up of a multiplexed connection's held transaction, at
/// `cadence`: the lease of every lock on it.
fn conn_held(
    check_interval_known: &std::sync::atomic::AtomicBool,
    cadence: Duration,
) -> HeldTx<'_> {
    HeldTx {
        check_interval_known,
        lease: lease_of(cadence),
        mint: false,
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

/// Drops the snapshot a connection's extended-protocol statements left
/// open, once the connection has run none for [`QUIET`]: a simple query
/// replaces the last statement's portal. Started by the first statement
/// after the previous drop (the `seen`th the connection ran).
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

impl Drop for MuxConn {
    /// Nothing is in flight on a connection nothing refers to any more
    /// (every statement runs on an `Arc` of it), and no lock is held on it
    /// (each guard and claim holds an `Arc`): its held transaction is ended
    /// on a task, every session-level lock let go and rolled back in one
    /// query ([`Cleanup::EndHeld`]), and the connection then ends while
    /// idle: with a `Terminate`, or, leased from a pool, detached and
    /// closed (it never goes back to its pool). A client that left inside
    /// the transaction would make a transaction-mode pooler close the
    /// server connection and open another. One given up was closed at
    /// once.
    fn drop(&mut self) {
        if !self.given_up.load(Ordering::Acquire) {
            drain(self.lease.take_out(), Cleanup::EndHeld);
        } else if self.lease.is_owned() {
            self.lease.clean = true;
        }
    }
}

impl Kept for MuxConn {
    /// The keepalive (each bounded by one cadence), or the close of a
    /// connection that held nothing and had no claim for a whole cadence.
    fn tick(self: Arc<Self>) -> Tick {
        Box::pin(async move {
            if self.is_lost() {
                return;
            }
            if idle(&self) {
                // Nothing held and nothing claimed: the slot forgot it and
                // opens a new one when needed; its held transaction ends
                // cleanly once the last `Arc` of it drops (`Drop`).
                let _ = self.lost.send_replace(true);
                return;
            }
            if let Err(e) = self.keepalive().await {
                self.give_up(&e);
            }
        })
    }

    fn connection_ended(self: Arc<Self>) -> Tick {
        Box::pin(async move { self.give_up(&"the connection ended") })
    }

    fn abandon(&self) -> bool {
        self.give_up(&"the runtime of the session locks' keeper shut down");
        false
    }
}

/// Whether `conn` held nothing and had no claim for a whole cadence; if
/// so, its slot forgets it.
fn idle(conn: &Arc<MuxConn>) -> bool {
    let used = conn.used.swap(false, Ordering::Relaxed);
    let Some(mux) = conn.mux.upgrade() else {
        return true;
    };
    mux.forget_idle(conn.slot, conn, used)
}
