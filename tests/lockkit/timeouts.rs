//! Waiting with a bound: timeouts (per call and per batch), deadlocks inside
//! them, try-locks, and `lockkit::retry` on a real deadlock.

use std::time::Duration;

use lockkit::{AdvisoryKey, Batch, Config, Error, LockKey, LockTx, Mode, OrderCheck, RetryPolicy};
use lockkit_tests::TestServer;
use tokio::sync::Barrier;
use tokio_postgres::Client;

use crate::common::{advisory_rows, backend_pid, held_by, locker, sorted, wait_until_waiting};

/// This module's keys, in a namespace of their own.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.timeouts")]
struct Key {
    id: i64,
}

/// The bound given to timeout calls on keys nobody holds, which must
/// succeed: it also bounds the statement (`statement_timeout`), so it is
/// far above any scheduling delay.
const NO_WAIT: Duration = Duration::from_secs(30);

fn keys(ids: std::ops::Range<i64>) -> Vec<Key> {
    sorted(ids.map(|id| Key { id }).collect())
}

async fn timeouts(tx: &LockTx<'_>) -> (String, String) {
    let row = tx
        .query_one(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test(flavor = "multi_thread")]
async fn lock_timeout_keeps_the_transaction_and_the_callers_settings() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    let caller = ("7s".to_owned(), "9s".to_owned());

    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock(Key { id: 1 }).await.unwrap();

    let tx = locker.begin(&mut b).await.unwrap();
    tx.batch_execute("SET LOCAL lock_timeout = '7s'; SET LOCAL statement_timeout = '9s'")
        .await
        .unwrap();
    let _ = tx.lock(Key { id: 2 }).await.unwrap();
    let err = tx
        .lock_timeout(Key { id: 1 }, Duration::from_millis(150))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "expected a timeout, got {err}");
    assert_eq!(err.timeout(), Some(Duration::from_millis(150)));
    assert!(err.to_string().contains("1 advisory lock"), "{err}");
    assert!(err.is_timeout() && err.is_transient());
    assert!(
        matches!(err.code(), Some("55P03" | "57014")),
        "{:?}",
        err.code()
    );
    assert_eq!(timeouts(&tx).await, caller, "restored after a timeout");
    assert!(!held_by(&observer, pid, Key { id: 1 }.lock_key()).await);
    assert_eq!(
        advisory_rows(&observer, pid).await,
        1,
        "only key 2, nothing waits"
    );
    assert_eq!(tx.held_count(), 1);

    // Usable: a shared timeout call and an ordinary lock both work. (A
    // free key: the timeout is only a bound, generous so that a descheduled
    // backend on a loaded machine cannot trip it.)
    let got = tx
        .lock_shared_timeout(Key { id: 3 }, NO_WAIT)
        .await
        .unwrap();
    assert_eq!(got.mode(), Mode::Shared);
    assert_eq!(timeouts(&tx).await, caller, "restored after success");
    let _ = tx.lock(Key { id: 4 }).await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 3);

    // And once the holder is gone, the same call succeeds.
    holder.rollback().await.unwrap();
    let _ = tx.lock_timeout(Key { id: 1 }, NO_WAIT).await.unwrap();
    assert_eq!(timeouts(&tx).await, caller);
    tx.commit().await.unwrap();
}

/// Holds each of `keys` in a transaction of its own client.
async fn hold<'c>(
    locker: &lockkit::Locker,
    clients: &'c mut [Client],
    keys: &[Key],
) -> Vec<LockTx<'c>> {
    let mut holders = Vec::new();
    for (client, key) in clients.iter_mut().zip(keys) {
        let tx = locker.begin(client).await.unwrap();
        let _ = tx.lock(*key).await.unwrap();
        holders.push(tx);
    }
    holders
}

/// Once `pid` waits, releases the holders one by one, `gap` apart.
async fn release_in_turn(observer: &Client, pid: i32, holders: Vec<LockTx<'_>>, gap: Duration) {
    wait_until_waiting(observer, pid).await;
    for (i, holder) in holders.into_iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(gap).await;
        }
        holder.commit().await.unwrap();
    }
}

