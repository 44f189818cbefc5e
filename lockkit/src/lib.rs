//! Typed PostgreSQL advisory locks, safe by construction.
//!
//! lockkit maps domain types to stable advisory-lock keys
//! (`#[derive(AdvisoryKey)]`, format fixed by KEYS.md) and takes them inside
//! transactions only, in one global order, within a lock budget.
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
#![warn(missing_docs, rust_2018_idioms, unreachable_pub, missing_debug_implementations)]
#![deny(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod encoding;
mod key;
mod namespace;

pub use encoding::{parts_bytes, KeyPart, Parts};
pub use key::{AdvisoryKey, KeyForm, KeySpec, LockKey, PgLocksId};
pub use namespace::{NamespaceError, MAX_NAMESPACE_LEN};

/// `#[derive(AdvisoryKey)]`: see the [`AdvisoryKey`] trait and KEYS.md.
#[cfg(feature = "derive")]
pub use lockkit_derive::AdvisoryKey;

/// Not public API: what `#[derive(AdvisoryKey)]` expands to.
#[doc(hidden)]
pub mod __private {
    pub use crate::encoding::{KeyPart, Parts};
    pub use crate::key::{AdvisoryKey, KeySpec, LockKey};
    pub use core;
}
