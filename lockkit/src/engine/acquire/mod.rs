//! The acquisition protocol, written once: checks, plan, statements,
//! replies, outcome, guards. No I/O: an adapter sends what
//! [`Acquisition::round`] lists and hands the replies to
//! [`Acquisition::receive`].
//!
//! The locker's [`Policy`] is here; the rest has a file per layer, each
//! using only those before it: the request and the transaction's state
//! (`request`), the call's ledger (`ledger`), the grant (`grant`), the
//! general call (`acquisition`) and the one-key call with the one-key
//! statements (`one_call`).

use crate::engine::config::Config;
use crate::engine::facts::ServerFacts;

mod acquisition;
mod grant;
mod ledger;
mod one_call;
mod request;
#[cfg(test)]
mod tests;

pub(crate) use acquisition::Acquisition;
pub(crate) use grant::Grant;
pub(crate) use one_call::OneCall;
pub use request::SavepointEnd;
pub(crate) use request::{Request, SavepointEnding, TxSlot, TxState, Wait};

/// What a locker enforces: its [`Config`] and the [`ServerFacts`] it learned.
/// Every adapter's locker holds one (`locker.policy()`).
#[derive(Clone, Debug)]
pub struct Policy {
    config: Config,
    facts: ServerFacts,
    recognizes_errors: bool,
    bounds_waits: bool,
}

impl Policy {
    /// A policy of `config` on the server described by `facts`, whose
    /// errors the driver reports with their SQLSTATE.
    pub fn new(config: Config, facts: ServerFacts) -> Self {
        Policy {
            config,
            facts,
            recognizes_errors: true,
            bounds_waits: true,
        }
    }

    /// The same policy, with lock waits left unbounded on the server
    /// ([`bounds_waits`](Self::bounds_waits) false): for a driver whose lock
    /// calls are never cut off in flight (a blocking driver: Diesel), or
    /// whose cut-off call's wait ends at once otherwise (a cancel request
    /// to a connection proven to reach its backend itself: the
    /// tokio-postgres adapter learns that).
    pub fn unbounded_waits(self) -> Self {
        self.with_bounded_waits(false)
    }

    /// The same policy, bounding its waits or not.
    pub(crate) fn with_bounded_waits(self, bounds_waits: bool) -> Self {
        Policy {
            bounds_waits,
            ..self
        }
    }

    /// Whether a lock call that waits as long as it takes bounds its wait
    /// on the server (the default): it waits in slices of the server's
    /// `deadlock_timeout` and one second, each under a savepoint, and
    /// starts the next slice when one ends with the key still busy. A call
    /// cut off in flight, or whose client is gone, then frees its server
    /// connection within one slice, whoever may send a cancel request and
    /// whatever pooler is in between; the server's deadlock check runs in
    /// every slice. A caller's own `lock_timeout` is left as it is, and
    /// bounds the wait instead. The slices' cost: a waiter that starts a
    /// new slice joins the key's queue again, behind those that came since.
    pub fn bounds_waits(&self) -> bool {
        self.bounds_waits
    }

    /// The same policy, for a driver that hides the SQLSTATE (Diesel) on a
    /// server whose messages are English (`english`) or not: lockkit then
    /// recognises deadlocks, timeouts and a full lock table by the
    /// server's English message, and cannot in another language.
    pub fn by_messages(self, english: bool) -> Self {
        Policy {
            recognizes_errors: english,
            ..self
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The server's facts.
    pub fn facts(&self) -> &ServerFacts {
        &self.facts
    }

    /// Whether lockkit's error kinds recognise deadlocks, timeouts and a
    /// full lock table ([`Error::is_deadlock`](crate::Error::is_deadlock),
    /// [`Error::is_timeout`](crate::Error::is_timeout),
    /// [`Error::is_lock_table_full`](crate::Error::is_lock_table_full)).
    /// Always, where the driver reports the SQLSTATE (tokio-postgres, sqlx);
    /// on Diesel's stacks only when the server's messages are English, else
    /// such errors are [`ErrorKind::Database`](crate::ErrorKind::Database).
    pub fn recognizes_errors(&self) -> bool {
        self.recognizes_errors
    }

    /// The lock budget per transaction (see [`Config::budget`] and
    /// [`Config::concurrent_lockers`]).
    pub fn budget(&self) -> usize {
        self.config.budget_for(&self.facts)
    }
}

#[cfg(test)]
mod policy_tests {
    use super::*;
    use crate::engine::config::{OrderCheck, StatementMode};

    /// A policy answers the configuration and facts it was made with, and
    /// recognises errors unless its driver reads them from messages in another
    /// language.
    #[test]
    fn a_policy_keeps_what_it_was_made_with() {
        let config = Config::default()
            .order_check(OrderCheck::Off)
            .statements(StatementMode::Unnamed)
            .budget(7);
        let facts = ServerFacts::assumed(64, 100, 0);
        let policy = Policy::new(config.clone(), facts.clone());
        assert_eq!(policy.config(), &config);
        assert_eq!(policy.facts(), &facts);
        assert_eq!(policy.budget(), 7);
        assert!(policy.recognizes_errors());
        assert!(policy.bounds_waits());
        assert!(!policy.clone().unbounded_waits().bounds_waits());
        assert!(policy.clone().by_messages(true).recognizes_errors());
        assert!(!policy.by_messages(false).recognizes_errors());
    }
}
