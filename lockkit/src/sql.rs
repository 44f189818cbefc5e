//! lockkit's keys computed in SQL: the key format of
//! `docs/KEYS.md` as plain
//! SQL and PL/pgSQL functions in a schema `lockkit`, so that SQL (a
//! migration, a psql session, a cron job, a service in another language)
//! takes the same advisory lock as the Rust service for the same entity.
//!
//! [`SQL`] is the install script: idempotent, PostgreSQL 12 to 17, no C
//! extension (it runs on managed PostgreSQL). Install it with [`install`]
//! (feature `tokio-postgres`), with `lockkit sql install`, or as a
//! migration of your own; `lockkit sql print` writes it out.
//!
//! ```sql
//! -- #[derive(AdvisoryKey)] struct Order { id: i64 }
//! SELECT pg_advisory_xact_lock(lockkit.key('Order', lockkit.int(42)));
//! -- #[derive(AdvisoryKey)] struct Tenanted<'a> { tenant: &'a str, id: u64 }
//! SELECT pg_advisory_xact_lock(lockkit.key('Tenanted', lockkit.str('acme'), lockkit.int(1001)));
//! -- #[advisory_key(pair)]: the class and the object of the Pair key
//! SELECT pg_advisory_xact_lock(lockkit.pair_class('Order'), lockkit.pair_object('Order', lockkit.int(42)));
//! ```
//!
//! The script's header lists every function. `lockkit key --sql` prints the
//! SQL expression of a given key.
//!
//! The script also installs what fencing tokens need
//! ([`crate::fencing`], docs/FENCING.md): the counter
//! `lockkit.fencing_counter`, the table `lockkit.fences`, and the functions
//! `lockkit.fencing_token()` and `lockkit.fence(resource, token)`
//! ([`fence`] from Rust).

/// The install script of the `lockkit` schema: the key format's part
/// encoders, SipHash-2-4, namespace tags and keys as SQL functions, then
/// the fencing tokens' counter, the fences' table and their two functions
/// ([`fencing`](crate::fencing)).
///
/// Idempotent: running it again changes nothing. It holds no `BEGIN` or
/// `COMMIT`, so a migration tool can run it inside its own transaction; sent
/// as one simple-query batch (as [`install`] does), PostgreSQL runs it in one
/// implicit transaction, all or nothing.
pub const SQL: &str = concat!(
    include_str!("../sql/lockkit_keys.sql"),
    include_str!("../sql/lockkit_fencing.sql")
);

/// The keys' part of [`SQL`]: pure functions only.
#[cfg(test)]
const KEYS_SQL: &str = include_str!("../sql/lockkit_keys.sql");

/// The fencing part of [`SQL`].
#[cfg(test)]
const FENCING_SQL: &str = include_str!("../sql/lockkit_fencing.sql");

/// The schema the functions of [`SQL`] live in.
pub const SCHEMA: &str = "lockkit";

/// The key format version the functions of [`SQL`] implement
/// (`lockkit.format_version()`).
pub const FORMAT_VERSION: i32 = 1;

/// Installs (or reinstalls) the `lockkit` schema's functions ([`SQL`]) on
/// `client`'s database, then checks that the installed functions compute
/// the KEYS.md golden vector `Order { id: 42 }` as this crate does.
///
/// Works on a [`tokio_postgres::Client`] (the script then runs in an
/// implicit transaction of its own) or inside a
/// [`tokio_postgres::Transaction`] (it commits or rolls back with it). The
/// role needs `CREATE` on the database, or to own an existing schema
/// `lockkit`.
///
/// ```no_run
/// # async fn run(client: &tokio_postgres::Client) -> Result<(), lockkit::Error> {
/// lockkit::sql::install(client).await?;
/// let key: i64 = client
///     .query_one("SELECT lockkit.key('Order', lockkit.int(42))", &[])
///     .await?
///     .get(0);
/// assert_eq!(key, -7205368663365046133); // KEYS.md golden vector
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// The server's error when the script fails (no privilege, a function of
/// the same signature but another return type left by something else in
/// the schema `lockkit`), as [`ErrorKind::Database`](crate::ErrorKind) with
/// its SQLSTATE; [`ErrorKind::Database`](crate::ErrorKind) too when the
/// installed functions compute another key than this crate for the golden
/// vector (functions of another version, or edited).
///
/// # Cancel safety
///
/// Not cancel safe in the sense of leaving nothing behind: dropped after
/// the script was sent, the server still runs it to the end, all or
/// nothing, and nothing checks the result. Run it again: it is idempotent.
#[cfg(feature = "tokio-postgres")]
pub async fn install<C>(client: &C) -> Result<(), crate::Error>
where
    C: tokio_postgres::GenericClient + Sync,
{
    client.batch_execute(SQL).await?;
    // Unnamed: a named statement could meet another client's behind a
    // transaction-mode pooler.
    let row = client
        .query_typed_one(crate::engine::sql::INSTALL_CHECK, &[])
        .await?;
    let version: i32 = row.try_get(0)?;
    let key: i64 = row.try_get(1)?;
    let class: i32 = row.try_get(2)?;
    let object: i32 = row.try_get(3)?;
    let spec = crate::KeySpec::new("Order");
    let expected = (
        FORMAT_VERSION,
        spec.key_of(&42_i64),
        spec.pair().key_of(&42_i64),
    );
    let got = (
        version,
        crate::LockKey::BigInt(key),
        crate::LockKey::Pair(class, object),
    );
    if got != expected {
        return Err(crate::Error::with_message(
            crate::ErrorKind::Database,
            format!(
                "the installed lockkit SQL functions compute format version {}, keys {} and {} \
             for Order {{ id: 42 }}; this lockkit computes format version {}, keys {} and {}",
                got.0, got.1, got.2, expected.0, expected.1, expected.2
            ),
        ));
    }
    Ok(())
}

