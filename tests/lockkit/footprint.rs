//! What a lock call costs the application's own future: a lock future is
//! moved at least once into the caller's state, so its size is paid on
//! every call.

use lockkit_tests::TestServer;

use crate::common::{locker, Item};

/// The lock future holds tokio-postgres's query future (about 1 KB) once.
/// It held two copies of it, and two of the engine's acquisition, at
/// 3,168 bytes, when the cancel-on-drop wrapper and the driver loop were
/// `async fn`s keeping their arguments beside what they awaited.
#[tokio::test(flavor = "current_thread")]
async fn a_lock_future_holds_the_drivers_future_once() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut client = db.connect().await;
    let locker = locker(&client, lockkit::Config::default()).await;
    let tx = locker.begin(&mut client).await.unwrap();
    let lock = tx.lock(Item { id: 1 });
    let size = std::mem::size_of_val(&lock);
    drop(lock);
    tx.rollback().await.unwrap();
    assert!(size <= 2048, "a lock future of {size} bytes");
}
