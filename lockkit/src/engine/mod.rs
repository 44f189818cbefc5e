//! The lock engine: the whole protocol of taking locks inside a
//! transaction, with no I/O and no driver types.
//!
//! Given what a transaction holds ([`TxState`]), a request ([`Request`],
//! [`Wait`]) and what the locker knows of the server ([`Policy`]), the engine
//! runs the checks (hot standby, `hashtext`, poisoning, budget, lock order),
//! plans the batch (deduplicated, sorted in the global order of KEYS.md, one
//! statement per key space), lists the statements to send, round by round
//! ([`Acquisition::round`]), takes the replies back and checks every one
//! ([`Acquisition::receive`]), records the outcome or poisons the
//! transaction, and makes the guards from the outcome ([`Grant::lock`] and
//! its siblings, which every adapter calls). Only the engine makes guards.
//!
//! The most common call, one key that waits as long as it takes or not at
//! all (an adapter's `lock`, `lock_shared`, `try_lock`, `try_lock_shared`),
//! is one statement and one reply: [`TxState::acquire_one`] starts it as a
//! [`OneCall`], with the same checks, reply check, bookkeeping and metrics
//! as [`Acquisition`] (one implementation of each, shared) and without the
//! rounds: a whole one-lock transaction is about 0.5–1 % faster through it
//! (BENCHMARKS.md).
//!
//! An adapter (tokio-postgres in [`crate::pg`], `lockkit-diesel`, …) only
//! sends [`Statement`]s on its connection, pipelined where its driver allows,
//! turns the rows into [`Reply`]s, turns its errors into [`DriverError`]s,
//! and cancels a call whose future is dropped. Its whole lock call is this
//! loop:
//!
//! ```
//! use lockkit::engine::{
//!     DriverError, Grant, Policy, Reply, ReplyShape, Request, Statement, TxState, Wait,
//! };
//! use lockkit::{Config, HeldBatch, Batch, ServerFacts};
//!
//! /// A stand-in for a driver: answers every statement as the server would
//! /// when nothing else holds the keys.
//! fn send(round: &[Statement<'_>]) -> Result<Vec<Reply>, DriverError> {
//!     Ok(round.iter().map(|s| match (s.reply(), s.sql().tag()) {
//!         (_, None) => Reply::Done,
//!         (ReplyShape::Locked, Some(tag)) => Reply::Locked { tag },
//!         (_, Some(tag)) => Reply::Tagged { tag, n: lockkit::engine::expected_rows(s) },
//!     }).collect())
//! }
//!
//! # fn main() -> Result<(), lockkit::Error> {
//! let policy = Policy::new(Config::default(), ServerFacts::assumed(64, 100, 0));
//! let state = TxState::new(); // one per transaction
//! # #[derive(lockkit::AdvisoryKey)] struct Account { id: i64 }
//! let batch = Batch::new().with(&Account { id: 1 }).with(&Account { id: 2 });
//! let mut call = state.acquire(&policy, 0, Request::batch(&batch), Wait::Forever)?;
//! while let Some(round) = call.round() {
//!     let replies = send(&round);
//!     call.receive(replies);
//! }
//! // The guard from the outcome: `Grant::lock` for one key, `try_lock`
//! // and `try_lock_batch` for the tries.
//! let held: HeldBatch<'_> = Grant::lock_batch(call.finish())?;
//! assert_eq!(held.keys().len(), 2);
//! assert_eq!(state.held_count(), 2);
//! # Ok(())
//! # }
//! ```

mod acquire;
pub(crate) mod budget;
pub(crate) mod config;
pub(crate) mod error;
pub(crate) mod facts;
pub(crate) mod guard;
mod observe;
pub(crate) mod plan;
pub mod sql;
mod statement;

pub use acquire::{
    Acquisition, Grant, OneCall, Policy, Request, SavepointEnd, SavepointEnding, TxSlot, TxState,
    Wait,
};
pub use error::DriverError;
pub use facts::{FactsRow, HASHTEXT_PROBES};
pub use statement::{
    read_reply, Param, ParamType, Reply, ReplyRow, ReplyShape, Round, Sql, Statement,
};

/// The count `n` a [`ReplyShape::Tagged`] statement answers when every key
/// it locks is granted: the number of keys it carries (0 for the timeout
/// statements). For adapters' tests and stand-ins; the engine checks it.
pub fn expected_rows(statement: &Statement<'_>) -> i64 {
    let n = match statement.params().first() {
        Some(Param::Int8Array(keys)) => keys.len(),
        Some(Param::Int4Array(keys)) => keys.len(),
        Some(Param::Int8(_)) if statement.sql() == Sql::SetTimeouts => 0,
        Some(Param::Int8(_) | Param::Int4(_)) => 1,
        _ => 0,
    };
    n as i64
}
