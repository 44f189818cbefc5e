//! lockkit-diesel-async behind a transaction-mode pgbouncer: only the reply
//! check stands between a forged statement and a lock reported held.

use diesel_async::{AsyncConnection, AsyncPgConnection};
use lockkit_diesel_async::{
    AdvisoryKey, Batch, Config, Error, ErrorKind, Locker, OrderCheck, StatementMode,
};
use lockkit_tests::{PgBouncer, TestServer};

use crate::common::granted_elsewhere;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-async-pooler")]
struct Job {
    id: i64,
}

/// Behind a transaction-mode pgbouncer with one server connection, every
/// lockkit statement diesel-async has prepared there is replaced by a
/// forgery (same name, parameters and reply shape, tag 7, no lock;
/// `lockkit_tests::forge`). Every lock call, in every form, is then refused
/// as `UnexpectedReply`, and no key is held on the server.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_statement_behind_a_pooler_is_refused_by_the_reply_check() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(1)
        .start();
    let mut direct = AsyncPgConnection::establish(db.url()).await.unwrap();
    // Named statements (the opt-in), whose reply check this is about.
    let config = Config::default()
        .statements(StatementMode::Prepared)
        .order_check(OrderCheck::Off);
    let locker = Locker::new(&mut direct, config).await.unwrap();
    let observer = db.connect().await;
    let mut conn = AsyncPgConnection::establish(&bouncer.url())
        .await
        .expect("through pgbouncer");
    for forged in [false, true] {
        if forged {
            lockkit_tests::forge::forge_behind(&bouncer).await;
        }
        for form in 0..5_i64 {
            let job = Job {
                id: 900_000 + form + if forged { 100 } else { 0 },
            };
            let (locker, observer) = (&locker, &observer);
            let result = conn
                .transaction::<_, Error, _>(async |conn| {
                    let mut tx = locker.lock_tx(conn)?;
                    let key = match form {
                        0 => tx.lock(job).await?.key(),
                        1 => tx.lock_shared(job).await?.key(),
                        2 => tx.try_lock(job).await?.expect("free").key(),
                        3 => tx.try_lock_shared(job).await?.expect("free").key(),
                        _ => {
                            let batch = Batch::new().with(&job).with(&Job { id: job.id + 1 });
                            let _ = tx.lock_batch(&batch).await?;
                            job.lock_key()
                        }
                    };
                    // Never a success without the lock.
                    assert!(granted_elsewhere(observer, key).await, "form {form}");
                    Ok(key)
                })
                .await;
            match (forged, result) {
                (false, Ok(_)) => {}
                (true, Err(e)) => {
                    assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "form {form}: {e:?}");
                    assert!(!granted_elsewhere(observer, job.lock_key()).await);
                }
                (forged, result) => panic!("form {form}, forged {forged}: {result:?}"),
            }
        }
    }
}
