//! No pooled connection is handed on inside a transaction, however a lock
//! call is cut off: every way Rust cuts a future (`select!`, `timeout`,
//! `now_or_never`, an early return) and a session `statement_timeout`
//! expiring while the call is being cut off, on every stack, through that
//! stack's pool of one connection and its own entry point.
//!
//! Each round: a holder takes the key, the stack's transaction asks for it
//! and is cut off, the holder lets go, the transaction returns; then the
//! pool's one connection is taken out again and asked whether it is inside
//! a transaction ([`Handed::of`]). The control hands a connection on inside
//! an open and an aborted transaction on purpose and sees the check say so.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use futures_util::FutureExt;
use lockkit::{Config, Error};
use lockkit_tests::observe::wait_until_key_waited;
use lockkit_tests::TestServer;
use tokio::sync::oneshot;
use tokio_postgres::Client;

use crate::session::Big;

/// How the lock call is cut off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cut {
    /// `tokio::select!` with a branch that wins first.
    Select,
    /// `tokio::time::timeout`.
    Timeout,
    /// `FutureExt::now_or_never`.
    NowOrNever,
    /// Polled once, then the closure returns an error and drops it.
    EarlyReturn,
    /// `SET LOCAL statement_timeout = '150ms'`, then `timeout(25ms, …)`, and
    /// the closure returns `Ok`: the server's timeout ends the statement
    /// while the stack is settling the cut-off call.
    StatementTimeout,
    /// The same, and the closure returns an error.
    StatementTimeoutThenError,
}

impl Cut {
    /// Whether the server's `statement_timeout` is set first.
    pub(crate) fn sets_statement_timeout(self) -> bool {
        matches!(self, Cut::StatementTimeout | Cut::StatementTimeoutThenError)
    }
}

/// Every way, in the order run.
pub(crate) const EVERY_CUT: [Cut; 6] = [
    Cut::StatementTimeout,
    Cut::StatementTimeoutThenError,
    Cut::Timeout,
    Cut::Select,
    Cut::NowOrNever,
    Cut::EarlyReturn,
];

/// The client-side bound of the cut-off forms.
pub(crate) const CUT_AFTER: Duration = Duration::from_millis(25);

/// The statement that sets the server-side timeout of [`Cut::StatementTimeout`].
pub(crate) const STATEMENT_TIMEOUT: &str = "SET LOCAL statement_timeout = '150ms'";

/// What a closure that was cut off returns: the application moved on.
pub(crate) fn gave_up() -> Error {
    Error::other("conformance: the lock call was cut off and the closure returned early")
}

/// Runs `call` (a lock call on a key another session holds) cut off as `cut`
/// says, and reports on `seen` once it was. For
/// [`Cut::StatementTimeout`] the caller has already set the timeout.
pub(crate) async fn cut_off<F: Future>(
    call: F,
    cut: Cut,
    seen: oneshot::Sender<()>,
) -> Result<(), Error> {
    let result = match cut {
        Cut::Select => {
            tokio::select! {
                biased;
                _ = call => Err(Error::other("conformance: the lock was granted while held elsewhere")),
                () = tokio::time::sleep(CUT_AFTER) => Ok(()),
            }
        }
        Cut::Timeout | Cut::StatementTimeout => match tokio::time::timeout(CUT_AFTER, call).await {
            Ok(_) => Err(Error::other(
                "conformance: the lock was granted while held elsewhere",
            )),
            Err(_) => Ok(()),
        },
        Cut::StatementTimeoutThenError => match tokio::time::timeout(CUT_AFTER, call).await {
            Ok(_) => Err(Error::other(
                "conformance: the lock was granted while held elsewhere",
            )),
            Err(_) => Err(gave_up()),
        },
        Cut::NowOrNever => match call.now_or_never() {
            Some(_) => Err(Error::other(
                "conformance: the lock was granted while held elsewhere",
            )),
            None => Ok(()),
        },
        Cut::EarlyReturn => {
            let mut call = pin!(call);
            let polled = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
            if polled.is_ready() {
                return Err(Error::other(
                    "conformance: the lock was granted while held elsewhere",
                ));
            }
            let _ = seen.send(());
            return Err(gave_up());
        }
    };
    let _ = seen.send(());
    result
}

