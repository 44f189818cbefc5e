//! A process that holds session locks until it is killed: the child of the
//! `kill -9` tests (tests/session/multiplexed.rs) and of the stopped-holder
//! tests (tests/session/lease.rs).
//!
//! `hold-session-locks <url> <count> <first id> [form [keepalive ms]]`
//! takes `count` keys [`Feed`] `first..first + count` in `form`
//! (`multiplexed`, the default, over at most 8 connections; `transaction`,
//! the default form; `level`, the session-level form; `permit`, a permit
//! of a one-permit semaphore per key)
//! through `url`, at a keepalive cadence of `keepalive ms` (60 s unless
//! given), prints `held <n> <backend pids>` on one line, then `lost <n>`
//! once every lock is lost, and sleeps until killed.

use std::collections::BTreeSet;
use std::num::NonZeroU8;
use std::time::Duration;

use futures_util::StreamExt;
use lockkit::pg::SessionForm;
use lockkit::SessionLock;
use lockkit_tests::fixtures::Feed;

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: hold-session-locks <url> <count> <first id> [form [keepalive ms]]";
    let url = args.next().expect(usage);
    let count: i64 = args.next().expect(usage).parse().expect(usage);
    let first: i64 = args.next().expect(usage).parse().expect(usage);
    let form = args.next().unwrap_or_else(|| "multiplexed".into());
    let keepalive: u64 = args.next().map_or(60_000, |ms| ms.parse().expect(usage));
    let config: tokio_postgres::Config = url.parse().expect("a connection URL");
    let sessions = SessionLock::new(config)
        .connections(8)
        .keepalive(Duration::from_millis(keepalive));
    let (sessions, permit) = match form.as_str() {
        "multiplexed" => (sessions.form(SessionForm::Multiplexed), false),
        "transaction" => (sessions.form(SessionForm::Transaction), false),
        "level" => (sessions.form(SessionForm::SessionLevel), false),
        "permit" => (sessions, true),
        _ => panic!("{usage}"),
    };
    let one = NonZeroU8::MIN;
    let guards: Vec<_> = futures_util::stream::iter(first..first + count)
        .map(|id| {
            let sessions = &sessions;
            async move {
                match permit {
                    true => sessions.try_acquire_permit(Feed { id }, one).await,
                    false => sessions.try_lock(Feed { id }).await,
                }
            }
        })
        .buffer_unordered(256)
        .map(|taken| taken.expect("try_lock").expect("a free key"))
        .collect()
        .await;
    let pids: BTreeSet<i32> = guards.iter().map(|g| g.backend_pid()).collect();
    let pids: Vec<String> = pids.iter().map(i32::to_string).collect();
    println!("held {} {}", guards.len(), pids.join(","));
    futures_util::future::join_all(guards.iter().map(|g| g.lost())).await;
    println!("lost {}", guards.len());
    std::future::pending::<()>().await;
}
