//! The lock engine: everything about taking locks inside a transaction that
//! does not depend on a driver.

pub(crate) mod budget;
pub(crate) mod config;
pub(crate) mod error;
pub(crate) mod facts;
pub(crate) mod guard;
pub(crate) mod plan;
pub(crate) mod sql;
