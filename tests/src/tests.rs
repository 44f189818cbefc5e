//! Tests of the harness itself, on real servers.

use std::time::Instant;

use crate::{binaries, StopMode, TestServer};

async fn show(server: &TestServer, setting: &str) -> String {
    let client = server.connect().await;
    let row = client
        .query_one(&format!("SHOW {setting}"), &[])
        .await
        .unwrap();
    row.get(0)
}

async fn in_recovery(server: &TestServer) -> bool {
    let client = server.connect().await;
    let row = client
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .unwrap();
    row.get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn custom_settings_apply() {
    let server = TestServer::builder()
        .setting("max_locks_per_transaction", "10")
        .setting("deadlock_timeout", "100ms")
        .start();
    assert_eq!(show(&server, "max_locks_per_transaction").await, "10");
    assert_eq!(show(&server, "deadlock_timeout").await, "100ms");
    assert_eq!(show(&server, "fsync").await, "off");
    assert_eq!(show(&server, "max_connections").await, "200");
}

#[tokio::test(flavor = "multi_thread")]
async fn later_settings_win() {
    let server = TestServer::builder()
        .setting("max_connections", "50")
        .setting("application_name", "it's quoted")
        .start();
    assert_eq!(show(&server, "max_connections").await, "50");
    assert_eq!(show(&server, "application_name").await, "it's quoted");
}

#[tokio::test(flavor = "multi_thread")]
async fn restart_keeps_data_and_ends_sessions() {
    let server = TestServer::builder().start();
    let _log = server.guard();
    let client = server.connect().await;
    client
        .batch_execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (42)")
        .await
        .unwrap();
    let url = server.url().to_owned();
    let started = Instant::now();
    server.restart();
    eprintln!("restarted a server in {:?}", started.elapsed());
    assert_eq!(server.url(), url, "same port after a restart");
    assert!(
        client.simple_query("SELECT 1").await.is_err(),
        "old session ended"
    );
    let client = server.connect().await;
    let row = client.query_one("SELECT n FROM kept", &[]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 42);
}

/// An immediate stop is a crash for the data: the start replays the WAL,
/// committed rows survive, the uncommitted one does not, and the log says
/// the server ran crash recovery (which a fast stop does not need). Needs
/// `synchronous_commit=on`: with the harness's `off`, a commit can still be
/// in the WAL buffers when the server quits, and is lost.
#[tokio::test(flavor = "multi_thread")]
async fn immediate_restart_recovers_committed_data() {
    let server = TestServer::builder()
        .setting("synchronous_commit", "on")
        .start();
    let _log = server.guard();
    let client = server.connect().await;
    client
        .batch_execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (1)")
        .await
        .unwrap();
    let mut open = server.connect().await;
    let tx = open.transaction().await.unwrap();
    tx.batch_execute("INSERT INTO kept VALUES (2)")
        .await
        .unwrap();
    let from = server.log_offset();
    server.restart_with(StopMode::Immediate);
    assert!(
        client.simple_query("SELECT 1").await.is_err(),
        "old session ended"
    );
    drop(tx);
    let log = server.log_since(from);
    assert!(
        log.contains("not properly shut down"),
        "no crash recovery in the log:\n{log}"
    );
    let client = server.connect().await;
    let rows: Vec<i32> = client
        .query("SELECT n FROM kept ORDER BY n", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(rows, [1]);
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_then_start() {
    let server = TestServer::builder().start();
    server.stop();
    assert!(server.try_connect().await.is_err(), "stopped");
    server.start();
    server.connect().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn standby_is_in_recovery() {
    let primary = TestServer::builder()
        .setting("max_locks_per_transaction", "100")
        .start();
    let started = Instant::now();
    let standby = primary.standby();
    eprintln!("started a standby in {:?}", started.elapsed());
    assert_ne!(primary.url(), standby.url());
    assert!(!in_recovery(&primary).await);
    assert!(in_recovery(&standby).await);
    assert_eq!(show(&standby, "max_locks_per_transaction").await, "100");
}

#[tokio::test(flavor = "multi_thread")]
async fn shared_server_and_databases() {
    let db = TestServer::shared();
    let _log = db.guard();
    assert!(std::ptr::eq(db, TestServer::shared()));
    let url = db.create_database("harness_isolated").await;
    let config: tokio_postgres::Config = url.parse().unwrap();
    assert_eq!(config.get_dbname(), Some("harness_isolated"));
    let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let row = client
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, &str>(0), "harness_isolated");
}

#[test]
fn failed_start_reports_the_log() {
    let error = TestServer::builder()
        .setting("max_connections", "many")
        .try_start()
        .unwrap_err()
        .to_string();
    assert!(error.contains("server log"), "{error}");
    assert!(error.contains("max_connections"), "{error}");
}

#[test]
fn directory_removed_on_drop() {
    let server = TestServer::builder().start();
    let dir = server.socket_dir().unwrap().to_owned();
    assert!(dir.join("data").is_dir());
    drop(server);
    assert!(!dir.exists(), "{} left behind", dir.display());
}

/// The servers run the programs of [`binaries::bindir`], which is the
/// directory of `LOCKKIT_PG_BINDIR` when that is set: what makes a run with
/// it a run on that directory's PostgreSQL.
#[tokio::test(flavor = "multi_thread")]
async fn servers_run_the_chosen_programs() {
    let bin = binaries::bindir().unwrap();
    if let Some(dir) = std::env::var_os(binaries::BINDIR_VAR).filter(|dir| !dir.is_empty()) {
        assert_eq!(bin, std::fs::canonicalize(dir).unwrap());
    }
    let out = std::process::Command::new(bin.join("postgres"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success(), "postgres --version: {out:?}");
    // `postgres (PostgreSQL) 14.23`, or `… 15.14 (Debian 15.14-0+deb12u1)`.
    let text = String::from_utf8(out.stdout).unwrap();
    let version = text.split_whitespace().nth(2).unwrap();
    let (major, minor) = version.split_once('.').unwrap();
    let expected = major.parse::<u32>().unwrap() * 10_000 + minor.parse::<u32>().unwrap();
    let server = TestServer::builder().start();
    let reported = show(&server, "server_version_num").await;
    assert_eq!(reported, expected.to_string(), "{text}");
}

#[test]
fn a_chosen_directory_must_hold_the_server_programs() {
    let dir = std::env::temp_dir().join(format!("lockkit-empty-bindir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let error = binaries::chosen(&dir).unwrap_err();
    std::fs::remove_dir(&dir).unwrap();
    assert!(
        error.ends_with("has no initdb, pg_ctl, postgres"),
        "{error}"
    );
    assert!(binaries::chosen(&dir.join("absent")).is_err());
}
