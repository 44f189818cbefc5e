//! diesel-async's named statements behind a pooler shared with other
//! processes: each of lockkit's statements prepared under a savepoint, and
//! a name another process left on the server connection cleared and the
//! statement sent again.
//!
//! diesel-async prepares every statement under a tokio-postgres name (`s0`,
//! `s1`, …, counted per process) and offers no way to send one unnamed.
//! Behind a transaction-mode pooler that keeps no named statement per
//! client (pgbouncer before 1.21), the server connection a transaction gets
//! may hold a statement of that name that another process prepared there
//! and left: preparing lockkit's then fails (`42P05`), and a failed
//! statement aborts the transaction, with the application's work in it.
//!
//! So in [`StatementMode::Unnamed`](lockkit::StatementMode::Unnamed), the
//! default, [`under_savepoint`] sends each statement as:
//!
//! 1. `SAVEPOINT lockkit_parse`, the statement's `Parse`, and `RELEASE
//!    SAVEPOINT lockkit_parse`, in that order and in one round trip: the
//!    three futures are polled in that order before any is awaited, and
//!    tokio-postgres writes a request when its future is first polled. The
//!    statement's `Bind` and `Execute` follow once its `Parse` is answered,
//!    after the savepoint is released: the statement runs, and fails, in
//!    the transaction itself, exactly as it would unguarded.
//! 2. When the `Parse` finds its name taken, only the savepoint fails. It
//!    is rolled back (nothing ran in it), and the statements named `s<n>`
//!    with `n` at least the taken name's, prepared on that server
//!    connection before this transaction began, are deallocated: this
//!    process never used those names (its counter only grows), and inside
//!    the transaction the pooler gives the server connection to no one
//!    else, so they are other processes' statements, left between
//!    transactions, where no client of a transaction-mode pooler can count
//!    on finding them again. What the transaction itself prepared, and
//!    every name of another form, stays. The statement is then sent once
//!    more, under its next name, which nothing on the server connection
//!    can hold any more.
//! 3. Any other failure of the `Parse`, or a second clash, leaves the
//!    savepoint failed, and with it the transaction, as the failure of an
//!    unguarded statement leaves the transaction.
//!
//! On a direct connection no other process's statement can be on the
//! server connection, and the savepoint is all that is added: two utility
//! statements in the round trip the `Parse` already takes.
//!
//! The taken name is read from the server's English message
//! (diesel-async's errors carry no SQLSTATE), like the other errors lockkit
//! recognizes over Diesel; with `lc_messages` in another language a clash
//! is not repaired, and fails the lock call as an
//! [`UnexpectedReply`](lockkit::ErrorKind::UnexpectedReply) with `42P05`.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::task::Poll;

use diesel::result::Error as DieselError;
use diesel::QueryResult;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use lockkit::driver::taken_statement_name;

/// Opens the savepoint the `Parse` of a lockkit statement runs in.
const BEGIN: &str = "SAVEPOINT lockkit_parse";

/// Releases it, so that the statement itself runs in the transaction.
const END: &str = "RELEASE SAVEPOINT lockkit_parse";

/// Rolls back the savepoint whose `Parse` failed (nothing ran in it), and
/// ends it.
const UNDO: &str = "ROLLBACK TO SAVEPOINT lockkit_parse; RELEASE SAVEPOINT lockkit_parse";

/// The statement that deallocates every statement named `s<n>`, `n ≥
/// first`, prepared on the server connection before the transaction began
/// (`prepare_time`, like `now()`, is a statement's and a transaction's
/// start): see the module docs. `first` is SQL: a number, or a scalar
/// subquery (NULL: nothing is deallocated). The `CASE` casts only names of
/// that form (a `WHERE`'s conditions run in no promised order).
fn deallocate_from(first: impl std::fmt::Display) -> String {
    format!(
        "DO $lockkit$ DECLARE foreign_name text; BEGIN \
         FOR foreign_name IN SELECT name FROM pg_prepared_statements \
         WHERE CASE WHEN name ~ '^s[0-9]+$' THEN substr(name, 2)::numeric >= {first} END \
         AND prepare_time < now() \
         LOOP EXECUTE format('DEALLOCATE %I', foreign_name); END LOOP; END $lockkit$"
    )
}

/// The `n` of the tokio-postgres name `s<n>` that preparing a statement
/// found already held on the server connection, from the server's English
/// message (`prepared statement "s12" already exists`); `None` for any
/// other error.
fn taken_name(e: &DieselError) -> Option<u64> {
    let DieselError::DatabaseError(_, info) = e else {
        return None;
    };
    taken_number(info.message())
}

