//! `lockkit key --sql` prints SQL that computes, on a real server with
//! lockkit's SQL functions installed, the keys `lockkit key` computes: for
//! random typed values of every kind, nested, in every key form; and
//! `lockkit sql install` / `lockkit sql print` work end to end.

use std::process::{Command, Output};

use lockkit_cli::keyarg::{compute, Form, KeyRequest, Value};
use lockkit_cli::sql::expressions;
use lockkit_tests::TestServer;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

fn lockkit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockkit"))
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run lockkit")
}

/// Any typed value, nested up to three levels.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(|v| Value::Int(v.into())),
        any::<i128>().prop_map(Value::Int),
        (i128::MAX as u128 + 1..=u128::MAX).prop_map(Value::UInt),
        any::<bool>().prop_map(Value::Bool),
        any::<char>().prop_map(Value::Char),
        // A PostgreSQL text cannot hold U+0000 (a char can: lockkit.char(0)).
        any::<String>().prop_map(|s| Value::Str(s.replace('\0', ""))),
        "[a-z'\\\\ ]{0,6}".prop_map(Value::Str),
        any::<u128>().prop_map(|u| Value::Uuid(uuid::Uuid::from_u128(u))),
        Just(Value::None),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            inner.clone().prop_map(|v| Value::Some(Box::new(v))),
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Seq),
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Tuple),
            (
                "[A-Za-z_][A-Za-z0-9_]{0,8}",
                prop::collection::vec(inner, 0..3)
            )
                .prop_map(|(name, fields)| Value::Variant(name, fields)),
        ]
    })
}

/// A request of a hashed form, with or without stripes and a class.
fn request() -> impl Strategy<Value = KeyRequest> {
    (
        "[A-Za-z0-9_.:/-]{1,64}",
        prop::collection::vec(value(), 0..4),
        prop_oneof![Just(Form::Hashed), Just(Form::BigInt), Just(Form::Pair)],
        prop::option::of(1..=u64::MAX),
        prop::option::of(any::<i32>()),
    )
        .prop_map(|(ns, values, form, stripes, class)| {
            let mut request = KeyRequest::new(Some(&ns), values);
            request.form = form;
            request.stripes = stripes;
            request.class = if form == Form::BigInt { None } else { class };
            request
        })
}

#[tokio::test(flavor = "multi_thread")]
async fn sql_expressions_compute_the_keys_of_lockkit_key() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = db.connect().await;
    lockkit::sql::install(&client).await.expect("install");

    let mut runner = TestRunner::deterministic();
    let mut requests: Vec<KeyRequest> = (0..600)
        .map(|_| request().new_tree(&mut runner).unwrap().current())
        .collect();
    // The unhashed forms.
    for (form, ns, values, class) in [
        (Form::Exact, Some("Account"), vec![Value::Int(-5)], None),
        (
            Form::Exact,
            Some("Account"),
            vec![Value::Int(i32::MAX.into())],
            Some(7),
        ),
        (Form::Raw, None, vec![Value::Int(i64::MIN.into())], None),
        (Form::Raw, None, vec![Value::Int(1), Value::Int(-2)], None),
        (
            Form::HashText,
            None,
            vec![Value::Str("payroll-1405-01".into())],
            None,
        ),
    ] {
        let mut request = KeyRequest::new(ns, values);
        request.form = form;
        request.class = class;
        requests.push(request);
    }

    let mut exprs = Vec::new();
    let mut want = Vec::new();
    for request in &requests {
        let keys = compute(request).expect("a key");
        let sql = expressions(request).expect("its SQL");
        match (keys.bigint, sql.bigint) {
            (Some(lockkit::LockKey::BigInt(k)), Some(e)) => {
                exprs.push(e);
                want.push(k);
            }
            (None, None) => {}
            other => panic!("{request:?}: {other:?}"),
        }
        match (keys.pair, sql.pair) {
            (Some(lockkit::LockKey::Pair(c, o)), Some(e)) => {
                exprs.push(e);
                want.extend([i64::from(c), i64::from(o)]);
            }
            (None, None) => {}
            other => panic!("{request:?}: {other:?}"),
        }
    }
    let mut got: Vec<i64> = Vec::new();
    for chunk in exprs.chunks(200) {
        let row = client
            .query_one(&format!("SELECT ARRAY[{}]::int8[]", chunk.join(",\n")), &[])
            .await
            .unwrap_or_else(|e| panic!("{e:?}"));
        got.extend(row.get::<_, Vec<i64>>(0));
    }
    assert_eq!(got.len(), want.len());
    let wrong: Vec<String> = got
        .iter()
        .zip(&want)
        .enumerate()
        .filter(|(_, (g, w))| g != w)
        .map(|(i, (g, w))| format!("#{i}: SQL {g}, lockkit key {w}"))
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[tokio::test(flavor = "multi_thread")]
async fn sql_install_print_and_key_sql_end_to_end() {
    let db = TestServer::shared();
    let _log = db.guard();
    let url = db.url();

    let out = lockkit(&["sql", "install", "--url", url]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("installed"));
    // Again: idempotent.
    let out = lockkit(&["sql", "install", "--url", url]);
    assert!(out.status.success(), "{out:?}");

    let out = lockkit(&["sql", "print"]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), lockkit::sql::SQL);

    // What `lockkit key --sql` prints pastes into psql as it is: here, its
    // statements run on the server and take the key lockkit key names.
    let out = lockkit(&["key", "--sql", "--form", "bigint", "Order", "i:42"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let script: String = text
        .lines()
        .skip_while(|l| !l.starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(script.contains("SELECT pg_advisory_xact_lock(lockkit.key('Order', lockkit.int(42)));"));
    let client = db.connect().await;
    client.batch_execute("BEGIN").await.unwrap();
    client.batch_execute(&script).await.unwrap();
    let row = client
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND pid = pg_backend_pid() AND objsubid = 1 \
             AND classid = 2617336672 AND objid = 1483026571",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, i64>(0),
        1,
        "the KEYS.md key of Order {{ id: 42 }}"
    );
    client.batch_execute("ROLLBACK").await.unwrap();

    let out = lockkit(&["key", "--sql", "--json", "Tenanted", "s:acme", "u64:1001"]);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        doc["bigint_sql"],
        "lockkit.key('Tenanted', lockkit.str('acme'), lockkit.int(1001))"
    );
}
