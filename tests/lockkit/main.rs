//! Integration tests of `lockkit` over tokio-postgres, on a real server.

mod common;
mod deadlock;
mod exclusion;
mod release;
mod session;
mod smoke;
