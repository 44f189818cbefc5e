//! The adapter-neutral half of the suite: the keys, the commands a test
//! sends to a session, the [`Session`] handle that sends them, and the
//! [`Adapter`] trait each stack implements.
//!
//! A session is one connection of one stack, driven by a worker of its own
//! (a tokio task for the async stacks, a thread for blocking Diesel) that
//! runs each transaction inside that stack's own transaction type or
//! closure and executes the commands the test sends over a channel. So one
//! test body, written against [`Session`], keeps a Diesel transaction open
//! across the test's awaits exactly as it does a sqlx one.

use std::sync::atomic::{AtomicI32, AtomicI64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use lockkit::{AdvisoryKey, Batch, Config, Error, LockKey, Mode};
use lockkit_tests::TestServer;
use tokio::sync::{mpsc, oneshot, Mutex, Notify};

/// The `BigInt` key space of the suite.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/conformance")]
pub(crate) struct Big {
    pub(crate) id: i64,
}

/// The `Pair` key space of the suite.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/conformance-pair", pair)]
pub(crate) struct Pair {
    pub(crate) id: i64,
}

/// A hand-written key whose `lock_key` answers the next key at each call
/// (a counter; in the field, a key read from a field that changes): the
/// guard must name the key the server granted, whatever a second call says.
#[derive(Debug)]
pub(crate) struct Drifting(pub(crate) AtomicI64);

impl AdvisoryKey for Drifting {
    const KEY_SPEC: lockkit::KeySpec<'static> =
        lockkit::KeySpec::new("lockkit-tests/conformance-drifting").raw();
    fn lock_key(&self) -> LockKey {
        LockKey::BigInt(self.0.fetch_add(1, SeqCst))
    }
}

/// A key of either space; every adapter locks it through its own typed
/// methods (`Big` or `Pair`), never as a raw `LockKey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Key {
    Big(i64),
    Pair(i64),
}

impl Key {
    pub(crate) fn lock_key(self) -> LockKey {
        match self {
            Key::Big(id) => Big { id }.lock_key(),
            Key::Pair(id) => Pair { id }.lock_key(),
        }
    }
}

/// `keys` as a [`Batch`] (which sorts them into the global lock order).
pub(crate) fn batch(keys: &[(Key, Mode)]) -> Batch {
    let mut batch = Batch::new();
    for &(key, mode) in keys {
        match key {
            Key::Big(id) => batch.add(&Big { id }, mode),
            Key::Pair(id) => batch.add(&Pair { id }, mode),
        };
    }
    batch
}

/// Where a worker sends the outcome of a command.
pub(crate) type Reply<T> = oneshot::Sender<Result<T, Error>>;

