//! One [`Adapter`] per stack. Each worker drives its stack's own public API
//! inside that stack's own transaction type or closure: tokio-postgres'
//! `LockClient::begin` and `LockTx`; Diesel's `Locker::transaction` on a
//! blocking connection, on a thread of its own; diesel-async's
//! `AsyncPgConnection::transaction`; sqlx's `begin` and `Locker::lock_tx`.
//! The command loops (`serve`) are the same loop over each stack's
//! `LockTx`: the operations every stack has are one macro
//! ([`exec_op!`](crate::session::exec_op)), and sqlx and diesel-async,
//! whose `LockTx` is lockkit's one [`LockTx`] over their `Locker`, share
//! one generic loop ([`serve_in_closure_savepoints`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lockkit::driver::{Async, Transactions};
use lockkit::tx::LockTx;
use lockkit::{Config, Error};
use lockkit_tests::TestServer;

use crate::session::{
    exec_op, lock_dropped, park, unpark, Adapter, BoxFuture, Cancel, Cmd, Ctx, End, Fin, Op,
    Pending, Session, Worker, LOCKKIT_PREPARED,
};

/// The table the exclusion workload increments.
pub(crate) const COUNTERS: &str = "conformance_counters";

/// Replies to a command that needs an open transaction (or needs none)
/// sent at the wrong time: a bug in a test body.
fn misplaced(cmd: Cmd) {
    let e = Error::other(format!("conformance: command out of place: {cmd:?}"));
    match cmd {
        Cmd::Begin(r) | Cmd::Savepoint(r) | Cmd::End(_, r) => drop(r.send(Err(e))),
        Cmd::Ping(r) => drop(r.send(Err(e))),
        Cmd::Prepared(r) => drop(r.send(Err(e))),
        Cmd::Op(_, r) => drop(r.send(Err(e))),
    }
}

const PANIC: &str = "deliberate panic inside the transaction (expected by the conformance test)";

/// An async stack whose `LockTx` is lockkit's one [`LockTx`] over its
/// `Locker` (sqlx, diesel-async), implemented by that `Locker`: what the
/// shared command loop needs beyond the `LockTx`.
pub(crate) trait AsyncStack: Transactions<Io = Async> {
    /// `Op::Increment` through the stack's own query API: reads row
    /// `row`'s `n`, then writes `n + 1`.
    fn increment(
        tx: &mut LockTx<'_, Self>,
        row: i64,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// `Op::Execute` through the stack's own query API.
    fn execute(
        tx: &mut LockTx<'_, Self>,
        sql: &'static str,
    ) -> impl Future<Output = Result<(), Error>> + Send;
}

/// The command loop of the stacks whose savepoints run a closure
/// (`LockTx::savepoint(|sp| …)`: sqlx and diesel-async), over lockkit's one
/// `LockTx`.
fn serve_in_closure_savepoints<'a, D: AsyncStack>(
    tx: &'a mut LockTx<'_, D>,
    ctx: &'a Ctx,
) -> BoxFuture<'a, Fin> {
    Box::pin(async move {
        while let Some(cmd) = ctx.next().await {
            match cmd {
                Cmd::Op(Op::LockDropped(key, mode, cancel), reply) => {
                    let lock = async {
                        exec_op!(&mut *tx, Op::Lock(key, mode), D::increment, D::execute, .await)
                    };
                    let _ = reply.send(lock_dropped(lock, cancel).await);
                }
                Cmd::Op(op, reply) => {
                    let _ = reply.send(exec_op!(&mut *tx, op, D::increment, D::execute, .await));
                }
                Cmd::Savepoint(reply) => {
                    let pending = Pending::default();
                    let (ctx2, pending2) = (ctx.clone(), Arc::clone(&pending));
                    let result = tx
                        .savepoint(move |sp| {
                            Box::pin(async move {
                                let _ = reply.send(Ok(()));
                                let fin = serve_in_closure_savepoints(sp, &ctx2).await;
                                park(fin, &pending2)
                            })
                        })
                        .await;
                    unpark(result, &pending);
                }
                other => {
                    if let Some(fin) = end_async(other, ctx).await {
                        return fin;
                    }
                }
            }
        }
        Fin::Closed
    })
}