/// The `n` of the tokio-postgres name `s<n>` that the server's message
/// says preparing found taken ([`taken_statement_name`]); `None` for any
/// other message or name.
fn taken_number(message: &str) -> Option<u64> {
    taken_statement_name(message).and_then(number_of)
}

/// After a clash of the name `s<taken>`: the failed savepoint rolled back
/// and ended ([`UNDO`]), then the foreign names from the taken one on
/// deallocated ([`deallocate_from`]), in one simple query.
fn undo_and_clear(taken: u64) -> String {
    format!("{UNDO}; {}", deallocate_from(taken))
}

/// The `n` of a tokio-postgres statement name `s<n>`; `None` for a name of
/// another form (a pooler that names statements itself on the server,
/// pgbouncer 1.21+ with `max_prepared_statements`, gives them its own).
fn number_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix('s')?;
    // Digits only: `u64`'s parse would take a sign.
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Runs the statement `load` makes on `conn` with its `Parse` under a
/// savepoint, clearing a name another process left there and sending the
/// statement again once (see the module docs). `load` is called once per
/// attempt; each of its futures must send its `Parse` at its first poll
/// (diesel-async does, for a statement it does not cache).
///
/// Must run inside a transaction block, which lockkit checks before every
/// call.
///
/// # Errors
///
/// The statement's error; `SAVEPOINT`'s when that failed and the statement
/// did not; `RELEASE`'s when the statement succeeded but its savepoint
/// could not be released, its lock then unknown.
///
/// # Cancel safety
///
/// As the statement's: dropped in flight, the statements sent stay in the
/// transaction, which the driver gives up (`cut_off`).
pub(crate) async fn under_savepoint<T, F, Q>(conn: &AsyncPgConnection, load: F) -> QueryResult<T>
where
    F: Fn() -> Q,
    Q: Future<Output = QueryResult<T>>,
{
    let mut cleared = false;
    loop {
        // Unconstrained: tokio's cooperative budget could otherwise make a
        // future yield at its first poll (diesel-async locks its statement
        // cache through a tokio mutex) before it sent its request, and the
        // three requests would leave out of order.
        let (begin, answer, end) =
            tokio::task::unconstrained(in_order(execute(conn, BEGIN), load(), execute(conn, END)))
                .await;
        match (begin, answer, end) {
            // The savepoint's failure is the call's first: a timeout or a
            // cancel that cut it, a lost connection, or the transaction
            // already failed (`25P02` again). The statement behind it met
            // only the `25P02` that failure left.
            (Err(e), _, _) => return Err(e),
            (Ok(()), answer, Ok(())) => return answer,
            (Ok(()), Ok(_), Err(e)) => return Err(e),
            (Ok(()), Err(e), Err(_)) => match taken_name(&e) {
                Some(taken) if !cleared => {
                    tracing::debug!(
                        "lockkit-diesel-async: statement name s{taken} held on the server \
                         connection by another process; clearing such names and sending again"
                    );
                    // The clear's own failure (a timeout that cut it, a
                    // lost connection) is what ends the call.
                    execute(conn, &undo_and_clear(taken)).await?;
                    cleared = true;
                }
                _ => return Err(e),
            },
        }
    }
}

/// A statement [`begin_clear_ahead`] prepares to learn this process's next
/// tokio-postgres name; [`clear_from_probe`] finds it by this text in
/// `pg_prepared_statements`.
const PROBE: &str = "SELECT 'lockkit-diesel-async: the next statement name'";

/// Opens the transaction [`begin_clear_ahead`] clears in, and the
/// savepoint its probe is prepared under.
const OPEN: &str = "BEGIN; SAVEPOINT lockkit_parse";

/// Releases the probe's savepoint, then deallocates as [`deallocate_from`]
/// does from the number of the name the probe ([`PROBE`]) was just
/// prepared under; nothing when that name is not a tokio-postgres name (a
/// pooler that names the statements on the server itself, pgbouncer 1.21+
/// with `max_prepared_statements`, where no client's name can meet
/// another's, and which may have prepared the probe there before: then no
/// row is this transaction's, and nothing is cleared either).
fn clear_from_probe() -> String {
    let first = format!(
        "(SELECT CASE WHEN name ~ '^s[0-9]+$' THEN substr(name, 2)::numeric END \
         FROM pg_prepared_statements \
         WHERE statement = $probe${PROBE}$probe$ AND prepare_time >= now() LIMIT 1)"
    );
    format!("{END}; {}", deallocate_from(first))
}

