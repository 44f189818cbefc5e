//! A process that holds session locks until it is killed: the child of the
//! `kill -9` tests (tests/session/multiplexed.rs) and of the stopped-holder
//! tests (tests/session/lease.rs, tests/session/fencing.rs).
//!
//! `hold-session-locks <url> <count> <first id> [form [keepalive ms [fencing]]]`
//! takes `count` keys [`Feed`] `first..first + count` in `form`
//! (`multiplexed`, the default, over at most 8 connections; `transaction`,
//! the default form; `level`, the session-level form; `level-pool`, the
//! session-level form on connections leased from a deadpool pool; `permit`, a permit
//! of a one-permit semaphore per key) through `url`, at a keepalive cadence
//! of `keepalive ms` (60 s unless given), minting fencing tokens when the
//! last argument is `fencing`. Each key is taken by a try, made again
//! when it timed out (a try waits one cadence at most, which a loaded
//! machine can exceed). It prints `held <n> <backend pids> <tokens>`
//! on one line (the tokens in key order, `-` without), then `lost <n>` once
//! every lock is lost, and sleeps until killed.
//!
//! Meanwhile it runs the commands of its standard input, one per line:
//! `write fenced <table>` or `write unfenced <table>` inserts one row
//! `(resource, writer, token)` per key into `<table>` on a connection of
//! its own, `resource` being `feed:<id>` and `writer` `holder`; fenced, only
//! where `lockkit.fence(resource, token)` accepts the key's token. It then
//! prints `wrote <rows>`.

use std::collections::BTreeSet;
use std::io::BufRead;
use std::num::NonZeroU8;
use std::time::Duration;

use futures_util::StreamExt;
use lockkit::pg::SessionForm;
use lockkit::pg::SessionGuard;
use lockkit::SessionLock;
use lockkit_tests::fixtures::Feed;

/// How long [`take_free`] keeps trying a key before it gives up: a hang
/// guard far above any load, not a timing claim.
const PATIENT: Duration = Duration::from_secs(120);

/// Takes key `id`, known free (each test gives its holder keys of its
/// own), by a try (a permit's when `permit`), which must not find it busy.
///
/// A try waits at most one keepalive cadence for its answer (300 ms for
/// the stopped-holder tests), which a loaded machine can exceed: a try
/// that timed out held nothing, and is made again until [`PATIENT`]. Its
/// connection is closed, but its backend may still hold the key for a
/// moment, so after a timeout a busy answer is tried again too.
async fn take_free(sessions: &SessionLock, permit: bool, id: i64) -> SessionGuard<Feed> {
    let deadline = std::time::Instant::now() + PATIENT;
    let mut timed_out = 0_u32;
    loop {
        let taken = match permit {
            true => {
                sessions
                    .try_acquire_permit(Feed { id }, NonZeroU8::MIN)
                    .await
            }
            false => sessions.try_lock(Feed { id }).await,
        };
        match taken {
            Ok(Ok(guard)) => return guard,
            Ok(Err(_busy)) if timed_out == 0 => panic!("key {id}: busy, though free"),
            Ok(Err(_busy)) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) if e.kind() == lockkit::ErrorKind::Timeout => {
                timed_out += 1;
                eprintln!("hold-session-locks: key {id}: try {timed_out} timed out, again: {e}");
            }
            Err(e) => panic!("key {id}: {e}"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "key {id}: not taken within {PATIENT:?} ({timed_out} tries timed out)"
        );
    }
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let usage =
        "usage: hold-session-locks <url> <count> <first id> [form [keepalive ms [fencing]]]";
    let url = args.next().expect(usage);
    let count: i64 = args.next().expect(usage).parse().expect(usage);
    let first: i64 = args.next().expect(usage).parse().expect(usage);
    let form = args.next().unwrap_or_else(|| "multiplexed".into());
    let keepalive: u64 = args.next().map_or(60_000, |ms| ms.parse().expect(usage));
    let fencing = match args.next().as_deref() {
        None => false,
        Some("fencing") => true,
        Some(_) => panic!("{usage}"),
    };
    let config: tokio_postgres::Config = url.parse().expect("a connection URL");
    let source = match form.as_str() {
        "level-pool" => {
            let manager = deadpool_postgres::Manager::from_config(
                config.clone(),
                tokio_postgres::NoTls,
                deadpool_postgres::ManagerConfig {
                    recycling_method: deadpool_postgres::RecyclingMethod::Fast,
                },
            );
            let pool = deadpool_postgres::Pool::builder(manager)
                .max_size(2 * usize::try_from(count).expect("a count") + 2)
                .build()
                .expect("pool");
            SessionLock::from_pool(pool)
        }
        _ => SessionLock::new(config.clone()),
    };
    let sessions = source
        .connections(8)
        .keepalive(Duration::from_millis(keepalive))
        .fencing_tokens(fencing);
    let (sessions, permit) = match form.as_str() {
        "multiplexed" => (sessions.form(SessionForm::Multiplexed), false),
        "transaction" => (sessions.form(SessionForm::Transaction), false),
        "level" | "level-pool" => (sessions.form(SessionForm::SessionLevel), false),
        "permit" => (sessions, true),
        _ => panic!("{usage}"),
    };
    let mut guards: Vec<_> = futures_util::stream::iter(first..first + count)
        .map(|id| take_free(&sessions, permit, id))
        .buffer_unordered(256)
        .collect()
        .await;
    guards.sort_by_key(|g| g.id);
    let pids: BTreeSet<i32> = guards.iter().map(|g| g.backend_pid()).collect();
    let pids: Vec<String> = pids.iter().map(i32::to_string).collect();
    let tokens: Vec<String> = guards
        .iter()
        .map(|g| g.fencing_token().map_or("-".into(), |t| t.to_string()))
        .collect();
    println!(
        "held {} {} {}",
        guards.len(),
        pids.join(","),
        tokens.join(",")
    );
    let writes: Vec<(i64, Option<lockkit::fencing::FencingToken>)> =
        guards.iter().map(|g| (g.id, g.fencing_token())).collect();
    let lost = futures_util::future::join_all(guards.iter().map(|g| g.lost()));
    tokio::spawn(async move {
        lost.await;
        println!("lost {count}");
    });
    let (send, mut commands) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { return };
            if send.send(line).is_err() {
                return;
            }
        }
    });
    while let Some(command) = commands.recv().await {
        let words: Vec<&str> = command.split_whitespace().collect();
        let ["write", how, table] = words[..] else {
            panic!("unknown command {command:?}");
        };
        let (client, connection) = config
            .connect(tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        let mut rows = 0;
        for (id, token) in &writes {
            let token = token.map(|t| t.to_string());
            let sql = match how {
                "fenced" => format!(
                    "INSERT INTO {table} (resource, writer, token) SELECT $1, 'holder', $2::text::numeric \
                     WHERE lockkit.fence($1, $2::text::numeric)"
                ),
                "unfenced" => format!(
                    "INSERT INTO {table} (resource, writer, token) VALUES ($1, 'holder', $2::text::numeric)"
                ),
                _ => panic!("unknown command {command:?}"),
            };
            let resource = format!("feed:{id}");
            rows += client
                .execute(&sql, &[&resource, &token])
                .await
                .expect("the holder's write");
        }
        println!("wrote {rows}");
    }
    std::future::pending::<()>().await;
}
