//! Issue 47: `lockkit inspect` on 5,000 held locks sums them up in at most
//! 40 lines, lists them all with --full, and draws who waits for whom as a
//! Graphviz or Mermaid graph; semaphores are named, a waiting permit is a
//! permit, and lockkit's own connections have their scope.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::time::Instant;

use lockkit::key::semaphore_base;
use lockkit::{AdvisoryKey, Config, KeySpec, LockClient, Locker, SessionLock};
use lockkit_tests::observe::wait_until_waiting;
use lockkit_tests::TestServer;
use serde_json::Value;

use super::{connect_url, lockkit, pid, stderr, stdout};

/// A fleet-wide semaphore's name: a unit struct.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "cli.exporters")]
struct CliExporters;

#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "cli.scoped")]
struct CliScoped {
    id: i64,
}

/// How many locks one transaction holds.
const MANY: i64 = 5_000;

/// A parsed graph: its nodes (id → label) and edges (from, to, label).
pub(super) type Graph = (BTreeMap<String, String>, Vec<(String, String, String)>);

/// The nodes (id → label) and edges (from, to, label) of a DOT graph as
/// `--graph dot` writes it: one statement a line.
pub(super) fn parse_dot(text: &str) -> Graph {
    let mut nodes = BTreeMap::new();
    let mut edges = Vec::new();
    let quoted = |s: &str| -> Option<(String, usize)> {
        let s_bytes = s.as_bytes();
        assert_eq!(s_bytes.first(), Some(&b'"'), "{s}");
        let mut out = String::new();
        let mut i = 1;
        while i < s.len() {
            match s_bytes[i] {
                b'\\' => {
                    out.push(s_bytes[i + 1] as char);
                    i += 2;
                }
                b'"' => return Some((out, i + 1)),
                _ => {
                    let c = s[i..].chars().next().unwrap();
                    out.push(c);
                    i += c.len_utf8();
                }
            }
        }
        None
    };
    let label = |rest: &str| -> String {
        let at = rest.find("[label=").expect("a label");
        quoted(&rest[at + 7..]).expect("a closed label").0
    };
    for line in text.lines().map(str::trim) {
        if !line.starts_with('"') {
            continue;
        }
        let (from, end) = quoted(line).unwrap();
        let rest = &line[end..];
        if let Some(to) = rest.trim_start().strip_prefix("->") {
            let (to, end) = quoted(to.trim_start()).unwrap();
            let rest = &rest[rest.find(&format!("\"{to}\"")).unwrap() + end..];
            edges.push((from, to, label(rest)));
        } else {
            nodes.insert(from, label(rest));
        }
    }
    (nodes, edges)
}

/// The nodes and edges of a Mermaid flowchart as `--graph mermaid` writes
/// it: `id["label"]` and `from -->|"label"| to`.
pub(super) fn parse_mermaid(text: &str) -> Graph {
    let mut nodes = BTreeMap::new();
    let mut edges = Vec::new();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.starts_with("%%"));
    assert_eq!(lines.next(), Some("flowchart LR"), "{text}");
    for line in lines {
        if let Some((from, rest)) = line.split_once(" -->|\"") {
            let (label, to) = rest.split_once("\"| ").expect("an edge's label");
            edges.push((from.to_owned(), to.to_owned(), label.to_owned()));
        } else {
            let (id, rest) = line.split_once("[\"").expect("a node");
            let label = rest.strip_suffix("\"]").expect("a closed node");
            nodes.insert(id.to_owned(), label.to_owned());
        }
    }
    (nodes, edges)
}

