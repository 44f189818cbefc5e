//! What the tokio-postgres test binaries (`lockkit` and `session`) share
//! besides the observer's questions ([`crate::observe`]): a locker for a
//! client's server, a client's backend pid, the check that a call was
//! refused on a hot standby, a pool, this process's next tokio-postgres
//! statement name, a key held in another session's transaction, and a
//! step bounded against a hang.

use std::future::Future;
use std::time::Duration;

use lockkit::{Config, Error, ErrorKind, LockKey, Locker};
use tokio_postgres::Client;

/// How long [`bounded`] lets a step run: far above any step's time on a
/// loaded 2-core machine, and far below CI's budget.
pub const HANG_GUARD: Duration = Duration::from_secs(150);

/// Awaits `step`, failing the test with `what` if it has not ended within
/// [`HANG_GUARD`]: a step that hangs then fails its test, named, instead
/// of stalling the whole run. A guard against a hang, no timing claim.
///
/// # Panics
///
/// If `step` runs longer than [`HANG_GUARD`].
///
/// # Cancel safety
///
/// As cancel safe as `step`: dropping the future drops `step`.
pub async fn bounded<T>(what: &str, step: impl Future<Output = T>) -> T {
    match tokio::time::timeout(HANG_GUARD, step).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: still running after {HANG_GUARD:?}, a hang"),
    }
}

/// A locker for `client`'s server with `config`.
///
/// # Panics
///
/// If the locker cannot read the server's facts.
pub async fn locker(client: &Client, config: Config) -> Locker {
    Locker::new(client, config).await.expect("locker")
}

/// The backend pid of `client`'s session.
///
/// # Panics
///
/// If the query fails.
pub async fn backend_pid(client: &Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pg_backend_pid")
        .get(0)
}

/// Asserts that `result` is lockkit's refusal on a hot standby
/// ([`ErrorKind::HotStandby`]); `what` names the call in the message.
///
/// # Panics
///
/// If it is not.
pub fn assert_standby<T>(result: Result<T, Error>, what: &str) {
    match result {
        Err(e) if e.kind() == ErrorKind::HotStandby => {}
        Err(other) => panic!("{what}: expected HotStandby, got {other}"),
        Ok(_) => panic!("{what}: expected HotStandby, got Ok"),
    }
}

/// A deadpool-postgres pool of at most `size` connections made from
/// `config` in plain text, recycled without a round trip.
///
/// # Panics
///
/// If the pool cannot be built.
pub fn pool_of(config: tokio_postgres::Config, size: usize) -> deadpool_postgres::Pool {
    use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
    let manager = Manager::from_config(
        config,
        tokio_postgres::NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager).max_size(size).build().expect("pool")
}

/// The number `n` of the name `s<n>` under which this process's next
/// tokio-postgres statement will be prepared: tokio-postgres counts its
/// statement names per process, so a test can leave another process's
/// statements of exactly those names on a pooler's server connections.
/// Learned by preparing a statement on `client` (a direct connection),
/// which uses up one name.
///
/// # Panics
///
/// If the statement cannot be prepared or found.
pub async fn next_statement_name(client: &Client) -> usize {
    const PROBE: &str = "SELECT 'lockkit-tests: the next statement name'";
    let _probe = client.prepare(PROBE).await.expect("prepare");
    let row = client
        .query_typed_one(
            "SELECT name FROM pg_prepared_statements WHERE statement = $1",
            &[(&PROBE, tokio_postgres::types::Type::TEXT)],
        )
        .await
        .expect("the statement's name");
    let name: String = row.get(0);
    name.trim_start_matches('s').parse::<usize>().expect("sN") + 1
}

/// The statement that takes `key`'s transaction-scoped exclusive lock,
/// either kind of key, with the key written in as literals.
pub fn xact_lock_sql(key: LockKey) -> String {
    match key {
        LockKey::BigInt(k) => format!("SELECT pg_advisory_xact_lock({k})"),
        LockKey::Pair(a, b) => format!("SELECT pg_advisory_xact_lock({a}, {b})"),
    }
}

/// Begins a transaction on `client` and takes `keys` in it, in that order:
/// another session holds them, the way a test needs a key busy, until
/// `client` ends its transaction.
///
/// # Panics
///
/// If a statement fails.
pub async fn hold_in_transaction(client: &Client, keys: impl IntoIterator<Item = LockKey>) {
    let mut sql = String::from("BEGIN");
    for key in keys {
        sql.push_str("; ");
        sql.push_str(&xact_lock_sql(key));
    }
    client
        .batch_execute(&sql)
        .await
        .expect("the holder's transaction and its locks");
}

/// A fencing token minted in SQL (`lockkit.fencing_token()`), as any other
/// client of the server mints one.
///
/// # Panics
///
/// If the function is not installed or fails.
pub async fn fencing_token_from_sql(client: &Client) -> lockkit::fencing::FencingToken {
    client
        .query_one("SELECT lockkit.fencing_token()::text", &[])
        .await
        .expect("lockkit.fencing_token()")
        .get::<_, String>(0)
        .parse()
        .expect("a token")
}