/// An operation inside a transaction (or savepoint).
#[derive(Debug)]
pub(crate) enum Op {
    /// `lock` / `lock_shared`.
    Lock(Key, Mode),
    /// `try_lock` / `try_lock_shared`.
    TryLock(Key, Mode),
    /// `lock_timeout` / `lock_shared_timeout`.
    LockTimeout(Key, Mode, Duration),
    /// `lock_batch`.
    LockBatch(Vec<(Key, Mode)>),
    /// `try_lock_batch`.
    TryLockBatch(Vec<(Key, Mode)>),
    /// `lock`, its future dropped when the receiver fires (async stacks).
    LockDropped(Key, Mode, oneshot::Receiver<()>),
    /// `lock` of a [`Drifting`] key that starts at this `BigInt` key.
    LockDrifting(i64),
    /// `try_lock` of a [`Drifting`] key that starts at this `BigInt` key.
    TryLockDrifting(i64),
    /// `holds` (lockkit's bookkeeping).
    Holds(Key, Mode),
    /// `held_count` (lockkit's bookkeeping): [`Out::Count`].
    HeldCount,
    /// `depth` (savepoints deep): [`Out::Count`].
    Depth,
    /// `is_poisoned`: [`Out::Bool`].
    IsPoisoned,
    /// `try_acquire_permit` of the semaphore of this many permits named
    /// by this `BigInt` key: the slot's key, or `Bool(false)`.
    TryPermit(i64, u8),
    /// `acquire_permit`, or `acquire_permit_timeout` with a timeout: the
    /// slot's key.
    Permit(i64, u8, Option<Duration>),
    /// Read-modify-write of row `id` of the counter table, through the
    /// stack's own query API: read `n`, then write `n + 1`.
    Increment(i64),
    /// A statement of the application's own, through the stack's own
    /// query API.
    Execute(&'static str),
    /// A lock call whose guard's fencing token is the answer.
    Token(TokenCall),
}

/// The lock calls of [`Op::Token`], on `BigInt` keys.
#[derive(Debug)]
pub(crate) enum TokenCall {
    Lock(i64),
    TryLock(i64),
    LockTimeout(i64, Duration),
    Batch(Vec<(Key, Mode)>),
    TryBatch(Vec<(Key, Mode)>),
    Permit(i64, u8),
    TryPermit(i64, u8),
}

/// What an [`Op`] returned.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Out {
    /// A lock call that returned its guard.
    Locked,
    /// A batch that returned its guard over this many keys.
    LockedBatch(usize),
    /// A try call: granted or busy; or `holds`.
    Bool(bool),
    /// A lock call that returned its guard, which names this key.
    Guard(LockKey),
    /// The lock future was dropped before it finished.
    Dropped,
    /// An increment or a statement done.
    Done,
    /// The fencing token of the call's guard (`None`: none, or busy).
    Token(Option<lockkit::fencing::FencingToken>),
    /// How many keys the transaction holds, by `held_count`.
    Count(usize),
}

/// How a transaction (or, for `Commit` and `Rollback`, a savepoint) ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End {
    /// Commit (a savepoint: release it).
    Commit,
    /// Roll back (a savepoint: roll back to it).
    Rollback,
    /// Drop the transaction without ending it (async stacks: the future
    /// that owns it is dropped).
    Drop,
    /// Panic inside the transaction.
    Panic,
}

/// A command to a session's worker.
#[derive(Debug)]
pub(crate) enum Cmd {
    /// Begin a transaction in the stack's own way.
    Begin(Reply<()>),
    /// Outside a transaction: use the connection as the stack's next use
    /// would (which runs what a dropped transaction left queued); returns
    /// the backend pid.
    Ping(Reply<i32>),
    /// Outside a transaction: how many of lockkit's statements are
    /// prepared (named) on the session's backend ([`LOCKKIT_PREPARED`]),
    /// read through the stack's own query API.
    Prepared(Reply<i64>),
    /// An operation in the open transaction.
    Op(Op, Reply<Out>),
    /// Open a savepoint in the open transaction.
    Savepoint(Reply<()>),
    /// End the innermost savepoint, else the transaction.
    End(End, Reply<()>),
}

/// How many of lockkit's statements are prepared (named) on the backend
/// that runs it (`pg_prepared_statements` shows a backend's own), itself
/// left out: a driver may prepare it too. Its column is `n`.
pub(crate) const LOCKKIT_PREPARED: &str =
    "SELECT count(*) AS n FROM pg_prepared_statements WHERE statement LIKE '/* lockkit:%' \
     AND statement NOT LIKE '%pg_prepared_statements%'";

/// What a worker's command loop hands its caller: how to end the
/// transaction or savepoint it serves, and where to reply once it is.
#[derive(Debug)]
pub(crate) enum Fin {
    Commit(Reply<()>),
    Rollback(Reply<()>),
    /// The test dropped its [`Session`].
    Closed,
}

