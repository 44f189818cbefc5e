//! Issue 44 and 47: `lockkit check` behind a transaction-mode pgbouncer
//! says which lockkit forms and which statement mode are safe there, as
//! the README does; directly connected, that named prepared statements are
//! available.

use lockkit_tests::{PgBouncer, TestServer};
use serde_json::{json, Value};

use super::bounds::{silent_listener, Silence};
use super::{lockkit, stderr, stdout};

#[test]
fn check_through_a_pooler_names_what_is_safe_there() {
    let db = TestServer::shared();
    let bouncer = PgBouncer::builder(db).pool_mode("transaction").start();
    let url = bouncer.url();

    let out = lockkit(&["--url", &url, "check"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let pooled = text
        .split("pooled ")
        .nth(1)
        .unwrap_or_else(|| panic!("no pooled line in\n{text}"));
    assert!(pooled.trim_start().starts_with("yes"), "{text}");
    for said in [
        "safe here: transaction-scoped locks (LockTx), SessionLock in its default form",
        "SessionForm::Multiplexed",
        "not safe here: SessionForm::SessionLevel",
        "named prepared statements are not safe here: keep the default StatementMode::Unnamed",
        "max_prepared_statements",
        "cut-off lock calls: nothing to configure; no cancel request goes through a pooler",
    ] {
        assert!(text.contains(said), "{said:?} not in\n{text}");
    }
    // What it said before, contradicting the README.
    assert!(!text.contains("session locks are unsafe here"), "{text}");

    let out = lockkit(&["--url", &url, "check", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["transaction_pooled"], true, "{doc:#}");
    assert_eq!(doc["unsafe_forms"], json!(["SessionForm::SessionLevel"]));
    assert_eq!(doc["statement_modes"], json!(["Unnamed"]));
    assert!(doc.get("cancel_to_needed").is_none(), "{doc:#}");
    assert!(doc["safe_forms"]
        .as_array()
        .unwrap()
        .contains(&json!("SessionForm::Multiplexed")));

    // The control: directly connected, no pooler, every form, both modes.
    let out = lockkit(&["--url", db.url(), "check"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("no transaction-mode pooler seen"), "{text}");
    assert!(
        text.contains("StatementMode::Prepared") && !text.contains("not safe here"),
        "{text}"
    );
    let out = lockkit(&["--url", db.url(), "check", "--json"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["transaction_pooled"], false);
    assert_eq!(doc["statement_modes"], json!(["Unnamed", "Prepared"]));
    assert_eq!(doc["unsafe_forms"], json!([]));
    assert!(!text.contains("cut-off lock calls"), "{text}");
}

/// A pooler probe that cannot finish within its bound (its connections
/// get no answer to their first query; behind a pooler whose server
/// connections are all busy, the further ones it opens wait alike), while
/// `check`'s own connection answers: `lockkit check` says it cannot tell,
/// names the forms that are safe behind a pooler (the side that cannot be
/// wrong), and exits 0 with the rest of its report. It failed as a whole
/// before ("cannot probe for a pooler", exit 1), as the fleet test saw with
/// its pool saturated by held locks.
#[test]
fn check_whose_pooler_probe_runs_out_of_time_says_it_cannot_tell_and_what_is_safe() {
    let db = TestServer::shared();
    let server_port = db.config().get_ports()[0];
    let url = |port: u16| format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode=disable");

    let port = silent_listener(Silence::AllButFirst(server_port));
    let out = lockkit(&["--url", &url(port), "check", "--probe-timeout", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("pooled          cannot tell"), "{text}");
    assert!(text.contains(POOLED_SAFE_LINE), "{text}");
    assert!(
        text.contains("not safe here: SessionForm::SessionLevel"),
        "{text}"
    );
    assert!(
        text.contains("lock settings"),
        "the rest of the report:\n{text}"
    );

    let port = silent_listener(Silence::AllButFirst(server_port));
    let out = lockkit(&[
        "--url",
        &url(port),
        "check",
        "--json",
        "--probe-timeout",
        "1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["transaction_pooled"], Value::Null, "{doc:#}");
    assert_eq!(doc["unsafe_forms"], json!(["SessionForm::SessionLevel"]));
    assert_eq!(doc["statement_modes"], json!(["Unnamed"]));
    assert!(
        doc["pooler_probe"]
            .as_str()
            .is_some_and(|s| s.contains("did not finish")),
        "{doc:#}"
    );
    assert!(doc["server_version"].is_string(), "{doc:#}");

    // With its connections answered, the probe finishes and says what it
    // saw.
    let bouncer = PgBouncer::builder(db).pool_mode("transaction").start();
    let out = lockkit(&["--url", &bouncer.url(), "check", "--json"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["transaction_pooled"], true, "{doc:#}");
    assert_eq!(doc["pooler_probe"], Value::Null, "{doc:#}");
}

/// Behind a pgbouncer whose every server connection is taken (its one,
/// by an open transaction), even `check`'s first query gets none: it says
/// it cannot tell and what is safe behind a pooler within its probe's
/// bound, as the README says, and fails naming the step and that bound
/// (the query bound, 10 s here, is not what ended it). It failed after the
/// 10 s with "no reply to the query reading the server settings" and said
/// nothing of a pooler. Text and JSON.
#[tokio::test(flavor = "multi_thread")]
async fn check_behind_a_saturated_pooler_says_it_cannot_tell_within_its_probe_bound() {
    let db = TestServer::shared();
    let bouncer = PgBouncer::one_server_connection(db);
    let url = bouncer.url();
    let (pinning, connection) = bouncer
        .config()
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    pinning.batch_execute("BEGIN; SELECT 1").await.unwrap();

    let out = lockkit(&["--url", &url, "check", "--probe-timeout", "1"]);
    let (text, err) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(1), "{text}{err}");
    assert!(text.contains("pooled          cannot tell"), "{text}");
    assert!(text.contains(POOLED_SAFE_LINE), "{text}");
    assert!(
        text.contains("not safe here: SessionForm::SessionLevel"),
        "{text}"
    );
    assert!(
        err.contains(
            "within 1s (--probe-timeout): no reply to the query reading the server settings"
        ) && err.contains("cannot tell"),
        "{err}"
    );

    let out = lockkit(&["--url", &url, "check", "--json", "--probe-timeout", "1"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["transaction_pooled"], Value::Null, "{doc:#}");
    assert_eq!(doc["unsafe_forms"], json!(["SessionForm::SessionLevel"]));
    assert!(
        doc["pooler_probe"]
            .as_str()
            .is_some_and(|s| s.contains("no reply within 1s")),
        "{doc:#}"
    );

    // The control: the connection free again, the whole report.
    pinning.batch_execute("ROLLBACK").await.unwrap();
    let out = lockkit(&["--url", &url, "check"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("lock settings"));
}

/// What `check` prints for the forms safe behind a pooler.
const POOLED_SAFE_LINE: &str =
    "safe here: transaction-scoped locks (LockTx), SessionLock in its default form";
