//! The forms a [`SessionLock`](super::SessionLock) holds its locks in:
//! [`SessionForm`].

/// How a [`SessionLock`](super::SessionLock) holds its locks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SessionForm {
    /// `pg_advisory_xact_lock` inside a transaction held open on the lock's
    /// connection, rolled back at release: safe behind any pooler (the
    /// default).
    #[default]
    Transaction,
    /// `pg_advisory_lock` on the lock's session, unlocked at release: for
    /// direct connections only; refused behind a transaction-mode pooler
    /// (see [`SessionLock::pooler_check`](super::SessionLock::pooler_check)).
    SessionLevel,
    /// Any number of locks over a few connections
    /// ([`SessionLock::connections`](super::SessionLock::connections),
    /// [`DEFAULT_CONNECTIONS`](super::DEFAULT_CONNECTIONS) by default):
    /// `pg_advisory_lock` on connections that each hold a transaction open
    /// for as long as they live and are closed, never committed, once they
    /// hold nothing. Safe behind any pooler, as the default form; see
    /// [Multiplexed locks](super#multiplexed-locks).
    Multiplexed,
}
