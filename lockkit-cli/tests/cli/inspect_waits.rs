//! `lockkit inspect` on real queues: a waiter reached along two paths
//! (`pg_blocking_pids` names the holder and every conflicting waiter ahead)
//! is no deadlock; only a real wait-for cycle is. `--graph` draws an edge
//! to the session each waiter waits for directly, and every holder.

use std::collections::BTreeSet;
use std::num::NonZeroU8;

use lockkit::{AdvisoryKey, Config, LockClient, LockKey, Locker};
use lockkit_tests::observe::{wait_until_true, wait_until_waiting};
use lockkit_tests::TestServer;
use tokio_postgres::Client;

use super::inspect_many::{parse_dot, parse_mermaid, render_with_graphviz};
use super::{connect_url, lockkit, pid, stderr, stdout};

#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "cli.waits")]
struct CliWaits {
    id: i64,
}

/// A semaphore of one permit.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "cli.waits.exporters")]
struct CliWaitsExporters;

fn bigint(key: CliWaits) -> i64 {
    match key.lock_key() {
        LockKey::BigInt(v) => v,
        other => panic!("not a BigInt key: {other:?}"),
    }
}

/// The lines of the wait-chain tree, without the tree's glyphs.
fn tree_lines(text: &str) -> Vec<String> {
    let chains = text
        .split("wait chains (a holder, then who waits for it):\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no wait chains in\n{text}"));
    chains
        .lines()
        .take_while(|l| !l.is_empty())
        .map(|l| l.trim_start_matches(['│', '├', '└', '─', ' ']).to_owned())
        .collect()
}

/// Opens a session named `app` that takes `key` (exclusive, or shared)
/// in a transaction of its own and waits for it; answers once the server
/// shows it waiting, with the task that ends when it got the key and
/// rolled back (or its statement was cancelled).
async fn queue_for(
    url: &str,
    observer: &Client,
    app: &str,
    key: i64,
    shared: bool,
) -> (i32, tokio::task::JoinHandle<()>) {
    let client = connect_url(url, app).await;
    let pid = pid(&client).await;
    let function = if shared {
        "pg_advisory_xact_lock_shared"
    } else {
        "pg_advisory_xact_lock"
    };
    let task = tokio::spawn(async move {
        // A cancelled statement (the deadlock's end below) fails: fine.
        let _ = client
            .batch_execute(&format!("BEGIN; SELECT {function}({key}); ROLLBACK"))
            .await;
    });
    wait_until_waiting(observer, pid).await;
    (pid, task)
}