/// Fences a write to `resource` with `token` (`lockkit.fence`, see
/// [`fencing`](crate::fencing)): `true` when `token` is at least the newest
/// token `resource` has seen (it then becomes the newest), `false` when it
/// is older, the write of a stale holder that must not happen.
///
/// Call it in the transaction of the protected write, before the write:
/// the resource's row in `lockkit.fences` stays locked until that
/// transaction ends, so a stale holder's fence waits for the new holder's
/// write to commit, then sees its newer token. Sent unnamed.
///
/// ```no_run
/// # async fn run(client: &mut tokio_postgres::Client, guard: &lockkit::SessionGuard<i64>)
/// #     -> Result<(), lockkit::Error> {
/// let token = guard.fencing_token().expect("a SessionLock set to mint tokens");
/// let tx = client.transaction().await?;
/// if lockkit::sql::fence(&tx, "invoice:42", token).await? {
///     tx.execute("UPDATE invoices SET paid = true WHERE id = 42", &[]).await?;
///     tx.commit().await?;
/// } // else: a newer holder wrote already; this one is stale
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`ErrorKind::NotInstalled`](crate::ErrorKind::NotInstalled) when the
/// database has no `lockkit.fence` (run [`install`]);
/// [`ErrorKind::Database`](crate::ErrorKind::Database) with SQLSTATE
/// `42501` when the role lacks `USAGE` on the schema `lockkit`
/// (docs/FENCING.md, "Who may call it"), or with the server's error
/// otherwise; the connection's error. A [`FencingToken`](crate::fencing::FencingToken)
/// is always a token, so the fence's refusal of anything else (`22023`)
/// cannot come from here. Never `false` for an error: `false` means stale.
///
/// # Cancel safety
///
/// Cancel safe in that nothing is left held: dropped in flight, the fence
/// may or may not have run, and the transaction it ran in decides (a
/// rolled-back transaction leaves the resource's newest token as it was).
#[cfg(feature = "tokio-postgres")]
pub async fn fence<C>(
    client: &C,
    resource: &str,
    token: crate::fencing::FencingToken,
) -> Result<bool, crate::Error>
where
    C: tokio_postgres::GenericClient + Sync,
{
    use tokio_postgres::types::Type;
    let token = token.to_string();
    let row = client
        .query_typed_one(
            crate::engine::sql::FENCE,
            &[(&resource, Type::TEXT), (&token, Type::TEXT)],
        )
        .await
        .map_err(|e| crate::Error::not_installed_or(e.into(), "lockkit::sql::fence"))?;
    // The fence answers true or false, or fails: a NULL (which no
    // installed version answers for a token and a resource) is an error
    // here, not `false`, which would say stale.
    Ok(row.try_get::<_, bool>(0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_is_plain_and_pinned() {
        assert_eq!(SQL, format!("{KEYS_SQL}{FENCING_SQL}"));
        // Every key function pins its search_path and is marked as pure.
        let functions: Vec<&str> = KEYS_SQL
            .split("CREATE OR REPLACE FUNCTION")
            .skip(1)
            .collect();
        assert!(functions.len() > 20, "{}", functions.len());
        for f in functions {
            let head = &f[..f.find("AS $$").expect("a body")];
            for attribute in [
                "SET search_path = pg_catalog, pg_temp",
                "IMMUTABLE",
                "PARALLEL SAFE",
            ] {
                assert!(head.contains(attribute), "{attribute} missing in{head}");
            }
        }
        assert!(SQL.contains("PostgreSQL 12, 13, 14, 15, 16 and 17"));
        // Concurrent installs take turns on a lockkit key of their own.
        let key = crate::KeySpec::new("lockkit.sql").key_of("install");
        assert!(SQL.contains(&format!("SELECT pg_catalog.pg_advisory_xact_lock({key});")));
        // No dynamic SQL, no transaction control, nothing outside the schema.
        for word in ["EXECUTE", "BEGIN;", "COMMIT", "public."] {
            assert!(!SQL.contains(word), "{word}");
        }
    }

    /// The fencing functions run as their owner, with a pinned search_path,
    /// and are never taken for pure ones.
    #[test]
    fn fencing_functions_are_definers_pinned_and_volatile() {
        let functions: Vec<&str> = FENCING_SQL
            .split("CREATE OR REPLACE FUNCTION")
            .skip(1)
            .collect();
        assert_eq!(functions.len(), 2);
        for f in functions {
            let head = &f[..f.find("AS $$").expect("a body")];
            for attribute in [
                "SET search_path = pg_catalog, pg_temp",
                "VOLATILE",
                "SECURITY DEFINER",
            ] {
                assert!(head.contains(attribute), "{attribute} missing in{head}");
            }
        }
    }
}
