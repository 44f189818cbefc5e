//! Helpers shared by the lockkit integration tests.

use lockkit::AdvisoryKey;
pub(crate) use lockkit_tests::capture;
pub(crate) use lockkit_tests::observe::{
    advisory_rows, granted_elsewhere, held_by, wait_until_waiting,
};
pub(crate) use lockkit_tests::support::{backend_pid, locker};

/// A key type for tests: a plain `i64` id.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Item {
    pub(crate) id: i64,
}

/// `keys` sorted by their lock keys (the global lock order).
pub(crate) fn sorted<K: AdvisoryKey>(mut keys: Vec<K>) -> Vec<K> {
    keys.sort_by_key(|k| k.lock_key());
    keys
}
