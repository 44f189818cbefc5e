//! A process that holds multiplexed session locks until it is killed: the
//! child of the `kill -9` tests (tests/session/multiplexed.rs).
//!
//! `hold-session-locks <url> <count> <first id>` takes `count` keys
//! [`Feed`] `first..first + count` with
//! [`SessionForm::Multiplexed`]
//! over at most 8 connections to `url`, prints `held <n> <backend pids>`
//! on one line, and sleeps until killed.

use std::collections::BTreeSet;
use std::time::Duration;

use futures_util::StreamExt;
use lockkit::pg::SessionForm;
use lockkit::SessionLock;
use lockkit_tests::fixtures::Feed;

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: hold-session-locks <url> <count> <first id>";
    let url = args.next().expect(usage);
    let count: i64 = args.next().expect(usage).parse().expect(usage);
    let first: i64 = args.next().expect(usage).parse().expect(usage);
    let config: tokio_postgres::Config = url.parse().expect("a connection URL");
    let sessions = SessionLock::new(config)
        .form(SessionForm::Multiplexed)
        .connections(8)
        .keepalive(Duration::from_secs(60));
    let guards: Vec<_> = futures_util::stream::iter(first..first + count)
        .map(|id| sessions.try_lock(Feed { id }))
        .buffer_unordered(256)
        .map(|taken| taken.expect("try_lock").expect("a free key"))
        .collect()
        .await;
    let pids: BTreeSet<i32> = guards.iter().map(|g| g.backend_pid()).collect();
    let pids: Vec<String> = pids.iter().map(i32::to_string).collect();
    println!("held {} {}", guards.len(), pids.join(","));
    std::future::pending::<()>().await;
}