/// Five keys, each released 400 ms after the previous one, once the batch is
/// seen waiting: the batch as a whole waits at least 4 × 400 = 1,600 ms,
/// more than its 1,500 ms timeout whatever the load (delays only lengthen
/// it), so it fails. The control shows per-key timeouts of the same length
/// would not: each key waits one gap (400 ms) plus a commit, which leaves
/// 1,100 ms of margin for scheduling delays on a loaded 2-core machine.
#[tokio::test(flavor = "multi_thread")]
async fn batch_timeout_bounds_the_whole_batch() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let mut clients = Vec::new();
    for _ in 0..5 {
        clients.push(db.connect().await);
    }
    let pid = backend_pid(&b).await;
    let locker = locker(&b, Config::default().order_check(OrderCheck::Warn)).await;
    let keys = keys(10..15);
    let batch: Batch = keys.iter().copied().collect();
    assert_eq!(
        batch.planned().iter().map(|(k, _)| *k).collect::<Vec<_>>(),
        keys.iter().map(|k| k.lock_key()).collect::<Vec<_>>(),
        "the holders release in acquisition order"
    );
    let gap = Duration::from_millis(400);
    let timeout = Duration::from_millis(1500);

    let holders = hold(&locker, &mut clients, &keys).await;
    let tx = locker.begin(&mut b).await.unwrap();
    let (result, ()) = tokio::join!(
        tx.lock_batch_timeout(&batch, timeout),
        release_in_turn(&observer, pid, holders, gap)
    );
    let err = result.unwrap_err();
    assert!(
        err.is_timeout()
            && err.timeout() == Some(timeout)
            && err.to_string().contains("5 advisory"),
        "{err}"
    );
    // Every holder is gone now: whatever the batch was granted before the
    // timeout would still show unless the savepoint rollback released it.
    assert_eq!(advisory_rows(&observer, pid).await, 0);
    assert_eq!(tx.held_count(), 0);
    let _ = tx.lock_batch_timeout(&batch, timeout).await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 5);
    tx.rollback().await.unwrap();

    // Control: the same schedule with a per-key timeout of the same length.
    let holders = hold(&locker, &mut clients, &keys).await;
    let tx = locker.begin(&mut b).await.unwrap();
    let per_key = async {
        for key in &keys {
            let _ = tx.lock_timeout(*key, timeout).await?;
        }
        Ok::<_, Error>(())
    };
    let (result, ()) = tokio::join!(per_key, release_in_turn(&observer, pid, holders, gap));
    result.expect("each key alone waits less than the timeout");
    assert_eq!(advisory_rows(&observer, pid).await, 5);
    tx.rollback().await.unwrap();
}

/// The first keys of a batch are free and granted at once; the last one is
/// busy. After the timeout none of them is held.
#[tokio::test(flavor = "multi_thread")]
async fn batch_timeout_releases_what_it_was_granted() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let mut c = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    let keys = keys(20..24);
    let last = *keys.last().unwrap();

    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock(last).await.unwrap();
    let tx = locker.begin(&mut b).await.unwrap();
    let _ = tx.lock(Key { id: 25 }).await.unwrap();
    let batch: Batch = keys.iter().copied().collect();
    let err = tx
        .lock_batch_timeout(&batch, Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert_eq!(
        advisory_rows(&observer, pid).await,
        1,
        "only the key held before the batch"
    );
    assert!(held_by(&observer, pid, Key { id: 25 }.lock_key()).await);
    assert!(tx.holds(&Key { id: 25 }, Mode::Exclusive));
    let other = locker.begin(&mut c).await.unwrap();
    for key in &keys[..keys.len() - 1] {
        assert!(other.try_lock(*key).await.unwrap().is_ok(), "{key:?}");
    }
    other.rollback().await.unwrap();
    holder.rollback().await.unwrap();
    tx.commit().await.unwrap();
}

/// Two transactions each hold a key and ask for the other's with a long
/// timeout: the server picks a victim, whose savepoint rollback leaves its
/// transaction usable with its own key still held.
#[tokio::test(flavor = "multi_thread")]
async fn deadlock_inside_a_timeout_call_leaves_the_transaction_usable() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    for client in [&a, &b] {
        client
            .batch_execute("SET deadlock_timeout = '50ms'")
            .await
            .unwrap();
    }
    let pids = [backend_pid(&a).await, backend_pid(&b).await];
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    let (ka, kb) = (Key { id: 30 }, Key { id: 31 });

    let tx_a = locker.begin(&mut a).await.unwrap();
    let tx_b = locker.begin(&mut b).await.unwrap();
    let _ = tx_a.lock(ka).await.unwrap();
    let _ = tx_b.lock(kb).await.unwrap();

    let (victim_a, victim_b) = tokio::join!(
        deadlock_side(&observer, tx_a, ka, kb, pids[0]),
        deadlock_side(&observer, tx_b, kb, ka, pids[1])
    );
    assert!(
        victim_a ^ victim_b,
        "exactly one victim: {victim_a} {victim_b}"
    );
}

