//! Fencing tokens under load: five `token-churn` processes take the same
//! eight keys again and again, three through transaction-mode pgbouncer
//! (the default and multiplexed forms) and two directly (the session-level
//! and default forms), each recording every grant's token in its critical
//! section; one of them is killed with SIGKILL and started again, and the
//! server is restarted, during the run. Per key, the tokens in grant order
//! strictly increase.
//!
//! The log's order is the grant order for the rows whose holder confirmed,
//! after writing its row, that it still held the lock: it held it from its
//! grant through its write, so no other grant of the key came between. A
//! holder that went stale first (a process stalled past its lease on a
//! loaded machine: the server ended its session and granted the key to
//! another, whose row came first) leaves its row unconfirmed; that is the
//! stale writer fencing tokens exist for, not a token out of order.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lockkit::fencing::FencingToken;
use lockkit_tests::{PgBouncer, TestServer};
use tokio_postgres::Client;

/// The longest a churner runs, a hang guard: the test ends each by
/// closing its standard input once enough grants are logged.
const SECONDS: u64 = 90;
const KEYS: i64 = 8;
const FIRST: i64 = 960_000;
/// The bound on a wait of this test: it guards a hang, not a timing.
const PATIENT: Duration = Duration::from_secs(90);

struct Churner(Child);

impl Churner {
    fn start(lock_url: &str, log_url: &str, form: &str, seconds: u64) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_token-churn"))
            .args([
                lock_url,
                log_url,
                form,
                &KEYS.to_string(),
                &FIRST.to_string(),
                &seconds.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("token-churn");
        Churner(child)
    }
}

impl Drop for Churner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Rows in `token_log` so far.
async fn logged(client: &Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM token_log", &[])
        .await
        .map(|row| row.get(0))
        .unwrap_or(0)
}

/// Waits until `token_log` has at least `rows` rows, on a connection made
/// anew when the server went away.
async fn until_logged(db: &TestServer, rows: i64) {
    let started = Instant::now();
    let mut client = db.connect().await;
    loop {
        if client.is_closed() {
            client = db.connect().await;
        }
        if logged(&client).await >= rows {
            return;
        }
        assert!(
            started.elapsed() < PATIENT,
            "fewer than {rows} grants logged"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn tokens_grow_per_key_under_load_through_a_pooler_with_kills_and_a_restart() {
    let db = TestServer::builder().start();
    let _log = db.guard();
    let client = db.connect().await;
    lockkit::sql::install(&client).await.expect("install");
    client
        .batch_execute(
            "CREATE TABLE token_log (n bigserial PRIMARY KEY, key int8 NOT NULL, \
             token numeric NOT NULL, confirmed bool NOT NULL DEFAULT false)",
        )
        .await
        .unwrap();
    let bouncer = PgBouncer::builder(&db)
        .pool_mode("transaction")
        .default_pool_size(4)
        .start();
    let (direct, pooled) = (db.url().to_owned(), bouncer.url());
    let mut churners = vec![
        Churner::start(&pooled, &direct, "transaction", SECONDS),
        Churner::start(&pooled, &direct, "transaction", SECONDS),
        Churner::start(&pooled, &direct, "multiplexed", SECONDS),
        Churner::start(&direct, &direct, "level", SECONDS),
        Churner::start(&direct, &direct, "transaction", SECONDS),
    ];

    until_logged(&db, 100).await;
    let killed = churners.remove(0);
    drop(killed); // SIGKILL, whatever it holds
    churners.push(Churner::start(&pooled, &direct, "transaction", SECONDS));

    until_logged(&db, 300).await;
    db.restart();
    let restarted_at = {
        let client = db.connect().await;
        logged(&client).await
    };
    until_logged(&db, restarted_at + 100).await;

    for mut churner in churners {
        drop(churner.0.stdin.take()); // its cue to stop
        let started = Instant::now();
        loop {
            if churner.0.try_wait().expect("wait").is_some() {
                break;
            }
            assert!(started.elapsed() < PATIENT, "a churner did not stop");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let client = db.connect().await;
    let rows = client
        .query(
            "SELECT key, token::text FROM token_log WHERE confirmed ORDER BY key, n",
            &[],
        )
        .await
        .unwrap();
    let mut last: Option<(i64, FencingToken)> = None;
    let mut keys = std::collections::BTreeSet::new();
    for row in &rows {
        let key: i64 = row.get(0);
        let token: FencingToken = row.get::<_, String>(1).parse().unwrap();
        if let Some((last_key, last_token)) = last {
            if last_key == key {
                assert!(token > last_token, "key {key}: {token} after {last_token}");
            }
        }
        keys.insert(key);
        last = Some((key, token));
    }
    assert_eq!(keys.len() as i64, KEYS);
    eprintln!(
        "{} grants logged ({} before the restart) over {KEYS} keys, tokens strictly growing per key",
        rows.len(),
        restarted_at
    );
}
