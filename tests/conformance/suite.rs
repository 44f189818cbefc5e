//! The test bodies, written once, generic over the [`Adapter`]; `main.rs`
//! instantiates them per stack.

use std::sync::atomic::{AtomicI64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::{Config, ErrorKind, LockKey, Mode, OrderCheck, StatementMode};
use lockkit_tests::observe::{self, advisory_rows, granted_elsewhere, wait_until_not_waiting};
use lockkit_tests::spans;
use lockkit_tests::waits::{wait_until_awaited, WaitCounter, Waits};
use lockkit_tests::workload::{deadlock, exclusion, seed, worker_rng};
use lockkit_tests::TestServer;
use tokio::sync::OnceCell;
use tokio_postgres::Client;

use crate::adapters::COUNTERS;
use crate::session::{Adapter, Cancel, End, Key, Op, Out, Session};

// ---------------------------------------------------------------------------
// The observer: a tokio-postgres session of its own reading `pg_locks`.

/// Whether backend `pid` holds `key` granted (any mode).
async fn held_by(observer: &Client, pid: i32, key: Key) -> bool {
    observe::held_by(observer, pid, key.lock_key()).await
}

/// Waits until no other session holds `key`: for releases the server does
/// asynchronously to the test (a session that ends). The deadline guards a
/// hang and is no timing claim.
async fn released(observer: &Client, key: Key) -> bool {
    observe::released(observer, key.lock_key()).await
}

/// Key ids of test `n` (0..100) of adapter `A`: distinct from every other
/// test's and adapter's, since they share the server and run in parallel.
fn id<A: Adapter>(test: i64, n: i64) -> i64 {
    100_000 + A::ID * 10_000 + test * 100 + n
}

async fn sessions<A: Adapter>(stack: &A, n: usize) -> Vec<Session> {
    let mut sessions = Vec::with_capacity(n);
    for _ in 0..n {
        sessions.push(stack.session().await);
    }
    sessions
}

// ---------------------------------------------------------------------------
// Mutual exclusion, with its control.

const EXCLUSION_SESSIONS: usize = 12;
const EXCLUSION_TXS: usize = 100;

/// The counter table, created once per test process.
async fn counters(observer: &Client) {
    static CREATED: OnceCell<()> = OnceCell::const_new();
    CREATED
        .get_or_init(|| async {
            observer
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {COUNTERS} (id int8 PRIMARY KEY, n int8 NOT NULL)"
                ))
                .await
                .expect("counter table");
        })
        .await;
}

/// What an exclusion run did.
struct ExclusionRun {
    tally: exclusion::Tally,
    waits: Waits,
    increments: i64,
    counted: i64,
}

