//! The semaphore, transaction scope: 4N concurrent takers for N slots over
//! many rounds, never more than N inside (counted from `pg_locks` and from
//! inside the critical section), every slot used; the control, a
//! check-then-lock semaphore, admits more. Try, timeout, wait, a permit
//! asked twice, and the slots' keys.

use std::collections::HashSet;
use std::num::NonZeroU8;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockkit::key::{semaphore_base, semaphore_of, SEMAPHORE_CLASS};
use lockkit::{AdvisoryKey, Config, LockClient, LockKey, Locker};
use lockkit_tests::TestServer;
use tokio_postgres::Client;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/semaphore")]
struct Exports {
    region: i64,
}

const fn permits(n: u8) -> NonZeroU8 {
    match NonZeroU8::new(n) {
        Some(n) => n,
        None => panic!("zero permits"),
    }
}

/// Granted slots of the semaphore named by `key`, in any session.
async fn slots_held(observer: &Client, key: LockKey) -> i64 {
    let base = semaphore_base(key);
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND objsubid = 2 AND classid = $1::int4::oid AND (objid::int8 & ~255) = ($2::int4::int8 & 4294967295 & ~255)",
            &[&SEMAPHORE_CLASS, &base],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

async fn lock_client(db: &TestServer, locker: &Locker) -> LockClient {
    LockClient::new(locker, db.connect().await)
}

/// Who is inside a semaphore's critical section, counted from inside:
/// how many now (asserted at most `n`), the most at once, and the slots
/// used.
#[derive(Clone)]
struct Inside {
    n: u8,
    now: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    slots: Arc<Mutex<HashSet<u8>>>,
}

impl Inside {
    fn new(n: u8) -> Self {
        Inside {
            n,
            now: Arc::default(),
            most: Arc::default(),
            slots: Arc::default(),
        }
    }

    /// A holder of slot key `key` comes in.
    fn enter(&self, key: LockKey) {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        assert!(now <= usize::from(self.n), "{now} inside");
        let (_, slot) = semaphore_of(key).expect("a slot key");
        self.slots.lock().unwrap().insert(slot);
    }

    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }

    fn slots_used(&self) -> usize {
        self.slots.lock().unwrap().len()
    }
}

/// Samples `pg_locks` until finished: never more than `n` slots of the
/// semaphore named by `key` held at once.
struct Sampler {
    stop: Arc<AtomicBool>,
    most: Arc<AtomicI64>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    async fn start(db: &TestServer, key: Exports, n: u8) -> Self {
        let (stop, most) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicI64::new(0)),
        );
        let observer = db.connect().await;
        let task = tokio::spawn({
            let (stop, most) = (stop.clone(), most.clone());
            async move {
                while !stop.load(Ordering::Relaxed) {
                    let held = slots_held(&observer, key.lock_key()).await;
                    assert!(held <= i64::from(n), "{held} slots held in pg_locks");
                    most.fetch_max(held, Ordering::Relaxed);
                }
            }
        });
        Sampler { stop, most, task }
    }

    /// Stops; answers the most slots seen held at once.
    async fn finish(self) -> i64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("sampler");
        self.most.load(Ordering::Relaxed)
    }
}

/// 4N takers for N permits, each taking a permit, counting itself inside,
/// running a statement under it and committing, `ROUNDS` times; an
/// observer samples `pg_locks` meanwhile. Never more than N inside by
/// either count, and every slot used.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_n_takers_never_more_than_n_inside() {
    const N: u8 = 3;
    const TAKERS: usize = 4 * N as usize;
    const ROUNDS: usize = 40;
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let locker = Locker::new(&observer, Config::default()).await.unwrap();
    let key = Exports { region: 1 };
    let inside = Inside::new(N);
    let sampler = Sampler::start(db, key, N).await;
    let mut takers = Vec::new();
    for _ in 0..TAKERS {
        let mut conn = lock_client(db, &locker).await;
        let inside = inside.clone();
        takers.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let tx = conn.begin().await.expect("begin");
                let held = tx.acquire_permit(key, permits(N)).await.expect("permit");
                inside.enter(held.key());
                tx.execute("SELECT pg_sleep(0.001)", &[])
                    .await
                    .expect("work");
                inside.leave();
                drop(held);
                tx.commit().await.expect("commit");
            }
        }));
    }
    for taker in takers {
        taker.await.expect("taker");
    }
    let sampled = sampler.finish().await;
    assert_eq!(
        inside.most.load(Ordering::SeqCst),
        usize::from(N),
        "never full"
    );
    assert_eq!(inside.slots_used(), usize::from(N), "every slot used");
    assert!(sampled >= 1);
    assert_eq!(slots_held(&observer, key.lock_key()).await, 0);
}

/// The control: a semaphore that counts the holders in `pg_locks` and then
/// takes a lock of its own when fewer than N hold one admits more than N
/// when the takers check at the same moment (here: all of them, lined up
/// by a barrier).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_a_check_then_lock_semaphore_admits_more_than_n() {
    const N: i64 = 3;
    const TAKERS: usize = 12;
    let db = TestServer::shared();
    let _log = db.guard();
    let class = 770_001_i32;
    let barrier = Arc::new(tokio::sync::Barrier::new(TAKERS));
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut takers = Vec::new();
    for me in 0..TAKERS as i32 {
        let mut client = db.connect().await;
        let (barrier, inside, most) = (barrier.clone(), inside.clone(), most.clone());
        takers.push(tokio::spawn(async move {
            let tx = client.transaction().await.unwrap();
            let holders: i64 = tx
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                     AND classid = $1::int4::oid AND objsubid = 2",
                    &[&class],
                )
                .await
                .unwrap()
                .get(0);
            barrier.wait().await;
            if holders < N {
                tx.execute("SELECT pg_advisory_xact_lock($1, $2)", &[&class, &me])
                    .await
                    .unwrap();
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
            }
            barrier.wait().await;
            tx.rollback().await.unwrap();
        }));
    }
    for taker in takers {
        taker.await.unwrap();
    }
    assert!(
        most.load(Ordering::SeqCst) > N as usize,
        "the naive semaphore admitted at most {}",
        most.load(Ordering::SeqCst)
    );
}

