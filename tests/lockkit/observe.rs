//! Observability: a lock call's span carries its key type, key count,
//! outcome and wait, and the `metrics` feature records the wait in a
//! histogram, on a real wait on the server.

use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Config};
use lockkit_tests::TestServer;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

use crate::common::capture::capture;
use crate::common::{backend_pid, locker, wait_until_waiting};

#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests.observe")]
struct Observed {
    id: i64,
}

#[tokio::test(flavor = "current_thread")]
async fn a_lock_wait_emits_a_span_and_a_metric_with_its_wait() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    let (spans, _capture) = capture();

    let db = TestServer::shared();
    let _log = db.guard();
    let mut holder = db.connect().await;
    let mut waiter = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&waiter).await;
    let backend_pid_of_holder = backend_pid(&holder).await;
    let locker = locker(&holder, Config::default()).await;
    let key = Observed { id: 1 };

    let h = locker.begin(&mut holder).await.unwrap();
    let _ = h.lock(key).await.unwrap();
    let tx = locker.begin(&mut waiter).await.unwrap();
    let (held, at_least) = tokio::join!(tx.lock(key), async {
        wait_until_waiting(&observer, pid).await;
        let seen = Instant::now();
        // Not synchronisation: a gap the wait must cover. The call was
        // waiting at `seen` and cannot be granted before the holder's
        // rollback, so it waited at least this long, however busy the
        // machine.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let at_least = seen.elapsed();
        h.rollback().await.unwrap();
        at_least
    });
    drop(held.unwrap());
    tx.commit().await.unwrap();

    // Two calls went to the server: the holder's, then the waiter's.
    assert_eq!(spans.span_field("key_type"), ["lockkit-tests.observe"; 2]);
    assert_eq!(spans.span_field("keys"), ["1", "1"]);
    assert_eq!(spans.span_field("outcome"), ["granted", "granted"]);
    let wait_ms: f64 = spans.span_field("wait_ms")[1].parse().unwrap();
    assert!(
        wait_ms >= at_least.as_secs_f64() * 1000.0,
        "the span's wait {wait_ms} ms covers the {at_least:?} the holder kept the key"
    );

    let samples: Vec<f64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| {
            key.key().name() == "lockkit_lock_wait_seconds"
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == "key_type" && l.value() == "lockkit-tests.observe")
        })
        .flat_map(|(_, _, _, value)| match value {
            DebugValue::Histogram(v) => v.into_iter().map(|f| f.into_inner()).collect(),
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(samples.len(), 2, "two lock calls went to the server");
    assert!(
        samples[1] >= at_least.as_secs_f64(),
        "the histogram's wait {}s covers {at_least:?}",
        samples[1]
    );

    // A busy try and a timeout: the histogram labels each with its
    // outcome, and each counts once in its counter.
    let h = locker.begin(&mut holder).await.unwrap();
    let _ = h.lock(key).await.unwrap();
    let tx = locker.begin(&mut waiter).await.unwrap();
    assert!(tx.try_lock(key).await.unwrap().is_err(), "busy");
    let err = tx
        .lock_timeout(key, Duration::from_millis(20))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    tx.rollback().await.unwrap();
    h.rollback().await.unwrap();

    let snapshot = snapshotter.snapshot().into_vec();
    let ours = |key: &metrics::Key| {
        key.labels()
            .any(|l| l.key() == "key_type" && l.value() == "lockkit-tests.observe")
    };
    let mut outcomes: Vec<String> = snapshot
        .iter()
        .filter(|(k, ..)| k.key().name() == "lockkit_lock_wait_seconds" && ours(k.key()))
        .flat_map(|(k, _, _, value)| {
            let outcome = k
                .key()
                .labels()
                .find(|l| l.key() == "outcome")
                .map(|l| l.value().to_owned())
                .unwrap_or_default();
            let n = match value {
                DebugValue::Histogram(v) => v.len(),
                _ => 0,
            };
            std::iter::repeat_n(outcome, n)
        })
        .collect();
    outcomes.sort();
    // The first snapshot took the first two samples; these are the
    // holder's second lock, the try and the timed lock.
    assert_eq!(
        outcomes,
        ["busy", "granted", "timeout"],
        "one sample per call, labelled with its outcome"
    );
    let counter = |name: &str| {
        snapshot
            .iter()
            .filter(|(k, ..)| k.key().name() == name && ours(k.key()))
            .map(|(.., value)| match value {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum::<u64>()
    };
    assert_eq!(counter("lockkit_lock_busy_total"), 1);
    assert_eq!(counter("lockkit_lock_timeouts_total"), 1);
    assert_eq!(counter("lockkit_lock_deadlocks_total"), 0);

    // A deadlock (keys taken in opposite orders, the order check off): the
    // server aborts one of the two calls with 40P01, and the deadlock
    // counter counts it, once.
    let lax = locker_unordered(&holder).await;
    let (first, second) = (Observed { id: 2 }, Observed { id: 3 });
    let a = lax.begin(&mut holder).await.unwrap();
    let b = lax.begin(&mut waiter).await.unwrap();
    let _ = a.lock(first).await.unwrap();
    let _ = b.lock(second).await.unwrap();
    let (ra, rb) = tokio::join!(async { a.lock(second).await.map(drop) }, async {
        wait_until_waiting(&observer, backend_pid_of_holder).await;
        b.lock(first).await.map(drop)
    });
    let deadlocks = [&ra, &rb]
        .iter()
        .filter(|r| r.as_ref().is_err_and(|e| e.is_deadlock()))
        .count();
    assert_eq!(deadlocks, 1, "{ra:?} {rb:?}");
    a.rollback().await.unwrap();
    b.rollback().await.unwrap();
    let snapshot = snapshotter.snapshot().into_vec();
    let deadlocks: u64 = snapshot
        .iter()
        .filter(|(k, ..)| k.key().name() == "lockkit_lock_deadlocks_total" && ours(k.key()))
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum();
    assert_eq!(deadlocks, 1, "the deadlock counter counts the 40P01");
}

async fn locker_unordered(client: &tokio_postgres::Client) -> lockkit::Locker {
    locker(
        client,
        Config::default().order_check(lockkit::OrderCheck::Off),
    )
    .await
}

/// A key type of its own, so the histogram test sees only its own calls.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests.observe.order")]
struct Ordered {
    id: i64,
}

/// Out-of-order acquisition: the default fails in debug builds (lockdep);
/// `OrderCheck::Warn` warns once per call site, not once per call.
#[tokio::test(flavor = "current_thread")]
async fn out_of_order_fails_in_debug_and_warns_once_per_call_site() {
    let (warnings, _capture) = capture();
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut keys: Vec<Ordered> = (10..12).map(|id| Ordered { id }).collect();
    keys.sort_by_key(|k| k.lock_key());
    let (low, high) = (keys[0], keys[1]);

    let strict = locker(&a, Config::default()).await;
    let tx = strict.begin(&mut a).await.unwrap();
    let _ = tx.lock(high).await.unwrap();
    let result = tx.lock(low).await;
    if cfg!(debug_assertions) {
        let err = result.unwrap_err();
        assert_eq!(err.kind(), lockkit::ErrorKind::LockOrder, "{err}");
    } else {
        drop(result.unwrap());
    }
    tx.rollback().await.unwrap();
    warnings.clear_warnings(); // release builds warned here

    let lax = locker(&a, Config::default().order_check(lockkit::OrderCheck::Warn)).await;
    for _ in 0..5 {
        let tx = lax.begin(&mut a).await.unwrap();
        let _ = tx.lock(high).await.unwrap();
        let _ = tx.lock(low).await.unwrap(); // one call site, five times
        tx.rollback().await.unwrap();
    }
    let after_one_site = warnings.warnings().len();
    assert_eq!(after_one_site, 1, "{:?}", warnings.warnings());
    let tx = lax.begin(&mut a).await.unwrap();
    let _ = tx.lock(high).await.unwrap();
    let _ = tx.lock(low).await.unwrap(); // another call site
    tx.rollback().await.unwrap();
    let all = warnings.warnings();
    assert_eq!(all.len(), 2, "{all:?}");
    assert!(
        all[1].contains("observe.rs"),
        "the warning names the call site: {all:?}"
    );
}
