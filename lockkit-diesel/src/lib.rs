//! lockkit's advisory locks inside Diesel transactions (work in progress).
#![warn(missing_docs, rust_2018_idioms, unreachable_pub, missing_debug_implementations)]
#![deny(unsafe_code)]

pub use lockkit::{AdvisoryKey, LockKey};
