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

mod budget;
mod config;
mod encoding;
mod error;
mod facts;
mod guard;
mod hashtext;
mod key;
mod namespace;
mod plan;
mod sip;
mod sql;

#[cfg(feature = "tokio-postgres")]
pub mod inspect;
#[cfg(feature = "tokio-postgres")]
mod locker;
#[cfg(feature = "tokio-postgres")]
mod prepared;
#[cfg(feature = "tokio-postgres")]
mod retry;
#[cfg(feature = "tokio-postgres")]
mod session;
#[cfg(feature = "tokio-postgres")]
mod transaction;

pub use config::{Config, OrderCheck};
pub use encoding::{parts_bytes, KeyPart, Parts};
pub use error::{sqlstate, BoxError, Error};
pub use facts::ServerFacts;
pub use guard::{Busy, Held, HeldBatch};
pub use hashtext::{
    hash_bytes, hashtext, hashtext_key, hashtext_key_with, hashtext_with, ByteOrder, HashText,
};
pub use key::{AdvisoryKey, KeyForm, KeySpec, LockKey, PgLocksId};
pub use namespace::{NamespaceError, MAX_NAMESPACE_LEN};
pub use plan::{Batch, Mode};

#[cfg(feature = "tokio-postgres")]
pub use locker::Locker;
#[cfg(feature = "tokio-postgres")]
pub use prepared::Prepared;
#[cfg(feature = "tokio-postgres")]
pub use retry::{retry, RetryPolicy, Transient};
#[cfg(feature = "tokio-postgres")]
pub use session::{probe_pooler, PoolerProbe, SessionGuard, SessionLock};
#[cfg(feature = "tokio-postgres")]
pub use transaction::LockTx;

/// `#[derive(AdvisoryKey)]`: see the [`AdvisoryKey`] trait and KEYS.md.
#[cfg(feature = "derive")]
pub use lockkit_derive::AdvisoryKey;

/// Building blocks for driver adapters (such as `lockkit-diesel`): the
/// per-transaction bookkeeping, the batch plan, the SQL texts, the server
/// facts probe. Applications do not need this module.
pub mod driver {
    pub use crate::budget::TxLocks;
    pub use crate::error::Context;
    pub use crate::facts::HASHTEXT_PROBES;
    pub use crate::plan::Plan;
    /// Every SQL text lockkit sends.
    pub mod sql {
        pub use crate::sql::*;
    }
}

/// Not public API: what `#[derive(AdvisoryKey)]` expands to.
#[doc(hidden)]
pub mod __private {
    pub use crate::encoding::{KeyPart, Parts};
    pub use crate::key::{AdvisoryKey, KeySpec, LockKey};
    pub use core;
}

/// The README's examples compile (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
