//! Integration tests of `lockkit-diesel-async` on a real server, through
//! diesel-async's deadpool pool: the API. Mutual exclusion, deadlock
//! freedom, release, the cancel request of a dropped lock future, what each
//! statement mode prepares, where instrumentation sees a lock call's
//! statements, and exclusion across stacks are the conformance suite's
//! (tests/conformance), run on every stack.

mod api;
mod common;
mod dropped;
mod pooler;