/// The commands both async loops answer alike: an end of the transaction
/// (`Some`, what the loop returns), or a misplaced command (`None`).
async fn end_async(cmd: Cmd, ctx: &Ctx) -> Option<Fin> {
    match cmd {
        Cmd::End(End::Commit, r) => Some(Fin::Commit(r)),
        Cmd::End(End::Rollback, r) => Some(Fin::Rollback(r)),
        Cmd::End(End::Drop, r) => Some(ctx.drop_transaction(r).await),
        Cmd::End(End::Panic, _) => panic!("{PANIC}"),
        other => {
            misplaced(other);
            None
        }
    }
}

/// The rows both Diesel stacks read, each through its own `RunQueryDsl`.
mod diesel_rows {
    use ::diesel::sql_types::{BigInt, Integer};

    /// The SQL of [`Pid`].
    pub(super) const PID: &str = "SELECT pg_backend_pid() AS pid";

    /// The row of [`PID`]: the session's backend pid.
    #[derive(::diesel::QueryableByName)]
    pub(super) struct Pid {
        #[diesel(sql_type = Integer)]
        pub(super) pid: i32,
    }

    /// A row of the counter table, or of `LOCKKIT_PREPARED`: its `n`.
    #[derive(::diesel::QueryableByName)]
    pub(super) struct N {
        #[diesel(sql_type = BigInt)]
        pub(super) n: i64,
    }

    /// The `tracing` target of [`report_statements`]'s events.
    pub(super) const STATEMENTS: &str = "lockkit_tests::sql";

    /// The instrumentation of every session's connection: it reports each
    /// statement the connection starts as a `tracing` event of target
    /// [`STATEMENTS`] with its text, as an application's own would (Diesel
    /// itself reports to no `tracing` target).
    pub(super) fn report_statements() -> impl ::diesel::connection::Instrumentation {
        |event: ::diesel::connection::InstrumentationEvent<'_>| {
            if let ::diesel::connection::InstrumentationEvent::StartQuery { query, .. } = event {
                tracing::info!(target: STATEMENTS, "{query}");
            }
        }
    }
}

/// tokio-postgres: `lockkit::LockClient` and its `LockTx`.
pub(crate) mod with_tokio_postgres {
    use super::*;
    use lockkit::{LockClient, LockTx, Locker};
    use tokio_postgres::{Client, NoTls};

    pub(crate) struct TokioPg {
        config: tokio_postgres::Config,
        locker: Locker,
    }

    impl Adapter for TokioPg {
        const NAME: &'static str = "tokio-postgres";
        const ID: i64 = 0;
        const CANCEL: Option<Cancel> = Some(Cancel::Request);
        /// tokio-postgres reports through `log`, not `tracing`, and of an
        /// execution only the prepared statement's name (of lockkit's
        /// unnamed statements, nothing), so there is no report to find in
        /// a span.
        const STATEMENT_EVENTS: Option<&'static str> = None;

        async fn open(db: &TestServer, config: Config, _sessions: usize) -> Self {
            let client = db.connect().await;
            let locker = Locker::new(&client, config).await.expect("locker");
            TokioPg {
                config: db.config(),
                locker,
            }
        }

        async fn session(&self) -> Session {
            let (client, connection) = self.config.connect(NoTls).await.expect("connect");
            tokio::spawn(async move {
                let _ = connection.await;
            });
            let pid = pid(&client).await.expect("pid");
            let (tx, ctx) = Session::channel();
            let client = LockClient::new(&self.locker, client);
            let task = tokio::spawn(worker(client, ctx));
            Session::new(tx, pid, Worker::Task(task))
        }

        /// `LockTx` has the lock methods and is only made by `begin`/`lock_tx`,
        /// which open a transaction: a lock outside one does not compile
        /// (tests/ui-guards/lock_without_transaction.rs).
        async fn lock_outside_transaction(&self) -> Option<Error> {
            None
        }
    }

    async fn pid(client: &Client) -> Result<i32, Error> {
        Ok(client
            .query_one("SELECT pg_backend_pid()", &[])
            .await?
            .get(0))
    }

    async fn increment(tx: &LockTx<'_>, row: i64) -> Result<(), Error> {
        let select = format!("SELECT n FROM {COUNTERS} WHERE id = $1");
        let n: i64 = tx.query_one(&select, &[&row]).await?.get(0);
        let update = format!("UPDATE {COUNTERS} SET n = $2 WHERE id = $1");
        tx.execute(&update, &[&row, &(n + 1)]).await?;
        Ok(())
    }

