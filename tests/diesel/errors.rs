//! How Diesel's errors, which do not carry the SQLSTATE, become typed
//! lockkit errors (lockkit's `diesel` feature), with no server.

use diesel::result::{DatabaseErrorKind as Kind, Error as DieselError};
use lockkit::ErrorKind;

use lockkit_diesel::Error;

fn db(kind: Kind, message: &str) -> DieselError {
    DieselError::DatabaseError(kind, Box::new(message.to_owned()))
}

#[test]
fn maps_what_diesel_names_and_the_servers_messages() {
    let e = Error::from(db(Kind::Unknown, "deadlock detected"));
    assert!(e.is_deadlock() && e.is_transient());
    assert_eq!(e.code(), Some("40P01"));

    let e = Error::from(db(Kind::Unknown, "canceling statement due to lock timeout"));
    assert!(e.is_timeout(), "the session's lock_timeout is a timeout");
    assert_eq!(e.code(), Some("55P03"));
    let e = Error::from(db(
        Kind::Unknown,
        "canceling statement due to statement timeout",
    ));
    assert!(e.is_timeout());
    assert_eq!(e.code(), Some("57014"));
    let e = Error::from(db(Kind::Unknown, "canceling statement due to user request"));
    assert_eq!(e.kind(), ErrorKind::Cancelled, "a cancel is not a timeout");

    assert!(Error::from(db(Kind::Unknown, "out of shared memory")).is_lock_table_full());
    let aborted = "current transaction is aborted, commands ignored until end of transaction block";
    let e = Error::from(db(Kind::Unknown, aborted));
    assert_eq!(e.kind(), ErrorKind::TransactionAborted);
    assert_eq!(e.code(), Some("25P02"));

    let e = Error::from(db(Kind::SerializationFailure, "anything"));
    assert!(e.is_transient());
    assert_eq!(e.code(), Some("40001"));
    assert!(
        Error::from(db(Kind::ClosedConnection, "server closed the connection"))
            .is_connection_lost()
    );
    let shutdown = "terminating connection due to administrator command";
    assert!(Error::from(db(Kind::Unknown, shutdown)).is_connection_lost());
    assert_eq!(
        Error::from(db(Kind::UniqueViolation, "dup")).code(),
        Some("23505")
    );
}

#[test]
fn transient_agrees_with_lockkit() {
    use lockkit::Transient;
    for (kind, message) in [
        (Kind::Unknown, "deadlock detected"),
        (Kind::Unknown, "canceling statement due to lock timeout"),
        (Kind::SerializationFailure, "x"),
        (Kind::Unknown, "canceling statement due to user request"),
        (Kind::Unknown, "out of shared memory"),
        (Kind::UniqueViolation, "dup"),
    ] {
        let e = db(kind, message);
        assert_eq!(
            Transient::is_transient(&e),
            Error::from(db(kind, message)).is_transient(),
            "{message}"
        );
    }
}

#[test]
fn unrecognised_errors_are_database_errors_without_a_code() {
    // A server with German messages: documented, not classified.
    let e = Error::from(db(Kind::Unknown, "Verklemmung (Deadlock) entdeckt"));
    assert_eq!(e.kind(), ErrorKind::Database, "{e}");
    assert_eq!(e.code(), None);
    assert!(!e.is_deadlock());
    let e = Error::from(DieselError::NotFound);
    assert_eq!(e.kind(), ErrorKind::Database);
    assert!(std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<DieselError>())
        .is_some_and(|s| matches!(s, DieselError::NotFound)));
}
