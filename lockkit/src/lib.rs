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
///
/// # Examples
///
/// These are the derive's examples, here so that they run as doctests (the
/// derive crate cannot depend on lockkit).
///
/// ```
/// use lockkit::{AdvisoryKey, LockKey};
///
/// #[derive(AdvisoryKey)]
/// struct Order {
///     id: i64,
/// }
///
/// // KEYS.md golden vector.
/// assert_eq!(Order { id: 42 }.lock_key(), LockKey::BigInt(-7205368663365046133));
/// ```
///
/// Type attributes:
///
/// ```
/// use lockkit::{AdvisoryKey, KeySpec, LockKey};
///
/// #[derive(AdvisoryKey)]
/// #[advisory_key(namespace = "billing.invoice", pair, class = 7)]
/// struct Invoice { id: u64 }
///
/// #[derive(AdvisoryKey)]
/// #[advisory_key(pair = "exact", class = 7)]
/// struct Account(i32);
///
/// #[derive(AdvisoryKey)]
/// #[advisory_key(raw)]
/// struct LegacyJobId(i64);
///
/// #[derive(AdvisoryKey)]
/// #[advisory_key(stripes = 1024)]
/// struct Event { business_key: String } // at most 1024 distinct keys
///
/// let invoice = Invoice { id: 9 }.lock_key();
/// assert!(matches!(invoice, LockKey::Pair(7, _)));
/// assert_eq!(invoice, KeySpec::new("billing.invoice").class(7).key_of(&9_u64));
/// assert_eq!(Account(5).lock_key(), LockKey::Pair(7, 5));
/// assert_eq!(LegacyJobId(9).lock_key(), LockKey::BigInt(9));
/// // KEYS.md golden vector.
/// let event = Event { business_key: "a1b2c3d4".into() };
/// assert_eq!(event.lock_key(), LockKey::BigInt(5974306380683673735));
/// ```
///
/// Field attributes:
///
/// ```
/// use lockkit::AdvisoryKey;
///
/// fn cents(amount: &f64, parts: &mut lockkit::Parts<'_>) {
///     parts.put(&((amount * 100.0).round() as i64));
/// }
///
/// #[derive(AdvisoryKey)]
/// struct Payment {
///     order: u64,
///     #[advisory_key(with = "cents")]
///     amount: f64,
///     #[advisory_key(skip)]
///     note: String,
/// }
///
/// let a = Payment { order: 1, amount: 12.5, note: "first".into() };
/// let b = Payment { order: 1, amount: 12.5, note: "second".into() };
/// let c = Payment { order: 1, amount: 12.75, note: "first".into() };
/// assert_eq!(a.lock_key(), b.lock_key()); // `note` is skipped
/// assert_ne!(a.lock_key(), c.lock_key());
/// ```
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
