//! The multiplexed form's lock budget (issue 46): a take that would pass it
//! is refused, typed, before anything is sent, the budget sized from the
//! server's shared lock table as a transaction's is; and a take the server
//! refuses (the table full, `53200`) fails alone, every other lock on its
//! connection kept.
//!
//! Each test runs on a server of its own whose lock table is small
//! (`max_locks_per_transaction = 10`, `max_connections = 20`: 200 entries),
//! so that filling it fails nobody else's test.

use lockkit::pg::SessionForm;
use lockkit::{AdvisoryKey, ErrorKind, SessionLock};
use lockkit_tests::TestServer;
use tokio_postgres::Client;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/session-multiplexed-budget")]
struct Tenant {
    id: i64,
}

/// `max_locks_per_transaction × (max_connections + max_prepared_transactions)`.
const CAPACITY: usize = 10 * 20;

fn small_server() -> TestServer {
    TestServer::builder()
        .setting("max_locks_per_transaction", "10")
        .setting("max_connections", "20")
        .start()
}

/// Granted advisory locks of backend `pid`.
async fn advisory_locks_of(observer: &Client, pid: i32) -> usize {
    let n: i64 = observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = $1",
            &[&pid],
        )
        .await
        .expect("pg_locks")
        .get(0);
    n as usize
}

fn multiplexed(db: &TestServer) -> SessionLock {
    SessionLock::new(db.config())
        .form(SessionForm::Multiplexed)
        .connections(1)
}

/// With no budget set, half the server's lock table: the take past it is
/// refused with `BudgetExceeded` and nothing is sent for it; a lock let go
/// makes room again.
#[tokio::test(flavor = "multi_thread")]
async fn a_take_past_the_budget_is_refused_before_anything_is_sent() {
    let db = small_server();
    let observer = db.connect().await;
    let sessions = multiplexed(&db);
    let budget = CAPACITY / 2;
    let mut guards = Vec::new();
    for id in 0..budget as i64 {
        let guard = sessions
            .try_lock(Tenant { id })
            .await
            .unwrap_or_else(|e| panic!("take {id} of {budget}: {e}"))
            .unwrap_or_else(|_| panic!("nobody else holds {id}"));
        guards.push(guard);
    }
    let pid = guards[0].backend_pid();
    assert_eq!(advisory_locks_of(&observer, pid).await, budget);
    let e = sessions
        .try_lock(Tenant { id: -1 })
        .await
        .expect_err("one more would pass the budget");
    assert_eq!(e.kind(), ErrorKind::BudgetExceeded, "{e}");
    assert!(e.to_string().contains(&budget.to_string()), "{e}");
    // Nothing was sent for it, and nothing is lost.
    assert_eq!(advisory_locks_of(&observer, pid).await, budget);
    assert!(guards.iter().all(|g| g.is_held()));
    // A lock let go makes room for one.
    assert!(guards.pop().unwrap().release().await.unwrap());
    let guard = sessions
        .try_lock(Tenant { id: -1 })
        .await
        .unwrap()
        .unwrap_or_else(|_| panic!("nobody else holds it"));
    assert_eq!(guard.backend_pid(), pid);
    // A budget set by hand.
    let five = multiplexed(&db).multiplexed_budget(5);
    let mut held = Vec::new();
    for id in 1_000..1_005 {
        held.push(
            five.try_lock(Tenant { id })
                .await
                .unwrap()
                .unwrap_or_else(|_| panic!("free")),
        );
    }
    let e = five
        .try_lock(Tenant { id: 1_005 })
        .await
        .expect_err("past 5");
    assert_eq!(e.kind(), ErrorKind::BudgetExceeded, "{e}");
}

/// The budget lifted: takes until the server's lock table is full. The take
/// the server refuses (`53200`) fails with `LockTableFull`, and every other
/// lock on its connection is kept: held, on the server, and the connection
/// takes locks again once room is made.
#[tokio::test(flavor = "multi_thread")]
async fn a_take_the_server_refuses_keeps_every_other_lock() {
    let db = small_server();
    let observer = db.connect().await;
    let sessions = multiplexed(&db).multiplexed_budget(usize::MAX);
    let mut guards = Vec::new();
    let refused = loop {
        let id = guards.len() as i64;
        assert!(id < 50_000, "the lock table never filled");
        match sessions.try_lock(Tenant { id }).await {
            Ok(Ok(guard)) => guards.push(guard),
            Ok(Err(_)) => panic!("nobody else holds {id}"),
            Err(e) => break e,
        }
    };
    assert_eq!(refused.kind(), ErrorKind::LockTableFull, "{refused}");
    let held = guards.len();
    assert!(
        held >= CAPACITY / 2,
        "refused after only {held} locks: {refused}"
    );
    let pid = guards[0].backend_pid();
    // Room for the observer's own catalog locks, then the count.
    for guard in guards.drain(held - 20..) {
        assert!(guard.release().await.unwrap(), "a lock was lost");
    }
    assert!(
        guards.iter().all(|g| g.is_held()),
        "locks were lost with the refused take"
    );
    assert_eq!(advisory_locks_of(&observer, pid).await, held - 20);
    for guard in &guards[..10] {
        assert!(guard.check().await.unwrap());
    }
    // The same connection takes locks again.
    let guard = sessions
        .try_lock(Tenant { id: -2 })
        .await
        .unwrap()
        .unwrap_or_else(|_| panic!("nobody else holds it"));
    assert_eq!(guard.backend_pid(), pid);
}

/// The same with tries in flight together on the one connection: a try
/// sent behind the refused one (`25P02`) is made again once the held
/// transaction is made anew, so every failure is the server's refusal of
/// that try itself, and no lock is lost.
#[tokio::test(flavor = "multi_thread")]
async fn tries_in_flight_behind_a_refused_one_are_made_again() {
    let db = small_server();
    let sessions = multiplexed(&db).multiplexed_budget(usize::MAX);
    let mut guards = Vec::new();
    let mut refused = 0;
    let mut next = 0_i64;
    while refused == 0 {
        assert!(next < 50_000, "the lock table never filled");
        let mut tries = tokio::task::JoinSet::new();
        for id in next..next + 32 {
            let sessions = sessions.clone();
            tries.spawn(async move { sessions.try_lock(Tenant { id }).await });
        }
        next += 32;
        while let Some(answer) = tries.join_next().await {
            match answer.unwrap() {
                Ok(Ok(guard)) => guards.push(guard),
                Ok(Err(_)) => panic!("nobody else holds the key"),
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::LockTableFull, "{e}");
                    refused += 1;
                }
            }
        }
    }
    assert!(
        guards.iter().all(|g| g.is_held()),
        "locks were lost with a refused take"
    );
    let n = guards.len();
    for guard in guards.drain(n - 40..) {
        assert!(guard.release().await.unwrap(), "a lock was lost");
    }
    for guard in &guards[..10] {
        assert!(guard.check().await.unwrap());
    }
}
