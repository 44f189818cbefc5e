//! A batch takes its keys one at a time in the global lock order
//! (docs/KEYS.md: `BigInt` keys ascending, then `Pair` keys ascending), each
//! granted before the next is asked for: what makes batches deadlock-free.
//! The conformance suite shows it statistically (thousands of random
//! batches, no deadlock); here it is seen directly in `pg_locks`, for each
//! of the engine's batch statements. With the middle key held by another
//! session, the batch holds the keys before it, waits for it, and has not
//! touched the keys after it.

use lockkit::driver::sql;
use lockkit::{Batch, Config, LockClient, LockKey, Mode};
use lockkit_tests::TestServer;
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;

use crate::common::{advisory_rows, backend_pid, held_by, locker, wait_until_waiting};

/// Keys of this file only: no other test of the binary locks them.
const BIGINT: i64 = 0x6f72_6465_7200_0000;
const CLASS: i32 = 0x6f72_6465;

fn big(i: i64) -> LockKey {
    LockKey::BigInt(BIGINT + i)
}

fn pair(i: i32) -> LockKey {
    LockKey::Pair(CLASS, i)
}

/// Takes `key` exclusive in a transaction of `client`'s, kept open.
async fn hold(client: &mut Client, key: LockKey) -> tokio_postgres::Transaction<'_> {
    let tx = client.transaction().await.expect("begin");
    let locked = match key {
        LockKey::BigInt(k) => {
            tx.execute("SELECT pg_advisory_xact_lock($1::int8)", &[&k])
                .await
        }
        LockKey::Pair(c, o) => {
            tx.execute(
                "SELECT pg_advisory_xact_lock($1::int4, $2::int4)",
                &[&c, &o],
            )
            .await
        }
    };
    locked.expect("the blocker locks");
    tx
}

/// What backend `pid` holds of `keys` while it waits, and how many advisory
/// rows (granted or waiting) it has then.
async fn seen_while_waiting(observer: &Client, pid: i32, keys: &[LockKey]) -> (Vec<bool>, i64) {
    wait_until_waiting(observer, pid).await;
    let mut held = Vec::with_capacity(keys.len());
    for &key in keys {
        held.push(held_by(observer, pid, key).await);
    }
    (held, advisory_rows(observer, pid).await)
}

/// Locks `keys` (given out of order) in one `lock_batch` while another
/// session holds `blocked`, and returns what the batch held while it waited
/// (in the global order of `keys`) and its advisory rows then.
async fn batch_while_blocked(
    db: &TestServer,
    keys: &[(LockKey, Mode)],
    blocked: LockKey,
) -> (Vec<bool>, i64) {
    let observer = db.connect().await;
    let mut blocker = db.connect().await;
    let client = db.connect().await;
    let locker = locker(&client, Config::default()).await;
    let mut client = LockClient::new(&locker, client);
    let pid = backend_pid(&client).await;
    let mut batch = Batch::new();
    for &(key, mode) in keys.iter().rev() {
        batch.add_key(key, mode);
    }
    let ordered: Vec<LockKey> = batch.planned().into_iter().map(|(k, _)| k).collect();

    let held_elsewhere = hold(&mut blocker, blocked).await;
    let tx = client.begin().await.expect("begin");
    let (locked, seen) = tokio::join!(tx.lock_batch(&batch), async {
        let seen = seen_while_waiting(&observer, pid, &ordered).await;
        held_elsewhere.commit().await.expect("the blocker lets go");
        seen
    });
    let locked = locked.expect("the batch is granted once the blocker lets go");
    for &key in &ordered {
        assert!(
            held_by(&observer, pid, key).await,
            "{key:?} held after the batch"
        );
    }
    drop(locked);
    tx.rollback().await.expect("rollback");
    seen
}