#[tokio::test(flavor = "multi_thread")]
async fn inspect_sums_up_five_thousand_locks_and_draws_the_waits() {
    let db = TestServer::builder()
        .setting("max_locks_per_transaction", "256")
        .start();
    let url = db.url().to_owned();
    let observer = connect_url(&url, "cli-many-observer").await;

    // One transaction holds 5,000 locks of `cli.many`; another waits for
    // one of them.
    let tag = i64::from(KeySpec::new("cli.many").tag());
    let holder = connect_url(&url, "cli-many-holder").await;
    let holder_pid = pid(&holder).await;
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT count(pg_advisory_xact_lock(({tag}::int8 << 48) | k)) \
             FROM generate_series(1, {MANY}) AS k"
        ))
        .await
        .unwrap();
    let waiter = connect_url(&url, "cli-many-waiter").await;
    let waiter_pid = pid(&waiter).await;
    let waiting = tokio::spawn(async move {
        waiter
            .batch_execute(&format!(
                "BEGIN; SELECT pg_advisory_xact_lock(({tag}::int8 << 48) | 7); ROLLBACK"
            ))
            .await
            .unwrap();
    });
    wait_until_waiting(&observer, waiter_pid).await;

    // A semaphore of one permit named by a unit struct: one holds its
    // permit, one waits for it.
    let locker = Locker::new(&observer, Config::default()).await.unwrap();
    let one = std::num::NonZeroU8::new(1).unwrap();
    let permit_holder = connect_url(&url, "cli-permit-holder").await;
    let permit_holder_pid = pid(&permit_holder).await;
    let mut permit_holder = LockClient::new(&locker, permit_holder);
    let tx = permit_holder.begin().await.unwrap();
    let permit = tx
        .try_acquire_permit(CliExporters, one)
        .await
        .unwrap()
        .expect("a free permit");
    let permit_waiter = connect_url(&url, "cli-permit-waiter").await;
    let permit_waiter_pid = pid(&permit_waiter).await;
    let mut permit_waiter = LockClient::new(&locker, permit_waiter);
    let permit_waiting = tokio::spawn(async move {
        let tx = permit_waiter.begin().await.unwrap();
        drop(tx.acquire_permit(CliExporters, one).await.unwrap());
        tx.rollback().await.unwrap();
    });
    wait_until_waiting(&observer, permit_waiter_pid).await;

    // A SessionLock in its default form: a transaction lock, held in a
    // transaction of its own connection.
    let config: tokio_postgres::Config = url.parse().unwrap();
    let session = SessionLock::new(config)
        .lock(CliScoped { id: 1 })
        .await
        .unwrap();

    let inspect = |extra: &[&str]| {
        let mut args = vec![
            "--url",
            url.as_str(),
            "inspect",
            "-n",
            "cli.many",
            "-n",
            "cli.exporters",
        ];
        args.extend_from_slice(extra);
        let started = Instant::now();
        let out = lockkit(&args);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        println!("lockkit inspect {extra:?}: {:?}", started.elapsed());
        stdout(&out)
    };

    // The summary, by default.
    let text = inspect(&[]);
    let lines: Vec<&str> = text.lines().collect();
    println!(
        "the summary of {MANY} held locks, {} lines:\n{text}",
        lines.len()
    );
    assert!(lines.len() <= 40, "{} lines:\n{text}", lines.len());
    assert!(
        lines[0].contains(&format!("{} held", MANY + 2))
            && lines[0].contains("awaited by 2 session(s)"),
        "{text}"
    );
    assert!(text.contains("--full lists every lock"), "{text}");
    let top = lines
        .iter()
        .position(|l| l.trim_start().starts_with("PID"))
        .unwrap_or_else(|| panic!("no holders in\n{text}"));
    assert!(
        lines[top + 1]
            .trim_start()
            .starts_with(&format!("{holder_pid} "))
            && lines[top + 1].contains(" 5000 "),
        "the largest holder first:\n{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.trim_start().starts_with("cli.many ") && l.contains(" 5000 ")),
        "{text}"
    );
    assert!(
        text.contains("semaphore cli.exporters: 1 permit(s) held, 1 session(s) wait"),
        "{text}"
    );
    assert!(
        text.contains("try_acquire_permit a permit of semaphore cli.exporters"),
        "a permit held is a permit: {text}"
    );
    // The session lock's row: its scope is the transaction it holds.
    let session_line = text
        .lines()
        .find(|l| {
            l.trim_start()
                .starts_with(&format!("{} ", session.backend_pid()))
        })
        .unwrap_or_else(|| panic!("no holder line of the session lock in\n{text}"));
    assert!(session_line.contains(" transaction "), "{session_line}");

    // Every lock with --full.
    let full = inspect(&["--full"]);
    assert!(
        full.lines().count() > MANY as usize,
        "{} lines",
        full.lines().count()
    );
    assert!(
        full.contains(&format!("{permit_waiter_pid} [cli-permit-waiter] waits"))
            && full.contains("for a permit of semaphore cli.exporters (slot 0)")
            && full.contains("acquire_permit semaphore cli.exporters"),
        "{}",
        full.split("wait chains").nth(1).unwrap_or(&full)
    );
    assert!(!full.contains("1×semaphore"), "a permit is a permit");

    // JSON: the semaphore's name, the scopes.
    let out = lockkit(&["--url", &url, "inspect", "--json", "-n", "cli.exporters"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let semaphore = doc["semaphores"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["base"] == semaphore_base(CliExporters.lock_key()))
        .unwrap_or_else(|| panic!("no semaphore in {doc:#}"));
    assert_eq!(semaphore["name"], "cli.exporters");
    let scope_of = |pid: i32| {
        doc["locks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["pid"] == pid && l["granted"] == true)
            .unwrap_or_else(|| panic!("no lock of {pid}"))["scope"]
            .clone()
    };
    assert_eq!(scope_of(session.backend_pid()), "transaction");
    // A plain session idle in transaction: either kind, so not guessed.
    assert_eq!(scope_of(holder_pid), "unknown");

    // The wait-for graph, in both formats.
    let p = |pid: i32| format!("p{pid}");
    let expect = |nodes: &BTreeMap<String, String>, edges: &[(String, String, String)]| {
        let ids: BTreeSet<&str> = nodes.keys().map(String::as_str).collect();
        // Every holder, the session lock's too, which nobody waits for.
        let want: BTreeSet<String> = [
            holder_pid,
            waiter_pid,
            permit_holder_pid,
            permit_waiter_pid,
            session.backend_pid(),
        ]
        .map(p)
        .into();
        assert_eq!(ids, want.iter().map(String::as_str).collect(), "{nodes:?}");
        assert!(
            nodes[&p(holder_pid)].contains("[cli-many-holder] ")
                && nodes[&p(holder_pid)].contains("idle in transaction, transaction ")
                && nodes[&p(holder_pid)].contains("(cli.many) and 4997 more"),
            "{nodes:?}"
        );
        assert_eq!(edges.len(), 2, "{edges:?}");
        let edge = |from: i32, to: i32| {
            edges
                .iter()
                .find(|(f, t, _)| *f == p(from) && *t == p(to))
                .unwrap_or_else(|| panic!("no edge {from} -> {to} in {edges:?}"))
                .2
                .clone()
        };
        let key = (tag << 48) | 7;
        assert!(
            edge(waiter_pid, holder_pid).starts_with(&format!("exclusive {key} (cli.many)")),
            "{edges:?}"
        );
        assert!(
            edge(permit_waiter_pid, permit_holder_pid)
                .starts_with("a permit of semaphore cli.exporters (slot 0)"),
            "{edges:?}"
        );
    };
    let dot_text = inspect(&["--graph", "dot"]);
    let (nodes, edges) = parse_dot(&dot_text);
    expect(&nodes, &edges);
    let mermaid_text = inspect(&["--graph", "mermaid"]);
    let (nodes, edges) = parse_mermaid(&mermaid_text);
    expect(&nodes, &edges);
    render_with_graphviz(&dot_text, "cli.exporters");

    assert!(session.release().await.unwrap());
    drop(permit);
    tx.rollback().await.unwrap();
    permit_waiting.await.unwrap();
    holder.batch_execute("ROLLBACK").await.unwrap();
    waiting.await.unwrap();
}

/// Renders `dot_text` with Graphviz (`dot -Tsvg`): it must render, and
/// the picture must hold `expect`. Without
/// `dot`, the test fails under CI (`CI=true`), where `.ci/run` installs
/// it, and says why it skips elsewhere.
pub(super) fn render_with_graphviz(dot_text: &str, expect: &str) {
    use std::io::Write as _;
    let child = Command::new("dot")
        .arg("-Tsvg")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("Graphviz `dot` is needed under CI (apt-get install graphviz): {e}")
        }
        Err(e) => {
            println!("skipped rendering the DOT graph: Graphviz `dot` cannot run here ({e})");
            return;
        }
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(dot_text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "dot -Tsvg refused the graph: {}\n{dot_text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let svg = String::from_utf8_lossy(&out.stdout);
    assert!(svg.contains("<svg") && svg.contains(expect), "{svg}");
}
