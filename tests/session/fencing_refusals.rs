//! The fence takes tokens only: a whole number in [0, 2^128). Anything
//! else is an error with its own SQLSTATE, never `false` (stale) and never
//! `true`; an installation of the earlier fence gets this one and its
//! poisoned rows healed by installing again; and a role with only the
//! documented grant (`USAGE` on the schema `lockkit`) mints and fences,
//! and can write neither the fences' table nor the counter.

use lockkit::fencing::FencingToken;
use lockkit::{ErrorKind, SessionLock};
use lockkit_tests::fixtures::Feed;
use lockkit_tests::TestServer;
use tokio_postgres::{Client, NoTls};

/// 2^128 - 1, the largest token.
const LARGEST: &str = "340282366920938463463374607431768211455";

/// What is no token, by class, as SQL numeric literals.
const NOT_TOKENS: [(&str, &str); 7] = [
    ("NaN", "NaN"),
    ("negative", "-1"),
    ("fractional", "5.5"),
    ("2^128", "340282366920938463463374607431768211456"),
    ("1e60", "1e60"),
    ("infinity", "Infinity"),
    ("negative infinity", "-Infinity"),
];

async fn connect(config: &tokio_postgres::Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.expect("connect");
    tokio::spawn(connection);
    client
}

/// A database of its own with lockkit's SQL installed: its config and a
/// client.
async fn installed(db: &TestServer, name: &str) -> (tokio_postgres::Config, Client) {
    let url = db.create_database(name).await;
    let config: tokio_postgres::Config = url.parse().unwrap();
    let client = connect(&config).await;
    lockkit::sql::install(&client).await.expect("install");
    (config, client)
}

/// The fence's answer for `resource` and the numeric literal `token`, or
/// the SQLSTATE of its error.
async fn fence(
    client: &Client,
    resource: Option<&str>,
    token: Option<&str>,
) -> Result<bool, String> {
    client
        .query_one(
            "SELECT lockkit.fence($1::text, $2::text::numeric)",
            &[&resource, &token],
        )
        .await
        .map(|row| row.get::<_, bool>(0))
        .map_err(|e| match e.as_db_error() {
            Some(db) => format!("{} {}", db.code().code(), db.message()),
            None => format!("no SQLSTATE: {e}"),
        })
}

async fn stored(client: &Client, resource: &str) -> Option<String> {
    client
        .query_opt(
            "SELECT token::text FROM lockkit.fences WHERE resource = $1",
            &[&resource],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}

/// Each class of non-token raises 22023 naming it, on a resource fenced
/// before and on a fresh one, and changes nothing: the newest token is
/// still taken, an older one still refused (`false`), the largest token
/// taken. NULL raises 22004. Before, NaN answered true and then refused
/// even the largest token; 2^128 and 1e60 did the same; negative and
/// fractional numbers were taken.
#[tokio::test(flavor = "multi_thread")]
async fn the_fence_refuses_what_is_no_token_with_an_error() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (_, client) = installed(db, "lockkit_fencing_refusals").await;
    let token = FencingToken::from_parts(1, 100, 5).unwrap();
    let older = FencingToken::from_parts(1, 100, 4).unwrap();
    assert_eq!(
        fence(&client, Some("r"), Some(&token.to_string())).await,
        Ok(true)
    );
    for (class, literal) in NOT_TOKENS {
        for resource in ["r", "fresh"] {
            let e = fence(&client, Some(resource), Some(literal))
                .await
                .expect_err(class);
            assert!(
                e.starts_with("22023 ") && e.contains("not a fencing token"),
                "{class} on {resource}: {e}"
            );
        }
        // Not a token in Rust either: the helper's type cannot carry it.
        assert!(literal.parse::<FencingToken>().is_err(), "{class}");
    }
    for (resource, token) in [(None, Some("1")), (Some("r"), None), (None, None)] {
        let e = fence(&client, resource, token).await.unwrap_err();
        assert!(e.starts_with("22004 "), "{resource:?} {token:?}: {e}");
    }
    assert_eq!(stored(&client, "r").await, Some(token.to_string()));
    assert_eq!(stored(&client, "fresh").await, None);
    // The fence as before, through the Rust helper.
    assert!(lockkit::sql::fence(&client, "r", token).await.unwrap());
    assert!(!lockkit::sql::fence(&client, "r", older).await.unwrap());
    let largest: FencingToken = LARGEST.parse().unwrap();
    assert!(lockkit::sql::fence(&client, "r", largest).await.unwrap());
    assert!(!lockkit::sql::fence(&client, "r", token).await.unwrap());
    // A whole number written with a zero fraction is that number.
    assert_eq!(fence(&client, Some("z"), Some("7.000")).await, Ok(true));
    assert_eq!(fence(&client, Some("z"), Some("6")).await, Ok(false));
}