/// Sessions of `A` run transactions that each take one to three random
/// slots (one `lock`, or a `lock_batch`) and read-modify-write each slot's
/// counter row while inside the slot's critical section. With `locked`
/// false (the control) each transaction locks a key private to it instead.
async fn exclusion_run<A: Adapter>(locked: bool) -> ExclusionRun {
    let db = TestServer::shared();
    let observer = db.connect().await;
    counters(&observer).await;
    let test = if locked { 0 } else { 1 };
    let slot = move |k: usize| id::<A>(test, k as i64);
    let rows: Vec<i64> = (0..exclusion::KEYS).map(slot).collect();
    observer
        .execute(
            &format!(
                "INSERT INTO {COUNTERS} SELECT unnest($1::int8[]), 0 \
                 ON CONFLICT (id) DO UPDATE SET n = 0"
            ),
            &[&rows],
        )
        .await
        .expect("reset the counters");
    let seed = seed();
    let stack = A::open(db, Config::default(), EXCLUSION_SESSIONS).await;
    let sessions = sessions(&stack, EXCLUSION_SESSIONS).await;
    let room = Arc::new(exclusion::Room::default());
    let tally = Arc::new(exclusion::Tally::default());
    let increments = Arc::new(AtomicI64::new(0));
    let counter = WaitCounter::start(
        db.config(),
        (0..exclusion::KEYS).map(|k| Key::Big(slot(k)).lock_key()),
    );
    let started = Instant::now();
    let workers: Vec<_> = sessions
        .into_iter()
        .enumerate()
        .map(|(worker, s)| {
            let (room, tally, increments) = (
                Arc::clone(&room),
                Arc::clone(&tally),
                Arc::clone(&increments),
            );
            tokio::spawn(async move {
                let mut rng = worker_rng(seed, worker);
                for i in 0..EXCLUSION_TXS {
                    let slots = exclusion::slots(&mut rng, &tally);
                    s.begin().await;
                    if !locked {
                        let private = exclusion::private_id(worker, i) + A::ID * 100_000_000;
                        s.lock(Key::Big(private), Mode::Exclusive).await.unwrap();
                    } else if let [k] = slots[..] {
                        s.lock(Key::Big(slot(k)), Mode::Exclusive).await.unwrap();
                    } else {
                        let keys: Vec<_> = slots
                            .iter()
                            .map(|&k| (Key::Big(slot(k)), Mode::Exclusive))
                            .collect();
                        assert_eq!(s.lock_batch(&keys).await.unwrap(), keys.len());
                    }
                    room.enter(&slots, &tally);
                    // In one order, so the control's row locks cannot
                    // deadlock (the locked run's slots exclude anyway).
                    let mut slots = slots;
                    slots.sort_unstable();
                    for &k in &slots {
                        s.increment(slot(k)).await.unwrap();
                    }
                    room.leave(&slots);
                    s.commit().await.unwrap();
                    increments.fetch_add(slots.len() as i64, SeqCst);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("worker panicked");
    }
    let waits = counter.stop();
    let counted: i64 = observer
        .query_one(
            &format!("SELECT sum(n)::int8 FROM {COUNTERS} WHERE id = ANY($1)"),
            &[&rows],
        )
        .await
        .expect("sum")
        .get(0);
    let run = ExclusionRun {
        tally: Arc::into_inner(tally).expect("workers are done"),
        waits,
        increments: increments.load(SeqCst),
        counted,
    };
    println!(
        "{} exclusion (locked: {locked}): {} increments, {} counted, {:?}, {:?} in {:?}",
        A::NAME,
        run.increments,
        run.counted,
        run.tally,
        run.waits,
        started.elapsed()
    );
    run
}

/// Exclusive locks: no two sessions ever inside one slot, no update lost,
/// and the server was seen making many requests wait.
pub(crate) async fn exclusion<A: Adapter>() {
    let run = exclusion_run::<A>(true).await;
    assert_eq!(run.counted, run.increments, "lost updates under the lock");
    run.tally.assert_excluded(&run.waits);
}

/// Control: the same workload, each transaction locking a key of its own,
/// overlaps and loses updates, so the test above can fail.
pub(crate) async fn exclusion_control<A: Adapter>() {
    let run = exclusion_run::<A>(false).await;
    run.tally
        .assert_overlapped("the detector saw no overlap without exclusion");
    let lost = run.increments - run.counted;
    println!("{} control: {lost} updates lost", A::NAME);
    assert!(
        lost > 0,
        "the control lost no update, so the test cannot fail"
    );
}

// ---------------------------------------------------------------------------
// Deadlock freedom, with its control.

const DEADLOCK_SESSIONS: usize = 16;
/// 16 × 320 = 5,120 transactions.
const SORTED_TXS: usize = 320;
/// 16 × 100 = 1,600 transactions.
const UNSORTED_TXS: usize = 100;

fn deadlock_key(k: usize) -> Key {
    if deadlock::is_big(k) {
        Key::Big(k as i64)
    } else {
        Key::Pair(k as i64)
    }
}

/// One transaction of the deadlock workload; on an error it rolls back and
/// returns the error.
async fn deadlock_transaction(
    s: &Session,
    keys: &[(usize, Mode)],
    acquire: deadlock::Acquire,
    holders: &deadlock::Holders,
) -> Result<(), lockkit::Error> {
    s.begin().await;
    let locked = match acquire {
        deadlock::Acquire::SortedBatch => {
            let batch: Vec<_> = keys.iter().map(|&(k, m)| (deadlock_key(k), m)).collect();
            s.lock_batch(&batch)
                .await
                .map(|n| assert_eq!(n, keys.len()))
        }
        deadlock::Acquire::OneByOneShuffled => {
            let mut result = Ok(());
            for &(k, mode) in keys {
                result = s.lock(deadlock_key(k), mode).await;
                if result.is_err() {
                    break;
                }
            }
            result
        }
    };
    if let Err(e) = locked {
        s.rollback().await.expect("rollback after a failed lock");
        return Err(e);
    }
    holders.enter(keys);
    tokio::task::yield_now().await;
    holders.leave(keys);
    s.commit().await
}

async fn deadlock_run<A: Adapter>(acquire: deadlock::Acquire, txs: usize) -> deadlock::Tally {
    // A private server that reports deadlocks quickly, the same for the
    // test and its control.
    let db = TestServer::builder()
        .setting("deadlock_timeout", "10ms")
        .start();
    let _log = db.guard();
    let seed = seed();
    let config = Config::default().order_check(OrderCheck::Off);
    let stack = A::open(&db, config, DEADLOCK_SESSIONS).await;
    let sessions = sessions(&stack, DEADLOCK_SESSIONS).await;
    let holders = Arc::new(deadlock::Holders::default());
    let tally = Arc::new(deadlock::Tally::default());
    let counter = WaitCounter::start(
        db.config(),
        (0..deadlock::KEYS).map(|k| deadlock_key(k).lock_key()),
    );
    let started = Instant::now();
    let workers: Vec<_> = sessions
        .into_iter()
        .enumerate()
        .map(|(worker, s)| {
            let (holders, tally) = (Arc::clone(&holders), Arc::clone(&tally));
            tokio::spawn(async move {
                let mut rng = worker_rng(seed, worker);
                for _ in 0..txs {
                    let keys = deadlock::key_set(&mut rng, &tally);
                    tally.record(deadlock_transaction(&s, &keys, acquire, &holders).await);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("worker panicked");
    }
    let waits = counter.stop();
    let tally = Arc::into_inner(tally).expect("workers are done");
    println!(
        "{} {acquire:?}: {} transactions: {tally:?}, {waits:?} in {:?}",
        A::NAME,
        DEADLOCK_SESSIONS * txs,
        started.elapsed()
    );
    if acquire == deadlock::Acquire::SortedBatch {
        tally.assert_never_deadlocked(DEADLOCK_SESSIONS * txs, &waits);
    }
    tally
}

/// 5,120 random multi-key batches in mixed modes over both key spaces on
/// 16 sessions: no deadlock, no error, no conflicting holders.
pub(crate) async fn deadlock_freedom<A: Adapter>() {
    deadlock_run::<A>(deadlock::Acquire::SortedBatch, SORTED_TXS).await;
}

/// Control: the same workload, each key locked on its own in random order,
/// deadlocks, and the server's `40P01` reaches the caller through the
/// stack as `is_deadlock()`.
pub(crate) async fn deadlock_control<A: Adapter>() {
    let tally = deadlock_run::<A>(deadlock::Acquire::OneByOneShuffled, UNSORTED_TXS).await;
    tally.assert_deadlocked(DEADLOCK_SESSIONS * UNSORTED_TXS);
}

// ---------------------------------------------------------------------------
// Release.

/// Locks in both key spaces and both modes, and checks in `pg_locks` that
/// the session holds them although the worker dropped every guard at once
/// (a guard's drop releases nothing).
async fn lock_some(s: &Session, observer: &Client, keys: &[Key; 3]) {
    s.lock(keys[0], Mode::Exclusive).await.unwrap();
    let n = s
        .lock_batch(&[(keys[1], Mode::Exclusive), (keys[2], Mode::Shared)])
        .await
        .unwrap();
    assert_eq!(n, 2);
    for &key in keys {
        assert!(held_by(observer, s.pid(), key).await, "{key:?} held");
    }
}

async fn release<A: Adapter>(end: End, test: i64) {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let stack = A::open(db, Config::default().order_check(OrderCheck::Off), 1).await;
    let s = stack.session().await;
    let keys = [
        Key::Big(id::<A>(test, 0)),
        Key::Pair(id::<A>(test, 1)),
        Key::Big(id::<A>(test, 2)),
    ];
    s.begin().await;
    lock_some(&s, &observer, &keys).await;
    match end {
        End::Commit | End::Rollback => {
            s.end(end).await.unwrap();
            // Synchronous: released by the time COMMIT/ROLLBACK returned.
            for key in keys {
                assert!(
                    !granted_elsewhere(&observer, key.lock_key()).await,
                    "{end:?}: {key:?}"
                );
            }
        }
        End::Drop => {
            let pid = s.pid();
            s.end(End::Drop).await.unwrap();
            // The connection's next use, which runs what the drop queued.
            let next = s.ping().await;
            println!("{}: after the drop, backend {pid} -> {next}", A::NAME);
            if next == pid {
                // The same connection: its ROLLBACK ran before the ping's
                // statement, so the release is a fact already.
                assert_eq!(advisory_rows(&observer, pid).await, 0, "drop: still held");
            } else {
                // The pool discarded the connection (diesel-async: a
                // dropped transaction leaves it open); the server releases
                // the locks when that session ends.
                for key in keys {
                    assert!(released(&observer, key).await, "drop: {key:?} still held");
                }
            }
        }
        End::Panic => {
            let pid = s.pid();
            if let Some(reclaim) = s.panic().await {
                // This stack cannot roll back in a destructor: the pool's
                // next checkout of the connection does (by closing it).
                assert!(held_by(&observer, pid, keys[0]).await, "held in the pool");
                reclaim().await;
            }
            for key in keys {
                assert!(released(&observer, key).await, "panic: {key:?} still held");
            }
            return;
        }
    }
    // The session is usable again, and the keys are free.
    s.begin().await;
    for key in keys {
        assert!(
            s.try_lock(key, Mode::Exclusive).await.unwrap(),
            "{key:?} free"
        );
    }
    s.commit().await.unwrap();
}

pub(crate) async fn release_on_commit<A: Adapter>() {
    release::<A>(End::Commit, 10).await;
}

pub(crate) async fn release_on_rollback<A: Adapter>() {
    release::<A>(End::Rollback, 11).await;
}

/// The transaction dropped unfinished (async stacks: the future that owns
/// it is dropped).
pub(crate) async fn release_on_drop<A: Adapter>() {
    release::<A>(End::Drop, 12).await;
}

/// A panic inside the transaction (closure).
pub(crate) async fn release_on_panic<A: Adapter>() {
    release::<A>(End::Panic, 13).await;
}

/// `pg_terminate_backend` of the locking backend: released, and the
/// session's next lock call fails as a lost connection.
pub(crate) async fn release_on_terminate<A: Adapter>() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let stack = A::open(db, Config::default().order_check(OrderCheck::Off), 1).await;
    let s = stack.session().await;
    let keys = [
        Key::Big(id::<A>(14, 0)),
        Key::Pair(id::<A>(14, 1)),
        Key::Big(id::<A>(14, 2)),
    ];
    s.begin().await;
    lock_some(&s, &observer, &keys).await;
    let terminated: bool = observer
        .query_one("SELECT pg_terminate_backend($1)", &[&s.pid()])
        .await
        .unwrap()
        .get(0);
    assert!(terminated);
    for key in keys {
        assert!(
            released(&observer, key).await,
            "terminate: {key:?} still held"
        );
    }
    let err = s
        .lock(Key::Big(id::<A>(14, 3)), Mode::Exclusive)
        .await
        .unwrap_err();
    println!("{}: after the terminate: {err} ({:?})", A::NAME, err.kind());
    assert!(err.is_connection_lost(), "{err} ({:?})", err.kind());
    // Ends the transaction (closure) as the application would; the
    // connection is gone, so whether it reports an error does not matter.
    let _ = s.rollback().await;
}

// ---------------------------------------------------------------------------
// Budget, timeout, cancel.

/// A batch over the budget is refused with `BudgetExceeded` before
/// anything is sent: nothing is taken, and the transaction goes on.
pub(crate) async fn budget<A: Adapter>() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let stack = A::open(db, Config::default().budget(4), 1).await;
    let s = stack.session().await;
    let keys: Vec<(Key, Mode)> = (0..5)
        .map(|n| {
            let id = id::<A>(20, n);
            let key = if n % 2 == 0 {
                Key::Big(id)
            } else {
                Key::Pair(id)
            };
            (
                key,
                if n == 4 {
                    Mode::Shared
                } else {
                    Mode::Exclusive
                },
            )
        })
        .collect();
    s.begin().await;
    let err = s.lock_batch(&keys).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExceeded, "{err}");
    let err = s.try_lock_batch(&keys).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExceeded, "{err}");
    assert_eq!(advisory_rows(&observer, s.pid()).await, 0, "nothing taken");
    for &(key, mode) in &keys {
        assert!(!s.holds(key, mode).await, "{key:?} not held");
    }
    // Control: within the budget the same transaction gets them.
    assert_eq!(s.lock_batch(&keys[..4]).await.unwrap(), 4);
    assert_eq!(advisory_rows(&observer, s.pid()).await, 4);
    let err = s.lock(keys[4].0, Mode::Shared).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExceeded, "{err}");
    assert_eq!(advisory_rows(&observer, s.pid()).await, 4);
    s.commit().await.unwrap();
}

/// `lock_timeout` on a key held elsewhere returns a timeout no sooner than
/// asked (the server measures it), holds nothing, and leaves the
/// transaction usable.
pub(crate) async fn timeout<A: Adapter>() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let stack = A::open(db, Config::default(), 2).await;
    let (holder, s) = (stack.session().await, stack.session().await);
    let (key, other) = (Key::Pair(id::<A>(21, 0)), Key::Big(id::<A>(21, 1)));
    holder.begin().await;
    holder.lock(key, Mode::Exclusive).await.unwrap();
    s.begin().await;
    for mode in [Mode::Exclusive, Mode::Shared] {
        let asked = Duration::from_millis(200);
        let started = Instant::now();
        let err = s.lock_timeout(key, mode, asked).await.unwrap_err();
        let took = started.elapsed();
        assert!(err.is_timeout(), "{mode:?}: {err} ({:?})", err.kind());
        assert!(
            took >= asked,
            "{mode:?}: returned after {took:?}, before {asked:?}"
        );
        // A bound against a hang on a loaded machine, not a timing claim.
        assert!(took < Duration::from_secs(60), "{mode:?}: took {took:?}");
        assert!(!held_by(&observer, s.pid(), key).await);
        assert!(!s.holds(key, mode).await);
    }
    // Usable afterwards: other locks work, the key is still busy.
    s.lock(other, Mode::Exclusive).await.unwrap();
    assert!(held_by(&observer, s.pid(), other).await);
    assert!(!s.try_lock(key, Mode::Shared).await.unwrap());
    s.commit().await.unwrap();
    holder.commit().await.unwrap();
}

/// A lock future dropped while another session holds the key (once the
/// server is seen making it wait) poisons the transaction; then, per the
/// stack: with a cancel request the connection is free at once (the
/// rollback returns while the other session still holds the key); without
/// one (sqlx) the rollback waits for the lock statement's reply.
pub(crate) async fn cancel<A: Adapter>() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let stack = A::open(db, Config::default(), 2).await;
    let (holder, s) = (stack.session().await, stack.session().await);
    let (key, other) = (Key::Big(id::<A>(22, 0)), Key::Pair(id::<A>(22, 1)));
    holder.begin().await;
    holder.lock(key, Mode::Exclusive).await.unwrap();
    s.begin().await;
    let (drop_it, dropped) = tokio::sync::oneshot::channel();
    let lock = s.start(Op::LockDropped(key, Mode::Exclusive, dropped));
    assert_eq!(wait_until_awaited(&observer, key.lock_key()).await, s.pid());
    drop_it.send(()).unwrap();
    assert_eq!(lock.await.unwrap().unwrap(), Out::Dropped);
    assert!(s.is_poisoned().await, "a lock call cut off poisons");
    let cancel = A::CANCEL.expect("an async stack");
    if cancel != Cancel::WaitsForReply {
        // The cut-off itself makes the server stop waiting, before anything
        // else is sent on the connection, while the holder holds the key.
        wait_until_not_waiting(&observer, s.pid()).await;
        assert!(held_by(&observer, holder.pid(), key).await);
    }
    let err = s.lock(other, Mode::Exclusive).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Poisoned, "{err}");
    match cancel {
        Cancel::Request | Cancel::RequestAndDiscard => {
            s.rollback().await.unwrap();
            assert!(
                held_by(&observer, holder.pid(), key).await,
                "the rollback returned while the holder still holds the key"
            );
            holder.commit().await.unwrap();
        }
        Cancel::WaitsForReply => {
            let mut rollback = s.start_end(End::Rollback);
            // A window in the safe direction: it fails only if the
            // rollback returns while the lock statement still waits.
            tokio::select! {
                _ = &mut rollback => panic!("the rollback returned while the lock statement waited"),
                () = tokio::time::sleep(Duration::from_millis(300)) => {}
            }
            holder.commit().await.unwrap();
            rollback.await.unwrap().unwrap();
        }
    }
    assert!(released(&observer, key).await);
    if cancel == Cancel::RequestAndDiscard {
        // The pool's next checkout discards the broken connection.
        let pid = s.pid();
        assert_ne!(
            s.ping().await,
            pid,
            "the broken connection was handed out again"
        );
    }
    // The connection is usable and holds nothing.
    s.begin().await;
    assert!(s.try_lock(key, Mode::Exclusive).await.unwrap());
    s.commit().await.unwrap();
}

