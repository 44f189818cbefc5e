//! What a locker enforces: the budget, the order check, standby refusal.

/// What to do when a transaction waits for a key that sorts below a key it
/// already holds (two such transactions can deadlock).
///
/// The default fails in debug builds (`debug_assertions`), as lockdep does,
/// so tests catch the pattern; release builds warn through `tracing`. A
/// try (`try_lock`, `try_lock_shared`, `try_lock_batch`) is never checked:
/// it does not wait, so it cannot close a wait cycle. The error and the
/// warning name the two keys' types and the call sites that took the key
/// held and asked for the key below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OrderCheck {
    /// Say nothing.
    Off,
    /// Log a `tracing` warning and take the lock (the release-build default).
    Warn,
    /// Fail with [`ErrorKind::LockOrder`](crate::ErrorKind::LockOrder) before
    /// sending anything (the debug-build default).
    Error,
}

impl Default for OrderCheck {
    fn default() -> Self {
        if cfg!(debug_assertions) {
            OrderCheck::Error
        } else {
            OrderCheck::Warn
        }
    }
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
    pub(crate) lockers: Option<usize>,
    pub(crate) order_check: OrderCheck,
    pub(crate) allow_standby: bool,
    pub(crate) statements: StatementMode,
    pub(crate) fencing: bool,
}

/// How an adapter sends lockkit's statements.
///
/// The default, [`Unnamed`](Self::Unnamed), works everywhere: lockkit sends
/// no named prepared statement, so behind a transaction-mode pooler shared
/// with other applications (pgbouncer before 1.21, or without
/// `max_prepared_statements`) nothing of lockkit's can collide with another
/// client's statement, or be missing from the server connection the pooler
/// picked. [`Prepared`](Self::Prepared) saves the server the parse of each
/// statement, for direct connections and poolers that keep named prepared
/// statements per client: `Config::default().statements(StatementMode::Prepared)`.
///
/// Either way every reply is checked: should a named statement meet another
/// client's of the same name, or none, the lock call fails with
/// [`ErrorKind::UnexpectedReply`](crate::ErrorKind::UnexpectedReply) and
/// the SQLSTATE (`42P05`, `26000`), and never succeeds without its lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StatementMode {
    /// Prepared once per connection and reused: a lock costs the server no
    /// parse and plan. tokio-postgres: lockkit's own cache per
    /// `LockClient`; Diesel and diesel-async: the connection's statement
    /// cache (unnamed if the application disabled it); sqlx: its persistent
    /// statements. Not behind a transaction-mode pooler that does not keep
    /// named prepared statements per client.
    Prepared,
    /// No statement kept on the connection, safe behind every pooler (the
    /// default): the server parses each statement every time, in one round
    /// trip. tokio-postgres and sqlx send each in the simple query
    /// protocol, its parameters (lockkit's: integers, integer arrays and
    /// booleans) written in as literals; Diesel sends it as the unnamed
    /// statement; diesel-async outside its statement cache (diesel-async
    /// names every statement it sends: see `lockkit-diesel-async`).
    #[default]
    Unnamed,
}

impl Config {
    /// At most `max` distinct keys per transaction. Without it (and without
    /// [`Config::concurrent_lockers`]) the budget is the server's
    /// `max_locks_per_transaction`, learned when the locker connects.
    pub fn budget(mut self, max: usize) -> Self {
        self.budget = Some(max);
        self
    }

    /// Sizes the budget from the server's shared lock table instead: its
    /// capacity is `max_locks_per_transaction × (max_connections +
    /// max_prepared_transactions)` entries (what `lockkit check` prints),
    /// shared by every session's relation and advisory locks. With `lockers`
    /// transactions taking advisory locks at once, each gets an even share of
    /// half the table, so that all of them together leave the other half to
    /// everything else:
    ///
    /// `budget = capacity / 2 / lockers`, never below the server's
    /// `max_locks_per_transaction`, which PostgreSQL sizes its table to grant
    /// any one transaction.
    ///
    /// On a default server (64 × (100 + 0) = 6,400 entries) and 8 lockers
    /// that is 400 keys per transaction, where the flat default is 64: a
    /// 500-event batch fits in one transaction when 6 lock at once, and a
    /// transaction that would crowd out the others is still refused.
    /// [`Config::budget`] wins when both are set.
    ///
    /// ```
    /// use lockkit::{Config, ServerFacts};
    /// use lockkit::driver::Policy;
    /// # let facts = ServerFacts::assumed(64, 100, 0);
    /// let policy = Policy::new(Config::default().concurrent_lockers(8), facts);
    /// assert_eq!(policy.budget(), 400);
    /// ```
    pub fn concurrent_lockers(mut self, lockers: usize) -> Self {
        self.lockers = Some(lockers.max(1));
        self
    }