/// One side of [`deadlock_inside_a_timeout_call_leaves_the_transaction_usable`]:
/// whether it was the victim.
async fn deadlock_side(observer: &Client, tx: LockTx<'_>, own: Key, other: Key, pid: i32) -> bool {
    match tx.lock_timeout(other, Duration::from_secs(30)).await {
        Ok(_) => {
            tx.commit().await.unwrap();
            false
        }
        Err(err) => {
            assert!(err.is_deadlock() && !err.is_timeout(), "{err}");
            assert_eq!(err.code(), Some("40P01"));
            let one: i32 = tx.query_one("SELECT 1", &[]).await.unwrap().get(0);
            assert_eq!(one, 1);
            assert_eq!(tx.held_count(), 1);
            assert!(held_by(observer, pid, own.lock_key()).await);
            assert!(!held_by(observer, pid, other.lock_key()).await);
            let _ = tx.lock(Key { id: 32 }).await.unwrap();
            assert!(held_by(observer, pid, Key { id: 32 }.lock_key()).await);
            // Committing releases `own`, which lets the other side finish.
            tx.commit().await.unwrap();
            true
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn try_lock_gives_the_key_back_when_busy() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;

    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock(Key { id: 40 }).await.unwrap();
    let tx = locker.begin(&mut b).await.unwrap();
    let back = tx.try_lock(Key { id: 40 }).await.unwrap().unwrap_err();
    assert_eq!(back, Key { id: 40 });
    let back = tx
        .try_lock_shared(Key { id: 40 })
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(back, Key { id: 40 });
    assert_eq!(tx.held_count(), 0);
    assert_eq!(advisory_rows(&observer, pid).await, 0);
    let got = tx.try_lock(Key { id: 41 }).await.unwrap().unwrap();
    assert_eq!(*got, Key { id: 41 });
    assert!(held_by(&observer, pid, Key { id: 41 }.lock_key()).await);
    holder.rollback().await.unwrap();
    let got = tx.try_lock(Key { id: 40 }).await.unwrap().unwrap();
    assert_eq!(got.into_value(), Key { id: 40 });
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn try_lock_batch_is_all_or_nothing() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    let keys = keys(50..56);
    let pairs = [LockKey::Pair(-77_001, 1), LockKey::Pair(-77_001, 2)];
    let mut batch: Batch = keys.iter().copied().collect();
    for pair in pairs {
        batch.add_key(pair, Mode::Exclusive);
    }

    let holder = locker.begin(&mut a).await.unwrap();
    let mut busy_batch = Batch::new();
    busy_batch
        .add(&keys[4], Mode::Exclusive)
        .add(&keys[1], Mode::Shared)
        .add_key(pairs[1], Mode::Exclusive);
    let _ = holder.lock_batch(&busy_batch).await.unwrap();

    let tx = locker.begin(&mut b).await.unwrap();
    let busy = tx.try_lock_batch(&batch).await.unwrap().unwrap_err();
    assert_eq!(
        busy.keys(),
        [keys[1].lock_key(), keys[4].lock_key(), pairs[1]],
        "exactly the busy keys, in lock order"
    );
    assert_eq!(
        advisory_rows(&observer, pid).await,
        0,
        "none of the free keys stayed"
    );
    assert_eq!(tx.held_count(), 0);

    // One busy key alone (the single-key path) and a batch that shares.
    let busy = tx
        .try_lock_batch(&Batch::new().with(&keys[4]))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(busy.keys(), [keys[4].lock_key()]);
    let shared = Batch::new().with_shared(&keys[1]).with(&keys[0]);
    let held = tx.try_lock_batch(&shared).await.unwrap().unwrap();
    assert!(held.contains(&keys[1]) && held.contains(&keys[0]));
    assert_eq!(advisory_rows(&observer, pid).await, 2);
    drop(held);

    holder.rollback().await.unwrap();
    let held = tx.try_lock_batch(&batch).await.unwrap().unwrap();
    assert_eq!(held.keys().len(), 8);
    assert_eq!(tx.held_count(), 8);
    // keys[1] is held twice over: shared from before and now exclusive.
    assert_eq!(advisory_rows(&observer, pid).await, 9);
    drop(held);
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn shared_try_admits_shared_holders() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let mut c = db.connect().await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    let k = Key { id: 60 };

    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock_shared(k).await.unwrap();
    let tx = locker.begin(&mut b).await.unwrap();
    let got = tx.try_lock_shared(k).await.unwrap().unwrap();
    assert_eq!(got.mode(), Mode::Shared);
    // An upgrade is refused while another shared holder remains, and the
    // shared lock stays.
    let back = tx.try_lock(k).await.unwrap().unwrap_err();
    assert_eq!(back, k);
    assert!(tx.holds(&k, Mode::Shared) && !tx.holds(&k, Mode::Exclusive));
    let third = locker.begin(&mut c).await.unwrap();
    assert!(third.try_lock(k).await.unwrap().is_err());
    assert!(third
        .try_lock_batch(&Batch::new().with_shared(&k).with_shared(&Key { id: 61 }))
        .await
        .unwrap()
        .is_ok());
    third.rollback().await.unwrap();
    holder.rollback().await.unwrap();
    tx.commit().await.unwrap();
}

/// Locks `first`, waits for the other side on the first attempt, then locks
/// `second`, inside `lockkit::retry`; returns the attempts it took.
async fn transfer(
    locker: &lockkit::Locker,
    client: &tokio::sync::Mutex<Client>,
    first: Key,
    second: Key,
    barrier: &Barrier,
) -> Result<u32, Error> {
    let policy = RetryPolicy::default()
        .max_attempts(20)
        .delays(Duration::from_millis(5), Duration::from_millis(100));
    lockkit::retry(&policy, |attempt| async move {
        let mut client = client.lock().await;
        let tx = locker.begin(&mut client).await?;
        let _ = tx.lock(first).await?;
        if attempt == 1 {
            barrier.wait().await;
        }
        let _ = tx.lock(second).await?;
        tx.commit().await?;
        Ok(attempt)
    })
    .await
}

/// Opposite lock orders, one key at a time, deadlock on the first attempt;
/// `retry` runs the victim's transaction again and both succeed.
#[tokio::test(flavor = "multi_thread")]
async fn retry_survives_a_real_deadlock() {
    let db = TestServer::builder()
        .setting("deadlock_timeout", "10ms")
        .start();
    let _log = db.guard();
    let a = db.connect().await;
    let b = db.connect().await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Off)).await;
    let (a, b) = (tokio::sync::Mutex::new(a), tokio::sync::Mutex::new(b));

    for round in 0..5 {
        let (x, y) = (Key { id: 70 + 2 * round }, Key { id: 71 + 2 * round });
        let barrier = Barrier::new(2);
        let (ra, rb) = tokio::join!(
            transfer(&locker, &a, x, y, &barrier),
            transfer(&locker, &b, y, x, &barrier)
        );
        let (na, nb) = (ra.unwrap(), rb.unwrap());
        assert_eq!(na.min(nb), 1, "round {round}: the winner needs one attempt");
        assert!(na.max(nb) > 1, "round {round}: the victim was retried");
    }
}

