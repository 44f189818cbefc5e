//! Integration tests of `lockkit-sqlx` on a real server: the API, and the
//! release of `Locker::transaction`'s locks when its closure panics. Mutual
//! exclusion, deadlock freedom, release, what a dropped lock future does,
//! what each statement mode prepares, where sqlx reports a lock call's
//! statements, and exclusion across stacks are the conformance suite's
//! (tests/conformance), run on every stack.

mod api;
mod common;
mod dropped;
mod pooler;
mod release;