// ---------------------------------------------------------------------------
// A commit after a lock error that aborted the transaction.

/// A deadlock between two transactions of `A` that each wrote a row: the
/// server fails one lock call with 40P01, which aborts that transaction,
/// and its application swallows the error and commits. Answers what the
/// victim's commit said, and the victim's row as committed (`n`, 0 or 1);
/// checks that the survivor committed its row, that no lock is left, and
/// that the victim's session is usable again.
async fn commit_after_a_deadlock<A: Adapter>(test: i64) -> (Result<(), lockkit::Error>, i64) {
    let db = TestServer::shared();
    let observer = db.connect().await;
    counters(&observer).await;
    let rows = [id::<A>(test, 0), id::<A>(test, 1)];
    observer
        .execute(
            &format!(
                "INSERT INTO {COUNTERS} SELECT unnest($1::int8[]), 0 \
                 ON CONFLICT (id) DO UPDATE SET n = 0"
            ),
            &[&&rows[..]],
        )
        .await
        .expect("reset the counters");
    let stack = A::open(db, Config::default().order_check(OrderCheck::Off), 2).await;
    let s = sessions(&stack, 2).await;
    let keys = [Key::Big(id::<A>(test, 0)), Key::Big(id::<A>(test, 1))];
    for i in 0..2 {
        s[i].begin().await;
        s[i].increment(rows[i]).await.unwrap();
        s[i].lock(keys[i], Mode::Exclusive).await.unwrap();
    }
    // Each asks for the other's key, the second once the first is seen
    // waiting: a wait cycle, which the server breaks by failing one call
    // with 40P01 and aborting its transaction.
    let (first, second) = tokio::join!(s[0].lock(keys[1], Mode::Exclusive), async {
        observe::wait_until_waiting(&observer, s[0].pid()).await;
        s[1].lock(keys[0], Mode::Exclusive).await
    });
    let outcomes = [first, second];
    let victims: Vec<usize> = (0..2).filter(|&i| outcomes[i].is_err()).collect();
    assert_eq!(victims.len(), 1, "one victim: {outcomes:?}");
    let (victim, survivor) = (victims[0], 1 - victims[0]);
    let err = outcomes[victim].as_ref().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Deadlock, "{err}");

    let committed = s[victim].commit().await;
    s[survivor].commit().await.unwrap();
    let n = |row: i64| {
        let observer = &observer;
        async move {
            let select = format!("SELECT n FROM {COUNTERS} WHERE id = $1");
            let n: i64 = observer.query_one(&select, &[&row]).await.unwrap().get(0);
            n
        }
    };
    assert_eq!(n(rows[survivor]).await, 1, "the survivor's write");
    for (i, session) in s.iter().enumerate() {
        assert_eq!(
            advisory_rows(&observer, session.pid()).await,
            0,
            "session {i}"
        );
    }
    // The victim's session is usable again.
    s[victim].begin().await;
    s[victim]
        .lock(keys[survivor], Mode::Exclusive)
        .await
        .unwrap();
    s[victim].commit().await.unwrap();
    (committed, n(rows[victim]).await)
}

