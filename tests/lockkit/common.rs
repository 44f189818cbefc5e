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
