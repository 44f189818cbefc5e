//! Integration tests of `lockkit-diesel-async` on a real server, through
//! diesel-async's deadpool pool: the API, mutual exclusion with its control,
//! release on every way a transaction ends, the cancel request of a dropped
//! lock future, deadlock freedom of sorted batches with its control, and exclusion across drivers (diesel-async against
//! tokio-postgres).

mod api;
mod common;
mod deadlock;
mod release;
