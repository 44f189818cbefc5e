//! The `lockkit` binary end to end, against the real test server.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use lockkit::{KeySpec, LockKey};
use lockkit_tests::observe::{
    wait_until_keepalive_ran, wait_until_waiting, wait_until_waiting_for, Awaited,
};
use lockkit_tests::TestServer;
use serde_json::Value;
use tokio_postgres::{Client, NoTls};

// The topics of issue 47, in files of their own (one test binary).
#[path = "cli/bounds.rs"]
mod bounds;
#[path = "cli/inspect_many.rs"]
mod inspect_many;
#[path = "cli/inspect_waits.rs"]
mod inspect_waits;
#[path = "cli/pooler.rs"]
mod pooler;
#[path = "cli/refused.rs"]
mod refused;

fn lockkit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockkit"))
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run lockkit")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

async fn connect_as(db: &TestServer, user: Option<&str>, app: &str) -> Client {
    let mut config = db.config();
    config.application_name(app);
    if let Some(user) = user {
        config.user(user);
    }
    let (client, connection) = config.connect(NoTls).await.expect("connect");
    tokio::spawn(connection);
    client
}

async fn pid(client: &Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

#[test]
fn key_prints_the_golden_vectors() {
    let out = lockkit(&["key", "Order", "i:42"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("-7205368663365046133"), "{text}");
    assert!(text.contains("(-1677652607, 1483026571)"), "{text}");
    assert!(text.contains("tag 0x9c01"), "{text}");

    let out = lockkit(&["key", "Event", "s:a1b2c3d4", "--stripes", "1024", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["bigint"]["key"], 5974306380683673735_i64);
    assert_eq!(doc["pair"]["class"], 1391066944);
    assert_eq!(doc["pair"]["object"], 135);
    let id = LockKey::BigInt(5974306380683673735).to_pg_locks();
    assert_eq!(doc["bigint"]["classid"], id.classid);
    assert_eq!(doc["bigint"]["objid"], id.objid);

    let out = lockkit(&["key", "Tenanted", "s:acme", "u64:1001", "--json"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["bigint"]["key"], -297873912991975939_i64);
    // A digit-only string field is a string: another key.
    let out = lockkit(&["key", "Tenanted", "s:acme", "s:1001", "--json"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_ne!(doc["bigint"]["key"], -297873912991975939_i64);
    assert_eq!(
        doc["bigint"]["key"],
        match KeySpec::new("Tenanted").key_of(&("acme", "1001")) {
            LockKey::BigInt(v) => v,
            LockKey::Pair(..) => unreachable!(),
        }
    );

    let out = lockkit(&["key", "bad namespace", "i:1"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("invalid namespace"),
        "{}",
        stderr(&out)
    );
}

/// Issue 12: `key shop.resource Account 1` printed a string's key for an
/// enum variant. Untyped values are refused now, and the variant's key is
/// the derive's.
#[test]
fn key_refuses_untyped_values_and_encodes_variants() {
    let out = lockkit(&["key", "shop.resource", "Account", "1"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("variant:Account") && err.contains("s:Account"),
        "{err}"
    );
    assert!(stdout(&out).is_empty());

    let out = lockkit(&[
        "key",
        "shop.resource",
        "variant:Account",
        "i:1",
        "--form",
        "bigint",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("-6857701621899833428"),
        "{}",
        stdout(&out)
    );
    assert!(!stdout(&out).contains("Pair"), "{}", stdout(&out));

    for (args, want) in [
        (&["key", "--form", "raw", "i64:9"][..], "BigInt     9 "),
        (
            &["key", "--form", "raw", "i32:1", "i32:-2"][..],
            "Pair       (1, -2)",
        ),
        (
            &["key", "--form", "hashtext", "s:payroll-1405-01"][..],
            "-1493109243",
        ),
        (
            &["key", "--form", "exact", "--class", "7", "Account", "i32:5"][..],
            "(7, 5)",
        ),
    ] {
        let out = lockkit(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert!(stdout(&out).contains(want), "{args:?}: {}", stdout(&out));
    }
    let out = lockkit(&["key", "--form", "raw", "Legacy", "i64:9"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no namespace"), "{}", stderr(&out));
    let out = lockkit(&["key", "--help"]);
    assert!(stdout(&out).contains("docs/KEYS.md"), "{}", stdout(&out));
    assert!(stdout(&out).contains("variant:Name"), "{}", stdout(&out));
}

/// A hostile value that nests deeply (`((((…`, `some:some:…`, `seq:[seq:[…`,
/// well within the argument length limit) is refused with a clear error and
/// exit code 1; the recursive parser overflowed the stack and aborted the
/// process (exit 134) instead. Out-of-range integers say "out of range"
/// rather than "not an integer".
#[test]
fn key_refuses_deep_nesting_and_says_out_of_range() {
    let deep = [
        "(".repeat(100_000),
        format!("{}i:1{}", "(".repeat(5_000), ")".repeat(5_000)),
        format!("{}i:1", "some:".repeat(20_000)),
        format!("{}i:1", "seq:[".repeat(20_000)),
        format!("{}i:1", "variant:A(".repeat(10_000)),
    ];
    for arg in &deep {
        let out = lockkit(&["key", "Order", arg]);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{}…: {}",
            &arg[..20],
            stderr(&out)
        );
        assert!(stderr(&out).contains("nest"), "{}", stderr(&out));
        assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
    }
    // Nesting a real type would use still works.
    let ok = format!("{}i:1", "some:".repeat(32));
    let out = lockkit(&["key", "Order", &ok]);
    assert!(out.status.success(), "{}", stderr(&out));

    for arg in [
        "i:999999999999999999999999999999999999999999999",
        "u128:340282366920938463463374607431768211456",
        "i:-170141183460469231731687303715884105729",
    ] {
        let out = lockkit(&["key", "Order", arg]);
        assert_eq!(out.status.code(), Some(1), "{arg}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("out of range"),
            "{arg}: {}",
            stderr(&out)
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn inspect_shows_holders_waiters_and_the_chain() {
    let db = TestServer::shared();
    let _log = db.guard();
    let holder = connect_as(db, None, "cli-holder").await;
    let waiter = connect_as(db, None, "cli-waiter").await;
    let observer = db.connect().await;
    let key = match KeySpec::new("CliOrder").key_of(&7_i64) {
        LockKey::BigInt(v) => v,
        LockKey::Pair(..) => unreachable!(),
    };
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .unwrap();
    let (holder_pid, waiter_pid) = (pid(&holder).await, pid(&waiter).await);
    let waiting = tokio::spawn(async move {
        waiter
            .execute("SELECT pg_advisory_lock($1)", &[&key])
            .await
            .unwrap();
        waiter
    });
    wait_until_waiting(&observer, waiter_pid).await;

    let url = db.url();
    let out = lockkit(&["--url", url, "inspect", "--json", "-n", "CliOrder"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let locks = doc["locks"].as_array().unwrap();
    let of = |pid: i32| {
        locks
            .iter()
            .find(|l| l["pid"] == pid && l["key"]["key"] == key)
            .unwrap_or_else(|| panic!("no row of {pid} in {doc:#}"))
    };
    let held = of(holder_pid);
    assert_eq!(held["granted"], true);
    assert_eq!(held["mode"], "exclusive");
    assert_eq!(held["application_name"], "cli-holder");
    assert_eq!(held["types"][0]["namespace"], "CliOrder");
    let waits = of(waiter_pid);
    assert_eq!(waits["granted"], false);
    assert_eq!(waits["blocked_by"], serde_json::json!([holder_pid]));
    assert!(waits["waited_seconds"].as_f64().is_some());
    assert!(waits["query"]
        .as_str()
        .unwrap()
        .contains("pg_advisory_lock"));

    let out = lockkit(&["--url", url, "inspect", "-n", "CliOrder"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let chain = text
        .split("wait chains")
        .nth(1)
        .expect("a wait chain section");
    let root = format!("{holder_pid} [cli-holder] holds exclusive {key} (CliOrder)");
    assert!(chain.contains(&root), "{text}");
    assert!(
        chain.contains(&format!("└── {waiter_pid} [cli-waiter] waits")),
        "{text}"
    );

    // `check` counts them among the advisory locks, and sees no pooler.
    let out = lockkit(&["--url", url, "check", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let check: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(check["advisory_locks"].as_i64().unwrap() >= 2);
    assert_eq!(check["hot_standby"], false);
    assert_eq!(check["transaction_pooled"], false);
    let row = observer
        .query_one(
            "SELECT current_setting('max_locks_per_transaction')::int8 * \
             (current_setting('max_connections')::int8 + current_setting('autovacuum_max_workers')::int8 + 1 \
              + current_setting('max_worker_processes')::int8 + current_setting('max_wal_senders')::int8 \
              + current_setting('max_prepared_transactions')::int8)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(check["lock_table_capacity"], row.get::<_, i64>(0));
    let out = lockkit(&["--url", url, "check"]);
    assert!(stdout(&out).contains("lock table"), "{}", stdout(&out));

    holder
        .execute("SELECT pg_advisory_unlock($1)", &[&key])
        .await
        .unwrap();
    let waiter = waiting.await.unwrap();
    waiter
        .execute("SELECT pg_advisory_unlock($1)", &[&key])
        .await
        .unwrap();
}

/// A waiter blocked by a prepared transaction: `pg_blocking_pids` names the
/// prepared transaction as process 0. The wait chain drew a root
/// `0 (holds no lock shown here)` although the table lists the prepared
/// transaction's lock just above it; it must name the prepared transaction
/// as the holder.
#[tokio::test(flavor = "multi_thread")]
async fn inspect_names_a_prepared_transaction_as_the_blocker() {
    let db = TestServer::builder()
        .setting("max_prepared_transactions", "2")
        .start();
    let _log = db.guard();
    let preparer = db.connect().await;
    let waiter = connect_as(&db, None, "cli-prep-waiter").await;
    let observer = db.connect().await;
    let key = match KeySpec::new("CliPrepared").key_of(&1_i64) {
        LockKey::BigInt(v) => v,
        LockKey::Pair(..) => unreachable!(),
    };
    preparer
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({key}); PREPARE TRANSACTION 'cli-prepared'"
        ))
        .await
        .unwrap();
    let waiter_pid = pid(&waiter).await;
    let waiting = tokio::spawn(async move {
        waiter
            .execute("SELECT pg_advisory_xact_lock($1)", &[&key])
            .await
            .unwrap();
    });
    wait_until_waiting(&observer, waiter_pid).await;

    let out = lockkit(&["--url", db.url(), "inspect", "-n", "CliPrepared"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let chain = text
        .split("wait chains")
        .nth(1)
        .unwrap_or_else(|| panic!("a wait chain section: {text}"));
    assert!(!chain.contains("holds no lock shown here"), "{text}");
    assert!(
        chain.contains(&format!(
            "prepared transaction holds exclusive {key} (CliPrepared)"
        )),
        "{text}"
    );
    assert!(
        chain.contains(&format!("└── {waiter_pid} [cli-prep-waiter] waits")),
        "{text}"
    );

    preparer
        .batch_execute("ROLLBACK PREPARED 'cli-prepared'")
        .await
        .unwrap();
    waiting.await.unwrap();
}

/// An invalid `--watch` interval (`inf`, or too large for a duration) is an
/// error before anything else happens: it was found only after connecting
/// and printing the first inspection, and a wrong URL hid it.
#[test]
fn inspect_checks_the_watch_interval_first() {
    for watch in ["inf", "1e300"] {
        let out = lockkit(&[
            "--url",
            "postgres://postgres@127.0.0.1:1/postgres",
            "inspect",
            "--watch",
            watch,
        ]);
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("invalid --watch interval"),
            "{watch}: {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "{}", stdout(&out));
    }
}

/// `lockkit … | head`: stdout closed by its reader. `print!` panicked
/// ("failed printing to stdout: Broken pipe", exit 101); the run now ends
/// quietly. The pipe's reader is gone before lockkit starts (a FIFO opened
/// read-write to open its write end, then closed), so the write fails for
/// certain.
#[cfg(target_os = "linux")]
#[test]
fn a_closed_stdout_is_not_a_panic() {
    use std::fs::OpenOptions;
    use std::process::Stdio;

    let dir = std::env::temp_dir().join(format!("lockkit-cli-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("out");
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    for args in [
        &["key", "Order", "i:42"][..],
        &["key", "Order", "i:42", "--json"][..],
    ] {
        let reader = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&fifo)
            .unwrap();
        let writer = OpenOptions::new().write(true).open(&fifo).unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_lockkit"))
            .args(args)
            .env_remove("DATABASE_URL")
            .stdout(Stdio::from(writer))
            .stderr(Stdio::piped())
            .output()
            .expect("run lockkit");
        assert!(
            !stderr(&out).contains("panicked"),
            "{args:?}: {}",
            stderr(&out)
        );
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn clear_errors_for_url_refusal_and_permissions() {
    let out = lockkit(&["inspect"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("pass --url or set DATABASE_URL"),
        "{}",
        stderr(&out)
    );

    let out = lockkit(&["--url", "postgres://u@localhost:notaport/db", "check"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("invalid connection URL"),
        "{}",
        stderr(&out)
    );

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let refused = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let out = lockkit(&["--url", &refused, "inspect"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("connection refused at 127.0.0.1"),
        "{}",
        stderr(&out)
    );

    let db = TestServer::shared();
    let _log = db.guard();
    let admin = db.connect().await;
    let url = db.create_database("lockkit_cli_noconnect").await;
    admin
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE lockkit_cli_user LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
             REVOKE CONNECT ON DATABASE lockkit_cli_noconnect FROM PUBLIC",
        )
        .await
        .unwrap();
    let denied = url.replacen("postgres@", "lockkit_cli_user@", 1);
    let out = lockkit(&["--url", &denied, "inspect"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("permission denied"),
        "{}",
        stderr(&out)
    );

    // A role without pg_read_all_stats sees others' locks, not their queries.
    let key = 0x5151_i64;
    admin
        .execute("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .unwrap();
    let viewer = db.url().replacen("postgres@", "lockkit_cli_user@", 1);
    let out = lockkit(&["--url", &viewer, "inspect"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("pg_read_all_stats"),
        "{}",
        stdout(&out)
    );
    // Control: the superuser sees the query.
    let out = lockkit(&["--url", db.url(), "inspect", "--json"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = doc["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["key"]["key"] == key)
        .expect("the admin's lock");
    assert_eq!(row["query_hidden"], false);
    admin
        .execute("SELECT pg_advisory_unlock($1)", &[&key])
        .await
        .unwrap();
}

/// Issue 12: scope, holder state, transaction age, application_name and the
/// namespace tag of an unregistered type, on a real server, with a session
/// lock held by an idle session and a transaction lock held by a session
/// idle in transaction. The key types come from a namespaces file and the
/// environment instead of `-n`.
#[tokio::test(flavor = "multi_thread")]
async fn inspect_shows_scope_state_age_and_tags() {
    let db = TestServer::shared();
    let _log = db.guard();
    let session_holder = connect_as(db, None, "cli-session-holder").await;
    let tx_holder = connect_as(db, None, "cli-tx-holder").await;
    let bigint = |ns: &str, v: i64| match KeySpec::new(ns).key_of(&v) {
        LockKey::BigInt(v) => v,
        LockKey::Pair(..) => unreachable!(),
    };
    let (session_key, tx_key, unknown_key) = (
        bigint("CliScopeSession", 1),
        bigint("CliScopeTx", 2),
        bigint("CliScopeUnregistered", 3),
    );
    session_holder
        .execute("SELECT pg_advisory_lock($1)", &[&session_key])
        .await
        .unwrap();
    tx_holder.batch_execute("BEGIN").await.unwrap();
    tx_holder
        .execute(
            "SELECT pg_advisory_xact_lock($1), pg_advisory_xact_lock($2)",
            &[&tx_key, &unknown_key],
        )
        .await
        .unwrap();
    let (session_pid, tx_pid) = (pid(&session_holder).await, pid(&tx_holder).await);
    // `execute(&str)` and `query_one(&str)` close their named statements
    // after the reply, with a Close and a Sync that move the holder's
    // `state_change`; one processed after the inspection began would rightly
    // make the session lock `unknown`. A last round trip with no named
    // statement leaves the holder with nothing in flight.
    session_holder.batch_execute("SELECT 1").await.unwrap();

    let dir = std::env::temp_dir().join(format!("lockkit-cli-ns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("namespaces");
    std::fs::write(&file, "# registered once\nCliScopeSession\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lockkit"))
        .args(["--url", db.url(), "inspect", "--json"])
        .env("LOCKKIT_NAMESPACES_FILE", &file)
        .env("LOCKKIT_NAMESPACES", "CliScopeTx")
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let locks = doc["locks"].as_array().unwrap();
    let of = |pid: i32, key: i64| {
        locks
            .iter()
            .find(|l| l["pid"] == pid && l["key"]["key"] == key)
            .unwrap_or_else(|| panic!("no row of {pid} in {doc:#}"))
    };
    let s = of(session_pid, session_key);
    assert_eq!(s["scope"], "session", "{s:#}");
    assert_eq!(s["state"], "idle");
    assert_eq!(s["application_name"], "cli-session-holder");
    assert!(s["transaction_age_seconds"].is_null(), "{s:#}");
    assert_eq!(s["types"][0]["namespace"], "CliScopeSession");
    let t = of(tx_pid, tx_key);
    // Idle in transaction: it may hold either kind, so it is not guessed.
    assert_eq!(t["scope"], "unknown", "{t:#}");
    assert_eq!(t["state"], "idle in transaction");
    assert_eq!(t["application_name"], "cli-tx-holder");
    assert!(
        t["transaction_age_seconds"].as_f64().unwrap() >= 0.0,
        "{t:#}"
    );
    assert_eq!(t["types"][0]["namespace"], "CliScopeTx");
    let u = of(tx_pid, unknown_key);
    assert!(u["types"].as_array().unwrap().is_empty());
    let tag = KeySpec::new("CliScopeUnregistered").tag();
    assert_eq!(u["tag"], tag);

    let out = Command::new(env!("CARGO_BIN_EXE_lockkit"))
        .args(["--url", db.url(), "inspect"])
        .env("LOCKKIT_NAMESPACES_FILE", &file)
        .env_remove("LOCKKIT_NAMESPACES")
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let text = stdout(&out);
    let line = |pid: i32, key: i64| {
        text.lines()
            .find(|l| l.starts_with(&format!("{pid} ")) && l.contains(&format!(" {key} ")))
            .unwrap_or_else(|| panic!("no line of {pid} {key} in\n{text}"))
            .to_owned()
    };
    let s = line(session_pid, session_key);
    assert!(
        s.contains(" session ") && s.contains(" idle ") && s.contains("CliScopeSession"),
        "{s}"
    );
    let t = line(tx_pid, tx_key);
    assert!(
        t.contains(" unknown ") && t.contains("idle in transaction"),
        "{t}"
    );
    // Not registered this time: the tag names it.
    assert!(
        t.contains(&format!("? tag 0x{:04x}", KeySpec::new("CliScopeTx").tag())),
        "{t}"
    );
    assert!(
        text.contains("SCOPE") && text.contains("XACT AGE"),
        "{text}"
    );

    tx_holder.batch_execute("COMMIT").await.unwrap();
    session_holder
        .execute("SELECT pg_advisory_unlock($1)", &[&session_key])
        .await
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The CLI's own connections carry `application_name = lockkit-cli`.
#[tokio::test(flavor = "multi_thread")]
async fn the_cli_sets_its_application_name() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockkit"))
        .args(["--url", db.url(), "inspect", "--watch", "0.2", "--json"])
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let seen = loop {
        let n: i64 = observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() \
                 AND application_name = 'lockkit-cli'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if n > 0 {
            break true;
        }
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(seen, "no session named lockkit-cli while the CLI ran");
}

async fn connect_url(url: &str, app: &str) -> Client {
    let mut config: tokio_postgres::Config = url.parse().unwrap();
    config.application_name(app);
    let (client, connection) = config.connect(NoTls).await.expect("connect");
    tokio::spawn(connection);
    client
}

/// Issue 14: `inspect --all` shows a stuck DDL lock queue in the wait-chain
/// tree: a long reader, the ALTER TABLE waiting behind it, and a new reader
/// queued behind the ALTER TABLE.
#[tokio::test(flavor = "multi_thread")]
async fn inspect_all_shows_a_ddl_lock_queue() {
    let db = TestServer::shared();
    let _log = db.guard();
    let url = db.create_database("lockkit_cli_ddl").await;
    let setup = connect_url(&url, "cli-setup").await;
    setup
        .batch_execute("CREATE TABLE accounts (id int8 PRIMARY KEY)")
        .await
        .unwrap();
    let reader = connect_url(&url, "cli-long-reader").await;
    reader
        .batch_execute("BEGIN; SELECT count(*) FROM accounts")
        .await
        .unwrap();
    let alter = connect_url(&url, "cli-migration").await;
    let new_reader = connect_url(&url, "cli-new-reader").await;
    let (reader_pid, alter_pid, new_pid) = (
        pid(&reader).await,
        pid(&alter).await,
        pid(&new_reader).await,
    );
    let altering = tokio::spawn(async move {
        alter
            .batch_execute("ALTER TABLE accounts ADD COLUMN note text")
            .await
            .unwrap();
    });
    wait_until_waiting_for(&setup, alter_pid, Awaited::Relation).await;
    let reading = tokio::spawn(async move {
        new_reader
            .batch_execute("SELECT count(*) FROM accounts")
            .await
            .unwrap();
    });
    wait_until_waiting_for(&setup, new_pid, Awaited::Relation).await;

    let out = lockkit(&["--url", &url, "inspect", "--all", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rel = doc["relation_locks"].as_array().unwrap();
    let of = |pid: i32| {
        rel.iter()
            .find(|l| l["pid"] == pid && l["relation"] == "accounts")
            .unwrap_or_else(|| panic!("no relation row of {pid} in {doc:#}"))
    };
    let r = of(reader_pid);
    assert_eq!(
        (r["granted"].clone(), r["mode"].clone()),
        (true.into(), "AccessShareLock".into())
    );
    assert_eq!(r["state"], "idle in transaction");
    let a = of(alter_pid);
    assert_eq!(a["granted"], false);
    assert_eq!(a["mode"], "AccessExclusiveLock");
    assert_eq!(a["blocked_by"], serde_json::json!([reader_pid]));
    let n = of(new_pid);
    assert_eq!(n["granted"], false);
    assert_eq!(n["blocked_by"], serde_json::json!([alter_pid]));

    let out = lockkit(&["--url", &url, "inspect", "--all"]);
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    let root = lines
        .iter()
        .position(|l| {
            l.starts_with(&format!(
                "{reader_pid} [cli-long-reader] holds AccessShareLock on accounts"
            ))
        })
        .unwrap_or_else(|| panic!("no root line in\n{text}"));
    assert!(lines[root].contains("idle in transaction"), "{text}");
    assert!(
        lines[root + 1].starts_with(&format!("└── {alter_pid} [cli-migration] waits"))
            && lines[root + 1].contains("for AccessExclusiveLock on accounts"),
        "{text}"
    );
    assert!(
        lines[root + 2].starts_with(&format!("    └── {new_pid} [cli-new-reader] waits"))
            && lines[root + 2].contains("for AccessShareLock on accounts"),
        "{text}"
    );
    // Without --all, relation locks are not shown, but with no advisory
    // lock to show, inspect says that sessions wait and points at --all
    // (issue 29).
    let out = lockkit(&["--url", &url, "inspect"]);
    let text = stdout(&out);
    assert!(!text.contains("AccessExclusiveLock"), "{text}");
    assert!(
        text.contains("no advisory locks held or awaited")
            && text.contains("2 session(s) wait for relation locks")
            && text.contains("`lockkit inspect --all`"),
        "{text}"
    );

    reader.batch_execute("COMMIT").await.unwrap();
    altering.await.unwrap();
    reading.await.unwrap();
}

/// Issue 14: `check` reports the lock settings, their meaning and the
/// recommendations that apply; the keep-alive is a flag.
#[tokio::test(flavor = "multi_thread")]
async fn check_reports_the_lock_settings() {
    let db = TestServer::shared();
    let _log = db.guard();
    let url = db.create_database("lockkit_cli_settings").await;
    let admin = db.connect().await;
    admin
        .batch_execute(
            "ALTER DATABASE lockkit_cli_settings SET log_lock_waits = off; \
             ALTER DATABASE lockkit_cli_settings SET lock_timeout = '250ms'; \
             ALTER DATABASE lockkit_cli_settings SET idle_in_transaction_session_timeout = '4s'; \
             ALTER DATABASE lockkit_cli_settings SET idle_session_timeout = '3s'",
        )
        .await
        .unwrap();
    let settings = |doc: &Value| -> Vec<Value> { doc["settings"].as_array().unwrap().clone() };
    let find = |list: &[Value], name: &str| {
        list.iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {list:#?}"))
            .clone()
    };
    let out = lockkit(&["--url", &url, "check", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let list = settings(&doc);
    let names: Vec<&str> = list.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "log_lock_waits",
            "deadlock_timeout",
            "lock_timeout",
            "statement_timeout",
            "idle_in_transaction_session_timeout",
            "idle_session_timeout"
        ]
    );
    assert_eq!(find(&list, "log_lock_waits")["value"], "off");
    assert!(find(&list, "log_lock_waits")["recommendation"].is_string());
    assert_eq!(find(&list, "lock_timeout")["value"], "250ms");
    assert!(find(&list, "lock_timeout")["meaning"]
        .as_str()
        .unwrap()
        .contains("55P03"));
    // The server's own deadlock_timeout, as the server shows it.
    let shown: String = admin
        .query_one("SHOW deadlock_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(find(&list, "deadlock_timeout")["value"], shown.as_str());
    assert_eq!(find(&list, "statement_timeout")["value"], "off");
    // The keep-alive assumed is SessionLock's own default (issue 29).
    assert_eq!(
        doc["session_keepalive_seconds"],
        lockkit::pg::DEFAULT_KEEPALIVE.as_secs_f64()
    );
    let idle_tx = find(&list, "idle_in_transaction_session_timeout");
    assert_eq!(idle_tx["value"], "4s");
    assert!(idle_tx["recommendation"]
        .as_str()
        .unwrap()
        .contains("keep-alive"));
    assert!(find(&list, "idle_session_timeout")["recommendation"].is_string());

    // With a 2 s keep-alive both idle timeouts are longer: no recommendation.
    let out = lockkit(&["--url", &url, "check", "--json", "--session-keepalive", "2"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let list = settings(&doc);
    assert!(find(&list, "idle_in_transaction_session_timeout")["recommendation"].is_null());
    assert!(find(&list, "idle_session_timeout")["recommendation"].is_null());

    let out = lockkit(&["--url", &url, "check"]);
    let text = stdout(&out);
    assert!(text.contains("lock settings"), "{text}");
    assert!(
        text.contains("log_lock_waits") && text.contains("recommendation: turn it on"),
        "{text}"
    );
    assert!(
        text.contains("idle_in_transaction_session_timeout") && text.contains("4s"),
        "{text}"
    );
}

#[derive(lockkit::AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "cli.published")]
struct CliPublished {
    id: i64,
}

#[derive(lockkit::AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "cli.session-type")]
struct CliSessionType {
    id: i64,
}

/// Issue 29: `inspect` names key types that nobody registered with it:
/// those an application published to the server and those a session lock's
/// `application_name` carries; it shows the lockkit call of each session;
/// a tag still unknown comes with how to make it known; two published
/// namespaces on one tag are a collision. The control is the same locks
/// inspected before the application published its types.
#[tokio::test(flavor = "multi_thread")]
async fn inspect_names_published_types_calls_and_session_locks() {
    use lockkit::{Batch, Config, LockClient, Locker, SessionLock};

    let db = TestServer::shared();
    let _log = db.guard();
    let url = db.create_database("lockkit_cli_published").await;
    let config: tokio_postgres::Config = url.parse().unwrap();
    let session = SessionLock::new(config.clone())
        .lock(CliSessionType { id: 1 })
        .await
        .unwrap();

    let holder = connect_url(&url, "cli-batch-holder").await;
    let holder_pid = pid(&holder).await;
    let locker = Locker::new(&holder, Config::default()).await.unwrap();
    let mut holder = LockClient::new(&locker, holder);
    let tx = holder.begin().await.unwrap();
    let batch = Batch::new()
        .with(&CliPublished { id: 1 })
        .with(&CliPublished { id: 2 })
        .with(&CliPublished { id: 3 });
    let held = tx.lock_batch(&batch).await.unwrap();

    let waiter = connect_url(&url, "cli-one-waiter").await;
    let waiter_pid = pid(&waiter).await;
    let mut waiter = LockClient::new(&locker, waiter);
    let waiting = tokio::spawn(async move {
        let tx = waiter.begin().await.unwrap();
        drop(tx.lock(CliPublished { id: 2 }).await.unwrap());
        tx.rollback().await.unwrap();
    });
    let observer = connect_url(&url, "cli-observer").await;
    wait_until_waiting(&observer, waiter_pid).await;

    let inspect_text = || {
        let out = lockkit(&["--url", &url, "inspect"]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let line_of = |text: &str, pid: i32| -> String {
        text.lines()
            .find(|l| l.starts_with(&format!("{pid} ")))
            .unwrap_or_else(|| panic!("no row of {pid} in\n{text}"))
            .to_owned()
    };
    let tag = format!("? tag 0x{:04x}", KeySpec::new("cli.published").tag());

    // Before publishing: unknown, with the way to make it known.
    let text = inspect_text();
    let row = line_of(&text, holder_pid);
    assert!(row.contains(&tag), "{text}");
    assert!(row.contains(&format!("lock_batch 3×{tag}")), "{text}");
    assert!(
        text.contains("key(s) of unknown types") && text.contains("publish_key_types"),
        "{text}"
    );
    // The session lock is named by its connection, without configuration.
    let row = line_of(&text, session.backend_pid());
    assert!(
        row.contains("session lock cli.session-type") && row.contains(" cli.session-type "),
        "{text}"
    );

    // The application publishes its types; twice is the same.
    let mut publisher = connect_url(&url, "cli-publisher").await;
    let n = locker
        .publish_key_types(&mut publisher, "cli-test-app")
        .await
        .unwrap();
    assert!(n >= 2, "{n}");
    assert_eq!(
        locker
            .publish_key_types(&mut publisher, "cli-test-app")
            .await
            .unwrap(),
        n
    );
    let text = inspect_text();
    let row = line_of(&text, holder_pid);
    assert!(
        row.contains(" cli.published ") && row.contains("lock_batch 3×cli.published"),
        "{text}"
    );
    let row = line_of(&text, waiter_pid);
    assert!(row.contains("lock 1×cli.published"), "{text}");
    assert!(!text.contains("unknown types"), "{text}");
    assert!(!text.contains("collide"), "{text}");
    let out = lockkit(&["--url", &url, "inspect", "--json"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let lock = doc["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["pid"] == holder_pid)
        .unwrap()
        .clone();
    assert_eq!(lock["types"][0]["namespace"], "cli.published");
    assert_eq!(lock["lockkit_call"], "lock_batch 3×cli.published");

    // Another application publishes a namespace with the same tag.
    let tag = KeySpec::new("cli.published").tag();
    let other = (0..10_000_000)
        .map(|i| format!("other{i}"))
        .find(|ns| KeySpec::try_new(ns).unwrap().tag() == tag)
        .expect("a namespace with the same tag");
    observer
        .execute(
            "INSERT INTO public.lockkit_key_types \
             (application, type_name, namespace, form, tag, pair_class) \
             VALUES ('other-app', 'other::Thing', $1, 'bigint', $2, 0)",
            &[&other, &i32::from(tag)],
        )
        .await
        .unwrap();
    let text = inspect_text();
    let warning = text
        .lines()
        .find(|l| l.starts_with("warning: key types collide"))
        .unwrap_or_else(|| panic!("no collision in\n{text}"));
    assert!(
        warning.contains("cli.published (published by cli-test-app)")
            && warning.contains(&format!("{other} (published by other-app)"))
            && warning.contains(&format!("BigInt tag 0x{tag:04x}")),
        "{text}"
    );

    drop(held);
    tx.rollback().await.unwrap();
    waiting.await.unwrap();
    assert!(session.release().await.unwrap());
}

#[derive(lockkit::AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "cli.exports")]
struct CliExports {
    region: i64,
}

/// A semaphore's holders are one entry, text and JSON: three transactions
/// hold a permit of a semaphore of 3 (one slot each, three slot keys in
/// `pg_locks`) and a fourth waits for one; the entry names the semaphore by
/// its base and lists the three holders and the waiter, and no slot key
/// has a row of its own. The control: a permit of another semaphore, held
/// by one of the three, is another entry.
#[tokio::test(flavor = "multi_thread")]
async fn inspect_shows_a_semaphore_as_one_entry() {
    use lockkit::key::{semaphore_base, semaphore_of, SEMAPHORE_CLASS};
    use lockkit::{AdvisoryKey, Config, LockClient, Locker};
    use std::num::NonZeroU8;

    let db = TestServer::shared();
    let _log = db.guard();
    let url = db.create_database("lockkit_cli_semaphore").await;
    let observer = connect_url(&url, "cli-observer").await;
    let locker = Locker::new(&observer, Config::default()).await.unwrap();
    let three = NonZeroU8::new(3).unwrap();
    let (exports, other) = (CliExports { region: 1 }, CliExports { region: 2 });
    let base = semaphore_base(exports.lock_key());
    let other_base = semaphore_base(other.lock_key());
    assert_ne!(base, other_base);

    let mut clients = Vec::new();
    let mut pids = Vec::new();
    for _ in 0..3 {
        let client = connect_url(&url, "cli-permit-holder").await;
        pids.push(pid(&client).await);
        clients.push(LockClient::new(&locker, client));
    }
    let mut txs = Vec::new();
    for c in &mut clients {
        txs.push(c.begin().await.unwrap());
    }
    let mut permits = Vec::new();
    let mut slots = Vec::new();
    for tx in &txs {
        let held = tx
            .try_acquire_permit(exports, three)
            .await
            .unwrap()
            .expect("a free slot");
        let (of, slot) = semaphore_of(held.key()).expect("a slot key");
        assert_eq!(of, base);
        slots.push(slot);
        permits.push(held);
    }
    let mut sorted = slots.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, [0, 1, 2], "three permits, three slots");
    let other_permit = txs[0]
        .try_acquire_permit(other, three)
        .await
        .unwrap()
        .expect("a free slot");

    let waiter = connect_url(&url, "cli-permit-waiter").await;
    let waiter_pid = pid(&waiter).await;
    let mut waiter = LockClient::new(&locker, waiter);
    let waiting = tokio::spawn(async move {
        let tx = waiter.begin().await.unwrap();
        drop(tx.acquire_permit(exports, three).await.unwrap());
        tx.rollback().await.unwrap();
    });
    wait_until_waiting(&observer, waiter_pid).await;

    let hex = |base: i32| format!("0x{:08x}", base as u32);
    let out = lockkit(&["--url", &url, "inspect"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let entry = text
        .lines()
        .find(|l| l.starts_with(&format!("semaphore {}: ", hex(base))))
        .unwrap_or_else(|| panic!("no entry of semaphore {} in\n{text}", hex(base)));
    assert!(entry.contains(": 3 slots held, by "), "{entry}");
    for (pid, slot) in pids.iter().zip(&slots) {
        assert!(
            entry.contains(&format!("{pid} [cli-permit-holder] (slot {slot})")),
            "{entry}"
        );
    }
    assert!(
        entry.contains(&format!(
            "; 1 session waits: {waiter_pid} [cli-permit-waiter] (for slot "
        )),
        "{entry}"
    );
    assert_eq!(
        text.matches(&format!("semaphore {}: ", hex(base))).count(),
        1,
        "one entry: {text}"
    );
    let other_entry = format!(
        "semaphore {}: 1 slot held, by {} [cli-permit-holder] (slot ",
        hex(other_base),
        pids[0]
    );
    assert!(text.contains(&other_entry), "{text}");
    // No slot key has a row in the lock table.
    assert!(!text.contains(&SEMAPHORE_CLASS.to_string()), "{text}");
    assert!(
        text.contains(&format!("└── {waiter_pid} [cli-permit-waiter] waits"))
            && text.contains(&format!("for a permit of semaphore {} (slot ", hex(base))),
        "{text}"
    );

    let out = lockkit(&["--url", &url, "inspect", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        !doc["locks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["key"]["class"] == SEMAPHORE_CLASS),
        "no slot key among the locks: {doc:#}"
    );
    let semaphores = doc["semaphores"].as_array().unwrap();
    assert_eq!(semaphores.len(), 2, "{doc:#}");
    let s = semaphores
        .iter()
        .find(|s| s["base"] == base)
        .unwrap_or_else(|| panic!("no semaphore {base} in {doc:#}"));
    assert_eq!(s["semaphore"], hex(base));
    assert_eq!(s["class"], SEMAPHORE_CLASS);
    assert_eq!(s["held"], 3, "{s:#}");
    assert_eq!(s["waiting"], 1, "{s:#}");
    let holders = s["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 3, "{s:#}");
    for (pid, slot) in pids.iter().zip(&slots) {
        let h = holders
            .iter()
            .find(|h| h["pid"] == *pid)
            .unwrap_or_else(|| panic!("no holder {pid} in {s:#}"));
        assert_eq!(h["slot"], *slot);
        assert_eq!(h["granted"], true);
        assert_eq!(h["key"]["object"], base | i32::from(*slot));
        assert_eq!(h["application_name"], "cli-permit-holder");
        assert!(
            h["lockkit_call"]
                .as_str()
                .unwrap()
                .starts_with("try_acquire_permit "),
            "{h:#}"
        );
    }
    let waiters = s["waiters"].as_array().unwrap();
    assert_eq!(waiters.len(), 1, "{s:#}");
    assert_eq!(waiters[0]["pid"], waiter_pid);
    assert_eq!(waiters[0]["granted"], false);
    assert_eq!(waiters[0]["blocked_by"].as_array().unwrap().len(), 1);
    let o = semaphores.iter().find(|s| s["base"] == other_base).unwrap();
    assert_eq!(o["held"], 1, "{o:#}");
    assert_eq!(o["holders"][0]["pid"], pids[0]);
    assert!(o["waiters"].as_array().unwrap().is_empty());

    drop(other_permit);
    drop(permits);
    for tx in txs {
        tx.rollback().await.unwrap();
    }
    waiting.await.unwrap();
}

/// Issue 29: the CLI reaches a server that takes TLS clients only, with
/// libpq's `sslmode` and `sslrootcert`, from the URL, the key=value string
/// or the options. The controls: plain text is refused by the server; a
/// root certificate that did not sign the server's is refused by the
/// client under verify-ca; a host name the certificate does not name is
/// refused under verify-full and accepted under verify-ca.
#[test]
fn inspect_and_check_over_tls() {
    let (cert, key) = lockkit_tests::tls::certificate();
    let db = TestServer::builder()
        .setting("ssl", "on")
        .data_file("server.crt", cert.to_pem().unwrap())
        .data_file("server.key", key.private_key_to_pem_pkcs8().unwrap())
        .data_file(
            "pg_hba.conf",
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        )
        .start();
    let dir = std::env::temp_dir().join(format!("lockkit-cli-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let root = dir.join("root.crt");
    std::fs::write(&root, cert.to_pem().unwrap()).unwrap();
    let (stranger, _) = lockkit_tests::tls::certificate();
    let wrong_root = dir.join("wrong.crt");
    std::fs::write(&wrong_root, stranger.to_pem().unwrap()).unwrap();
    let root = root.display().to_string();
    let wrong_root = wrong_root.display().to_string();
    let port = db.config().get_ports()[0];
    let kv = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres");
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    // `localhost` as the name the certificate is checked against, the
    // connection made to 127.0.0.1 all the same.
    let by_name = format!("host=localhost hostaddr=127.0.0.1 port={port} user=postgres");

    let ok = |args: &[&str]| {
        let out = lockkit(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        stdout(&out)
    };
    let refused = |args: &[&str]| {
        let out = lockkit(args);
        assert!(
            !out.status.success(),
            "{args:?} connected: {}",
            stdout(&out)
        );
        stderr(&out)
    };

    // The default (prefer) takes TLS when offered; require encrypts.
    ok(&["--url", &kv, "inspect"]);
    ok(&["--url", &format!("{kv} sslmode=require"), "inspect"]);
    // verify-full from the URL, from the key=value string, from options.
    let text = ok(&[
        "--url",
        &format!("{url}?sslmode=verify-full&sslrootcert={root}"),
        "inspect",
    ]);
    assert!(text.contains("no advisory locks"), "{text}");
    ok(&[
        "--url",
        &format!("{kv} sslmode=verify-full sslrootcert='{root}'"),
        "inspect",
    ]);
    let text = ok(&[
        "--url",
        &kv,
        "--sslmode",
        "verify-full",
        "--sslrootcert",
        &root,
        "check",
    ]);
    assert!(text.contains("lock table"), "{text}");
    // verify-ca does not check the host name; verify-full does.
    ok(&[
        "--url",
        &by_name,
        "--sslmode",
        "verify-ca",
        "--sslrootcert",
        &root,
        "inspect",
    ]);
    let err = refused(&[
        "--url",
        &by_name,
        "--sslmode",
        "verify-full",
        "--sslrootcert",
        &root,
        "inspect",
    ]);
    assert!(err.contains("certificate was not accepted"), "{err}");

    // Controls.
    let err = refused(&["--url", &format!("{kv} sslmode=disable"), "inspect"]);
    assert!(
        err.contains("pg_hba.conf") || err.contains("refused"),
        "{err}"
    );
    let err = refused(&[
        "--url",
        &kv,
        "--sslmode",
        "verify-ca",
        "--sslrootcert",
        &wrong_root,
        "inspect",
    ]);
    assert!(err.contains("certificate was not accepted"), "{err}");
    let err = refused(&["--url", &kv, "--sslmode", "verify-full", "inspect"]);
    assert!(err.contains("--sslrootcert"), "{err}");
    let err = refused(&["--url", &kv, "--sslmode", "sometimes", "inspect"]);
    assert!(err.contains("invalid sslmode"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 45: `inspect` shows the fencing token a session lock holds its key
/// with, in its table and in `--json`, once the lock's keepalive has run
/// (which names the token). The control is a lock that mints none.
#[tokio::test(flavor = "multi_thread")]
async fn inspect_shows_a_session_locks_fencing_token() {
    use lockkit::SessionLock;

    let db = TestServer::shared();
    let _log = db.guard();
    let url = db.create_database("lockkit_cli_tokens").await;
    let observer = connect_url(&url, "cli-observer").await;
    lockkit::sql::install(&observer).await.unwrap();
    let cadence = Duration::from_millis(200);
    let config: tokio_postgres::Config = url.parse().unwrap();
    let minting = SessionLock::new(config.clone())
        .keepalive(cadence)
        .fencing_tokens(true)
        .lock(CliSessionType { id: 7 })
        .await
        .unwrap();
    let plain = SessionLock::new(config)
        .keepalive(cadence)
        .lock(CliSessionType { id: 8 })
        .await
        .unwrap();
    let token = minting.fencing_token().expect("minted").to_string();
    // The event: each lock's connection ran its keepalive since the grant.
    for pid in [minting.backend_pid(), plain.backend_pid()] {
        wait_until_keepalive_ran(&observer, pid).await;
    }

    let out = lockkit(&["--url", &url, "inspect"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let row = |pid: i32| {
        text.lines()
            .find(|l| l.starts_with(&format!("{pid} ")))
            .unwrap_or_else(|| panic!("no row of {pid} in\n{text}"))
    };
    assert!(
        row(minting.backend_pid()).contains(&format!("fencing token {token}")),
        "{text}"
    );
    assert!(
        !row(plain.backend_pid()).contains("fencing token"),
        "{text}"
    );

    let out = lockkit(&["--url", &url, "inspect", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let lock_of = |pid: i32| {
        doc["locks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["pid"] == pid)
            .unwrap_or_else(|| panic!("no lock of {pid} in {doc}"))
            .clone()
    };
    assert_eq!(
        lock_of(minting.backend_pid())["fencing_token"],
        token.as_str()
    );
    assert_eq!(lock_of(plain.backend_pid())["fencing_token"], Value::Null);
    assert!(minting.release().await.unwrap());
    assert!(plain.release().await.unwrap());
}