    async fn execute(tx: &LockTx<'_>, sql: &'static str) -> Result<(), Error> {
        tx.execute(sql, &[]).await?;
        Ok(())
    }

    async fn prepared(client: &Client) -> Result<i64, Error> {
        Ok(client.query_one(LOCKKIT_PREPARED, &[]).await?.get(0))
    }

    async fn worker(mut client: LockClient, ctx: Ctx) {
        while let Some(cmd) = ctx.next().await {
            match cmd {
                Cmd::Begin(reply) => {
                    let client = &mut client;
                    let ctx2 = &ctx;
                    let transaction = async move {
                        let mut tx = match client.begin().await {
                            Ok(tx) => tx,
                            Err(e) => return drop(reply.send(Err(e))),
                        };
                        let _ = reply.send(Ok(()));
                        match serve(&mut tx, ctx2).await {
                            Fin::Commit(r) => drop(r.send(tx.commit().await)),
                            Fin::Rollback(r) => drop(r.send(tx.rollback().await)),
                            Fin::Closed => {}
                        }
                    };
                    ctx.run_droppable(transaction).await;
                }
                Cmd::Ping(reply) => drop(reply.send(pid(&client).await)),
                Cmd::Prepared(reply) => drop(reply.send(prepared(&client).await)),
                other => misplaced(other),
            }
        }
    }

    fn serve<'a>(tx: &'a mut LockTx<'_>, ctx: &'a Ctx) -> BoxFuture<'a, Fin> {
        Box::pin(async move {
            while let Some(cmd) = ctx.next().await {
                match cmd {
                    Cmd::Op(Op::LockDropped(key, mode, cancel), reply) => {
                        let lock = async {
                            exec_op!(&*tx, Op::Lock(key, mode), increment, execute, .await)
                        };
                        let _ = reply.send(lock_dropped(lock, cancel).await);
                    }
                    Cmd::Op(op, reply) => {
                        let _ = reply.send(exec_op!(&*tx, op, increment, execute, .await));
                    }
                    Cmd::Savepoint(reply) => {
                        let mut sp = match tx.savepoint().await {
                            Ok(sp) => sp,
                            Err(e) => {
                                let _ = reply.send(Err(e));
                                continue;
                            }
                        };
                        let _ = reply.send(Ok(()));
                        match serve(&mut sp, ctx).await {
                            Fin::Commit(r) => drop(r.send(sp.commit().await)),
                            Fin::Rollback(r) => drop(r.send(sp.rollback().await)),
                            Fin::Closed => return Fin::Closed,
                        }
                    }
                    other => {
                        if let Some(fin) = end_async(other, ctx).await {
                            return fin;
                        }
                    }
                }
            }
            Fin::Closed
        })
    }
}

/// sqlx: a `PgPool`, one pooled connection per session, `begin` on it and
/// `Locker::lock_tx(&mut tx)`.
pub(crate) mod with_sqlx {
    use super::*;
    use ::sqlx::pool::PoolConnection;
    use ::sqlx::postgres::PgPoolOptions;
    use ::sqlx::{PgPool, Postgres};
    use lockkit_sqlx::{lock_error, LockTx, Locker};

    pub(crate) struct Sqlx {
        pool: PgPool,
        locker: Locker,
    }

    impl Adapter for Sqlx {
        const NAME: &'static str = "sqlx";
        const ID: i64 = 1;
        const CANCEL: Option<Cancel> = Some(Cancel::WaitsForReply);
        /// sqlx's own report of each statement (its query logger, on by
        /// default).
        const STATEMENT_EVENTS: Option<&'static str> = Some("sqlx::query");

        async fn open(db: &TestServer, config: Config, sessions: usize) -> Self {
            let pool = PgPoolOptions::new()
                .max_connections(sessions as u32 + 2)
                .acquire_timeout(Duration::from_secs(60))
                .connect(db.url())
                .await
                .expect("sqlx pool");
            let locker = Locker::new(&pool, config).await.expect("locker");
            Sqlx { pool, locker }
        }

        async fn session(&self) -> Session {
            let mut conn = self.pool.acquire().await.expect("acquire");
            let pid = pid(&mut conn).await.expect("pid");
            let (tx, ctx) = Session::channel();
            let task = tokio::spawn(worker(conn, self.locker.clone(), ctx));
            Session::new(tx, pid, Worker::Task(task))
        }

