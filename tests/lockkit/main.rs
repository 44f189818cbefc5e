//! Integration tests of `lockkit` over tokio-postgres, on a real server.

mod budget;
mod common;
mod deadlock;
mod exclusion;
mod guards_ui;
mod hashtext;
mod inspect;
mod pipeline;
mod poison;
mod pool;
mod release;
mod session;
mod smoke;
mod standby;
mod timeouts;