/// A stack's pool of one connection, and a transaction through the stack's
/// own entry point whose lock call is cut off.
pub(crate) trait Pooled: Sized + Send + Sync + 'static {
    const NAME: &'static str;
    /// Key ids of this stack's rounds start here.
    const BASE: i64;
    /// The ways this stack's lock calls can be cut off (blocking Diesel has
    /// no future to cut: only the server's timeout).
    const CUTS: &'static [Cut];

    /// The pool, of exactly one connection.
    async fn open(db: &TestServer) -> Self;

    /// One transaction through the stack's entry point: takes `key`, which
    /// another session holds, cut off as `cut` says (reporting on `seen`),
    /// then returns. Its outcome is the entry point's.
    async fn cut_off(&self, key: Big, cut: Cut, seen: oneshot::Sender<()>) -> Result<(), Error>;

    /// Runs the two statements of [`PROBE`] on the pool's connection as
    /// the next user gets it, and returns the second one's boolean, or the
    /// first error's SQLSTATE.
    async fn next_use(&self) -> Result<bool, String>;
}

/// Whether the connection a pool handed on was inside a transaction.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Handed {
    /// Outside any transaction, as a pool must hand it on.
    Clean,
    /// Inside an open transaction.
    InTransaction,
    /// Inside an aborted transaction (its statement failed with 25P02).
    Aborted,
    /// The check itself failed otherwise.
    Failed(String),
}

/// The first statement of the check sets a setting for the rest of its
/// transaction. Outside an explicit transaction that transaction is the
/// statement's own, and the setting is gone for the next statement; inside
/// one, it is still set. (A comparison of `now()` with
/// `statement_timestamp()` cannot tell: over the extended protocol the
/// statement's implicit transaction starts at its `Parse`, before the
/// `Execute` that sets `statement_timestamp()`.)
pub(crate) const PROBE: [&str; 2] = [
    "SELECT set_config('lockkit_tests.handoff', 'inside', true) = 'inside' AS answer",
    "SELECT coalesce(current_setting('lockkit_tests.handoff', true), '') = '' AS answer",
];

impl Handed {
    /// How `pool` hands its connection on. A late cancel request of the
    /// cut-off call can still cancel the first statement the next user
    /// sends (`Canceller::cancel_until_answered` documents that window on
    /// the stacks that send cancel requests): that statement fails with
    /// 57014, outside any transaction, and the check runs again. The count
    /// of those goes to `late_cancels`.
    pub(crate) async fn of<P: Pooled>(pool: &P, late_cancels: &mut u32) -> Handed {
        loop {
            return match pool.next_use().await {
                Ok(true) => Handed::Clean,
                Ok(false) => Handed::InTransaction,
                Err(code) if code == "25P02" => Handed::Aborted,
                Err(code) if code == "57014" && *late_cancels < 100 => {
                    *late_cancels += 1;
                    continue;
                }
                Err(other) => Handed::Failed(other),
            };
        }
    }
}

/// Rounds per way of cutting off.
const ROUNDS: i64 = 3;

/// The scenario on stack `P`: every way of cutting a lock call off, a few
/// rounds each; after each, the pool's connection is outside any
/// transaction and holds nothing.
pub(crate) async fn no_connection_handed_on_inside_a_transaction<P: Pooled>() {
    let db = TestServer::shared();
    let pool = P::open(db).await;
    let mut holder = db.connect().await;
    let observer = db.connect().await;
    let mut late_cancels = 0;
    for (c, &cut) in P::CUTS.iter().enumerate() {
        for round in 0..ROUNDS {
            let key = Big {
                id: P::BASE + c as i64 * 100 + round,
            };
            let holding = hold(&mut holder, key).await;
            let (seen_tx, mut seen) = oneshot::channel();
            let call = pool.cut_off(key, cut, seen_tx);
            let outcome = if cut.sets_statement_timeout() {
                // The holder keeps the key past the server's timeout.
                let outcome = bounded(P::NAME, cut, call).await;
                holding.rollback().await.expect("the holder lets go");
                outcome
            } else {
                let mut call = pin!(call);
                tokio::select! {
                    // A stack that cuts nothing off still answers: the
                    // holder is not waiting for it.
                    outcome = &mut call => {
                        holding.rollback().await.expect("the holder lets go");
                        outcome
                    }
                    _ = &mut seen => {
                        wait_or_not(&observer, key).await;
                        holding.rollback().await.expect("the holder lets go");
                        bounded(P::NAME, cut, call).await
                    }
                }
            };
            let handed = Handed::of(&pool, &mut late_cancels).await;
            assert_eq!(
                handed,
                Handed::Clean,
                "{}: a lock call cut off by {cut:?} (round {round}; the call answered {outcome:?}): \
                 the pool handed its connection on inside a transaction",
                P::NAME
            );
        }
    }
    eprintln!(
        "{}: {late_cancels} next statements cancelled by a late cancel request",
        P::NAME
    );
}

