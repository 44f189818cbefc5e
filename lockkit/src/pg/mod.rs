//! The tokio-postgres adapter: it runs the [engine](crate::driver)'s
//! statements on a `tokio_postgres` connection, and adds what only a
//! connection can do: session locks, inspection of `pg_locks`, DDL under a
//! short lock timeout.
//!
//! Everything here is also at the crate root.

pub(crate) mod ddl;
mod error;
pub(crate) mod exec;
pub mod inspect;
pub(crate) mod lock_tx;
pub(crate) mod locker;
pub(crate) mod migrate;
pub(crate) mod publish;
pub mod session;
pub(crate) mod text_row;

pub use ddl::{run_ddl, DdlOutcome, DdlRetry};
pub use lock_tx::LockTx;
pub use locker::{LockClient, Locker};
pub use migrate::{Migration, MigrationError, MigrationGuard, WhenBusy};
pub use publish::{published_key_types, PublishedKeyType};
pub use session::{
    probe_pooler, PoolerProbe, ProbeTimeout, SessionForm, SessionGuard, SessionLock,
    DEFAULT_CONNECTIONS, DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEEPALIVE, DEFAULT_PROBE_TIMEOUT,
    MULTIPLEXED_NAME, PENDING_CONNECTIONS_PER_SESSION_LOCK,
};
