//! The statements of lockkit's [`sql`] run through Diesel, and Diesel's
//! transaction state.
//!
//! Diesel's `sql_query` loads rows by column name, and several of lockkit's
//! statements have unnamed or repeated columns, so the ones that return rows
//! are wrapped as `SELECT * FROM (<statement>) AS lockkit(<names>)`: the
//! statement itself is lockkit's, unchanged.

use std::num::NonZeroU32;
use std::sync::LazyLock;

use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::sql_types::{Array, BigInt, Bool, Integer, Text};
use diesel::{sql_query, PgConnection, QueryResult, QueryableByName, RunQueryDsl};
use lockkit::driver::{sql, Plan, HASHTEXT_PROBES};
use lockkit::{LockKey, ServerFacts};

fn named(statement: &str, columns: &str) -> String {
    format!("SELECT * FROM ({statement}) AS lockkit({columns})")
}

static FACTS: LazyLock<String> = LazyLock::new(|| {
    named(
        sql::SERVER_FACTS,
        "max_locks, in_recovery, version_num, hashes, backend_pid",
    )
});
static TRY_BIGINT: LazyLock<String> = LazyLock::new(|| named(sql::TRY_BIGINT, "ok"));
static TRY_BIGINT_SHARED: LazyLock<String> = LazyLock::new(|| named(sql::TRY_BIGINT_SHARED, "ok"));
static TRY_PAIR: LazyLock<String> = LazyLock::new(|| named(sql::TRY_PAIR, "ok"));
static TRY_PAIR_SHARED: LazyLock<String> = LazyLock::new(|| named(sql::TRY_PAIR_SHARED, "ok"));
static TRY_BATCH_BIGINT: LazyLock<String> = LazyLock::new(|| named(sql::TRY_BATCH_BIGINT, "busy"));
static TRY_BATCH_PAIR: LazyLock<String> =
    LazyLock::new(|| named(sql::TRY_BATCH_PAIR, "busy_class, busy_object"));
/// [`sql::SAVEPOINT`] and [`sql::SAVE_TIMEOUTS`] in one round trip.
static OPEN_TIMEOUT: LazyLock<String> =
    LazyLock::new(|| format!("{}; {}", sql::SAVEPOINT, sql::SAVE_TIMEOUTS));
/// [`sql::RESTORE_TIMEOUTS`] and [`sql::RELEASE`] in one round trip.
static CLOSE_TIMEOUT: LazyLock<String> =
    LazyLock::new(|| format!("{}; {}", sql::RESTORE_TIMEOUTS, sql::RELEASE));

#[derive(QueryableByName)]
struct FactsRow {
    #[diesel(sql_type = Integer)]
    max_locks: i32,
    #[diesel(sql_type = Bool)]
    in_recovery: bool,
    #[diesel(sql_type = Integer)]
    version_num: i32,
    #[diesel(sql_type = Array<Integer>)]
    hashes: Vec<i32>,
}

#[derive(QueryableByName)]
struct MessagesRow {
    #[diesel(sql_type = Text)]
    lc_messages: String,
}

#[derive(QueryableByName)]
struct TryRow {
    #[diesel(sql_type = Bool)]
    ok: bool,
}

#[derive(QueryableByName)]
struct BusyBigint {
    #[diesel(sql_type = Array<BigInt>)]
    busy: Vec<i64>,
}

#[derive(QueryableByName)]
struct BusyPair {
    #[diesel(sql_type = Array<Integer>)]
    busy_class: Vec<i32>,
    #[diesel(sql_type = Array<Integer>)]
    busy_object: Vec<i32>,
}

/// The server facts, learned with [`sql::SERVER_FACTS`].
pub(crate) fn server_facts(conn: &mut PgConnection) -> QueryResult<ServerFacts> {
    let probes: Vec<&str> = HASHTEXT_PROBES.to_vec();
    let row: FactsRow = sql_query(FACTS.as_str())
        .bind::<Array<Text>, _>(probes)
        .get_result(conn)?;
    Ok(ServerFacts::new(
        row.max_locks,
        row.in_recovery,
        row.version_num,
        &row.hashes,
    ))
}

/// Whether the server reports errors in English, which the error mapping
/// needs (Diesel hides the SQLSTATE).
pub(crate) fn english_messages(conn: &mut PgConnection) -> QueryResult<bool> {
    let row: MessagesRow =
        sql_query("SELECT current_setting('lc_messages') AS lc_messages").get_result(conn)?;
    let lc = row.lc_messages.to_ascii_lowercase();
    Ok(lc.is_empty() || lc == "c" || lc == "posix" || lc.starts_with("c.") || lc.starts_with("en"))
}

/// Diesel's transaction depth on `conn`: 0 outside a transaction, 1 in
/// `conn.transaction(…)`, 2 in a nested one (a savepoint), ….
///
/// # Errors
///
/// Diesel's `BrokenTransactionManager` when its transaction manager is in
/// error (after a failed `COMMIT` or `ROLLBACK`).
pub(crate) fn transaction_depth(conn: &mut PgConnection) -> QueryResult<u32> {
    // `TransactionManagerStatus::transaction_depth` is public and documented;
    // its accessor is the only way to it (`#[doc(hidden)]` unless Diesel's
    // third-party-backend feature is on). Kept to this one call.
    let status =
        <AnsiTransactionManager as TransactionManager<PgConnection>>::transaction_manager_status_mut(
            conn,
        );
    Ok(status.transaction_depth()?.map_or(0, NonZeroU32::get))
}

/// Opens a transaction (depth 0) or a savepoint, as `conn.transaction` does.
pub(crate) fn begin(conn: &mut PgConnection) -> QueryResult<()> {
    <AnsiTransactionManager as TransactionManager<PgConnection>>::begin_transaction(conn)
}

