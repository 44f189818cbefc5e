//! Session-duration advisory locks that cannot leak, behind any pooler:
//! [`SessionLock`] and its [`SessionGuard`].
//!
//! # The default form: a transaction held open
//!
//! A session-duration lock ("only one payroll run at a time", leader
//! election, one migrator per fleet) must outlive the short transactions of
//! the work it protects. By default lockkit holds it as
//! `pg_advisory_xact_lock` inside a transaction of its own, on a connection
//! of its own (opened for the lock, or leased from the application's pool),
//! and keeps that transaction open until [`SessionGuard::release`] rolls it
//! back. An open transaction pins its server connection in every pooler
//! (pgbouncer in transaction mode, pgcat, Supavisor, RDS Proxy), so the
//! lock cannot be stranded on a pooled backend, and whatever ends the
//! connection (a drop, a panic, a cancelled task, a network failure, a
//! server restart) ends the transaction and the lock with it. No pooler
//! detection is needed for safety.
//!
//! Its lock goes through the lock engine under the same policy as a
//! [`Locker`]'s: the server's facts, read at a
//! `SessionLock`'s first lock in this form (one round trip more, once;
//! clones share them) and read again before any refusal, are checked
//! before anything is sent (a hot standby refused unless
//! [`SessionLock::allow_standby`], another server's `hashtext` for a
//! `HashText` key, the lock budget).
//!
//! # What an operator sees
//!
//! The lock's backend is `idle in transaction` in `pg_stat_activity`, with
//! `application_name = 'lockkit session lock <namespace> <key>'` (e.g.
//! `lockkit session lock Payroll -3553327097295050730`, the key type's
//! namespace and the key as `pg_locks` has it; `lockkit inspect` shows
//! `session lock Payroll`; set transaction-locally, never on the
//! connection itself, so the connection has its own name back at the
//! rollback: a transaction-mode pooler would carry a connection's name to
//! the backends it later hands to other clients), `backend_xid` and
//! `backend_xmin` null: the transaction is `READ COMMITTED` and writes
//! nothing, so between statements it holds no snapshot and does not hold
//! back VACUUM. Its
//! `pg_locks` row is the `advisory` lock of the key, `ExclusiveLock` or
//! `ShareLock`.
//!
//! # Keepalive
//!
//! One task per [`SessionLock`] (shared by its clones), running while it
//! has locks held, runs lockkit's keepalive statement (`SELECT 1`) on each
//! held lock's connection, and on each multiplexed connection, at the
//! lock's cadence ([`SessionLock::keepalive`], 5 s by default; the first
//! within one cadence of the lock). An idle-connection killer, a dead peer
//! or the end of the lease (below) ends the session: the transaction rolls
//! back and the lock is released, and [`SessionGuard::lost`] resolves: at
//! once on a connection lockkit opened (the connection ends), at the next
//! keepalive on a leased one. A path gone silent (a half-open TCP
//! connection, a partition: no reply at all) is noticed when a keepalive
//! gets no reply within one cadence.
//!
//! # The lease
//!
//! A lock is a lease: a holder that stops answering loses it on the
//! server, whatever the server's or the role's own settings, behind a
//! pooler too. Each held lock's transaction (the default form, a permit,
//! each multiplexed connection) is set up with `SET LOCAL
//! idle_in_transaction_session_timeout` to its lease,
//! [`SessionLock::lease`]: [`LEASE_CADENCES`] keepalive cadences, at least
//! [`MIN_LEASE`] (15 s at the default 5 s cadence). A running holder sends
//! a keepalive every cadence, so its session is never idle that long; a
//! holder that stopped (a paused or stopped process or container, a
//! swapped-out VM, a runtime blocked by a long synchronous call) sends
//! none, and once its transaction has been idle for the lease the server
//! terminates the session (`FATAL 25P03`): its locks pass to the next
//! taker. A `SET LOCAL` lasts only as long as its transaction, so nothing
//! of it outlives the lock on a pooled backend.
//!
//! The session-level form holds its lock outside a transaction: on
//! PostgreSQL 14+ it sets `idle_session_timeout` to the lease instead, on
//! a connection lockkit opened, or, on one leased from the application's
//! pool, for the lock's time only, with `client_connection_check_interval`:
//! both reset to the server's defaults before the connection goes back
//! (after a release or a busy try; after an error the connection is
//! closed). On an older server it has no lease: use the default form where
//! a stopped holder must lose its lock.
//!
//! **A lease does not stop a stale holder from acting.** The holder
//! learns that its lease ended only when it runs again ([`lost()`]
//! resolves then, or its next statement fails), and between waking and
//! noticing it may still write to whatever the lock protected. Two holders
//! can overlap in time: the one that was paused and the next taker. Where
//! that matters, the protected resource must be able to refuse a stale
//! writer (a write made in the same transaction as a check of the lock, or
//! a version the resource compares).
//!
//! [`lost()`]: SessionGuard::lost
//!
//! Every statement lockkit runs on a held lock's connection (keepalive,
//! [`SessionGuard::check`], [`SessionGuard::release`], the rollback of a
//! dropped guard) waits at most one cadence for its answer; one that gets
//! none gives the lock up and closes the connection. So whatever is in
//! flight, `lost()` resolves within one cadence of a connection lockkit
//! opened closing, and within two cadences of the lock's path going silent
//! (the next keepalive starts within one, and waits at most one); `check()`
//! and `release()` answer within two (one waiting for a statement in flight,
//! one for their own). Once `lost()`
//! resolves the holder must stop acting as the lock's owner.
//!
//! # Bounded waits
//!
//! A network path gone silent never holds a call forever; where a call
//! gives up, it holds nothing, and its connection is drained ([Connections
//! that hold nothing](#connections-that-hold-nothing)):
//! - **Opening a connection** (the TCP connect, TLS and the startup, for
//!   each host of the configuration in turn) waits at most the
//!   configuration's `connect_timeout` per host, or
//!   [`DEFAULT_CONNECT_TIMEOUT`] per host when it sets none, then fails
//!   with [`ErrorKind::ConnectFailed`]. (tokio-postgres itself bounds only
//!   the TCP connect.) A pool's lease (`from_pool`) waits as the pool's own
//!   timeouts say. A connection the server or a pooler refuses (too many
//!   clients, authentication, no such database) fails with
//!   `ConnectFailed` too, never `ConnectionLost`: no connection was made,
//!   so no lock was lost.
//! - **Taking a lock**, once connected: a try waits at most one keepalive
//!   cadence for the server's answers, a `_timeout` call its timeout plus
//!   one cadence (plus the [`probe_timeout`](SessionLock::probe_timeout)
//!   when the session-level form probes for a pooler); past that bound it
//!   fails with [`ErrorKind::Timeout`], never `ConnectionLost`. A server
//!   that does not answer cannot be told from a pooler that is alive and
//!   waiting for a free server connection (a transaction-mode pgbouncer
//!   whose server connections are all pinned by held locks, each lock's
//!   transaction holding one): either way the lock was not granted in
//!   time, and a loop of tries (a leader election) sees a timeout it can
//!   retry, not a lost connection. A multiplexed try on a connection it
//!   already holds waits for no server connection. A take waits for one of
//!   the `SessionLock`'s pending slots within the same bound. A call that
//!   waits for the key as long as it takes is not bounded here (the server
//!   bounds each slice of its wait, not the whole): a silent path cannot be
//!   told apart from a key held for long; bound it with
//!   `tokio::time::timeout` (it is cancel safe) or a `_timeout` call.
//! - **Holding a lock**: see the keepalive above.
//!
//! # Multiplexed locks
//!
//! A [`SessionLock`] in the [`SessionForm::Multiplexed`] form holds any
//! number of locks over at most [`SessionLock::connections`] connections
//! ([`DEFAULT_CONNECTIONS`] by default), for the worker per tenant, shard or
//! feed that holds thousands of long-lived locks: 10,000 held at once over
//! 8 connections is tested, direct and through transaction-mode pgbouncer.
//! Each lock is taken and released on its own, with `pg_try_advisory_lock`
//! and `pg_advisory_unlock` (one round trip each, sent unnamed, so that no
//! statement name can meet another client's on a pooled server connection),
//! inside a transaction each connection holds open
//! for as long as it lives:
//! - **Behind any pooler.** The open transaction pins the connection's
//!   backend, so no lock can be stranded on a pooled backend; the
//!   transaction is ended only once the connection holds nothing and has
//!   had no claim for a keepalive cadence (every lock let go and rolled
//!   back in one query, then the connection ends while idle); when
//!   anything fails on it, it is closed at once. A client that goes away
//!   (crashed, killed with `kill -9`) ends the session too, since a pooler
//!   closes a backend its client left inside a transaction, and the server
//!   releases every lock on it. Tested
//!   through transaction-mode pgbouncer: the locks are gone as soon as the
//!   pooler sees the client's socket close, with no timeout involved.
//! - **A try never waits, and a wait never delays another lock.** A free
//!   key is granted in one round trip on a multiplexed connection. A
//!   waiting call ([`SessionLock::lock`], [`SessionLock::lock_timeout`], …)
//!   that finds the key held takes a connection of its own in the default
//!   form ([`SessionGuard::form`] says which), since a connection waiting
//!   for one key would hold up every statement of the others on it.
//! - **One holder per key.** Session-level locks are re-entrant on their
//!   session, so the `SessionLock` (and its clones) keeps a table of the
//!   keys it holds or has a statement in flight for: a try for a key it
//!   holds answers busy at once, with no second grant. A key stays in the
//!   table until its guard is released or dropped, even once `lost()` has
//!   resolved: drop a lost guard to take its key again.
//! - **Losses are per connection.** Each connection has a keepalive at the
//!   cadence, as in the default form. When a connection ends (terminated
//!   backend, restart, lost network) or a statement on it fails or gets no
//!   answer within a cadence, it is closed and [`SessionGuard::lost`]
//!   resolves for every lock it held, once its connection slot has
//!   forgotten it: a lock taken again from then on goes to a new
//!   connection. A try that finds its connection ended before the keeper
//!   saw it ([`ErrorKind::ConnectionLost`]) is made once more, on a new
//!   connection. [`SessionGuard::check`] answering anything but `true`
//!   gives the whole connection up.
//! - **Cut-off calls.** A try or release whose future is dropped while its
//!   statement is in flight leaves its key claimed until a task has sent
//!   the key's unlock after it and read the answer; should that fail, or
//!   no runtime be left to run it, the connection is closed. A guard
//!   dropped without release is unlocked the same way.
//!
//! The connections' backends show `application_name` =
//! [`MULTIPLEXED_NAME`] and `idle in transaction`, with no `backend_xid`.
//! A statement's snapshot stays open in the transaction until the
//! connection's next statement; once a connection has run none for 100 ms,
//! a simple query drops it, so that `backend_xmin` is null: a connection
//! holds back VACUUM only while it is busy, and then only by its last
//! statement's snapshot.
//! On a pool (`from_pool`), each connection is leased for its life and
//! never returned: detached and closed once its held transaction ended as
//! above (a connection given up closes when its last guard drops); size
//! the pool for them and for the waits that take connections of their
//! own, since a lease waits for the pool.
//!
//! # The plain session-level form
//!
//! [`SessionForm::SessionLevel`] takes `pg_advisory_lock` instead: no
//! transaction stays open, but the lock is bound to the server session, so
//! it is safe only on a direct connection (or a session-mode pool). It is
//! refused when [`probe_pooler`] sees a transaction-mode pooler. Its
//! backend shows the same `application_name` as the default form's, set
//! session-wide once the probe has passed, on connections lockkit opens
//! (a leased pool connection keeps its own).
//!
//! # Connections leased from a pool
//!
//! With `from_pool` (feature `deadpool`), each lock leases a connection
//! from the application's deadpool-postgres pool for its life. A release
//! rolls the lock's transaction back and returns the connection to the
//! pool. A guard dropped without release rolls back on its task and
//! returns the connection only when the rollback completed; otherwise (a
//! failed or cut-short rollback, a lost connection, the runtime shutting
//! down) the connection is detached from the pool and closed, which ends
//! the transaction on the server. A connection is never returned with a
//! lock on it, and keeps its own name: a lock's `application_name` is set
//! transaction-locally, as on every connection.
//!
//! # Connections that hold nothing
//!
//! No form ever sends a cancel request: a pooler may be in between, and
//! pgbouncer before 1.19 can die of one (its issues 801, 822 and 847), with
//! every client of every service that shares it. Instead:
//! - **A wait is bounded on the server.** A lock that waits as long as it
//!   takes waits in slices of the server's `deadlock_timeout` and one
//!   second, each ended by a `lock_timeout` of lockkit's own and followed
//!   by the next while the key is busy (the default form's, under a
//!   savepoint: [`Policy::bounds_waits`](crate::Policy::bounds_waits); the
//!   session-level form's, between statements). A lock cut off, or whose
//!   client is gone, stops waiting on the server within one slice, behind
//!   any pooler. A `lock_timeout` of the caller's own (its role's or
//!   database's) bounds the wait instead. The cost: a waiter that starts a
//!   new slice joins the key's queue again, behind those that came since.
//! - **A take cut off, or given up at its bound, is drained, never closed
//!   under its statement.** Its connection goes to a task that waits for
//!   the statement to end (a guard of 150 s against a path that hangs),
//!   rolls back (or, in the session-level form, unlocks the key) behind
//!   it, and then gives the connection back to its pool, or ends one
//!   lockkit opened with a `Terminate` while idle. Closing it at once
//!   would let a statement queued in a transaction-mode pgbouncer reach
//!   the server after its client left, and pgbouncer would then close that
//!   server connection and open another: under many cut-off calls,
//!   PostgreSQL runs out of connections for everyone.
//! - **At most [`PENDING_CONNECTIONS_PER_SESSION_LOCK`] connections of a
//!   `SessionLock` (with its clones) hold no lock yet**: opening, waiting
//!   for a take's answer, or being drained. A take waits for a slot within
//!   its own bound ([Bounded waits](#bounded-waits)), and past it fails
//!   with [`ErrorKind::Timeout`] having opened nothing. pgbouncer 1.18
//!   reads nothing from a client waiting for a server connection, so a
//!   client that closed then still takes a slot of its `max_client_conn`
//!   until a server connection frees; a loop of tries that gave up behind
//!   a saturated pooler would fill them, and the pooler would refuse every
//!   new client, of every service. With the slots, such a loop keeps at
//!   most this many clients there beside its held locks.

