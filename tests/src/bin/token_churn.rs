//! A process that takes keys again and again with fencing tokens and
//! records each grant's token in its critical section: the child of the
//! token-order test under load (tests/session/fencing_load.rs).
//!
//! `token-churn <lock url> <log url> <form> <keys> <first id> <seconds>`
//! takes random keys [`Feed`] `first..first + keys` through `lock url` in
//! `form` (`transaction`, `level` or `multiplexed`), each with a bounded
//! wait; once granted it confirms the lock with the server
//! (`SessionGuard::check`) and inserts `(key, token)` into `token_log` on
//! its own connection to `log url`, confirms the lock again and marks the
//! row confirmed, then releases, until its standard input ends (its
//! parent closes it once it has seen enough), or `seconds` have passed,
//! a hang guard: a run of a fixed length would log fewer rows on a loaded
//! machine than its parent waits for. Errors (a restarted server, a busy key)
//! are counted, not fatal; the log connection is made anew on the next
//! grant after it fails, so a holder whose lock ended with the server
//! cannot record after the server came back. It prints
//! `granted <n> logged <n> errors <n>` when its time is up.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::pg::SessionForm;
use lockkit::SessionLock;
use lockkit_tests::fixtures::Feed;
use tokio_postgres::{Client, NoTls};

#[tokio::main]
async fn main() {
    let usage = "usage: token-churn <lock url> <log url> <form> <keys> <first id> <seconds>";
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [lock_url, log_url, form, keys, first, seconds] = &args[..] else {
        panic!("{usage}");
    };
    let keys: i64 = keys.parse().expect(usage);
    let first: i64 = first.parse().expect(usage);
    let seconds: u64 = seconds.parse().expect(usage);
    let form = match form.as_str() {
        "transaction" => SessionForm::Transaction,
        "level" => SessionForm::SessionLevel,
        "multiplexed" => SessionForm::Multiplexed,
        _ => panic!("{usage}"),
    };
    let sessions = SessionLock::new(lock_url.parse().expect("a URL"))
        .form(form)
        .connections(2)
        .keepalive(Duration::from_millis(500))
        .fencing_tokens(true);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let stop = Arc::new(AtomicBool::new(false));
    std::thread::spawn({
        let stop = stop.clone();
        move || {
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            stop.store(true, Ordering::Relaxed);
        }
    });
    let (mut granted, mut logged, mut errors) = (0_u64, 0_u64, 0_u64);
    let mut log: Option<Client> = None;
    let mut next = std::process::id() as i64;
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        // A cheap spread over the keys, different in every process.
        next = next
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let id = first + (next >> 33).rem_euclid(keys);
        let guard = match sessions
            .lock_timeout(Feed { id }, Duration::from_secs(2))
            .await
        {
            Ok(guard) => guard,
            Err(_) => {
                errors += 1;
                continue;
            }
        };
        granted += 1;
        let token = guard.fencing_token().expect("minted").to_string();
        if !matches!(guard.check().await, Ok(true)) {
            errors += 1;
            continue;
        }
        if log.is_none() {
            log = match tokio_postgres::connect(log_url, NoTls).await {
                Ok((client, connection)) => {
                    tokio::spawn(connection);
                    Some(client)
                }
                Err(_) => None,
            };
        }
        let Some(client) = &log else {
            errors += 1;
            continue;
        };
        let row = match client
            .query_one(
                "INSERT INTO token_log (key, token) VALUES ($1, $2::text::numeric) RETURNING n",
                &[&id, &token],
            )
            .await
        {
            Ok(row) => row.get::<_, i64>(0),
            Err(_) => {
                errors += 1;
                log = None;
                continue;
            }
        };
        // Held from the grant through the write: the row is in grant order.
        if !matches!(guard.check().await, Ok(true)) {
            errors += 1;
            continue;
        }
        match client
            .execute(
                "UPDATE token_log SET confirmed = true WHERE n = $1",
                &[&row],
            )
            .await
        {
            Ok(_) => logged += 1,
            Err(_) => {
                errors += 1;
                log = None;
                continue;
            }
        }
        if guard.release().await.is_err() {
            errors += 1;
        }
    }
    println!("granted {granted} logged {logged} errors {errors}");
}