        async fn lock_outside_transaction(&self) -> Option<Error> {
            let mut conn = self.pool.acquire().await.expect("acquire");
            self.locker.lock_tx(&mut conn).err()
        }
    }

    async fn pid(conn: &mut PoolConnection<Postgres>) -> Result<i32, Error> {
        ::sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut **conn)
            .await
            .map_err(lock_error)
    }

    impl AsyncStack for Locker {
        async fn increment(tx: &mut LockTx<'_>, row: i64) -> Result<(), Error> {
            let n: i64 = ::sqlx::query_scalar(&format!("SELECT n FROM {COUNTERS} WHERE id = $1"))
                .bind(row)
                .fetch_one(tx.conn())
                .await
                .map_err(lock_error)?;
            ::sqlx::query(&format!("UPDATE {COUNTERS} SET n = $2 WHERE id = $1"))
                .bind(row)
                .bind(n + 1)
                .execute(tx.conn())
                .await
                .map_err(lock_error)?;
            Ok(())
        }

        async fn execute(tx: &mut LockTx<'_>, sql: &'static str) -> Result<(), Error> {
            ::sqlx::query(sql)
                .execute(tx.conn())
                .await
                .map_err(lock_error)?;
            Ok(())
        }
    }

    async fn worker(mut conn: PoolConnection<Postgres>, locker: Locker, ctx: Ctx) {
        while let Some(cmd) = ctx.next().await {
            match cmd {
                Cmd::Begin(reply) => {
                    let (conn, locker, ctx2) = (&mut conn, &locker, &ctx);
                    let transaction = async move {
                        let mut tx = match ::sqlx::Connection::begin(&mut **conn).await {
                            Ok(tx) => tx,
                            Err(e) => return drop(reply.send(Err(lock_error(e)))),
                        };
                        let _ = reply.send(Ok(()));
                        let fin = {
                            let mut ltx = locker.lock_tx(&mut tx).expect("in a transaction");
                            serve_in_closure_savepoints(&mut ltx, ctx2).await
                        };
                        match fin {
                            Fin::Commit(r) => drop(r.send(tx.commit().await.map_err(lock_error))),
                            Fin::Rollback(r) => {
                                drop(r.send(tx.rollback().await.map_err(lock_error)))
                            }
                            Fin::Closed => {}
                        }
                    };
                    ctx.run_droppable(transaction).await;
                }
                Cmd::Ping(reply) => {
                    let _ = reply.send(pid(&mut conn).await);
                }
                Cmd::Prepared(reply) => {
                    let prepared = ::sqlx::query_scalar(LOCKKIT_PREPARED)
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(lock_error);
                    let _ = reply.send(prepared);
                }
                other => misplaced(other),
            }
        }
    }
}

/// diesel-async: a deadpool pool per session (of one connection, so the
/// session's next checkout is that connection's recycling), and
/// `AsyncPgConnection::transaction` with `lock_tx` inside.
pub(crate) mod with_diesel_async {
    use super::*;
    use ::diesel::sql_types::BigInt;
    use ::diesel_async::pooled_connection::deadpool::{Object, Pool};
    use ::diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use ::diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
    use lockkit_diesel_async::{LockTx, Locker};

    use super::diesel_rows::{report_statements, Pid, N, PID, STATEMENTS};

    type PgPool = Pool<AsyncPgConnection>;

    pub(crate) struct DieselAsync {
        url: String,
        locker: Locker,
    }

    fn pool(url: &str) -> PgPool {
        let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(url);
        Pool::builder(manager)
            .max_size(1)
            .build()
            .expect("deadpool")
    }

    impl Adapter for DieselAsync {
        const NAME: &'static str = "diesel-async";
        const ID: i64 = 2;
        const CANCEL: Option<Cancel> = Some(Cancel::RequestAndDiscard);
        const STATEMENT_EVENTS: Option<&'static str> = Some(STATEMENTS);

        async fn open(db: &TestServer, config: Config, _sessions: usize) -> Self {
            let url = db.url().to_string();
            let mut conn = pool(&url).get().await.expect("checkout");
            let locker = Locker::new(&mut conn, config).await.expect("locker");
            DieselAsync { url, locker }
        }