/// Opens a transaction on `client` and deallocates there other processes'
/// statements under the tokio-postgres names this process will use from
/// now on, as a clash does (see the module docs): what a connection's
/// set-up needs, whose statements diesel-async sends itself. The caller
/// runs the set-up in that transaction, and commits it.
///
/// Learns the next name by preparing [`PROBE`] under a savepoint, whose
/// name (or the clash's, when another process holds it) is the first the
/// clear starts from. Opening, the probe and the clear leave in that order
/// in one round trip, as [`under_savepoint`]'s do; a clash of the probe
/// takes a second.
///
/// # Errors
///
/// tokio-postgres's error when a statement fails, the transaction then
/// failed.
///
/// # Cancel safety
///
/// Dropped in flight, the statements sent stay in the transaction, which
/// the caller then drops with its connection.
pub(crate) async fn begin_clear_ahead(
    client: &tokio_postgres::Client,
) -> Result<(), tokio_postgres::Error> {
    // Unconstrained, in order: see `under_savepoint`.
    let clear = clear_from_probe();
    let (open, probe, clear) = tokio::task::unconstrained(in_order(
        client.batch_execute(OPEN),
        client.prepare(PROBE),
        client.batch_execute(&clear),
    ))
    .await;
    open?;
    match probe {
        // Its `Close` goes before the caller's next statement, inside the
        // transaction, on the server connection it was prepared on.
        Ok(_) => clear,
        Err(e) => match e.as_db_error().and_then(|db| taken_number(db.message())) {
            Some(taken) => client.batch_execute(&undo_and_clear(taken)).await,
            None => Err(e),
        },
    }
}

/// `sql` in the simple query protocol on `conn`.
async fn execute(conn: &AsyncPgConnection, sql: &str) -> QueryResult<()> {
    let mut conn = conn;
    conn.batch_execute(sql).await
}

/// Polls `a`, `b` and `c`, in that order each time, until all three are
/// done: what each sends at its first poll leaves in that order.
async fn in_order<A, B, C>(a: A, b: B, c: C) -> (A::Output, B::Output, C::Output)
where
    A: Future,
    B: Future,
    C: Future,
{
    let (mut a, mut b, mut c) = (pin!(a), pin!(b), pin!(c));
    let (mut ra, mut rb, mut rc) = (None, None, None);
    poll_fn(|cx| {
        if ra.is_none() {
            if let Poll::Ready(out) = a.as_mut().poll(cx) {
                ra = Some(out);
            }
        }
        if rb.is_none() {
            if let Poll::Ready(out) = b.as_mut().poll(cx) {
                rb = Some(out);
            }
        }
        if rc.is_none() {
            if let Poll::Ready(out) = c.as_mut().poll(cx) {
                rc = Some(out);
            }
        }
        match (ra.take(), rb.take(), rc.take()) {
            (Some(a), Some(b), Some(c)) => Poll::Ready((a, b, c)),
            (a, b, c) => {
                (ra, rb, rc) = (a, b, c);
                Poll::Pending
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use diesel::result::{DatabaseErrorKind, Error as DieselError};

    use super::taken_name;

    fn error(message: &str) -> DieselError {
        DieselError::DatabaseError(DatabaseErrorKind::Unknown, Box::new(message.to_owned()))
    }

    #[test]
    fn the_taken_name_is_a_tokio_postgres_name_from_the_clash_message() {
        let taken = |m: &str| taken_name(&error(m));
        assert_eq!(taken("prepared statement \"s12\" already exists"), Some(12));
        assert_eq!(taken("prepared statement \"s0\" already exists"), Some(0));
        assert_eq!(taken("prepared statement \"s12\" does not exist"), None);
        assert_eq!(
            taken("prepared statement \"sqlx_s_1\" already exists"),
            None
        );
        assert_eq!(taken("prepared statement \"s+1\" already exists"), None);
        assert_eq!(taken("prepared statement \"s\" already exists"), None);
        assert_eq!(taken("prepared statement \"s1x\" already exists"), None);
        assert_eq!(taken("la sentencia preparada «s12» ya existe"), None);
        assert_eq!(taken_name(&DieselError::NotFound), None);
    }

    #[test]
    fn only_a_tokio_postgres_name_has_a_number() {
        use super::number_of;
        assert_eq!(number_of("s0"), Some(0));
        assert_eq!(number_of("s418"), Some(418));
        assert_eq!(number_of("PGBOUNCER_12"), None);
        assert_eq!(number_of("sqlx_s_1"), None);
        assert_eq!(number_of("s"), None);
        assert_eq!(number_of("s-1"), None);
        assert_eq!(number_of("s99999999999999999999999"), None);
    }
}
