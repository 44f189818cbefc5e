//! Forged lockkit statements on a pooled backend, for the tests of the
//! reply check: behind a transaction-mode pooler, the prepared statement a
//! driver has cached under a name can be another client's on the backend
//! its transaction lands on.
//!
//! [`forge_lockkit_statements`] replaces every lockkit statement prepared
//! on a backend by a forgery under the same name: the same text, parameter
//! types and reply shape, but a tag of `7` and no lock taken (each advisory
//! lock function is swapped for a stand-in that locks nothing). Only the
//! reply check tells such a statement from lockkit's: without it, a driver
//! would report a lock held that the server does not hold.

use tokio_postgres::Client;

use crate::pgbouncer::PgBouncer;

/// Stand-ins for the advisory lock functions, with their signatures:
/// `void` for the waiting forms, `true` for the try forms.
const STAND_INS: &str = "
DO $forge$
BEGIN
  CREATE FUNCTION lockkit_tests_no_lock(bigint) RETURNS void LANGUAGE sql AS 'SELECT';
  CREATE FUNCTION lockkit_tests_no_lock(integer, integer) RETURNS void LANGUAGE sql AS 'SELECT';
  CREATE FUNCTION lockkit_tests_no_try(bigint) RETURNS boolean LANGUAGE sql AS 'SELECT true';
  CREATE FUNCTION lockkit_tests_no_try(integer, integer) RETURNS boolean LANGUAGE sql AS 'SELECT true';
EXCEPTION WHEN duplicate_function OR unique_violation THEN NULL;
END
$forge$";

/// The forgery of lockkit statement `text`: tag `7`, no lock.
pub fn forgery(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    // lockkit's tags are 19-digit `int8` literals starting "78135731915".
    while let Some(at) = rest.find("78135731915") {
        out.push_str(&rest[..at]);
        let digits = rest[at..].bytes().take_while(u8::is_ascii_digit).count();
        out.push('7');
        rest = &rest[at + digits..];
    }
    out.push_str(rest);
    out.replace("pg_try_advisory_xact_lock_shared(", "lockkit_tests_no_try(")
        .replace("pg_try_advisory_xact_lock(", "lockkit_tests_no_try(")
        .replace("pg_advisory_xact_lock_shared(", "lockkit_tests_no_lock(")
        .replace("pg_advisory_xact_lock(", "lockkit_tests_no_lock(")
}

/// Replaces every lockkit statement prepared on the backend of `client`
/// (a connection through a pooler with one server connection, so the
/// backend is the one the driver's transactions land on) by its
/// [`forgery`], under the same name and parameter types. Returns how many
/// it replaced.
///
/// # Panics
///
/// When a statement fails.
pub async fn forge_lockkit_statements(client: &Client) -> usize {
    client
        .batch_execute(STAND_INS)
        .await
        .expect("create the stand-in functions");
    replace_prepared(client, "/* lockkit:", forgery).await
}

/// [`forge_lockkit_statements`] through a connection of its own to
/// `bouncer` (which must have one server connection); at least four
/// statements must have been there to forge.
///
/// # Panics
///
/// When it cannot connect, or finds fewer than four lockkit statements.
pub async fn forge_behind(bouncer: &PgBouncer) -> usize {
    let (client, connection) = bouncer
        .config()
        .connect(tokio_postgres::NoTls)
        .await
        .expect("connect through the pooler");
    tokio::spawn(connection);
    let n = forge_lockkit_statements(&client).await;
    assert!(n >= 4, "lockkit's statements are prepared there: {n}");
    n
}

/// Replaces every statement prepared on the backend of `client` whose text
/// contains `marker` by `with(its text)`, under the same name and parameter
/// types: `DEALLOCATE`, then `PREPARE`. Returns how many it replaced.
///
/// # Panics
///
/// When a statement fails.
pub async fn replace_prepared(
    client: &Client,
    marker: &str,
    with: impl Fn(&str) -> String,
) -> usize {
    let rows = client
        .query(
            "SELECT name, array_to_string(parameter_types::text[], ','), statement \
             FROM pg_prepared_statements WHERE strpos(statement, $1) > 0 \
             AND statement NOT LIKE '%pg_prepared_statements%'",
            &[&marker],
        )
        .await
        .expect("pg_prepared_statements");
    for row in &rows {
        let (name, types, text): (&str, &str, &str) = (row.get(0), row.get(1), row.get(2));
        let params = if types.is_empty() {
            String::new()
        } else {
            format!("({types})")
        };
        client
            .batch_execute(&format!(
                "DEALLOCATE \"{name}\"; PREPARE \"{name}\"{params} AS {}",
                with(text)
            ))
            .await
            .unwrap_or_else(|e| panic!("replace {name}: {e}"));
    }
    rows.len()
}

#[cfg(test)]
mod tests {
    use super::forgery;

    #[test]
    fn a_forgery_has_another_tag_and_takes_no_lock() {
        let text = "/* lockkit:lock_bigint */ SELECT 7813573191525823489::int8 AS tag \
                    FROM (SELECT pg_advisory_xact_lock($1)) AS l";
        assert_eq!(
            forgery(text),
            "/* lockkit:lock_bigint */ SELECT 7::int8 AS tag \
             FROM (SELECT lockkit_tests_no_lock($1)) AS l"
        );
    }
}