/// A transaction that a failed lock call aborted (here, the victim of a
/// deadlock) does not report a commit: committing it rolls it back and
/// fails with `TransactionAborted`, and its write is not there. PostgreSQL
/// answers `COMMIT` in an aborted transaction by rolling back, without an
/// error, so a commit that only reads errors would report success. The
/// other transaction of the cycle commits, and its write is there.
pub(crate) async fn commit_after_an_aborting_error<A: Adapter>() {
    let _log = TestServer::shared().guard();
    let (committed, victims_row) = commit_after_a_deadlock::<A>(40).await;
    assert_eq!(victims_row, 0, "the victim's write");
    let err = committed.expect_err("the aborted transaction's commit reported success");
    assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{err}");
}

/// The control, on the stacks whose sessions commit through the stack's
/// own transaction (`lock_tx`), which lockkit does not end: the same
/// deadlock's victim commits, the stack reports success, and the write is
/// not there. What the `lock_tx` docs of sqlx and diesel-async warn of,
/// and what the scenario above catches.
pub(crate) async fn commit_after_an_aborting_error_control<A: Adapter>() {
    let _log = TestServer::shared().guard();
    let (committed, victims_row) = commit_after_a_deadlock::<A>(41).await;
    assert_eq!(victims_row, 0, "the victim's write");
    committed.expect("the stack's own commit reports the rollback as success");
}

