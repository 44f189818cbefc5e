use super::*;

fn err(code: &str, message: &str) -> DriverError {
    DriverError::new("driver")
        .code(Some(code))
        .message(Some(message))
}

#[test]
fn the_accessors_answer_only_for_their_kind() {
    let lost = err("08006", "connection failure").into_error();
    assert!(lost.is_connection_lost());
    let other = err("40P01", "deadlock detected").into_error();
    assert!(!other.is_connection_lost());
    assert_eq!(other.backend_pid(), None);
    let pooled = Error::pooled(4242, "two backends".to_owned());
    assert_eq!(pooled.backend_pid(), Some(4242));
    assert!(!pooled.is_connection_lost());
    // Each predicate is true of its own kind only.
    let timeout = err("55P03", "canceling statement due to lock timeout").into_error();
    let full = err("53200", "out of shared memory").into_error();
    let unique = err("23505", "duplicate key value").into_error();
    for (e, expected) in [
        (&timeout, (true, false, false)),
        (&other, (false, true, false)),
        (&full, (false, false, true)),
        (&unique, (false, false, false)),
        (&lost, (false, false, false)),
    ] {
        let seen = (e.is_timeout(), e.is_deadlock(), e.is_lock_table_full());
        assert_eq!(seen, expected, "{e}");
    }
}

#[test]
fn maps_sqlstates() {
    let timed = Some((Duration::from_millis(5), Duration::from_millis(6)));
    let e = err("55P03", "canceling statement due to lock timeout").into_error_in(timed, 2);
    assert!(e.is_timeout());
    assert_eq!(e.timeout(), Some(Duration::from_millis(5)));
    assert_eq!(e.code(), Some("55P03"));
    // The session's own timeouts are timeouts too, without a lockkit timeout.
    let e = err("55P03", "canceling statement due to lock timeout").into_error();
    assert!(e.is_timeout() && e.timeout().is_none());
    let e = err("57014", "canceling statement due to statement timeout").into_error();
    assert!(e.is_timeout());
    // Past a timed call's timeout, a cancel is the call's own
    // statement_timeout, whatever the message: one that fires as a
    // statement ends cancels the next "due to user request".
    let e = err("57014", "canceling statement due to user request").into_error_in(timed, 1);
    assert!(e.is_timeout());
    assert_eq!(e.timeout(), Some(Duration::from_millis(5)));
    // Before it, or outside a timed call, a cancel request is a cancel.
    let early = Some((Duration::from_secs(10), Duration::from_millis(300)));
    let e = err("57014", "canceling statement due to user request").into_error_in(early, 1);
    assert_eq!(e.kind(), ErrorKind::Cancelled);
    assert!(!e.is_transient());
    let e = err("57014", "canceling statement due to user request").into_error();
    assert_eq!(e.kind(), ErrorKind::Cancelled);
    // Another language: decided by the clock, in the safe direction.
    let e = err("57014", "Abbruch").into_error_in(early, 1);
    assert_eq!(e.kind(), ErrorKind::Cancelled);
    assert!(err("57014", "Abbruch").into_error_in(timed, 1).is_timeout());
    assert!(err("40P01", "deadlock detected").into_error().is_deadlock());
    assert!(err("53200", "out of shared memory")
        .into_error()
        .is_lock_table_full());
    assert!(err("57P01", "terminating")
        .into_error()
        .is_connection_lost());
    assert!(err("08006", "x").into_error().is_connection_lost());
    // A refused message (a `Bind` that does not fit the statement of
    // that name, behind a pooler) is an `ERROR`: the session goes on,
    // its locks held. Only when the connection closed is it lost.
    let refused = "bind message supplies 1 parameters, but prepared statement \"s0\" requires 2";
    assert_eq!(
        err("08P01", refused).into_error().kind(),
        ErrorKind::Database
    );
    assert!(err("08P01", refused)
        .closed(true)
        .into_error()
        .is_connection_lost());
    assert!(DriverError::new("x")
        .closed(true)
        .into_error()
        .is_connection_lost());
    let e = err("25P02", "current transaction is aborted").into_error();
    assert_eq!(e.kind(), ErrorKind::TransactionAborted);
    assert_eq!(e.code(), Some("25P02"));
    let e = err("42P01", "relation does not exist").into_error();
    assert_eq!(e.code(), Some("42P01"));
    assert_eq!(e.to_string(), "database error (SQLSTATE 42P01)");
    assert!(!e.is_transient());
    assert!(err("40001", "x").into_error().is_transient());
}

