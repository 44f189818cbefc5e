//! Integration tests of `lockkit-sqlx` on a real server: the API, mutual
//! exclusion with its control, release on every way a transaction ends,
//! what a dropped lock future does, deadlock freedom of sorted batches with
//! its control, and exclusion across drivers (sqlx
//! against tokio-postgres).

mod api;
mod common;
mod cross_driver;
mod deadlock;
mod exclusion;
mod release;
