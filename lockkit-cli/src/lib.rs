//! The library behind the `lockkit` command, for tests and tools that want
//! what the command computes.
//!
//! - [`keyarg`]: `lockkit key`'s typed values and key forms.
//! - [`registry`]: the key types `lockkit inspect` names, from `-n`, the
//!   `LOCKKIT_NAMESPACES` variable and a namespaces file.
//! - [`settings`]: the lock settings `lockkit check` reports and assesses.
//! - [`sql`]: `lockkit key --sql`, a key as an SQL expression of lockkit's
//!   SQL functions.
//! - [`tls`]: `sslmode` and `sslrootcert`, as libpq reads them.
//!
//! The key format is `docs/KEYS.md` in lockkit's source.
pub mod keyarg;
pub mod registry;
pub mod settings;
pub mod sql;
pub mod tls;