#[test]
fn message_names_the_code_when_the_driver_hides_it() {
    let e = DriverError::new("x")
        .message(Some("deadlock detected"))
        .into_error();
    assert!(e.is_deadlock());
    assert_eq!(e.code(), Some("40P01"));
    let e = DriverError::new("x")
        .message(Some("Verklemmung (Deadlock) entdeckt"))
        .into_error();
    assert_eq!(e.kind(), ErrorKind::Database);
    assert_eq!(e.code(), None);
}

#[test]
fn is_send_sync_static() {
    fn check<T: Send + Sync + 'static + StdError>() {}
    check::<Error>();
    assert_eq!(std::mem::size_of::<Error>(), std::mem::size_of::<usize>());
}

/// The driver's own error stays reachable as the source, whatever lockkit
/// makes of it.
#[test]
fn the_drivers_error_is_the_source() {
    let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
    for e in [
        DriverError::new(io).closed(true).into_error(),
        DriverError::new("the driver's words")
            .code(Some("40P01"))
            .into_error(),
    ] {
        let source = e.source().expect("a source");
        let text = source.to_string();
        assert!(
            text == "reset by peer" || text == "the driver's words",
            "{e}: source {text:?}"
        );
    }
}

/// An error's `Debug` shows its kind, SQLSTATE, message and source.
#[test]
fn debug_shows_kind_code_message_and_source() {
    let shown = format!("{:?}", err("40P01", "deadlock detected").into_error());
    for part in ["Error", "Deadlock", "40P01", "deadlock detected", "source"] {
        assert!(shown.contains(part), "{shown} lacks {part}");
    }
}

#[test]
fn a_deadlock_names_its_key_types_and_the_remedy() {
    let e = err("40P01", "deadlock detected")
        .into_error_in(None, 2)
        .with_key_types(vec!["Account", "Order"]);
    let text = e.to_string();
    assert!(
        text.starts_with(
            "deadlock detected while acquiring advisory locks of types Account, Order;"
        ),
        "{text}"
    );
    assert!(text.contains("retry the whole transaction"), "{text}");
    assert!(
        text.contains("in one batch, or in ascending order"),
        "{text}"
    );
    // Without key types (a raw key), it still gives the remedy.
    let raw = err("40P01", "deadlock detected").into_error().to_string();
    assert!(raw.contains("retry the whole transaction"), "{raw}");
}

#[test]
fn every_kind_that_aborts_the_transaction_says_what_to_do() {
    for (code, message, advice) in [
        ("40P01", "deadlock detected", "retry the whole transaction"),
        (
            "40001",
            "could not serialize access",
            "retry the whole transaction",
        ),
        (
            "57014",
            "canceling statement due to user request",
            "roll it back",
        ),
        ("25P02", "current transaction is aborted", "roll it back"),
        ("57P01", "terminating connection", "take them again"),
        (
            "53200",
            "out of shared memory",
            "raise max_locks_per_transaction",
        ),
        (
            "42P05",
            "prepared statement \"s1\" already exists",
            "StatementMode::Unnamed",
        ),
        (
            "26000",
            "prepared statement \"s1\" does not exist",
            "StatementMode::Unnamed",
        ),
    ] {
        let text = err(code, message).into_error().to_string();
        assert!(text.contains(advice), "{code}: {text}");
    }
}

