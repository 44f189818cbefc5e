//! Integration tests of `lockkit` over tokio-postgres, on a real server.

mod budget;
mod common;
mod ddl;
mod deadlock;
mod exclusion;
mod findings;
mod hashtext;
mod inspect;
mod observe;
mod poison;
mod pool;
mod release;
mod session;
mod smoke;
mod standby;
mod timeouts;