/// Commits the innermost transaction or savepoint, as `conn.transaction` does.
pub(crate) fn commit(conn: &mut PgConnection) -> QueryResult<()> {
    <AnsiTransactionManager as TransactionManager<PgConnection>>::commit_transaction(conn)
}

/// Rolls back the innermost transaction or savepoint, as `conn.transaction`
/// does.
pub(crate) fn rollback(conn: &mut PgConnection) -> QueryResult<()> {
    <AnsiTransactionManager as TransactionManager<PgConnection>>::rollback_transaction(conn)
}

/// Sends the lock statements of a non-empty plan: `BigInt` keys first, then
/// `Pair` keys (two statements, in that order, when the plan has both).
pub(crate) fn lock_plan(conn: &mut PgConnection, plan: &Plan) -> QueryResult<()> {
    match (plan.bigint(), plan.pair_classes()) {
        ([key], []) => {
            let stmt = if plan.bigint_shared()[0] {
                sql::LOCK_BIGINT_SHARED
            } else {
                sql::LOCK_BIGINT
            };
            sql_query(stmt).bind::<BigInt, _>(*key).execute(conn)?;
        }
        ([], [class]) => {
            let stmt = if plan.pair_shared()[0] {
                sql::LOCK_PAIR_SHARED
            } else {
                sql::LOCK_PAIR
            };
            sql_query(stmt)
                .bind::<Integer, _>(*class)
                .bind::<Integer, _>(plan.pair_objects()[0])
                .execute(conn)?;
        }
        (bigint, pair) => {
            if !bigint.is_empty() {
                sql_query(sql::BATCH_BIGINT)
                    .bind::<Array<BigInt>, _>(bigint)
                    .bind::<Array<Bool>, _>(plan.bigint_shared())
                    .execute(conn)?;
            }
            if !pair.is_empty() {
                sql_query(sql::BATCH_PAIR)
                    .bind::<Array<Integer>, _>(pair)
                    .bind::<Array<Integer>, _>(plan.pair_objects())
                    .bind::<Array<Bool>, _>(plan.pair_shared())
                    .execute(conn)?;
            }
        }
    }
    Ok(())
}

/// Sends a plan under `setting` (see [`sql::timeout_setting`]) inside
/// lockkit's savepoint, restoring the caller's timeouts after. On an error
/// the caller rolls back with [`sql::ROLLBACK`].
pub(crate) fn lock_plan_timeout(
    conn: &mut PgConnection,
    plan: &Plan,
    setting: &str,
) -> QueryResult<()> {
    conn.batch_execute(&OPEN_TIMEOUT)?;
    sql_query(sql::SET_TIMEOUTS)
        .bind::<Text, _>(setting)
        .execute(conn)?;
    lock_plan(conn, plan)?;
    conn.batch_execute(&CLOSE_TIMEOUT)
}

/// Undoes lockkit's savepoint after a failure ([`sql::ROLLBACK`]).
pub(crate) fn rollback_acquire(conn: &mut PgConnection) -> QueryResult<()> {
    conn.batch_execute(sql::ROLLBACK)
}

/// Tries the single key of `plan`; nothing to undo when it is busy.
pub(crate) fn try_one(conn: &mut PgConnection, plan: &Plan) -> QueryResult<bool> {
    let row: TryRow = match (plan.bigint(), plan.pair_classes()) {
        ([key], _) => {
            let stmt = if plan.bigint_shared()[0] {
                &TRY_BIGINT_SHARED
            } else {
                &TRY_BIGINT
            };
            sql_query(stmt.as_str())
                .bind::<BigInt, _>(*key)
                .get_result(conn)?
        }
        (_, [class]) => {
            let stmt = if plan.pair_shared()[0] {
                &TRY_PAIR_SHARED
            } else {
                &TRY_PAIR
            };
            sql_query(stmt.as_str())
                .bind::<Integer, _>(*class)
                .bind::<Integer, _>(plan.pair_objects()[0])
                .get_result(conn)?
        }
        _ => unreachable!("try_one is called with exactly one key"),
    };
    Ok(row.ok)
}

/// Tries every key of `plan` inside lockkit's savepoint; releases it when
/// all were granted, rolls it back (releasing every granted key) otherwise.
/// Returns the busy keys. On an error the caller rolls back with
/// [`sql::ROLLBACK`].
pub(crate) fn try_many(conn: &mut PgConnection, plan: &Plan) -> QueryResult<Vec<LockKey>> {
    conn.batch_execute(sql::SAVEPOINT)?;
    let mut busy = Vec::new();
    if !plan.bigint().is_empty() {
        let row: BusyBigint = sql_query(TRY_BATCH_BIGINT.as_str())
            .bind::<Array<BigInt>, _>(plan.bigint())
            .bind::<Array<Bool>, _>(plan.bigint_shared())
            .get_result(conn)?;
        busy.extend(row.busy.into_iter().map(LockKey::BigInt));
    }
    if !plan.pair_classes().is_empty() {
        let row: BusyPair = sql_query(TRY_BATCH_PAIR.as_str())
            .bind::<Array<Integer>, _>(plan.pair_classes())
            .bind::<Array<Integer>, _>(plan.pair_objects())
            .bind::<Array<Bool>, _>(plan.pair_shared())
            .get_result(conn)?;
        busy.extend(
            row.busy_class
                .into_iter()
                .zip(row.busy_object)
                .map(|(c, o)| LockKey::Pair(c, o)),
        );
    }
    if busy.is_empty() {
        conn.batch_execute(sql::RELEASE)?;
    } else {
        conn.batch_execute(sql::ROLLBACK)?;
    }
    Ok(busy)
}
