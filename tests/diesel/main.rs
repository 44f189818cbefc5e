//! Integration tests of `lockkit-diesel` on a real server: the API, and
//! what Diesel's own transactions and r2d2 pools do with lockkit's locks
//! (errors and panics in `Locker::transaction` and in Diesel's
//! `conn.transaction`). Mutual exclusion, deadlock freedom, release, what
//! each statement mode prepares, where instrumentation sees a lock call's
//! statements and exclusion across stacks are the conformance suite's
//! (tests/conformance), run on every stack.

mod api;
mod common;
mod errors;
mod pooler;
mod release;
