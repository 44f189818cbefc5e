//! The acquisition protocol, written once: checks, plan, statements,
//! replies, outcome, guards. No I/O: an adapter sends what
//! [`Acquisition::round`] lists and hands the replies to
//! [`Acquisition::receive`].

mod acquisition;
mod grant;
mod ledger;
mod one_call;
mod request;
#[cfg(test)]
mod tests;

pub use acquisition::Acquisition;
pub use grant::Grant;
pub use one_call::OneCall;
pub use request::{Policy, Request, SavepointEnd, SavepointEnding, TxSlot, TxState, Wait};