/// Bounds a call that must end once the holder let go: a hang is a failure,
/// and the bound is no timing claim.
async fn bounded<T>(stack: &str, cut: Cut, call: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), call)
        .await
        .unwrap_or_else(|_| panic!("{stack}: the transaction cut off by {cut:?} never returned"))
}

/// Takes `key` in a transaction of the holder's own.
async fn hold(holder: &mut Client, key: Big) -> tokio_postgres::Transaction<'_> {
    let tx = holder.transaction().await.expect("holder begins");
    let lock_key = lockkit::AdvisoryKey::lock_key(&key);
    let lockkit::LockKey::BigInt(k) = lock_key else {
        unreachable!("Big is a BigInt key")
    };
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&k])
        .await
        .expect("holder locks");
    tx
}

/// The call may not have reached the server (`now_or_never` can drop it
/// before its statement is written); when it did, it is seen waiting before
/// the holder lets go, so that the cut-off call is the one in flight.
async fn wait_or_not(observer: &Client, key: Big) {
    let lock_key = lockkit::AdvisoryKey::lock_key(&key);
    let _ = tokio::time::timeout(
        Duration::from_millis(200),
        wait_until_key_waited(observer, lock_key),
    )
    .await;
}

/// The control: a connection handed back inside an open transaction, and
/// one inside an aborted transaction, are seen as such by [`Handed::of`].
pub(crate) async fn control_a_connection_handed_on_inside_a_transaction() {
    use ::sqlx::postgres::PgPoolOptions;
    use ::sqlx::Executor;
    let db = TestServer::shared();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(db.url())
        .await
        .expect("sqlx pool");
    let pool = with_sqlx::SqlxPool::from(pool);
    assert_eq!(Handed::of(&pool, &mut 0).await, Handed::Clean);
    {
        let mut conn = pool.pool().acquire().await.expect("acquire");
        conn.execute("BEGIN").await.expect("begin");
    }
    assert_eq!(Handed::of(&pool, &mut 0).await, Handed::InTransaction);
    {
        let mut conn = pool.pool().acquire().await.expect("acquire");
        conn.execute("ROLLBACK").await.expect("rollback");
        conn.execute("BEGIN").await.expect("begin");
        let _ = conn.execute("SELECT 1/0").await;
    }
    assert_eq!(Handed::of(&pool, &mut 0).await, Handed::Aborted);
    let mut conn = pool.pool().acquire().await.expect("acquire");
    conn.execute("ROLLBACK").await.expect("rollback");
}

/// The config every stack's locker is made with here: the defaults.
fn config() -> Config {
    Config::default()
}

pub(crate) mod with_sqlx {
    use super::*;
    use ::sqlx::postgres::PgPoolOptions;
    use ::sqlx::PgPool;
    use lockkit_sqlx::Locker;

    pub(crate) struct SqlxPool {
        pool: PgPool,
        locker: Option<Locker>,
    }

    impl From<PgPool> for SqlxPool {
        fn from(pool: PgPool) -> Self {
            SqlxPool { pool, locker: None }
        }
    }

    impl SqlxPool {
        pub(crate) fn pool(&self) -> &PgPool {
            &self.pool
        }
    }

    impl Pooled for SqlxPool {
        const NAME: &'static str = "sqlx";
        const BASE: i64 = 910_000;
        const CUTS: &'static [Cut] = &EVERY_CUT;