/// The fence of the earlier version, as it was installed.
const EARLIER_FENCE: &str = "
CREATE OR REPLACE FUNCTION lockkit.fence(resource text, token numeric) RETURNS boolean
LANGUAGE sql VOLATILE STRICT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH accepted AS (
        INSERT INTO lockkit.fences AS f (resource, token) VALUES ($1, $2)
        ON CONFLICT (resource) DO UPDATE SET token = excluded.token
        WHERE f.token OPERATOR(pg_catalog.<=) excluded.token
        RETURNING true
    )
    SELECT EXISTS (SELECT FROM accepted)
$$;";

/// A database with the earlier fence: NaN is taken and then refuses the
/// largest token, for good (the report, reproduced). Installing again
/// replaces the fence and heals the poisoned row with a fresh token: a
/// token minted before it is still refused, the next lock's accepted.
#[tokio::test(flavor = "multi_thread")]
async fn installing_again_replaces_the_earlier_fence_and_heals_its_poisoned_rows() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (config, client) = installed(db, "lockkit_fencing_upgrade").await;
    client.batch_execute(EARLIER_FENCE).await.unwrap();
    let before: FencingToken = lockkit_tests::support::fencing_token_from_sql(&client).await;
    assert_eq!(
        fence(&client, Some("poisoned"), Some("NaN")).await,
        Ok(true)
    );
    assert_eq!(
        fence(&client, Some("poisoned"), Some(LARGEST)).await,
        Ok(false)
    );
    assert_eq!(fence(&client, Some("huge"), Some("1e60")).await, Ok(true));

    lockkit::sql::install(&client).await.expect("install again");
    assert!(fence(&client, Some("poisoned"), Some("NaN"))
        .await
        .unwrap_err()
        .starts_with("22023 "));
    for resource in ["poisoned", "huge"] {
        let healed: FencingToken = stored(&client, resource)
            .await
            .unwrap()
            .parse()
            .unwrap_or_else(|e| panic!("{resource}: {e}"));
        assert!(healed > before, "{resource}");
        assert!(!lockkit::sql::fence(&client, resource, before)
            .await
            .unwrap());
    }
    // The next holder's token is accepted.
    let guard = SessionLock::new(config)
        .fencing_tokens(true)
        .lock(Feed { id: 960_001 })
        .await
        .unwrap();
    let next = guard.fencing_token().unwrap();
    for resource in ["poisoned", "huge"] {
        assert!(
            lockkit::sql::fence(&client, resource, next).await.unwrap(),
            "{resource}"
        );
    }
    assert!(guard.release().await.unwrap());
}

/// A role with only what docs/FENCING.md says calling needs, `USAGE` on
/// the schema `lockkit`: without it, both functions and a minting lock are
/// refused (42501); with it, it mints (by the function and with a lock)
/// and fences, and still may not write the fences' table, set the
/// counter, or create anything in the schema.
#[tokio::test(flavor = "multi_thread")]
async fn a_role_with_usage_on_the_schema_mints_and_fences_and_writes_nothing_else() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (config, owner) = installed(db, "lockkit_fencing_grants").await;
    let role = "lockkit_fence_caller";
    owner
        .batch_execute(&format!(
            "DO $$ BEGIN CREATE ROLE {role} LOGIN; \
             EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
             REVOKE USAGE ON SCHEMA lockkit FROM {role}"
        ))
        .await
        .unwrap();
    let mut as_role = config.clone();
    as_role.user(role);
    let caller = connect(&as_role).await;
    let token = FencingToken::from_parts(1, 7, 1).unwrap();
    let code = |e: tokio_postgres::Error| lockkit::Error::from(e).code().map(str::to_owned);
    let denied = caller
        .query_one("SELECT lockkit.fencing_token()::text", &[])
        .await
        .unwrap_err();
    assert_eq!(code(denied).as_deref(), Some("42501"));
    let e = lockkit::sql::fence(&caller, "g", token).await.unwrap_err();
    assert_eq!(
        (e.kind(), e.code()),
        (ErrorKind::Database, Some("42501")),
        "{e}"
    );

    owner
        .batch_execute(&format!("GRANT USAGE ON SCHEMA lockkit TO {role}"))
        .await
        .unwrap();
    let minted: FencingToken = lockkit_tests::support::fencing_token_from_sql(&caller).await;
    assert!(lockkit::sql::fence(&caller, "g", minted).await.unwrap());
    let guard = SessionLock::new(as_role)
        .fencing_tokens(true)
        .lock(Feed { id: 960_002 })
        .await
        .unwrap();
    assert!(guard.fencing_token().unwrap() > minted);
    assert!(guard.release().await.unwrap());
    for statement in [
        "INSERT INTO lockkit.fences VALUES ('g2', 1)",
        "UPDATE lockkit.fences SET token = 0",
        "DELETE FROM lockkit.fences",
        "SELECT setval('lockkit.fencing_counter', 1)",
        "CREATE FUNCTION lockkit.mine() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    ] {
        let e = caller.batch_execute(statement).await.unwrap_err();
        assert_eq!(code(e).as_deref(), Some("42501"), "{statement}");
    }
    assert_eq!(stored(&owner, "g").await, Some(minted.to_string()));
    drop(caller);
    owner
        .batch_execute(&format!("REVOKE USAGE ON SCHEMA lockkit FROM {role}"))
        .await
        .unwrap();
}