        async fn session(&self) -> Session {
            let pool = pool(&self.url);
            let mut conn = pool.get().await.expect("checkout");
            conn.set_instrumentation(report_statements());
            let pid = pid(&mut conn).await.expect("pid");
            let (tx, ctx) = Session::channel();
            let task = tokio::spawn(worker(pool.clone(), conn, self.locker.clone(), ctx));
            Session::new(tx, pid, Worker::Task(task)).with_reclaim(Box::new(move || {
                Box::pin(async move {
                    drop(pool.get().await.expect("checkout"));
                })
            }))
        }

        async fn lock_outside_transaction(&self) -> Option<Error> {
            let mut conn = pool(&self.url).get().await.expect("checkout");
            self.locker.lock_tx(&mut conn).err()
        }
    }

    async fn pid(conn: &mut AsyncPgConnection) -> Result<i32, Error> {
        let row: Pid = ::diesel::sql_query(PID).get_result(conn).await?;
        Ok(row.pid)
    }

    impl AsyncStack for Locker {
        async fn increment(tx: &mut LockTx<'_>, row: i64) -> Result<(), Error> {
            let got: N = ::diesel::sql_query(format!("SELECT n FROM {COUNTERS} WHERE id = $1"))
                .bind::<BigInt, _>(row)
                .get_result(tx.conn())
                .await?;
            ::diesel::sql_query(format!("UPDATE {COUNTERS} SET n = $2 WHERE id = $1"))
                .bind::<BigInt, _>(row)
                .bind::<BigInt, _>(got.n + 1)
                .execute(tx.conn())
                .await?;
            Ok(())
        }

        async fn execute(tx: &mut LockTx<'_>, sql: &'static str) -> Result<(), Error> {
            ::diesel::sql_query(sql).execute(tx.conn()).await?;
            Ok(())
        }
    }

    async fn worker(pool: PgPool, mut conn: Object<AsyncPgConnection>, locker: Locker, ctx: Ctx) {
        while let Some(cmd) = ctx.next().await {
            match cmd {
                Cmd::Begin(reply) => {
                    let pending = Pending::default();
                    let (locker, ctx2, pending2) = (&locker, ctx.clone(), Arc::clone(&pending));
                    let conn = &mut *conn;
                    let transaction = async move {
                        let result = conn
                            .transaction::<(), Error, _>(async move |c| {
                                let mut tx = locker.lock_tx(c)?;
                                let _ = reply.send(Ok(()));
                                let fin = serve_in_closure_savepoints(&mut tx, &ctx2).await;
                                park(fin, &pending2)
                            })
                            .await;
                        unpark(result, &pending);
                    };
                    ctx.run_droppable(transaction).await;
                }
                Cmd::Ping(reply) => {
                    // The next use of a pooled connection is a checkout:
                    // deadpool recycles it, and discards it if a dropped
                    // transaction left it open.
                    drop(conn);
                    conn = pool.get().await.expect("checkout");
                    let _ = reply.send(pid(&mut conn).await);
                }
                Cmd::Prepared(reply) => {
                    let prepared = ::diesel::sql_query(LOCKKIT_PREPARED)
                        .get_result::<N>(&mut *conn)
                        .await;
                    let _ = reply.send(prepared.map(|row| row.n).map_err(Error::from));
                }
                other => misplaced(other),
            }
        }
    }
}

/// Blocking Diesel: a `PgConnection` owned by a thread of its own, which
/// runs each transaction in `Locker::transaction` and its savepoints in
/// `LockTx::savepoint`, receiving the test's commands over the channel
/// while the transaction stays open.
pub(crate) mod with_diesel {
    use super::*;
    use ::diesel::sql_types::BigInt;
    use ::diesel::{sql_query, Connection, PgConnection, RunQueryDsl};
    use lockkit_diesel::{LockTx, Locker};

    use super::diesel_rows::{report_statements, Pid, N, PID, STATEMENTS};

    pub(crate) struct Diesel {
        url: String,
        locker: Locker,
    }

    fn connect(url: &str) -> PgConnection {
        PgConnection::establish(url).expect("diesel connects")
    }

    impl Adapter for Diesel {
        const NAME: &'static str = "diesel";
        const ID: i64 = 3;
        const CANCEL: Option<Cancel> = None;
        const STATEMENT_EVENTS: Option<&'static str> = Some(STATEMENTS);