/// The scene on a real server, with a real deadlock kept open by a
/// raised `deadlock_timeout`: five waiters queued on one key behind an idle
/// holder (its lock taken by `try_lock`), three waiters for a semaphore's
/// one permit, a mixed queue (shared, shared, exclusive, shared), a holder
/// nobody waits for, and two sessions each waiting for the other's key.
/// The tree draws each waiter once and one cycle, the deadlock's; the
/// graph has exactly the direct edges and every holder. Before, every
/// waiter behind another was also drawn as "(cycle: a deadlock)" (seven
/// times in this scene), and the graph had an edge to every waiter ahead.
#[tokio::test(flavor = "multi_thread")]
async fn inspect_reports_only_the_real_deadlock_and_direct_waits() {
    let db = TestServer::shared();
    let _log = db.guard();
    let url = db.create_database("lockkit_cli_waits").await;
    let observer = connect_url(&url, "cli-waits-observer").await;
    let locker = Locker::new(&observer, Config::default()).await.unwrap();

    // The queue of five behind an idle holder that took its key with
    // try_lock.
    let queue_key = CliWaits { id: 1 };
    let holder = connect_url(&url, "cli-waits-holder").await;
    let holder_pid = pid(&holder).await;
    let mut holder = LockClient::new(&locker, holder);
    let holder_tx = holder.begin().await.unwrap();
    let held = holder_tx
        .try_lock(queue_key)
        .await
        .unwrap()
        .expect("a free key");
    let mut queue = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..5 {
        let app = format!("cli-waits-queue-{i}");
        let (pid, task) = queue_for(&url, &observer, &app, bigint(queue_key), false).await;
        queue.push(pid);
        tasks.push(task);
    }

    // Three waiters for a semaphore's one permit.
    let one = NonZeroU8::new(1).unwrap();
    let permit_holder = connect_url(&url, "cli-permit-holder").await;
    let permit_holder_pid = pid(&permit_holder).await;
    let mut permit_holder = LockClient::new(&locker, permit_holder);
    let permit_tx = permit_holder.begin().await.unwrap();
    let permit = permit_tx
        .try_acquire_permit(CliWaitsExporters, one)
        .await
        .unwrap()
        .expect("a free permit");
    let mut permit_waiters = Vec::new();
    for i in 0..3 {
        let waiter = connect_url(&url, &format!("cli-permit-waiter-{i}")).await;
        let waiter_pid = pid(&waiter).await;
        let mut waiter = LockClient::new(&locker, waiter);
        permit_waiters.push(waiter_pid);
        tasks.push(tokio::spawn(async move {
            let tx = waiter.begin().await.unwrap();
            drop(tx.acquire_permit(CliWaitsExporters, one).await.unwrap());
            tx.rollback().await.unwrap();
        }));
        wait_until_waiting(&observer, waiter_pid).await;
    }

    // A mixed queue behind an exclusive holder: shared, shared, exclusive,
    // shared.
    let mixed_key = bigint(CliWaits { id: 2 });
    let mixed_holder = connect_url(&url, "cli-mixed-holder").await;
    let mixed_holder_pid = pid(&mixed_holder).await;
    mixed_holder
        .batch_execute(&format!("BEGIN; SELECT pg_advisory_xact_lock({mixed_key})"))
        .await
        .unwrap();
    let mut mixed = Vec::new();
    for (i, shared) in [true, true, false, true].into_iter().enumerate() {
        let app = format!("cli-mixed-{i}");
        let (pid, task) = queue_for(&url, &observer, &app, mixed_key, shared).await;
        mixed.push(pid);
        tasks.push(task);
    }

    // A holder nobody waits for.
    let lone = connect_url(&url, "cli-lone-holder").await;
    let lone_pid = pid(&lone).await;
    let lone_key = bigint(CliWaits { id: 3 });
    lone.batch_execute(&format!("BEGIN; SELECT pg_advisory_xact_lock({lone_key})"))
        .await
        .unwrap();

    // A real deadlock, kept open: each session waits a minute before the
    // server looks for a deadlock, long enough to inspect it.
    let (d1, d2) = (bigint(CliWaits { id: 4 }), bigint(CliWaits { id: 5 }));
    let a = connect_url(&url, "cli-deadlock-a").await;
    let b = connect_url(&url, "cli-deadlock-b").await;
    let (a_pid, b_pid) = (pid(&a).await, pid(&b).await);
    for (client, key) in [(&a, d1), (&b, d2)] {
        client
            .batch_execute(&format!(
                "SET deadlock_timeout = '60s'; BEGIN; SELECT pg_advisory_xact_lock({key})"
            ))
            .await
            .unwrap();
    }
    let a = std::sync::Arc::new(a);
    let b = std::sync::Arc::new(b);
    let mut deadlocked = Vec::new();
    for (client, key, waiter) in [(a.clone(), d2, a_pid), (b.clone(), d1, b_pid)] {
        deadlocked.push(tokio::spawn(async move {
            client
                .batch_execute(&format!("SELECT pg_advisory_xact_lock({key})"))
                .await
        }));
        wait_until_waiting(&observer, waiter).await;
    }

    let inspect = |extra: &[&str]| {
        let mut args = vec![
            "--url",
            url.as_str(),
            "inspect",
            "-n",
            "cli.waits",
            "-n",
            "cli.waits.exporters",
        ];
        args.extend_from_slice(extra);
        let out = lockkit(&args);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        stdout(&out)
    };

    // The tree: one cycle, the deadlock's; each waiter drawn once.
    let text = inspect(&["--full"]);
    let lines = tree_lines(&text);
    let cycles: Vec<&String> = lines.iter().filter(|l| l.contains("cycle")).collect();
    assert_eq!(
        cycles,
        [&format!("{} (cycle: a deadlock)", a_pid.min(b_pid))],
        "{text}"
    );
    let drawn = |pid: i32| {
        lines
            .iter()
            .filter(|l| l.starts_with(&format!("{pid} [")) && l.contains("] waits "))
            .count()
    };
    for &waiter in queue.iter().chain(&permit_waiters).chain(&mixed) {
        assert_eq!(drawn(waiter), 1, "{waiter} in\n{text}");
    }
    assert!(
        lines.iter().any(|l| l.starts_with(&format!(
            "{holder_pid} [cli-waits-holder] holds exclusive {} (cli.waits) <idle in transaction",
            bigint(queue_key)
        )) && l.ends_with(": try_lock 1×cli.waits")),
        "{text}"
    );
    // The exclusive request behind two shared ones waits for both.
    let also: Vec<&String> = lines.iter().filter(|l| l.contains("also waits")).collect();
    assert_eq!(
        also,
        [&format!("{} also waits behind {}", mixed[2], mixed[1])],
        "{text}"
    );

    // The graph: the direct edges, nothing else; every holder a node.
    let mut want: BTreeSet<(i32, i32)> = BTreeSet::new();
    let chain = |head: i32, tail: &[i32], want: &mut BTreeSet<(i32, i32)>| {
        let mut ahead = head;
        for &w in tail {
            want.insert((w, ahead));
            ahead = w;
        }
    };
    chain(holder_pid, &queue, &mut want);
    chain(permit_holder_pid, &permit_waiters, &mut want);
    want.extend([
        (mixed[0], mixed_holder_pid),
        (mixed[1], mixed_holder_pid),
        (mixed[2], mixed[0]),
        (mixed[2], mixed[1]),
        (mixed[3], mixed[2]),
        (a_pid, b_pid),
        (b_pid, a_pid),
    ]);
    let p = |pid: i32| format!("p{pid}");
    let want: BTreeSet<(String, String)> = want.into_iter().map(|(w, b)| (p(w), p(b))).collect();
    let dot_text = inspect(&["--graph", "dot"]);
    let mermaid_text = inspect(&["--graph", "mermaid"]);
    for (nodes, edges) in [parse_dot(&dot_text), parse_mermaid(&mermaid_text)] {
        let got: BTreeSet<(String, String)> = edges
            .iter()
            .map(|(f, t, _)| (f.clone(), t.clone()))
            .collect();
        assert_eq!(got, want, "{dot_text}");
        assert_eq!(edges.len(), want.len(), "{dot_text}");
        for holder in [
            holder_pid,
            permit_holder_pid,
            mixed_holder_pid,
            lone_pid,
            a_pid,
        ] {
            assert!(nodes.contains_key(&p(holder)), "{holder} in {nodes:?}");
        }
        let label = &nodes[&p(holder_pid)];
        for said in [
            "[cli-waits-holder]",
            "transaction ",
            "(cli.waits)",
            "try_lock 1×cli.waits",
        ] {
            assert!(label.contains(said), "{said:?} not in {label:?}");
        }
        assert!(
            nodes[&p(lone_pid)].contains("[cli-lone-holder]"),
            "{nodes:?}"
        );
    }
    render_with_graphviz(&dot_text, "try_lock 1×cli.waits");

    // End the deadlock (cancel one side), then everything else.
    observer
        .execute("SELECT pg_cancel_backend($1)", &[&a_pid])
        .await
        .unwrap();
    let results: Vec<_> = futures_join(deadlocked).await;
    assert!(results[0].is_err() && results[1].is_ok(), "{results:?}");
    a.batch_execute("ROLLBACK").await.unwrap();
    b.batch_execute("ROLLBACK").await.unwrap();
    lone.batch_execute("ROLLBACK").await.unwrap();
    mixed_holder.batch_execute("ROLLBACK").await.unwrap();
    drop(permit);
    permit_tx.rollback().await.unwrap();
    drop(held);
    holder_tx.rollback().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
}

