//! The key protocol is shared across drivers: a Diesel session and a
//! tokio-postgres session locking the same typed key exclude each other.

use std::sync::mpsc;

use lockkit::AdvisoryKey;
use lockkit_diesel::{Batch, Config, Error, Mode};
use lockkit_tests::TestServer;

use crate::common::{connect, granted_elsewhere, locker};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-cross")]
struct Order {
    id: i64,
}

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-cross-pair", pair)]
struct Shelf {
    id: i64,
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

#[test]
fn diesel_and_tokio_postgres_exclude_each_other() {
    let db = TestServer::shared();
    let _log = db.guard();
    let rt = runtime();
    let mut pg = rt.block_on(db.connect());
    let pg_locker = rt
        .block_on(lockkit::Locker::new(&pg, lockkit::Config::default()))
        .unwrap();
    let mut conn = connect(db);
    let locker = locker(&mut conn, Config::default());

    // Diesel holds; tokio-postgres is refused, in both key spaces.
    locker
        .transaction(&mut conn, |tx| {
            let _ = tx.lock_batch(&Batch::new().with(&Order { id: 1 }).with(&Shelf { id: 1 }))?;
            rt.block_on(async {
                let pg_tx = pg_locker.begin(&mut pg).await.unwrap();
                assert!(pg_tx.try_lock(Order { id: 1 }).await.unwrap().is_err());
                assert!(pg_tx.try_lock(Shelf { id: 1 }).await.unwrap().is_err());
                assert!(pg_tx
                    .try_lock_shared(Order { id: 1 })
                    .await
                    .unwrap()
                    .is_err());
                // Control: a different key of the same type is free.
                assert!(pg_tx.try_lock(Order { id: 2 }).await.unwrap().is_ok());
                pg_tx.rollback().await.unwrap();
            });
            Ok::<_, Error>(())
        })
        .unwrap();

    // tokio-postgres holds; Diesel is refused, then waits and gets it once
    // tokio-postgres commits.
    let (held_tx, held_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        rt.block_on(async {
            let tx = pg_locker.begin(&mut pg).await.unwrap();
            let _ = tx.lock(Order { id: 3 }).await.unwrap();
            let _ = tx.lock_shared(Shelf { id: 3 }).await.unwrap();
            held_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            tx.commit().await.unwrap();
        });
    });
    held_rx.recv().unwrap();
    let mut observer = connect(db);
    locker
        .transaction(&mut conn, |tx| {
            assert!(tx.try_lock(Order { id: 3 })?.is_err());
            assert!(
                tx.try_lock(Shelf { id: 3 })?.is_err(),
                "exclusive vs shared"
            );
            assert!(
                tx.try_lock_shared(Shelf { id: 3 })?.is_ok(),
                "shared vs shared"
            );
            Ok::<_, Error>(())
        })
        .unwrap();
    go_tx.send(()).unwrap();
    locker
        .transaction(&mut conn, |tx| {
            let held = tx.lock(Order { id: 3 })?; // waits for the commit
            assert_eq!(held.mode(), Mode::Exclusive);
            assert!(granted_elsewhere(&mut observer, Order { id: 3 }.lock_key()));
            Ok::<_, Error>(())
        })
        .unwrap();
    holder.join().unwrap();
}
