//! Helpers shared by the lockkit integration tests.

use lockkit::{AdvisoryKey, Config, LockKey, Locker};
use tokio_postgres::Client;

/// A key type for tests: a plain `i64` id.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Item {
    pub(crate) id: i64,
}

/// A locker for `client`'s server with `config`.
pub(crate) async fn locker(client: &Client, config: Config) -> Locker {
    Locker::new(client, config).await.expect("locker")
}

/// Whether a second session sees `key` granted to some other backend, per
/// `pg_locks`.
pub(crate) async fn granted_elsewhere(observer: &Client, key: LockKey) -> bool {
    let id = key.to_pg_locks();
    let row = observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = $1 AND objid = $2 AND objsubid = $3 AND pid <> pg_backend_pid()",
            &[&id.classid, &id.objid, &id.objsubid],
        )
        .await
        .expect("pg_locks");
    row.get::<_, i64>(0) > 0
}

/// The backend pid of `client`'s session.
pub(crate) async fn backend_pid(client: &Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pg_backend_pid")
        .get(0)
}

/// Whether backend `pid` holds `key` (granted, in any mode), per `pg_locks`
/// as seen by `observer`.
pub(crate) async fn held_by(observer: &Client, pid: i32, key: LockKey) -> bool {
    let id = key.to_pg_locks();
    let row = observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = $1 AND objid = $2 AND objsubid = $3 AND pid = $4",
            &[&id.classid, &id.objid, &id.objsubid, &pid],
        )
        .await
        .expect("pg_locks");
    row.get::<_, i64>(0) > 0
}

/// The advisory-lock rows of backend `pid` in `pg_locks`, granted or
/// waiting.
pub(crate) async fn advisory_rows(observer: &Client, pid: i32) -> i64 {
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1",
            &[&pid],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// Waits (up to 30 s, else panics) until backend `pid` waits for an
/// advisory lock.
pub(crate) async fn wait_until_waiting(observer: &Client, pid: i32) {
    wait_for(observer, pid, None).await;
}

async fn wait_for(observer: &Client, pid: i32, key: Option<LockKey>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let done = match key {
            Some(key) => held_by(observer, pid, key).await,
            None => {
                observer
                    .query_one(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                     AND NOT granted AND pid = $1",
                        &[&pid],
                    )
                    .await
                    .expect("pg_locks")
                    .get::<_, i64>(0)
                    > 0
            }
        };
        if done {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "backend {pid} never reached the expected lock state ({key:?})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// `keys` sorted by their lock keys (the global lock order).
pub(crate) fn sorted<K: AdvisoryKey>(mut keys: Vec<K>) -> Vec<K> {
    keys.sort_by_key(|k| k.lock_key());
    keys
}
