//! A process whose lock calls are cut off while they wait: the child of the
//! test that a `Locker` which sends no cancel request says so once per
//! process (tests/lockkit/shared_pooler.rs). The warning is once per
//! process, so the test needs a process of its own.
//!
//! `cut-off-calls <route url> <server url> <first id> <calls>` holds keys
//! [`Feed`] `first..first + calls` in a transaction on its own connection to
//! `server url`, and makes a `Locker` (default configuration) on a
//! connection to `route url`. Then, for each key, it begins a transaction on
//! a new connection to `route url`, drops its `lock` call once the server
//! shows the key waited for (in `pg_locks`), and drops the transaction.
//! Then it lets the keys go, checks that each connection's next statement
//! runs outside a transaction, and prints `made <n>`. lockkit's `tracing`
//! warnings go to standard output, one line each. It panics (exit status
//! 101) if a step fails, or if it has not ended within 90 s.

use std::time::Duration;

use lockkit::{AdvisoryKey, Config, LockClient, Locker};
use lockkit_tests::fixtures::Feed;
use lockkit_tests::observe::{outside_a_transaction, wait_until_key_waited};
use lockkit_tests::support::hold_in_transaction;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
    tokio::spawn(connection);
    client
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stdout)
        .init();
    tokio::time::timeout(Duration::from_secs(90), cut_off_calls())
        .await
        .expect("cut-off-calls within 90 s");
}

async fn cut_off_calls() {
    let usage = "usage: cut-off-calls <route url> <server url> <first id> <calls>";
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [route, server, first, calls] = &args[..] else {
        panic!("{usage}");
    };
    let first: i64 = first.parse().expect(usage);
    let calls: i64 = calls.parse().expect(usage);
    let keys: Vec<Feed> = (first..first + calls).map(|id| Feed { id }).collect();

    let holder = connect(server).await;
    hold_in_transaction(&holder, keys.iter().map(AdvisoryKey::lock_key)).await;
    let observer = connect(server).await;
    let locker = Locker::new(&connect(route).await, Config::default())
        .await
        .expect("a locker");

    let mut clients = Vec::new();
    for key in &keys {
        let mut client = LockClient::new(&locker, connect(route).await);
        let tx = client.begin().await.expect("BEGIN");
        tokio::select! {
            biased;
            _ = wait_until_key_waited(&observer, key.lock_key()) => {}
            granted = tx.lock(*key) => panic!("a held key was granted: {granted:?}"),
        }
        drop(tx);
        clients.push(client);
    }

    holder
        .batch_execute("ROLLBACK")
        .await
        .expect("the holder's ROLLBACK");
    for client in &clients {
        // Behind a statement that waited for the key, once it was granted
        // and the queued rollback ran. On a direct connection a cancel
        // request processed late can cancel this statement instead
        // (`57014`, documented on `LockTx::rollback`), once: it is then
        // sent again, as `cutoff.rs` does.
        let outside = match outside_a_transaction(client).await {
            Err(e) if e.code() == Some(&SqlState::QUERY_CANCELED) => {
                outside_a_transaction(client).await
            }
            answer => answer,
        }
        .expect("the next statement");
        assert!(outside, "the next statement ran inside a transaction");
    }
    println!("made {}", clients.len());
}
