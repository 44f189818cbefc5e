//! `Locker::publish_key_types`: an application's key types on the server,
//! for `lockkit inspect` (issue 29).

use lockkit::driver::sql;
use lockkit::inspect::{published_key_types, KeyRegistry};
use lockkit::key::KeyForm;
use lockkit::{AdvisoryKey, Config, KeySpec, LockKey, Locker};
use lockkit_tests::observe::{wait_until_waiting_for, Awaited};
use lockkit_tests::TestServer;
use tokio_postgres::{Client, NoTls};

use crate::common::backend_pid;

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "lockkit-tests/published", pair, class = 77)]
struct Published {
    id: u64,
}

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

/// The program's types reach the table, once per (application, type)
/// however often they are published, and read back as the registry the
/// derive filled.
#[tokio::test(flavor = "multi_thread")]
async fn publishes_the_linked_types_idempotently() {
    let db = TestServer::shared();
    let _log = db.guard();
    let url = db.create_database("lockkit_publish_idempotent").await;
    let mut client = connect(&url).await;
    assert_eq!(published_key_types(&client).await.unwrap(), None);
    let locker = Locker::new(&client, Config::default()).await.unwrap();
    let linked = lockkit::key::linked_key_types().count();
    let n = locker
        .publish_key_types(&mut client, "svc-a")
        .await
        .unwrap();
    assert!(n > 0 && n <= linked, "{n} of {linked}");
    locker
        .publish_key_types(&mut client, "svc-a")
        .await
        .unwrap();
    locker
        .publish_key_types(&mut client, "svc-b")
        .await
        .unwrap();
    let published = published_key_types(&client).await.unwrap().unwrap();
    assert_eq!(published.len(), 2 * n);
    let ours: Vec<_> = published
        .iter()
        .filter(|p| p.namespace == "lockkit-tests/published")
        .collect();
    assert_eq!(ours.len(), 2, "{ours:?}");
    assert_eq!(ours[0].form, KeyForm::Pair);
    assert_eq!(ours[0].pair_class, 77);
    assert!(ours[0].type_name.ends_with("::Published"), "{ours:?}");
    // One namespace published by two applications is one type.
    let registry = KeyRegistry::new().register_published(&published);
    let key = Published { id: 5 }.lock_key();
    assert!(matches!(key, LockKey::Pair(77, _)));
    let types = registry.decode(key);
    assert_eq!(types.len(), 1, "{types:?}");
    assert_eq!(types[0].namespace(), "lockkit-tests/published");
    assert!(
        registry.collisions().is_empty(),
        "{:?}",
        registry.collisions()
    );
    // Registered already by the program, not again.
    let both = KeyRegistry::linked().register_published(&published);
    assert_eq!(both.types().len(), KeyRegistry::linked().types().len());
}

/// A publisher that finds another one creating the table waits for it,
/// then publishes. The control: without the publishers' lock, the second
/// `CREATE TABLE IF NOT EXISTS` waits on the first one's catalog row and
/// fails with 23505 once it commits.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_publishers_on_a_fresh_database() {
    let db = TestServer::shared();
    let _log = db.guard();
    let url = db.create_database("lockkit_publish_race").await;
    let observer = connect(&url).await;
    // Another publisher, by hand, stopped inside its transaction after
    // creating the table.
    let mut first = connect(&url).await;
    let tx = first.transaction().await.unwrap();
    let LockKey::BigInt(key) = KeySpec::new("lockkit.key_types").key_of(&0_i64) else {
        unreachable!()
    };
    tx.execute(sql::PUBLISH_LOCK, &[&key]).await.unwrap();
    tx.batch_execute(sql::CREATE_KEY_TYPES).await.unwrap();

    let mut second = connect(&url).await;
    let second_pid = backend_pid(&second).await;
    let locker = Locker::new(&second, Config::default()).await.unwrap();
    let publishing =
        tokio::spawn(async move { locker.publish_key_types(&mut second, "svc-second").await });
    wait_until_waiting_for(&observer, second_pid, Awaited::Any).await;
    tx.commit().await.unwrap();
    let n = publishing.await.unwrap().expect("the second publisher");
    assert!(n > 0);

    // And many at once, on another fresh database.
    let url = db.create_database("lockkit_publish_many").await;
    let mut tasks = Vec::new();
    for i in 0..6 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = connect(&url).await;
            let locker = Locker::new(&client, Config::default()).await.unwrap();
            locker
                .publish_key_types(&mut client, &format!("svc-{i}"))
                .await
        }));
    }
    for task in tasks {
        task.await.unwrap().expect("a concurrent publisher");
    }
    let client = connect(&url).await;
    let published = published_key_types(&client).await.unwrap().unwrap();
    assert_eq!(published.len(), 6 * n);
}