/// A try with every slot busy gives the key back; a timed wait times out
/// and leaves the transaction usable; a wait is granted once the holders
/// commit (seen waiting in `pg_locks` first); a permit asked twice in one
/// transaction is the same one, with nothing sent.
#[tokio::test(flavor = "multi_thread")]
async fn try_timeout_wait_and_a_permit_asked_twice() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let locker = Locker::new(&observer, Config::default()).await.unwrap();
    let key = Exports { region: 2 };
    let two = permits(2);
    let mut a = lock_client(db, &locker).await;
    let mut b = lock_client(db, &locker).await;
    let mut c = lock_client(db, &locker).await;
    let ta = a.begin().await.unwrap();
    let tb = b.begin().await.unwrap();
    let first = ta
        .try_acquire_permit(key, two)
        .await
        .unwrap()
        .expect("free");
    let again = ta.acquire_permit(key, two).await.unwrap();
    assert_eq!(first.key(), again.key(), "one permit per transaction");
    assert_eq!(ta.held_count(), 1);
    let second = tb
        .try_acquire_permit(key, two)
        .await
        .unwrap()
        .expect("free");
    assert_ne!(first.key(), second.key());
    assert_eq!(slots_held(&observer, key.lock_key()).await, 2);

    let tc = c.begin().await.unwrap();
    assert_eq!(
        tc.try_acquire_permit(key, two).await.unwrap().unwrap_err(),
        key
    );
    let err = tc
        .acquire_permit_timeout(key, two, Duration::from_millis(50))
        .await
        .expect_err("every slot busy");
    assert!(err.is_timeout(), "{err}");
    tc.execute("SELECT 1", &[]).await.expect("still usable");
    tc.commit().await.unwrap();
    let waiter = tokio::spawn(async move {
        let tc = c.begin().await.unwrap();
        let held = tc.acquire_permit(key, two).await.map(|held| held.key());
        tc.commit().await.unwrap();
        held
    });
    semaphore_slot_any(&observer, key).await;
    drop((first, again, second));
    ta.commit().await.unwrap();
    tb.commit().await.unwrap();
    let granted = waiter.await.unwrap().expect("granted after the commits");
    assert!(semaphore_of(granted).is_some());
    assert_eq!(slots_held(&observer, key.lock_key()).await, 0);
}

/// The slot some session waits for, of the semaphore named by `key`,
/// once one does (polled; up to 30 s, a guard against a hang).
async fn semaphore_slot_any(observer: &Client, key: Exports) -> LockKey {
    let base = semaphore_base(key.lock_key());
    for _ in 0..3000 {
        let rows = observer
            .query(
                "SELECT objid::int8 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND objsubid = 2 AND classid = $1::int4::oid",
                &[&SEMAPHORE_CLASS],
            )
            .await
            .unwrap();
        for row in rows {
            let object = row.get::<_, i64>(0) as u32 as i32;
            if object & !0xFF == base {
                return LockKey::Pair(SEMAPHORE_CLASS, object);
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("nobody waited for a slot of {key:?}");
}

/// Session permits: 4N takers for N permits, each holding its permit on a
/// connection of its own for a statement's time, many rounds: never more
/// than N inside (counted inside, and sampled from `pg_locks`), every slot
/// used. Transaction permits of the same semaphore share its slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_permits_never_more_than_n_inside() {
    const N: u8 = 2;
    const TAKERS: usize = 4 * N as usize;
    const ROUNDS: usize = 10;
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let key = Exports { region: 3 };
    let sessions = lockkit::SessionLock::new(db.config());
    let inside = Inside::new(N);
    let sampler = Sampler::start(db, key, N).await;
    let mut takers = Vec::new();
    for _ in 0..TAKERS {
        let (sessions, inside) = (sessions.clone(), inside.clone());
        takers.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let guard = sessions
                    .acquire_permit_timeout(key, permits(N), Duration::from_secs(60))
                    .await
                    .expect("permit");
                inside.enter(guard.key());
                tokio::task::yield_now().await;
                inside.leave();
                assert!(guard.release().await.expect("release"));
            }
        }));
    }
    for taker in takers {
        taker.await.expect("taker");
    }
    sampler.finish().await;
    assert_eq!(inside.slots_used(), usize::from(N), "every slot used");

    // One session permit and one transaction permit fill 2 slots.
    let held = sessions
        .try_acquire_permit(key, permits(N))
        .await
        .unwrap()
        .expect("free");
    let locker = Locker::new(&observer, Config::default()).await.unwrap();
    let mut conn = lock_client(db, &locker).await;
    let tx = conn.begin().await.unwrap();
    let in_tx = tx
        .try_acquire_permit(key, permits(N))
        .await
        .unwrap()
        .expect("free");
    assert_ne!(in_tx.key(), held.key());
    assert!(sessions
        .try_acquire_permit(key, permits(N))
        .await
        .unwrap()
        .is_err());
    let err = sessions
        .acquire_permit_timeout(key, permits(N), Duration::from_millis(50))
        .await
        .expect_err("full");
    assert!(err.is_timeout(), "{err}");
    drop(in_tx);
    tx.commit().await.unwrap();
    assert!(held.release().await.unwrap());
    assert_eq!(slots_held(&observer, key.lock_key()).await, 0);
}
