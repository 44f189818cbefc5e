//! A connection the `lockkit` command opens and that is refused says what
//! refused it, never that a connection was lost: behind a pgbouncer 1.18
//! whose `max_client_conn` is full, the command's own connection, and the
//! connection `check`'s pooler probe opens after it.

use lockkit_tests::{PgBouncer, TestServer};

use super::{lockkit, stderr};

/// pgbouncer refuses a client over `max_client_conn` at its startup with
/// `FATAL` `08P01` "no more connections allowed (max_client_conn)".
#[tokio::test(flavor = "multi_thread")]
async fn a_full_pooler_is_named_as_such() {
    let db = TestServer::shared();
    let bouncer = PgBouncer::builder(db)
        .setting("max_client_conn", "2")
        .start();
    let url = bouncer.url();
    // One slot taken: the command's own connection takes the other, and
    // the pooler probe's connection, opened after it, is refused.
    let first = bouncer.connect().await;
    let out = tokio::task::block_in_place(|| lockkit(&["--url", &url, "check"]));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("cannot probe for a pooler"), "{err}");
    assert!(err.contains("the pooler is full"), "{err}");
    assert!(
        err.contains("no more connections allowed (max_client_conn)"),
        "{err}"
    );
    assert!(err.contains("nothing was held"), "{err}");
    assert!(!err.contains("lost"), "{err}");
    // Both slots taken: the command's own connection is refused.
    let second = bouncer.connect().await;
    let out = tokio::task::block_in_place(|| lockkit(&["--url", &url, "check"]));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("the pooler is full"), "{err}");
    assert!(
        err.contains("no more connections allowed (max_client_conn)"),
        "{err}"
    );
    assert!(!err.contains("lost"), "{err}");
    drop((first, second));
}

/// A server whose `max_connections` are all taken refuses the command's
/// connection with `53300`.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_server_is_named_as_such() {
    let db = TestServer::builder()
        .setting("max_connections", "3")
        .setting("superuser_reserved_connections", "0")
        .start();
    let (_taken, _refusal) = db.fill(3).await;
    let out = tokio::task::block_in_place(|| lockkit(&["--url", db.url(), "check"]));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("the server is full (too many clients)"),
        "{err}"
    );
    assert!(err.contains("SQLSTATE 53300"), "{err}");
}