#[test]
fn a_pooler_error_that_closes_the_connection_is_lost_without_its_code() {
    // diesel-async hides both the SQLSTATE and the severity: pgbouncer's
    // closing errors are told by their whole text, and keep their code.
    for message in super::classify::POOLER_FATAL {
        let e = DriverError::new("x").message(Some(message)).into_error();
        assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{message}");
        assert_eq!(e.code(), Some(sqlstate::PROTOCOL_VIOLATION), "{message}");
    }
    // Only the whole text: a server error that mentions one is not one.
    let e = DriverError::new("x")
        .message(Some("query_wait_timeout is set to 0"))
        .into_error();
    assert_eq!(e.kind(), ErrorKind::Database);
    assert_eq!(e.code(), None);
    // With its code, the driver's `closed` decides (tokio-postgres and sqlx
    // set it for a `FATAL` error): a refused `Bind` is an `ERROR`.
    assert_eq!(
        err("08P01", "query_wait_timeout").into_error().kind(),
        ErrorKind::Database
    );
}

#[test]
fn a_pool_timeout_is_a_timeout_that_says_so() {
    let e = DriverError::new("pool timed out")
        .pool_timeout(true)
        .into_error();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(e.is_transient());
    let text = e.to_string();
    assert!(text.contains("the pool handed out no connection"), "{text}");
    assert!(!text.contains("aborted"), "{text}");
}

#[test]
fn a_reply_the_driver_could_not_read_is_an_unexpected_reply() {
    let foreign = DriverError::new("unexpected message from server").foreign_reply(true);
    assert_eq!(foreign.into_error().kind(), ErrorKind::UnexpectedReply);
    // Without a code it is no database error; a code or a closed connection
    // says more, and wins.
    let plain = DriverError::new("unexpected message from server");
    assert_eq!(plain.into_error().kind(), ErrorKind::Database);
    let closed = DriverError::new("closed").foreign_reply(true).closed(true);
    assert_eq!(closed.into_error().kind(), ErrorKind::ConnectionLost);
    let deadlock = err("40P01", "deadlock detected").foreign_reply(true);
    assert_eq!(deadlock.into_error().kind(), ErrorKind::Deadlock);
}

#[test]
fn a_statement_name_error_without_its_code_is_typed_by_its_message() {
    // Diesel and diesel-async hide the SQLSTATE: outside a lock call too
    // (a locker learning the server's facts, an application's own query),
    // a clash or a missing statement is what it is, never a bare database
    // error.
    for (message, code) in [
        ("prepared statement \"s7\" already exists", "42P05"),
        (
            "prepared statement \"__diesel_stmt_3\" does not exist",
            "26000",
        ),
    ] {
        let e = DriverError::new("x").message(Some(message)).into_error();
        assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{message}");
        assert_eq!(e.code(), Some(code), "{message}");
        assert!(e.to_string().contains("max_prepared_statements"), "{e}");
    }
    for message in [
        "prepared statement \"s7\" is in use",
        "statement \"s7\" already exists",
    ] {
        let e = DriverError::new("x").message(Some(message)).into_error();
        assert_eq!(e.kind(), ErrorKind::Database, "{message}");
        assert_eq!(e.code(), None, "{message}");
    }
}

#[test]
fn a_statement_name_message_gives_its_name_and_code() {
    use super::statement_name_message as read;
    assert_eq!(
        read("prepared statement \"s12\" already exists"),
        Some(("s12", sqlstate::DUPLICATE_PREPARED_STATEMENT))
    );
    assert_eq!(
        read("prepared statement \"sqlx_s_1\" does not exist"),
        Some(("sqlx_s_1", sqlstate::INVALID_SQL_STATEMENT_NAME))
    );
    assert_eq!(
        read("prepared statement \"a\" b\" already exists"),
        Some(("a\" b", sqlstate::DUPLICATE_PREPARED_STATEMENT))
    );
    assert_eq!(read("prepared statement \"s12\" is odd"), None);
    assert_eq!(read("la sentencia preparada «s12» ya existe"), None);
    assert_eq!(read("statement \"s12\" already exists"), None);
    use crate::driver::taken_statement_name as taken;
    assert_eq!(
        taken("prepared statement \"s7\" already exists"),
        Some("s7")
    );
    assert_eq!(taken("prepared statement \"s7\" does not exist"), None);
    assert_eq!(taken("deadlock detected"), None);
}

