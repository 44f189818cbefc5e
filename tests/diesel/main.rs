//! Integration tests of `lockkit-diesel` on a real server: the API, mutual
//! exclusion and deadlock freedom under concurrency (threads sharing an r2d2
//! pool), release on every way a transaction ends, and exclusion across
//! drivers (Diesel against tokio-postgres).

mod api;
mod common;
mod cross_driver;
mod deadlock;
mod exclusion;
mod release;