/// What a worker shares with the command loops it runs: the command
/// channel, and the signal that asks it to drop the transaction future.
#[derive(Clone, Debug)]
pub(crate) struct Ctx {
    pub(crate) rx: Arc<Mutex<mpsc::UnboundedReceiver<Cmd>>>,
    pub(crate) drop_now: Arc<Notify>,
    pub(crate) drop_reply: Arc<std::sync::Mutex<Option<Reply<()>>>>,
}

impl Ctx {
    /// The next command, `None` once the session is dropped.
    pub(crate) async fn next(&self) -> Option<Cmd> {
        self.rx.lock().await.recv().await
    }

    /// The next command, for a blocking worker.
    pub(crate) fn next_blocking(&self) -> Option<Cmd> {
        self.rx.blocking_lock().blocking_recv()
    }

    /// Asks the worker to drop the transaction future (replying `reply`
    /// once it has) and never returns: the caller is part of that future.
    pub(crate) async fn drop_transaction(&self, reply: Reply<()>) -> Fin {
        *self.drop_reply.lock().unwrap() = Some(reply);
        self.drop_now.notify_one();
        std::future::pending().await
    }

    /// Runs `transaction`, dropping it if a command loop inside asks to
    /// (see [`Ctx::drop_transaction`]).
    pub(crate) async fn run_droppable(&self, transaction: impl std::future::Future<Output = ()>) {
        tokio::select! {
            () = transaction => {}
            () = self.drop_now.notified() => {
                let reply = self.drop_reply.lock().unwrap().take();
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(()));
                }
            }
        }
    }
}

/// The error a command loop returns from a stack's transaction closure to
/// make it roll back (the reply waits in [`Pending`]).
pub(crate) fn rollback_requested() -> Error {
    Error::other("conformance: rollback requested")
}

/// Whether `e` is (or wraps: a stack may convert the closure's error) the
/// marker of [`rollback_requested`].
fn is_rollback_requested(e: &Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if err.to_string().contains("conformance: rollback requested") {
            return true;
        }
        source = err.source();
    }
    false
}

/// The reply to an `End` of a closure-based transaction or savepoint,
/// parked while the stack ends it.
pub(crate) type Pending = Arc<std::sync::Mutex<Option<Reply<()>>>>;

/// Turns a [`Fin`] into what a closure-based stack's closure returns:
/// `Ok` to commit, `Err` to roll back, with the reply parked in `pending`.
pub(crate) fn park(fin: Fin, pending: &Pending) -> Result<(), Error> {
    match fin {
        Fin::Commit(reply) => {
            *pending.lock().unwrap() = Some(reply);
            Ok(())
        }
        Fin::Rollback(reply) => {
            *pending.lock().unwrap() = Some(reply);
            Err(rollback_requested())
        }
        Fin::Closed => Err(rollback_requested()),
    }
}

/// Replies to the parked `End` with how the stack ended the transaction
/// or savepoint: the requested rollback is a success.
pub(crate) fn unpark(result: Result<(), Error>, pending: &Pending) {
    let reply = pending.lock().unwrap().take();
    if let Some(reply) = reply {
        let _ = reply.send(match result {
            Err(e) if is_rollback_requested(&e) => Ok(()),
            other => other,
        });
    }
}

/// The worker of a session.
#[derive(Debug)]
pub(crate) enum Worker {
    Task(tokio::task::JoinHandle<()>),
    Thread(std::thread::JoinHandle<()>),
}

/// What a stack's pool does, at the application's next checkout, with a
/// connection whose worker panicked inside a transaction.
pub(crate) type Reclaim = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send + Sync>;

/// A boxed future: lockkit's own, which its savepoint closures return.
pub(crate) use lockkit::tx::BoxFuture;

/// A session: one connection of one stack and the worker that drives it.
/// Dropping it ends the worker (an open transaction is dropped).
pub(crate) struct Session {
    tx: mpsc::UnboundedSender<Cmd>,
    pid: AtomicI32,
    worker: Option<Worker>,
    reclaim: Option<Reclaim>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// A session whose worker reads from the other end of `tx`, connected
    /// as backend `pid`.
    pub(crate) fn new(tx: mpsc::UnboundedSender<Cmd>, pid: i32, worker: Worker) -> Session {
        Session {
            tx,
            pid: AtomicI32::new(pid),
            worker: Some(worker),
            reclaim: None,
        }
    }

