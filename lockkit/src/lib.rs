//! Typed PostgreSQL advisory locks, safe by construction.
//!
//! lockkit maps domain types to stable advisory-lock keys
//! (`#[derive(AdvisoryKey)]`, in the key format fixed by
//! [KEYS.md](https://example.invalid/lockkit/blob/main/docs/KEYS.md)) and takes
//! them inside transactions only, in one global order, within a lock budget.
//!
//! # Example
//!
//! ```
//! use lockkit::{AdvisoryKey, LockKey};
//!
//! #[derive(AdvisoryKey)]
//! struct Order {
//!     id: i64,
//! }
//!
//! // Golden vector of KEYS.md: every process, build and version agrees.
//! assert_eq!(Order { id: 42 }.lock_key(), LockKey::BigInt(-7205368663365046133));
//! ```
//!
//! With the `tokio-postgres` feature (default), a [`Locker`] takes the keys
//! inside a [`LockTx`]; see [`Locker`] for a complete example.
//!
//! # Facts this crate relies on (PostgreSQL 15)
//!
//! - Transaction-scoped locks are released only at `COMMIT`/`ROLLBACK` (or a
//!   rollback to an enclosing savepoint), never earlier, except that an
//!   error that aborts the transaction releases them at once; outside an
//!   explicit transaction they are released at the end of the statement,
//!   which is why lockkit only takes them inside one.
//! - PostgreSQL detects deadlocks among advisory locks (`40P01` after
//!   `deadlock_timeout`); sorted acquisition avoids the stall and the abort.
//! - `max_locks_per_transaction` sizes a lock table shared by all sessions:
//!   one greedy transaction makes other sessions fail with `53200`, even in
//!   `pg_try_*`. Hence the lock budget.
#![warn(
    missing_docs,
    rust_2018_idioms,
    unreachable_pub,
    missing_debug_implementations
)]
#![deny(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod engine;
mod key;
#[cfg(feature = "tokio-postgres")]
mod pg;

#[cfg(feature = "tokio-postgres")]
pub use pg::inspect;

pub use engine::config::{Config, OrderCheck};
pub use engine::error::{sqlstate, BoxError, Error};
pub use engine::facts::ServerFacts;
pub use engine::guard::{Busy, Held, HeldBatch};
pub use engine::plan::{Batch, Mode};
pub use key::encoding::{parts_bytes, KeyPart, Parts};
pub use key::hashtext::{
    hash_bytes, hashtext, hashtext_key, hashtext_key_with, hashtext_with, ByteOrder, HashText,
};
pub use key::namespace::{NamespaceError, MAX_NAMESPACE_LEN};
pub use key::{AdvisoryKey, KeyForm, KeySpec, LockKey, PgLocksId};

#[cfg(feature = "tokio-postgres")]
pub use pg::locker::Locker;
#[cfg(feature = "tokio-postgres")]
pub use pg::prepared::Prepared;
#[cfg(feature = "tokio-postgres")]
pub use pg::retry::{retry, RetryPolicy, Transient};
#[cfg(feature = "tokio-postgres")]
pub use pg::session::{probe_pooler, PoolerProbe, SessionGuard, SessionLock};
#[cfg(feature = "tokio-postgres")]
pub use pg::transaction::LockTx;

/// `#[derive(AdvisoryKey)]`: see the [`AdvisoryKey`] trait and
/// [KEYS.md](https://example.invalid/lockkit/blob/main/docs/KEYS.md).
#[cfg(feature = "derive")]
pub use lockkit_derive::AdvisoryKey;

/// Building blocks for driver adapters (such as `lockkit-diesel`): the
/// per-transaction bookkeeping, the batch plan, the SQL texts, the server
/// facts probe. Applications do not need this module.
pub mod driver {
    pub use crate::engine::budget::TxLocks;
    pub use crate::engine::error::Context;
    pub use crate::engine::facts::HASHTEXT_PROBES;
    pub use crate::engine::plan::Plan;
    /// Every SQL text lockkit sends.
    pub mod sql {
        pub use crate::engine::sql::*;
    }
}

/// Not public API: what `#[derive(AdvisoryKey)]` expands to.
#[doc(hidden)]
pub mod __private {
    pub use crate::key::encoding::{KeyPart, Parts};
    pub use crate::key::{AdvisoryKey, KeySpec, LockKey};
    pub use core;
}

/// The README's examples compile (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
