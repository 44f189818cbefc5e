//! The lock engine: the whole protocol of taking locks inside a
//! transaction, with no I/O and no driver types. Adapters reach it through
//! [`crate::driver`], whose docs describe it.

mod acquire;
pub(crate) mod budget;
pub(crate) mod config;
pub(crate) mod error;
pub(crate) mod facts;
pub(crate) mod guard;
mod observe;
pub(crate) mod plan;
pub(crate) mod sql;
mod statement;

pub(crate) use acquire::{
    Acquisition, Grant, OneCall, Request, SavepointEnding, TxSlot, TxState, Wait,
};
pub use acquire::{Policy, SavepointEnd};
pub use error::DriverError;
pub use facts::{FactsRow, HASHTEXT_PROBES};
pub use statement::{read_reply, Param, Reply, ReplyRow, ReplyShape, Statement};
#[cfg(any(feature = "tokio-postgres", test))]
pub(crate) use statement::{ParamType, Sql};

/// The count `n` a [`ReplyShape::Tagged`] statement answers when every key
/// it locks is granted: the number of keys it carries (0 for the timeout
/// statements). For the engine's tests, whose stand-in drivers answer it.
#[cfg(test)]
pub(crate) fn expected_rows(statement: &Statement<'_>) -> i64 {
    let n = match statement.params().first() {
        Some(Param::Int8Array(keys)) => keys.len(),
        Some(Param::Int4Array(keys)) => keys.len(),
        Some(Param::Int8(_)) if statement.sql() == Sql::SetTimeouts => 0,
        Some(Param::Int8(_) | Param::Int4(_)) => 1,
        _ => 0,
    };
    n as i64
}
