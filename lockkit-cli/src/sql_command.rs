//! `lockkit sql` and the text of `lockkit key --sql`.

use crate::connect::Conn;
use crate::{emit, query_error, Result};
use lockkit_cli::sql::SqlKeys;

/// `lockkit sql`'s subcommands.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum SqlCommand {
    /// Install the functions in the schema `lockkit` of the --url database.
    ///
    /// The key functions, and what fencing tokens need (a counter, the
    /// fences' table, lockkit.fencing_token() and lockkit.fence()).
    /// Idempotent (run it again after an upgrade), in one transaction; then
    /// checks that the installed functions compute the KEYS.md golden vector
    /// as this lockkit does. The role needs CREATE on the database (or to
    /// own the schema).
    #[command(after_long_help = crate::BOUNDS_HELP, after_help = "Every wait for the server is bounded by the URL's connect_timeout, 10 s when unset (see --help).")]
    Install,
    /// Write the install script to stdout.
    ///
    /// To install it as a migration of your own, or with psql
    /// (psql --single-transaction -f FILE).
    Print,
}

/// `lockkit sql install`.
pub(crate) async fn sql_install(conn: &Conn) -> Result<()> {
    conn.within("installing lockkit's SQL functions", async {
        lockkit::sql::install(&conn.client)
            .await
            .map_err(|e| query_error("cannot install lockkit's SQL functions", &e))
    })
    .await?;
    let version = lockkit::sql::FORMAT_VERSION;
    emit(&format!(
        "installed lockkit's SQL functions (schema {}, key format version {version}) and the \
         fencing tokens' counter and fence (docs/FENCING.md); the key functions compute the \
         KEYS.md golden vector as this lockkit does\n",
        lockkit::sql::SCHEMA
    ))
}

/// `lockkit key --sql`'s lines: each key's expressions under an SQL comment
/// naming the key, so that the text pastes into psql as it is.
pub(crate) fn sql_text(sql: &SqlKeys) -> String {
    let mut out =
        String::from("\n-- the keys in SQL, with lockkit's SQL functions (lockkit sql install):\n");
    for (name, expression) in [("BigInt", &sql.bigint), ("Pair", &sql.pair)] {
        if let Some(expression) = expression {
            out.push_str(&format!(
                "-- {name}\nSELECT pg_advisory_xact_lock({expression});\n"
            ));
        }
    }
    out
}
