//! Issue 44 and 47: `lockkit check` behind a transaction-mode pgbouncer
//! says which lockkit forms and which statement mode are safe there, as
//! the README does; directly connected, that named prepared statements are
//! available.

use lockkit_tests::{PgBouncer, TestServer};
use serde_json::{json, Value};

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
}