    /// The budget this configuration gives on a server with `facts`.
    pub(crate) fn budget_for(&self, facts: &crate::engine::facts::ServerFacts) -> usize {
        match (self.budget, self.lockers) {
            (Some(max), _) => max,
            (None, Some(lockers)) => {
                (facts.lock_table_capacity() / 2 / lockers).max(facts.max_locks_per_transaction())
            }
            (None, None) => facts.max_locks_per_transaction(),
        }
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

    /// How lockkit's statements are sent: unnamed (the default, safe behind
    /// every pooler), or prepared once per connection, for direct
    /// connections (see [`StatementMode`]).
    pub fn statements(mut self, mode: StatementMode) -> Self {
        self.statements = mode;
        self
    }

    /// The statement mode.
    pub fn statement_mode(&self) -> StatementMode {
        self.statements
    }

    /// Take locks on a hot standby too (refused by default: they exclude
    /// nothing on the primary).
    pub fn allow_standby(mut self, allow: bool) -> Self {
        self.allow_standby = allow;
        self
    }

    /// Mint a fencing token with every grant (off by default): each lock
    /// call's guard ([`Held::fencing_token`](crate::Held::fencing_token),
    /// [`HeldBatch::fencing_token`](crate::HeldBatch::fencing_token)) then
    /// carries a number larger than every token minted before, for the
    /// protected resource to refuse an older holder's write
    /// ([`crate::fencing`]). The token is read in the lock statement
    /// itself, after its locks: no round trip more. Needs lockkit's SQL
    /// functions on the database (`lockkit sql install`, or the script of
    /// [`sql`](crate::sql)); without them a lock call fails with
    /// [`ErrorKind::NotInstalled`](crate::ErrorKind::NotInstalled), and its
    /// error aborts the transaction (or the call's savepoint).
    ///
    /// ```
    /// use lockkit::Config;
    ///
    /// assert!(Config::default().fencing_tokens(true).mints_tokens());
    /// assert!(!Config::default().mints_tokens());
    /// ```
    pub fn fencing_tokens(mut self, mint: bool) -> Self {
        self.fencing = mint;
        self
    }

    /// Whether every grant mints a fencing token
    /// ([`fencing_tokens`](Self::fencing_tokens)).
    pub fn mints_tokens(&self) -> bool {
        self.fencing
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::facts::ServerFacts;

    /// Each option reads back what was set, and the defaults are prepared
    /// statements on a primary only.
    #[test]
    fn options_read_back_what_was_set() {
        let default = Config::default();
        assert_eq!(default.statement_mode(), StatementMode::Unnamed);
        assert!(!default.standby_allowed());
        let set = Config::default()
            .statements(StatementMode::Prepared)
            .allow_standby(true);
        assert_eq!(set.statement_mode(), StatementMode::Prepared);
        assert!(set.standby_allowed());
        assert!(!set.allow_standby(false).standby_allowed());
    }

    #[test]
    fn the_budget_is_the_configured_one_or_a_share_of_the_lock_table() {
        // 64 locks per transaction × (100 + 0) slots: a table of 6,400.
        let facts = ServerFacts::assumed(64, 100, 0);
        assert_eq!(Config::default().budget_limit(), None);
        assert_eq!(Config::default().budget_for(&facts), 64);
        assert_eq!(Config::default().budget(3).budget_limit(), Some(3));
        // Half the table shared by 8 lockers: 400 each.
        assert_eq!(
            Config::default().concurrent_lockers(8).budget_for(&facts),
            400
        );
        // Never below max_locks_per_transaction, and never 0 lockers.
        assert_eq!(
            Config::default()
                .concurrent_lockers(1000)
                .budget_for(&facts),
            64
        );
        assert_eq!(
            Config::default().concurrent_lockers(0).budget_for(&facts),
            3200
        );
        // An explicit budget wins.
        let both = Config::default().budget(5).concurrent_lockers(8);
        assert_eq!(both.budget_for(&facts), 5);
    }
}