/// A server's refusal of a new connection (`FATAL` at its startup) is a
/// connection that was never made, not one that was lost: too many
/// clients, authentication, no such database, not accepting connections
/// now, and pgbouncer's full `max_client_conn` (sent as `08P01`, told by
/// its text). As an `ERROR` in a session, `3D000` or `28000` is another
/// statement's error.
#[test]
fn a_refused_connection_is_a_connect_failure_not_a_lost_one() {
    for (code, message) in [
        ("53300", "sorry, too many clients already"),
        (
            "53300",
            "remaining connection slots are reserved for non-replication superuser connections",
        ),
        ("28P01", "password authentication failed for user \"app\""),
        ("28000", "no pg_hba.conf entry for host \"10.0.0.1\""),
        ("3D000", "database \"nope\" does not exist"),
        ("57P03", "the database system is starting up"),
        ("08P01", "no more connections allowed (max_client_conn)"),
    ] {
        let e = err(code, message).closed(true).into_error();
        assert_eq!(e.kind(), ErrorKind::ConnectFailed, "{code}: {e:?}");
        assert!(!e.is_connection_lost() && !e.is_transient(), "{e:?}");
        assert_eq!(e.code(), Some(code));
        let text = e.to_string();
        assert!(text.contains(message), "{text}");
        assert!(text.contains("nothing was held"), "{text}");
        assert!(!text.contains("lost"), "{text}");
    }
    // pgbouncer's refusal from a driver that hides code and severity.
    let e = DriverError::new("x")
        .message(Some("no more connections allowed (max_client_conn)"))
        .into_error();
    assert_eq!(e.kind(), ErrorKind::ConnectFailed, "{e:?}");
    assert!(e.to_string().contains("the pooler is full"), "{e}");
    // Each refusal says what it is.
    for (code, says) in [
        ("53300", "the server is full"),
        ("28P01", "authentication failed"),
        ("28000", "authentication failed"),
        ("3D000", "the database does not exist"),
        ("57P03", "not accepting connections now"),
    ] {
        let text = err(code, "m").closed(true).into_error().to_string();
        assert!(text.contains(says), "{code}: {text}");
    }
    // The same codes as an `ERROR` in a live session are not refusals.
    let e = err("3D000", "database \"nope\" does not exist").into_error();
    assert_eq!(e.kind(), ErrorKind::Database);
    // A session that existed and ended is lost, not refused.
    for code in ["57P01", "57P02", "25P03", "08006"] {
        let e = err(code, "terminating").closed(true).into_error();
        assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{code}");
    }
    let e = err("08P01", "query_wait_timeout").closed(true).into_error();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost);
}

/// Any error in opening a connection, up to the end of its startup, is a
/// connect failure, whatever it would be in a session: no session existed.
#[test]
fn an_error_opening_a_connection_is_a_connect_failure() {
    let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
    let e = DriverError::new(io).into_connect_error();
    assert_eq!(e.kind(), ErrorKind::ConnectFailed);
    assert_eq!(e.code(), None);
    assert!(
        e.to_string()
            .starts_with("could not connect to the server: Connection refused;"),
        "{e}"
    );
    // A connection closed during the startup (a pooler's own error there).
    let e = err("08P01", "pgbouncer cannot connect to server")
        .closed(true)
        .into_connect_error();
    assert_eq!(e.kind(), ErrorKind::ConnectFailed);
    assert_eq!(e.code(), Some("08P01"));
    assert!(
        e.to_string().contains(
            "refused the connection: pgbouncer cannot connect to server (SQLSTATE 08P01)"
        ),
        "{e}"
    );
    let e = DriverError::new("x").closed(true).into_connect_error();
    assert_eq!(e.kind(), ErrorKind::ConnectFailed);
    let e = Error::not_connected(Duration::from_secs(10));
    assert_eq!(e.kind(), ErrorKind::ConnectFailed);
    assert!(e.to_string().contains("no answer within 10s"), "{e}");
    assert_eq!(
        Error::from(ErrorKind::ConnectFailed).to_string(),
        "no connection was made to the server; nothing was held"
    );
}