/// The keys before the blocked one, held; the blocked one awaited; nothing
/// after it asked for.
fn in_order(seen: &(Vec<bool>, i64), blocked_at: usize) {
    let (held, rows) = seen;
    let expected: Vec<bool> = (0..held.len()).map(|i| i < blocked_at).collect();
    assert_eq!(
        held, &expected,
        "keys held while waiting for key {blocked_at}"
    );
    assert_eq!(*rows, blocked_at as i64 + 1, "advisory rows while waiting");
}

#[tokio::test]
async fn an_exclusive_bigint_batch_takes_its_keys_in_order() {
    let db = TestServer::shared();
    let _log = db.guard();
    let keys = [
        (big(1), Mode::Exclusive),
        (big(2), Mode::Exclusive),
        (big(3), Mode::Exclusive),
    ];
    in_order(&batch_while_blocked(db, &keys, big(2)).await, 1);
}

#[tokio::test]
async fn a_mixed_mode_bigint_batch_takes_its_keys_in_order() {
    let db = TestServer::shared();
    let _log = db.guard();
    let keys = [
        (big(11), Mode::Shared),
        (big(12), Mode::Exclusive),
        (big(13), Mode::Shared),
        (big(14), Mode::Exclusive),
    ];
    in_order(&batch_while_blocked(db, &keys, big(13)).await, 2);
}

#[tokio::test]
async fn an_exclusive_pair_batch_takes_its_keys_in_order() {
    let db = TestServer::shared();
    let _log = db.guard();
    let keys = [
        (pair(21), Mode::Exclusive),
        (pair(22), Mode::Exclusive),
        (pair(23), Mode::Exclusive),
    ];
    in_order(&batch_while_blocked(db, &keys, pair(22)).await, 1);
}

#[tokio::test]
async fn a_mixed_mode_pair_batch_takes_its_keys_in_order() {
    let db = TestServer::shared();
    let _log = db.guard();
    let keys = [
        (pair(31), Mode::Exclusive),
        (pair(32), Mode::Shared),
        (pair(33), Mode::Exclusive),
    ];
    in_order(&batch_while_blocked(db, &keys, pair(32)).await, 1);
}

/// `BigInt` keys before `Pair` keys: the pair statement, pipelined behind
/// the bigint one, runs only once every bigint key is granted.
#[tokio::test]
async fn bigint_keys_come_before_pair_keys() {
    let db = TestServer::shared();
    let _log = db.guard();
    let keys = [
        (big(41), Mode::Exclusive),
        (big(42), Mode::Exclusive),
        (pair(-41), Mode::Exclusive),
        (pair(42), Mode::Shared),
    ];
    in_order(&batch_while_blocked(db, &keys, big(42)).await, 1);
}

/// The control: the same observation of lockkit's batch statement sent by
/// hand with its keys in reverse order sees the key after the blocked one
/// held, and the one before it not, so the assertions above can fail.
#[tokio::test]
async fn control_a_batch_in_reverse_order_is_seen_out_of_order() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let mut blocker = db.connect().await;
    let mut client = db.connect().await;
    let pid = backend_pid(&client).await;
    let ordered = [big(51), big(52), big(53)];
    let reversed: Vec<i64> = ordered
        .iter()
        .rev()
        .map(|k| match k {
            LockKey::BigInt(k) => *k,
            LockKey::Pair(..) => unreachable!(),
        })
        .collect();

    let held_elsewhere = hold(&mut blocker, big(52)).await;
    let tx = client.transaction().await.expect("begin");
    let params: [&(dyn ToSql + Sync); 1] = [&reversed];
    let (locked, seen) = tokio::join!(tx.query_one(sql::BATCH_BIGINT_EXCLUSIVE, &params), async {
        let seen = seen_while_waiting(&observer, pid, &ordered).await;
        held_elsewhere.commit().await.expect("the blocker lets go");
        seen
    });
    locked.expect("the hand-sent batch is granted");
    tx.rollback().await.expect("rollback");
    assert_eq!(seen.0, vec![false, false, true], "reverse order, seen");
    assert_eq!(seen.1, 2, "advisory rows while waiting");
}
