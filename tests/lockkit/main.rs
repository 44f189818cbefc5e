//! Integration tests of `lockkit` over tokio-postgres, on a real server.

mod budget;
mod common;
mod ddl;
mod exclusion;
mod facts;
mod findings;
mod footprint;
mod guards_ui;
mod hashtext;
mod inspect;
mod migrate;
mod observe;
mod order;
mod pipeline;
mod poison;
mod pool;
mod release;
mod session;
mod session_forms;
mod session_lost;
mod session_pooler;
mod session_probe;
mod session_tls;
mod smoke;
mod standby;
mod timeouts;
