//! Runnable lockkit examples: the ingestion study of the design notes
//! (`ingest`), the notes' other scenarios (`singleton`, `job_queue`,
//! `edit_lock`), and a money transfer through Diesel (`transfer_diesel`).
//!
//! Every example runs with no setup: it starts a throwaway PostgreSQL server
//! (see `lockkit_tests::TestServer`), or uses `DATABASE_URL` when it is set.
//!
//! ```sh
//! cargo run --release -p lockkit-examples --bin ingest
//! cargo run -p lockkit-examples --bin singleton
//! cargo run -p lockkit-examples --bin job_queue
//! cargo run -p lockkit-examples --bin edit_lock
//! cargo run -p lockkit-examples --bin transfer_diesel
//! ```
pub mod db;
pub mod ingest;
pub mod transfer;

pub use db::Database;