// ---------------------------------------------------------------------------
// Savepoints, and the refusal outside a transaction.

/// A lock taken in a savepoint that is rolled back is released (and
/// forgotten by the bookkeeping); one taken before it is kept; one taken in
/// a released savepoint belongs to the transaction.
pub(crate) async fn savepoints<A: Adapter>() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let stack = A::open(db, Config::default().order_check(OrderCheck::Off), 1).await;
    let s = stack.session().await;
    let before = Key::Big(id::<A>(23, 0));
    let inside = [Key::Pair(id::<A>(23, 1)), Key::Big(id::<A>(23, 2))];
    let kept = Key::Pair(id::<A>(23, 3));
    s.begin().await;
    assert_eq!(s.depth().await, 0);
    s.lock(before, Mode::Exclusive).await.unwrap();
    s.savepoint().await;
    assert_eq!(s.depth().await, 1, "inside the savepoint");
    s.lock(inside[0], Mode::Exclusive).await.unwrap();
    s.lock_batch(&[(inside[1], Mode::Shared)]).await.unwrap();
    assert!(held_by(&observer, s.pid(), inside[0]).await);
    assert_eq!(s.held_count().await, 3);
    s.end(End::Rollback).await.unwrap();
    assert!(held_by(&observer, s.pid(), before).await, "kept");
    assert!(s.holds(before, Mode::Exclusive).await);
    assert_eq!(s.held_count().await, 1, "the savepoint's keys forgotten");
    assert_eq!(s.depth().await, 0, "back in the transaction");
    for key in inside {
        assert!(!held_by(&observer, s.pid(), key).await, "{key:?} released");
    }
    assert!(!s.holds(inside[0], Mode::Exclusive).await);
    assert!(!s.holds(inside[1], Mode::Shared).await);
    s.savepoint().await;
    s.lock(kept, Mode::Shared).await.unwrap();
    s.end(End::Commit).await.unwrap();
    assert!(
        held_by(&observer, s.pid(), kept).await,
        "released savepoint"
    );
    assert!(s.holds(kept, Mode::Shared).await);
    assert_eq!(s.held_count().await, 2, "the released savepoint's key kept");
    assert_eq!(advisory_rows(&observer, s.pid()).await, 2);
    s.commit().await.unwrap();
    assert_eq!(advisory_rows(&observer, s.pid()).await, 0);
}