        async fn open(db: &TestServer) -> Self {
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(60))
                .connect(db.url())
                .await
                .expect("sqlx pool");
            let locker = Locker::new(&pool, config()).await.expect("locker");
            SqlxPool {
                pool,
                locker: Some(locker),
            }
        }

        async fn cut_off(
            &self,
            key: Big,
            cut: Cut,
            seen: oneshot::Sender<()>,
        ) -> Result<(), Error> {
            let locker = self.locker.as_ref().expect("opened with a locker");
            locker
                .transaction(&self.pool, |tx| {
                    Box::pin(async move {
                        if cut.sets_statement_timeout() {
                            ::sqlx::query(STATEMENT_TIMEOUT)
                                .execute(tx.conn())
                                .await
                                .map_err(lockkit_sqlx::lock_error)?;
                        }
                        super::cut_off(tx.lock(key), cut, seen).await
                    })
                })
                .await
        }

        async fn next_use(&self) -> Result<bool, String> {
            let mut conn = self.pool.acquire().await.map_err(|e| e.to_string())?;
            let mut answer = false;
            for sql in PROBE {
                answer = ::sqlx::query_scalar(sql)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(|e| match e.as_database_error().and_then(|d| d.code()) {
                        Some(code) => code.into_owned(),
                        None => e.to_string(),
                    })?;
            }
            Ok(answer)
        }
    }
}

pub(crate) mod with_diesel_async {
    use super::*;
    use ::diesel::sql_types::Bool;
    use ::diesel::QueryableByName;
    use ::diesel_async::pooled_connection::deadpool::Pool;
    use ::diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use ::diesel_async::{AsyncPgConnection, RunQueryDsl};
    use lockkit_diesel_async::Locker;

    pub(crate) struct DieselAsyncPool {
        pool: Pool<AsyncPgConnection>,
        locker: Locker,
    }

    #[derive(QueryableByName)]
    struct Answer {
        #[diesel(sql_type = Bool, column_name = "answer")]
        answer: bool,
    }

    impl Pooled for DieselAsyncPool {
        const NAME: &'static str = "diesel-async";
        const BASE: i64 = 920_000;
        const CUTS: &'static [Cut] = &EVERY_CUT;

        async fn open(db: &TestServer) -> Self {
            let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(db.url());
            let pool = Pool::builder(manager)
                .max_size(1)
                .build()
                .expect("deadpool");
            let locker = {
                let mut conn = pool.get().await.expect("checkout");
                Locker::new(&mut conn, config()).await.expect("locker")
            };
            DieselAsyncPool { pool, locker }
        }

        async fn cut_off(
            &self,
            key: Big,
            cut: Cut,
            seen: oneshot::Sender<()>,
        ) -> Result<(), Error> {
            let mut conn = self.pool.get().await.map_err(Error::other)?;
            self.locker
                .transaction(&mut conn, |tx| {
                    Box::pin(async move {
                        if cut.sets_statement_timeout() {
                            ::diesel::sql_query(STATEMENT_TIMEOUT)
                                .execute(tx.conn())
                                .await?;
                        }
                        super::cut_off(tx.lock(key), cut, seen).await
                    })
                })
                .await
        }

        async fn next_use(&self) -> Result<bool, String> {
            let mut conn = self.pool.get().await.map_err(|e| e.to_string())?;
            let mut answer = false;
            for sql in PROBE {
                answer = ::diesel::sql_query(sql)
                    .get_result::<Answer>(&mut conn)
                    .await
                    .map_err(|e| diesel_code(&e))?
                    .answer;
            }
            Ok(answer)
        }
    }

    /// The SQLSTATE of a Diesel error, read from its message where Diesel
    /// keeps none: 25P02's text is fixed by the server.
    pub(crate) fn diesel_code(e: &::diesel::result::Error) -> String {
        let text = e.to_string();
        if text.contains("current transaction is aborted") {
            "25P02".to_owned()
        } else {
            text
        }
    }
}

pub(crate) mod with_tokio_postgres {
    use super::*;
    use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
    use lockkit::Locker;

    pub(crate) struct DeadpoolPg {
        pool: Pool,
        locker: Locker,
    }

    impl Pooled for DeadpoolPg {
        const NAME: &'static str = "tokio-postgres";
        const BASE: i64 = 930_000;
        const CUTS: &'static [Cut] = &EVERY_CUT;