#[cfg(doc)]
use crate::engine::error::ErrorKind;
use crate::pg::locker::Locker;

mod claims;
mod conn;
mod drain;
mod form;
mod guard;
mod held;
mod keeper;
mod level;
mod lock;
mod mux;
mod mux_conn;
mod probe;
mod simple;
mod take;
mod wire;
mod xact;

pub use claims::DEFAULT_CONNECTIONS;
pub use conn::{DEFAULT_CONNECT_TIMEOUT, PENDING_CONNECTIONS_PER_SESSION_LOCK};
pub use form::SessionForm;
pub use guard::SessionGuard;
pub use keeper::{DEFAULT_KEEPALIVE, LEASE_CADENCES, MIN_LEASE};
pub use lock::SessionLock;
pub use mux_conn::MULTIPLEXED_NAME;
pub use probe::{probe_pooler, PoolerProbe, ProbeTimeout, DEFAULT_PROBE_TIMEOUT};

impl Locker {
    /// Session locks on connections made from `config` (without TLS), with
    /// this locker's standby policy
    /// ([`Config::allow_standby`](crate::Config::allow_standby)).
    ///
    /// The locker's transactions and the session locks take keys from the
    /// same key spaces, so an xact lock and a session lock on one key
    /// exclude each other.
    pub fn session(&self, config: tokio_postgres::Config) -> SessionLock {
        SessionLock::new(config).allow_standby(self.policy().config().allow_standby)
    }
}
