//! What a locker enforces: the budget, the order check, standby refusal.

/// What to do when a transaction asks for a key that sorts below a key it
/// already holds (two such transactions can deadlock).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OrderCheck {
    /// Say nothing.
    Off,
    /// Log a `tracing` warning and take the lock (the default).
    #[default]
    Warn,
    /// Fail with [`Error::LockOrder`](crate::Error::LockOrder) before sending
    /// anything.
    Error,
}

/// The policy a locker enforces on every transaction.
///
/// ```
/// use lockkit::{Config, OrderCheck};
///
/// let config = Config::default().budget(256).order_check(OrderCheck::Error);
/// assert_eq!(config.budget_limit(), Some(256));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    pub(crate) budget: Option<usize>,
    pub(crate) order_check: OrderCheck,
    pub(crate) allow_standby: bool,
}

impl Config {
    /// At most `max` distinct keys per transaction. The default is the
    /// server's `max_locks_per_transaction`, learned when the locker connects.
    pub fn budget(mut self, max: usize) -> Self {
        self.budget = Some(max);
        self
    }

    /// The configured budget, `None` for the server's
    /// `max_locks_per_transaction`.
    pub fn budget_limit(&self) -> Option<usize> {
        self.budget
    }

    /// How lock order violations are reported.
    pub fn order_check(mut self, check: OrderCheck) -> Self {
        self.order_check = check;
        self
    }

    /// Whether locks are taken on a hot standby too (see
    /// [`Config::allow_standby`]).
    pub fn standby_allowed(&self) -> bool {
        self.allow_standby
    }

    /// Take locks on a hot standby too (refused by default: they exclude
    /// nothing on the primary).
    pub fn allow_standby(mut self, allow: bool) -> Self {
        self.allow_standby = allow;
        self
    }
}