async fn futures_join(
    tasks: Vec<tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>>,
) -> Vec<Result<(), tokio_postgres::Error>> {
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

/// How many sessions queue in the real-server test, on how many keys: as
/// many backends as a test server takes without crowding a small machine
/// (the graph logic is checked at 5,000 waiters on 50 keys in the unit
/// test `five_thousand_waiters_on_fifty_keys_have_no_cycle`).
const WAITERS: usize = 1_000;
const KEYS: usize = 50;

/// 1,000 waiters on 50 keys, 20 queued on each behind an idle holder:
/// no cycle, each waiter once in the tree, one direct edge each, and the
/// summary's one count of locks.
#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_waiters_on_fifty_keys_are_no_deadlock() {
    let db = TestServer::builder()
        .setting("max_connections", (WAITERS + KEYS + 50).to_string())
        .start();
    let url = db.url().to_owned();
    let observer = connect_url(&url, "cli-many-waits-observer").await;
    let mut holders = Vec::new();
    for k in 0..KEYS {
        let holder = connect_url(&url, "cli-many-waits-holder").await;
        let key = bigint(CliWaits { id: k as i64 });
        holder
            .batch_execute(&format!("BEGIN; SELECT pg_advisory_xact_lock({key})"))
            .await
            .unwrap();
        holders.push(holder);
    }
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let client = connect_url(&url, "cli-many-waits-waiter").await;
        let key = bigint(CliWaits {
            id: (i % KEYS) as i64,
        });
        tasks.push(tokio::spawn(async move {
            client
                .batch_execute(&format!(
                    "BEGIN; SELECT pg_advisory_xact_lock({key}); ROLLBACK"
                ))
                .await
                .unwrap();
        }));
    }
    wait_until_true(
        &observer,
        &format!(
            "SELECT count(*) = {WAITERS} FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        ),
        "every waiter queued",
    )
    .await;

    let inspect = |extra: &[&str]| {
        let mut args = vec!["--url", url.as_str(), "inspect", "-n", "cli.waits"];
        args.extend_from_slice(extra);
        let out = lockkit(&args);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        stdout(&out)
    };
    let text = inspect(&["--full"]);
    let lines = tree_lines(&text);
    assert!(!lines.iter().any(|l| l.contains("cycle")), "{text}");
    assert!(!lines.iter().any(|l| l.contains("also waits")), "{text}");
    assert_eq!(
        lines.iter().filter(|l| l.contains(" waits ")).count(),
        WAITERS
    );
    let (_, edges) = parse_dot(&inspect(&["--graph", "dot"]));
    assert_eq!(edges.len(), WAITERS);

    // The summary counts the locks once.
    let summary = inspect(&[]);
    let first = summary.lines().next().unwrap_or_default();
    assert!(
        first.starts_with(&format!(
            "{} advisory locks: {KEYS} held, {WAITERS} awaited",
            WAITERS + KEYS
        )),
        "{summary}"
    );
    assert!(!summary.contains(" rows"), "{summary}");

    for holder in &holders {
        holder.batch_execute("ROLLBACK").await.unwrap();
    }
    for task in tasks {
        task.await.unwrap();
    }
}
