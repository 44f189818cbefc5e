//! The tokio-postgres adapter: transactions, session locks, inspection and
//! retry over `tokio_postgres`.

pub(crate) mod ddl;
pub(crate) mod exec;
pub mod inspect;
pub(crate) mod locker;
pub(crate) mod session;
pub(crate) mod transaction;