/// Where a lock outside a transaction is expressible at runtime, it is
/// refused with `NotInTransaction`. (tokio-postgres: it does not compile,
/// tests/ui-guards/lock_without_transaction.rs, so it is not instantiated
/// there.)
pub(crate) async fn lock_outside_transaction_refused<A: Adapter>() {
    let db = TestServer::shared();
    let _log = db.guard();
    let stack = A::open(db, Config::default(), 1).await;
    let err = stack
        .lock_outside_transaction()
        .await
        .expect("refused at runtime");
    assert_eq!(err.kind(), ErrorKind::NotInTransaction, "{err}");
}

// ---------------------------------------------------------------------------
// Cross-driver exclusion.

/// `a` holds keys in both spaces and both modes; `b` is refused what
/// conflicts and granted what does not; then `b` waits for a key `a`
/// holds and gets it once `a` commits.
async fn holds_against(a: &Session, b: &Session, observer: &Client, base: i64) {
    let (x, s, free) = (base, base + 1, base + 2);
    a.begin().await;
    let held = [
        (Key::Big(x), Mode::Exclusive),
        (Key::Pair(x), Mode::Exclusive),
        (Key::Big(s), Mode::Shared),
        (Key::Pair(s), Mode::Shared),
    ];
    assert_eq!(a.lock_batch(&held).await.unwrap(), 4);
    b.begin().await;
    for key in [Key::Big(x), Key::Pair(x)] {
        assert!(
            !b.try_lock(key, Mode::Exclusive).await.unwrap(),
            "{key:?} X vs X"
        );
        assert!(
            !b.try_lock(key, Mode::Shared).await.unwrap(),
            "{key:?} S vs X"
        );
    }
    for key in [Key::Big(s), Key::Pair(s)] {
        assert!(
            !b.try_lock(key, Mode::Exclusive).await.unwrap(),
            "{key:?} X vs S"
        );
        assert!(
            b.try_lock(key, Mode::Shared).await.unwrap(),
            "{key:?} S vs S"
        );
    }
    // Controls: free keys of both spaces are granted.
    assert!(b.try_lock(Key::Big(free), Mode::Exclusive).await.unwrap());
    assert!(b.try_lock(Key::Pair(free), Mode::Exclusive).await.unwrap());
    // b waits for a key a holds exclusive, and gets it when a commits.
    let lock = b.start(Op::Lock(Key::Pair(x), Mode::Exclusive));
    assert_eq!(
        wait_until_awaited(observer, Key::Pair(x).lock_key()).await,
        b.pid()
    );
    a.commit().await.unwrap();
    assert_eq!(lock.await.unwrap().unwrap(), Out::Locked);
    assert!(held_by(observer, b.pid(), Key::Pair(x)).await);
    b.commit().await.unwrap();
}

/// Sessions of two stacks exclude each other, in both directions, both key
/// spaces and both modes.
pub(crate) async fn cross<A: Adapter, B: Adapter>() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let config = Config::default().order_check(OrderCheck::Off);
    let (a, b) = (
        A::open(db, config.clone(), 1).await,
        B::open(db, config, 1).await,
    );
    let (sa, sb) = (a.session().await, b.session().await);
    let base = 200_000 + (A::ID * 4 + B::ID) * 100;
    holds_against(&sa, &sb, &observer, base).await;
    holds_against(&sb, &sa, &observer, base + 10).await;
    println!("{} and {}: exclusion in both directions", A::NAME, B::NAME);
}