    /// For a stack whose pool, not a rollback, releases what a panicking
    /// worker's transaction held: what its next checkout does.
    pub(crate) fn with_reclaim(mut self, reclaim: Reclaim) -> Session {
        self.reclaim = Some(reclaim);
        self
    }

    /// A new command channel and the worker's context.
    pub(crate) fn channel() -> (mpsc::UnboundedSender<Cmd>, Ctx) {
        let (tx, rx) = mpsc::unbounded_channel();
        let ctx = Ctx {
            rx: Arc::new(Mutex::new(rx)),
            drop_now: Arc::new(Notify::new()),
            drop_reply: Arc::default(),
        };
        (tx, ctx)
    }

    /// The backend pid of the session's connection.
    pub(crate) fn pid(&self) -> i32 {
        self.pid.load(SeqCst)
    }

    /// Sends a command; returns the receiver of its reply (`Err` if the
    /// worker is gone).
    fn send<T>(&self, cmd: impl FnOnce(Reply<T>) -> Cmd) -> oneshot::Receiver<Result<T, Error>> {
        let (reply, rx) = oneshot::channel();
        // A gone worker drops the reply sender: the receiver says so.
        let _ = self.tx.send(cmd(reply));
        rx
    }

    async fn call<T>(&self, cmd: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, Error> {
        self.send(cmd)
            .await
            .expect("the session's worker died (panicked?) without replying")
    }

    /// Begins a transaction.
    pub(crate) async fn begin(&self) {
        self.call(Cmd::Begin).await.expect("BEGIN");
    }

    /// Uses the connection outside a transaction as the stack's next use
    /// would; updates and returns the pid (a pooled stack may have replaced
    /// the connection).
    pub(crate) async fn ping(&self) -> i32 {
        let pid = self
            .call(Cmd::Ping)
            .await
            .expect("the connection is usable");
        self.pid.store(pid, SeqCst);
        pid
    }

    /// Runs `op` in the open transaction.
    pub(crate) async fn op(&self, op: Op) -> Result<Out, Error> {
        self.call(|r| Cmd::Op(op, r)).await
    }

    /// Sends `op` without waiting for its reply.
    pub(crate) fn start(&self, op: Op) -> oneshot::Receiver<Result<Out, Error>> {
        self.send(|r| Cmd::Op(op, r))
    }

    pub(crate) async fn lock(&self, key: Key, mode: Mode) -> Result<(), Error> {
        self.op(Op::Lock(key, mode))
            .await
            .map(|out| assert_eq!(out, Out::Locked))
    }

    /// `Ok(true)` when granted, `Ok(false)` when busy.
    pub(crate) async fn try_lock(&self, key: Key, mode: Mode) -> Result<bool, Error> {
        self.op(Op::TryLock(key, mode)).await.map(bool_of)
    }

    pub(crate) async fn lock_timeout(
        &self,
        key: Key,
        mode: Mode,
        timeout: Duration,
    ) -> Result<(), Error> {
        self.op(Op::LockTimeout(key, mode, timeout))
            .await
            .map(|out| assert_eq!(out, Out::Locked))
    }

    /// Returns how many keys the guard covers.
    pub(crate) async fn lock_batch(&self, keys: &[(Key, Mode)]) -> Result<usize, Error> {
        match self.op(Op::LockBatch(keys.to_vec())).await? {
            Out::LockedBatch(n) => Ok(n),
            other => panic!("lock_batch returned {other:?}"),
        }
    }

    pub(crate) async fn try_lock_batch(&self, keys: &[(Key, Mode)]) -> Result<bool, Error> {
        self.op(Op::TryLockBatch(keys.to_vec())).await.map(bool_of)
    }

    pub(crate) async fn holds(&self, key: Key, mode: Mode) -> bool {
        bool_of(self.op(Op::Holds(key, mode)).await.expect("holds"))
    }

    pub(crate) async fn held_count(&self) -> usize {
        match self.op(Op::HeldCount).await.expect("held_count") {
            Out::Count(n) => n,
            other => panic!("held_count returned {other:?}"),
        }
    }

    /// How many savepoints deep the current `LockTx` is, by `depth`.
    pub(crate) async fn depth(&self) -> usize {
        match self.op(Op::Depth).await.expect("depth") {
            Out::Count(n) => n,
            other => panic!("depth returned {other:?}"),
        }
    }

    /// Whether the transaction is poisoned, by `is_poisoned`.
    pub(crate) async fn is_poisoned(&self) -> bool {
        match self.op(Op::IsPoisoned).await.expect("is_poisoned") {
            Out::Bool(b) => b,
            other => panic!("is_poisoned returned {other:?}"),
        }
    }

    pub(crate) async fn increment(&self, row: i64) -> Result<(), Error> {
        self.op(Op::Increment(row))
            .await
            .map(|out| assert_eq!(out, Out::Done))
    }

    /// Runs `sql`, a statement of the application's own, in the open
    /// transaction.
    pub(crate) async fn execute(&self, sql: &'static str) -> Result<(), Error> {
        self.op(Op::Execute(sql))
            .await
            .map(|out| assert_eq!(out, Out::Done))
    }

    /// Outside a transaction: how many of lockkit's statements are
    /// prepared on the session's backend.
    pub(crate) async fn lockkit_prepared(&self) -> i64 {
        self.call(Cmd::Prepared)
            .await
            .expect("pg_prepared_statements")
    }

    pub(crate) async fn savepoint(&self) {
        self.call(Cmd::Savepoint).await.expect("SAVEPOINT");
    }

    /// Ends the innermost savepoint, else the transaction.
    pub(crate) async fn end(&self, end: End) -> Result<(), Error> {
        self.call(|r| Cmd::End(end, r)).await
    }

    /// Sends an `End` without waiting for its reply.
    pub(crate) fn start_end(&self, end: End) -> oneshot::Receiver<Result<(), Error>> {
        self.send(|r| Cmd::End(end, r))
    }

    pub(crate) async fn commit(&self) -> Result<(), Error> {
        self.end(End::Commit).await
    }

    pub(crate) async fn rollback(&self) -> Result<(), Error> {
        self.end(End::Rollback).await
    }

    /// Asks the worker to panic inside the transaction, and asserts it did.
    /// Returns what the stack's pool does next, for stacks that release
    /// only then.
    pub(crate) async fn panic(mut self) -> Option<Reclaim> {
        let reply = self.send(|r| Cmd::End(End::Panic, r));
        assert!(
            reply.await.is_err(),
            "the worker replied instead of panicking"
        );
        let panicked = match self.worker.take().expect("joined once") {
            Worker::Task(task) => task.await.expect_err("the worker panicked").is_panic(),
            Worker::Thread(thread) => tokio::task::spawn_blocking(move || thread.join().is_err())
                .await
                .expect("join"),
        };
        assert!(panicked, "the worker did not panic");
        self.reclaim.take()
    }
}

fn bool_of(out: Out) -> bool {
    match out {
        Out::Bool(b) => b,
        other => panic!("expected a bool, got {other:?}"),
    }
}

/// How a stack's lock future behaves when dropped while it waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cancel {
    /// It sends a cancel request: the transaction is poisoned and the
    /// connection is free at once (a rollback returns while the other
    /// holder still holds the key).
    Request,
    /// As `Request`, and the stack's own transaction manager, which owns
    /// the `COMMIT`, is left broken so that it cannot report one
    /// (diesel-async): the transaction fails, and the pool discards the
    /// connection at its next checkout.
    RequestAndDiscard,
    /// No cancel request (sqlx): the transaction is poisoned and the
    /// connection answers nothing until the server answers the lock
    /// statement.
    WaitsForReply,
}