        async fn open(db: &TestServer) -> Self {
            let manager = Manager::from_config(
                db.config(),
                tokio_postgres::NoTls,
                ManagerConfig {
                    recycling_method: RecyclingMethod::Fast,
                },
            );
            let pool = Pool::builder(manager)
                .max_size(1)
                .build()
                .expect("deadpool");
            let locker = {
                let conn = pool.get().await.expect("checkout");
                Locker::new(&conn, config()).await.expect("locker")
            };
            DeadpoolPg { pool, locker }
        }

        async fn cut_off(
            &self,
            key: Big,
            cut: Cut,
            seen: oneshot::Sender<()>,
        ) -> Result<(), Error> {
            let mut conn = self.pool.get().await.map_err(Error::other)?;
            let tx = self.locker.begin(&mut conn).await?;
            if cut.sets_statement_timeout() {
                tx.batch_execute(STATEMENT_TIMEOUT).await?;
            }
            super::cut_off(tx.lock(key), cut, seen).await
            // `tx` dropped here: tokio-postgres rolls it back before the
            // connection's next statement.
        }

        async fn next_use(&self) -> Result<bool, String> {
            let conn = self.pool.get().await.map_err(|e| e.to_string())?;
            let mut answer = false;
            for sql in PROBE {
                answer = match conn.query_one(sql, &[]).await {
                    Ok(row) => row.get(0),
                    Err(e) => {
                        return Err(e
                            .code()
                            .map(|c| c.code().to_owned())
                            .unwrap_or_else(|| e.to_string()))
                    }
                };
            }
            Ok(answer)
        }
    }
}

pub(crate) mod with_diesel {
    use super::*;
    use ::diesel::r2d2::{ConnectionManager, Pool};
    use ::diesel::sql_types::Bool;
    use ::diesel::{PgConnection, QueryableByName, RunQueryDsl};
    use lockkit_diesel::Locker;

    pub(crate) struct DieselPool {
        pool: Pool<ConnectionManager<PgConnection>>,
        locker: Locker,
    }

    #[derive(QueryableByName)]
    struct Answer {
        #[diesel(sql_type = Bool, column_name = "answer")]
        answer: bool,
    }

    impl Pooled for DieselPool {
        const NAME: &'static str = "diesel";
        const BASE: i64 = 940_000;
        // A blocking call has no future to cut off; the server's timeout
        // ends it.
        const CUTS: &'static [Cut] = &[Cut::StatementTimeout];

        async fn open(db: &TestServer) -> Self {
            let url = db.url().to_owned();
            tokio::task::spawn_blocking(move || {
                let pool = Pool::builder()
                    .max_size(1)
                    .build(ConnectionManager::<PgConnection>::new(url))
                    .expect("r2d2");
                let locker =
                    Locker::new(&mut pool.get().expect("checkout"), config()).expect("locker");
                DieselPool { pool, locker }
            })
            .await
            .expect("open")
        }

        async fn cut_off(
            &self,
            key: Big,
            _cut: Cut,
            seen: oneshot::Sender<()>,
        ) -> Result<(), Error> {
            let (pool, locker) = (self.pool.clone(), self.locker.clone());
            tokio::task::spawn_blocking(move || {
                let mut conn = pool.get().map_err(Error::other)?;
                locker.transaction(&mut conn, |tx| {
                    ::diesel::sql_query(STATEMENT_TIMEOUT).execute(tx.conn())?;
                    let answer = tx.lock(key).map(drop);
                    let _ = seen.send(());
                    answer
                })
            })
            .await
            .expect("the blocking transaction")
        }

        async fn next_use(&self) -> Result<bool, String> {
            let pool = self.pool.clone();
            tokio::task::spawn_blocking(move || {
                let mut conn = pool.get().map_err(|e| e.to_string())?;
                let mut answer = false;
                for sql in PROBE {
                    answer = ::diesel::sql_query(sql)
                        .get_result::<Answer>(&mut conn)
                        .map_err(|e| super::with_diesel_async::diesel_code(&e))?
                        .answer;
                }
                Ok(answer)
            })
            .await
            .expect("the blocking check")
        }
    }
}