        async fn open(db: &TestServer, config: Config, _sessions: usize) -> Self {
            let url = db.url().to_string();
            tokio::task::spawn_blocking(move || {
                let locker = Locker::new(&mut connect(&url), config).expect("locker");
                Diesel { url, locker }
            })
            .await
            .expect("open")
        }

        async fn session(&self) -> Session {
            let (tx, ctx) = Session::channel();
            let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
            let (url, locker) = (self.url.clone(), self.locker.clone());
            // The thread reports to the test's `tracing` subscriber, as a
            // task on the test's thread would.
            let dispatch = tracing::dispatcher::get_default(tracing::Dispatch::clone);
            let thread = std::thread::spawn(move || {
                let _reporting = tracing::dispatcher::set_default(&dispatch);
                let mut conn = connect(&url);
                conn.set_instrumentation(report_statements());
                let _ = pid_tx.send(pid(&mut conn).expect("pid"));
                worker(&mut conn, &locker, &ctx);
            });
            let pid = pid_rx.await.expect("the session's thread connects");
            Session::new(tx, pid, Worker::Thread(thread))
        }

        async fn lock_outside_transaction(&self) -> Option<Error> {
            let (url, locker) = (self.url.clone(), self.locker.clone());
            tokio::task::spawn_blocking(move || locker.lock_tx(&mut connect(&url)).err())
                .await
                .expect("lock_tx")
        }
    }

    fn pid(conn: &mut PgConnection) -> Result<i32, Error> {
        let row: Pid = sql_query(PID).get_result(conn)?;
        Ok(row.pid)
    }

    fn increment(tx: &mut LockTx<'_>, row: i64) -> Result<(), Error> {
        let got: N = sql_query(format!("SELECT n FROM {COUNTERS} WHERE id = $1"))
            .bind::<BigInt, _>(row)
            .get_result(tx.conn())?;
        sql_query(format!("UPDATE {COUNTERS} SET n = $2 WHERE id = $1"))
            .bind::<BigInt, _>(row)
            .bind::<BigInt, _>(got.n + 1)
            .execute(tx.conn())?;
        Ok(())
    }

    fn execute(tx: &mut LockTx<'_>, sql: &'static str) -> Result<(), Error> {
        sql_query(sql).execute(tx.conn())?;
        Ok(())
    }

    fn worker(conn: &mut PgConnection, locker: &Locker, ctx: &Ctx) {
        while let Some(cmd) = ctx.next_blocking() {
            match cmd {
                Cmd::Begin(reply) => {
                    let pending = Pending::default();
                    let result = locker.transaction(conn, |tx| {
                        let _ = reply.send(Ok(()));
                        park(serve(tx, ctx), &pending)
                    });
                    unpark(result, &pending);
                }
                Cmd::Ping(reply) => {
                    let _ = reply.send(pid(conn));
                }
                Cmd::Prepared(reply) => {
                    let prepared = sql_query(LOCKKIT_PREPARED).get_result::<N>(conn);
                    let _ = reply.send(prepared.map(|row| row.n).map_err(Error::from));
                }
                other => misplaced(other),
            }
        }
    }

    fn serve(tx: &mut LockTx<'_>, ctx: &Ctx) -> Fin {
        while let Some(cmd) = ctx.next_blocking() {
            match cmd {
                Cmd::Op(op, reply) => {
                    let _ = reply.send(exec_op!(&mut *tx, op, increment, execute,));
                }
                Cmd::Savepoint(reply) => {
                    let pending = Pending::default();
                    let result = tx.savepoint(|sp| {
                        let _ = reply.send(Ok(()));
                        park(serve(sp, ctx), &pending)
                    });
                    unpark(result, &pending);
                }
                Cmd::End(End::Commit, r) => return Fin::Commit(r),
                Cmd::End(End::Rollback, r) => return Fin::Rollback(r),
                // A blocking closure cannot be abandoned half-way: its only
                // way out other than returning is unwinding (End::Panic).
                Cmd::End(End::Drop, r) => drop(r.send(Err(Error::other(
                    "conformance: a Diesel transaction cannot be dropped unfinished",
                )))),
                Cmd::End(End::Panic, _) => panic!("{PANIC}"),
                other => misplaced(other),
            }
        }
        Fin::Closed
    }
}
