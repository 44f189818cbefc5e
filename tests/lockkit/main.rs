//! Integration tests of `lockkit` over tokio-postgres, on a real server.

mod common;
mod smoke;