/// One PostgreSQL stack under test.
pub(crate) trait Adapter: Sized + Send + Sync + 'static {
    /// Its name in messages.
    const NAME: &'static str;
    /// A small number of its own, so its tests' key ids and counter rows
    /// differ from the other adapters' tests running at the same time.
    const ID: i64;
    /// What a dropped lock future does (`None`: blocking, no futures).
    const CANCEL: Option<Cancel>;
    /// The `tracing` target under which the stack's driver reports each
    /// statement it runs, with the statement's text (`None`: it reports
    /// none).
    const STATEMENT_EVENTS: Option<&'static str>;

    /// The stack's pool (or connection factory) and locker for `db`, with
    /// `config`; at least `sessions` sessions will be open at once.
    async fn open(db: &TestServer, config: Config, sessions: usize) -> Self;

    /// A new session.
    async fn session(&self) -> Session;

    /// Tries to take a lock on a connection outside any transaction and
    /// returns the refusal; `None` where the type system already rules it
    /// out.
    async fn lock_outside_transaction(&self) -> Option<Error>;
}

/// Executes the operations every stack has, on `$tx` (a `&mut LockTx` or
/// `&LockTx`), awaiting with the trailing tokens (`.await`, or nothing for
/// blocking Diesel); `$increment` is the stack's read-modify-write,
/// `$execute` runs a statement of the application's.
macro_rules! exec_op {
    ($tx:expr, $op:expr, $increment:path, $execute:path, $($aw:tt)*) => {{
        use lockkit::Mode;
        use $crate::session::{batch, Big, Key, Op, Out, Pair};
        let tx = $tx;
        match $op {
            Op::Lock(Key::Big(id), Mode::Exclusive) => tx.lock(Big { id }) $($aw)* .map(|_| Out::Locked),
            Op::Lock(Key::Big(id), Mode::Shared) => tx.lock_shared(Big { id }) $($aw)* .map(|_| Out::Locked),
            Op::Lock(Key::Pair(id), Mode::Exclusive) => tx.lock(Pair { id }) $($aw)* .map(|_| Out::Locked),
            Op::Lock(Key::Pair(id), Mode::Shared) => tx.lock_shared(Pair { id }) $($aw)* .map(|_| Out::Locked),
            Op::TryLock(Key::Big(id), Mode::Exclusive) => tx.try_lock(Big { id }) $($aw)* .map(|r| Out::Bool(r.is_ok())),
            Op::TryLock(Key::Big(id), Mode::Shared) => tx.try_lock_shared(Big { id }) $($aw)* .map(|r| Out::Bool(r.is_ok())),
            Op::TryLock(Key::Pair(id), Mode::Exclusive) => tx.try_lock(Pair { id }) $($aw)* .map(|r| Out::Bool(r.is_ok())),
            Op::TryLock(Key::Pair(id), Mode::Shared) => tx.try_lock_shared(Pair { id }) $($aw)* .map(|r| Out::Bool(r.is_ok())),
            Op::LockTimeout(Key::Big(id), Mode::Exclusive, t) => tx.lock_timeout(Big { id }, t) $($aw)* .map(|_| Out::Locked),
            Op::LockTimeout(Key::Big(id), Mode::Shared, t) => tx.lock_shared_timeout(Big { id }, t) $($aw)* .map(|_| Out::Locked),
            Op::LockTimeout(Key::Pair(id), Mode::Exclusive, t) => tx.lock_timeout(Pair { id }, t) $($aw)* .map(|_| Out::Locked),
            Op::LockTimeout(Key::Pair(id), Mode::Shared, t) => tx.lock_shared_timeout(Pair { id }, t) $($aw)* .map(|_| Out::Locked),
            Op::LockBatch(keys) => tx.lock_batch(&batch(&keys)) $($aw)* .map(|held| Out::LockedBatch(held.keys().len())),
            Op::TryLockBatch(keys) => tx.try_lock_batch(&batch(&keys)) $($aw)* .map(|r| Out::Bool(r.is_ok())),
            Op::LockDrifting(from) => tx.lock($crate::session::Drifting(from.into())) $($aw)* .map(|held| Out::Guard(held.key())),
            Op::TryLockDrifting(from) => tx.try_lock($crate::session::Drifting(from.into())) $($aw)* .map(|r| r.map_or(Out::Bool(false), |held| Out::Guard(held.key()))),
            Op::TryPermit(id, n) => tx.try_acquire_permit(Big { id }, n.try_into().expect("permits")) $($aw)* .map(|r| r.map_or(Out::Bool(false), |held| Out::Guard(held.key()))),
            Op::Permit(id, n, None) => tx.acquire_permit(Big { id }, n.try_into().expect("permits")) $($aw)* .map(|held| Out::Guard(held.key())),
            Op::Permit(id, n, Some(t)) => tx.acquire_permit_timeout(Big { id }, n.try_into().expect("permits"), t) $($aw)* .map(|held| Out::Guard(held.key())),
            Op::Holds(Key::Big(id), mode) => Ok(Out::Bool(tx.holds(&Big { id }, mode))),
            Op::Holds(Key::Pair(id), mode) => Ok(Out::Bool(tx.holds(&Pair { id }, mode))),
            Op::HeldCount => Ok(Out::Count(tx.held_count())),
            Op::Depth => Ok(Out::Count(tx.depth() as usize)),
            Op::IsPoisoned => Ok(Out::Bool(tx.is_poisoned())),
            Op::Increment(row) => $increment(tx, row) $($aw)* .map(|()| Out::Done),
            Op::Execute(sql) => $execute(tx, sql) $($aw)* .map(|()| Out::Done),
            Op::Token(call) => {
                use $crate::session::TokenCall as T;
                match call {
                    T::Lock(id) => tx.lock(Big { id }) $($aw)* .map(|h| Out::Token(h.fencing_token())),
                    T::TryLock(id) => tx.try_lock(Big { id }) $($aw)* .map(|r| Out::Token(r.ok().and_then(|h| h.fencing_token()))),
                    T::LockTimeout(id, t) => tx.lock_timeout(Big { id }, t) $($aw)* .map(|h| Out::Token(h.fencing_token())),
                    T::Batch(keys) => tx.lock_batch(&batch(&keys)) $($aw)* .map(|h| Out::Token(h.fencing_token())),
                    T::TryBatch(keys) => tx.try_lock_batch(&batch(&keys)) $($aw)* .map(|r| Out::Token(r.ok().and_then(|h| h.fencing_token()))),
                    T::Permit(id, n) => tx.acquire_permit(Big { id }, n.try_into().expect("permits")) $($aw)* .map(|h| Out::Token(h.fencing_token())),
                    T::TryPermit(id, n) => tx.try_acquire_permit(Big { id }, n.try_into().expect("permits")) $($aw)* .map(|r| Out::Token(r.ok().and_then(|h| h.fencing_token()))),
                }
            }
            Op::LockDropped(..) => unreachable!("handled by the async command loops"),
        }
    }};
}
pub(crate) use exec_op;

/// Runs `Op::LockDropped` on an async stack: `lock`, the future of its
/// `Op::Lock`, dropped if `cancel` fires first.
pub(crate) async fn lock_dropped(
    lock: impl std::future::Future<Output = Result<Out, Error>>,
    cancel: oneshot::Receiver<()>,
) -> Result<Out, Error> {
    tokio::select! {
        out = lock => out,
        _ = cancel => Ok(Out::Dropped),
    }
}
