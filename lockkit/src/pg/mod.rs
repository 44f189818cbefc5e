//! The tokio-postgres adapter: transactions, session locks, inspection and
//! retry over `tokio_postgres`.

pub mod inspect;
pub(crate) mod locker;
pub(crate) mod migrate;
pub(crate) mod prepared;
pub(crate) mod retry;
pub(crate) mod session;
pub(crate) mod transaction;