/// A hand-written key type whose `lock_key` answers another key at each
/// call ([`Drifting`]): lockkit computes the key once, sends it, and the
/// guard names the key the server granted, the one `pg_locks` shows held.
/// It made a granted `lock` panic ("the grant is for this key") and a
/// granted `try_lock` report the key busy while it was held: the guard was
/// checked against the key computed a second time. The control: the key a
/// second call computes is not held.
pub(crate) async fn drifting_key<A: Adapter>() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let stack = A::open(db, Config::default(), 1).await;
    let s = stack.session().await;
    let (locked, tried) = (id::<A>(30, 0), id::<A>(30, 10));
    s.begin().await;
    let out = s.op(Op::LockDrifting(locked)).await.expect("granted");
    assert_eq!(out, Out::Guard(LockKey::BigInt(locked)));
    let out = s.op(Op::TryLockDrifting(tried)).await.expect("granted");
    assert_eq!(out, Out::Guard(LockKey::BigInt(tried)), "granted, not busy");
    let held = |key| observe::held_by(&observer, s.pid(), LockKey::BigInt(key));
    for key in [locked, tried] {
        assert!(held(key).await, "{key} held");
        assert!(!held(key + 1).await, "{} not held", key + 1);
    }
    s.rollback().await.unwrap();
    assert_eq!(advisory_rows(&observer, s.pid()).await, 0, "released");
}

// ---------------------------------------------------------------------------
// The semaphore.

/// A semaphore of 2 permits through the stack's face: two transactions
/// take distinct slots (seen held by their backends), a third is refused
/// by a try and times out waiting, asking again in one transaction answers
/// its permit; once the holders commit, the third's wait is granted (it is
/// seen waiting first).
pub(crate) async fn semaphore<A: Adapter>() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let stack = A::open(db, Config::default(), 3).await;
    let s = sessions(&stack, 3).await;
    let name = id::<A>(42, 0);
    let slot = |out: Out| match out {
        Out::Guard(key) => key,
        other => panic!("not a permit: {other:?}"),
    };
    let mut slots = Vec::new();
    for holder in &s[..2] {
        holder.begin().await;
        let key = slot(holder.op(Op::TryPermit(name, 2)).await.unwrap());
        assert!(lockkit::key::semaphore_of(key).is_some(), "{key}");
        assert!(observe::held_by(&observer, holder.pid(), key).await);
        let again = slot(holder.op(Op::Permit(name, 2, None)).await.unwrap());
        assert_eq!(again, key, "one permit per transaction");
        slots.push(key);
    }
    assert_ne!(slots[0], slots[1]);
    let third = &s[2];
    third.begin().await;
    assert_eq!(
        third.op(Op::TryPermit(name, 2)).await.unwrap(),
        Out::Bool(false)
    );
    let err = third
        .op(Op::Permit(name, 2, Some(Duration::from_millis(50))))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    let waiting = third.start(Op::Permit(name, 2, None));
    observe::wait_until_waiting(&observer, third.pid()).await;
    for holder in &s[..2] {
        holder.commit().await.unwrap();
    }
    let granted = slot(waiting.await.expect("reply").expect("granted"));
    assert!(slots.contains(&granted), "{granted} is not a slot");
    third.commit().await.unwrap();
}

/// Fencing tokens ([`Config::fencing_tokens`]) on transaction-scoped
/// locks: every kind of call's guard carries a token, minted in the call's
/// own statements, larger than every token before it across sessions and
/// transactions; a busy try has none; a locker that does not mint hands
/// none; and on a database without lockkit's SQL functions a minting call
/// fails with `NotInstalled`, holding nothing once rolled back.
pub(crate) async fn fencing_tokens<A: Adapter>() {
    use crate::session::TokenCall as T;
    use lockkit::fencing::FencingToken;
    let db = TestServer::builder().start();
    let _log = db.guard();
    let observer = db.connect().await;
    let config = Config::default()
        .fencing_tokens(true)
        .order_check(lockkit::OrderCheck::Off);
    let bare = A::open(&db, config.clone(), 1).await;
    let session = bare.session().await;
    session.begin().await;
    let e = session.op(Op::Token(T::Lock(1))).await.unwrap_err();
    assert_eq!(
        e.kind(),
        lockkit::ErrorKind::NotInstalled,
        "{}: {e}",
        A::NAME
    );
    session.rollback().await.unwrap();
    assert_eq!(observe::advisory_rows(&observer, session.pid()).await, 0);
    drop(session);

    lockkit::sql::install(&observer).await.expect("install");
    let stack = A::open(&db, config, 2).await;
    let s = sessions(&stack, 2).await;
    let token = |out: Out| match out {
        Out::Token(token) => token,
        other => panic!("not a token: {other:?}"),
    };
    let mut last: Option<FencingToken> = None;
    let mut next = |t: Option<FencingToken>, what: &str| {
        let t = t.unwrap_or_else(|| panic!("{}: {what} has no token", A::NAME));
        if let Some(last) = last {
            assert!(t > last, "{}: {what}: {t} after {last}", A::NAME);
        }
        last = Some(t);
    };
    let pairs = |ids: &[i64]| {
        ids.iter()
            .map(|&id| (Key::Big(id), Mode::Exclusive))
            .collect::<Vec<_>>()
    };
    for round in 0..2_i64 {
        for (i, session) in s.iter().enumerate() {
            let base = 100 * (round * 2 + i as i64);
            session.begin().await;
            let calls = [
                ("lock", T::Lock(base + 1)),
                ("try_lock", T::TryLock(base + 2)),
                (
                    "lock_timeout",
                    T::LockTimeout(base + 3, Duration::from_secs(5)),
                ),
                ("lock_batch", T::Batch(pairs(&[base + 4, base + 5]))),
                ("try_lock_batch", T::TryBatch(pairs(&[base + 6, base + 7]))),
                ("acquire_permit", T::Permit(base + 8, 2)),
                ("try_acquire_permit", T::TryPermit(base + 9, 2)),
            ];
            for (what, call) in calls {
                let out = session.op(Op::Token(call)).await;
                let out = out.unwrap_or_else(|e| panic!("{}: {what}: {e}", A::NAME));
                next(token(out), what);
            }
            session.commit().await.unwrap();
        }
    }
    // Busy: no guard, no token.
    s[0].begin().await;
    next(token(s[0].op(Op::Token(T::Lock(1))).await.unwrap()), "lock");
    s[1].begin().await;
    assert_eq!(
        token(s[1].op(Op::Token(T::TryLock(1))).await.unwrap()),
        None
    );
    s[1].rollback().await.unwrap();
    s[0].commit().await.unwrap();
    // A locker that does not mint hands no token.
    let plain = A::open(&db, Config::default(), 1).await;
    let session = plain.session().await;
    session.begin().await;
    assert_eq!(
        token(session.op(Op::Token(T::Lock(1))).await.unwrap()),
        None
    );
    session.commit().await.unwrap();
}