/// A timed batch of `BigInt` and `Pair` keys re-arms its timeouts between
/// the two lock statements from a deadline the server keeps as text. That
/// text was `timestamptz::text`, in the session's `DateStyle` and
/// `TimeZone`: under a non-ISO `DateStyle` it carries a zone abbreviation,
/// which the server cannot always read back (`WIB`, Asia/Jakarta: the call
/// failed with 22007) or reads as another zone (`IST`, Asia/Kolkata, read as
/// Israel time: 3.5 hours more to wait than the timeout allows; `UTC` of
/// `UTC+3`: 3 hours less, so 1 ms). A server, database or role default
/// `DateStyle` is enough.
#[tokio::test(flavor = "multi_thread")]
async fn batch_timeout_works_under_any_time_zone_and_date_style() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&b, Config::default().order_check(OrderCheck::Warn)).await;
    let pair = LockKey::Pair(-77_002, 1);
    for (zone, style) in [
        ("Asia/Jakarta", "Postgres, MDY"),
        ("Asia/Jakarta", "SQL, DMY"),
        ("Asia/Jakarta", "German"),
    ] {
        b.batch_execute(&format!(
            "SET TimeZone = '{zone}'; SET DateStyle = '{style}'"
        ))
        .await
        .unwrap();
        let mut batch = Batch::new().with(&Key { id: 71 });
        batch.add_key(pair, Mode::Exclusive);
        let tx = locker.begin(&mut b).await.unwrap();
        let held = tx.lock_batch_timeout(&batch, NO_WAIT).await;
        assert!(held.is_ok(), "{zone}, {style}: {:?}", held.err());
        drop(held);
        assert_eq!(advisory_rows(&observer, pid).await, 2, "{zone}, {style}");
        tx.rollback().await.unwrap();
    }
}
