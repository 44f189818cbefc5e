//! Typed PostgreSQL advisory locks, safe by construction.
//!
//! lockkit maps domain types to stable advisory-lock keys
//! (`#[derive(AdvisoryKey)]`, in the key format fixed by KEYS.md) and takes
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

pub mod engine;
mod key;
#[cfg(feature = "tokio-postgres")]
mod pg;
mod retry;

#[cfg(feature = "tokio-postgres")]
pub use pg::inspect;

pub use engine::config::{Config, OrderCheck, StatementMode};
pub use engine::error::{sqlstate, BoxError, Error, ErrorKind};
pub use engine::facts::ServerFacts;
pub use engine::guard::{Busy, Held, HeldBatch};
pub use engine::plan::{Batch, Mode};
pub use engine::Policy;
pub use key::encoding::{parts_bytes, KeyPart, Parts};
pub use key::hashtext::{
    hash_bytes, hashtext, hashtext_key, hashtext_key_with, hashtext_with, ByteOrder, HashText,
};
pub use key::namespace::{NamespaceError, MAX_NAMESPACE_LEN};
pub use key::{AdvisoryKey, KeyForm, KeySpec, LockKey, PgLocksId};

#[cfg(feature = "tokio-postgres")]
pub use pg::locker::{LockClient, Locker};
#[cfg(feature = "tokio-postgres")]
pub use pg::session::{probe_pooler, PoolerProbe, SessionGuard, SessionLock};
#[cfg(feature = "tokio-postgres")]
pub use pg::transaction::LockTx;
#[cfg(feature = "tokio-postgres")]
pub use retry::retry;
pub use retry::{retry_blocking, RetryPolicy, Transient};

/// `#[derive(AdvisoryKey)]`: see the [`AdvisoryKey`] trait and KEYS.md.
#[cfg(feature = "derive")]
pub use lockkit_derive::AdvisoryKey;

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