// ---------------------------------------------------------------------------
// What lockkit's statements leave on a connection, and where a driver
// reports them.

/// `StatementMode::Prepared` (the opt-in) keeps lockkit's statements
/// prepared on the connection (in the driver's statement cache, where it
/// has one): at least the two the transactions ran, the lock's and the
/// batch's (tokio-postgres prepares all of them); `Unnamed`, for
/// transaction-mode poolers, prepares none of them. The prepared case is
/// the control that the count can be seen at all.
pub(crate) async fn statement_mode_decides_what_is_prepared<A: Adapter>() {
    let db = TestServer::shared();
    let _log = db.guard();
    for (mode, least, most) in [
        (StatementMode::Unnamed, 0, 0),
        (StatementMode::Prepared, 2, i64::MAX),
    ] {
        let config = Config::default()
            .statements(mode)
            .order_check(OrderCheck::Off);
        let stack = A::open(db, config, 1).await;
        let s = stack.session().await;
        for n in 0..3 {
            s.begin().await;
            s.lock(Key::Big(id::<A>(50, n)), Mode::Exclusive)
                .await
                .unwrap();
            let batch = [
                (Key::Big(id::<A>(50, 10 + n)), Mode::Exclusive),
                (Key::Big(id::<A>(50, 20 + n)), Mode::Exclusive),
            ];
            assert_eq!(s.lock_batch(&batch).await.unwrap(), 2);
            s.commit().await.unwrap();
        }
        let n = s.lockkit_prepared().await;
        println!("{} {mode:?}: {n} of lockkit's statements prepared", A::NAME);
        assert!(
            (least..=most).contains(&n),
            "{} {mode:?}: {n} of lockkit's statements prepared",
            A::NAME
        );
    }
}

/// A lock call's statements run in its `lockkit.lock` span: the stack's
/// driver's report of each (`Adapter::STATEMENT_EVENTS`: sqlx's own, or
/// the Diesel connection's instrumentation as an application would set it)
/// is inside it, for a lock, a try, a batch and a timed lock (a round of
/// five statements); the transaction's own statement is in no lock's span
/// (the control). See [`spans::assert_lock_statements_in_span`].
///
/// The recording subscriber is a thread's default, so the stack runs on a
/// current-thread runtime of its own on a blocking thread (a blocking
/// stack's session thread reports to it too).
pub(crate) async fn a_lock_calls_statements_are_reported_inside_its_span<A: Adapter>() {
    let target = A::STATEMENT_EVENTS.expect("a stack whose driver reports its statements");
    let db = TestServer::shared();
    let _log = db.guard();
    let events = spans::Events::new(target);
    let recorder = events.clone();
    tokio::task::spawn_blocking(move || {
        recorder.run(async {
            let stack = A::open(db, Config::default().order_check(OrderCheck::Off), 1).await;
            let s = stack.session().await;
            let key = |n| Key::Big(id::<A>(51, n));
            s.begin().await;
            s.lock(key(0), Mode::Exclusive).await.unwrap();
            assert!(s.try_lock(key(1), Mode::Exclusive).await.unwrap());
            let batch = [(key(2), Mode::Exclusive), (key(3), Mode::Exclusive)];
            assert_eq!(s.lock_batch(&batch).await.unwrap(), 2);
            s.lock_timeout(key(4), Mode::Exclusive, Duration::from_secs(5))
                .await
                .unwrap();
            s.execute("SELECT 'the application''s own' AS mine")
                .await
                .unwrap();
            s.commit().await.unwrap();
        });
    })
    .await
    .expect("the traced transaction");
    spans::assert_lock_statements_in_span(&events.seen());
}
