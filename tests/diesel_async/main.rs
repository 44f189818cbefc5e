//! Integration tests of `lockkit-diesel-async` on a real server, through
//! diesel-async's deadpool pool: the API, mutual exclusion with its control,
//! release on every way a transaction ends, the cancel request of a dropped
//! lock future, and exclusion across drivers (diesel-async against
//! tokio-postgres).

mod api;
mod common;
mod release;
