//! What a locker learns about its server once, so a lock costs no extra round
//! trip: the lock budget, whether it is a hot standby, its version, and
//! whether its `hashtext` matches the client's.

use crate::engine::error::Error;
use crate::key::hashtext;

/// Strings whose `hashtext` the server computes once to check the client's
/// implementation: every tail length of the hash's 12-byte blocks and
/// multi-byte UTF-8.
pub const HASHTEXT_PROBES: [&str; 4] = [
    "",
    "lockkit",
    "payroll-1405-01",
    "Zürich-注文-🔑-0123456789abcdef",
];

/// Facts about the server, learned once per locker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerFacts {
    max_locks_per_transaction: usize,
    lock_table_capacity: usize,
    in_recovery: bool,
    server_version_num: i32,
    hashtext_mismatch: Option<(String, i32, i32)>,
}

/// The row of [`SERVER_FACTS`](crate::driver::sql::SERVER_FACTS), run with
/// [`HASHTEXT_PROBES`] as `$1`, as an adapter reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FactsRow {
    /// Column `max_locks`.
    pub max_locks: i32,
    /// Column `max_connections` (`max_connections + max_prepared_transactions`).
    pub max_connections: i32,
    /// Column `in_recovery`.
    pub in_recovery: bool,
    /// Column `version_num`.
    pub version_num: i32,
    /// Column `hashes`: the server's `hashtext` of each probe, in order.
    pub hashes: Vec<i32>,
    /// Column `backend_pid`.
    pub backend_pid: i32,
}

impl FactsRow {
    /// Reads the row of [`SERVER_FACTS`](crate::driver::sql::SERVER_FACTS)
    /// by its column order.
    ///
    /// # Errors
    ///
    /// The driver's error when a column does not decode.
    pub fn read<R: crate::engine::ReplyRow>(row: &R) -> Result<FactsRow, R::Error> {
        Ok(FactsRow {
            max_locks: row.int4(0)?,
            max_connections: row.int4(1)?,
            in_recovery: row.bool(2)?,
            version_num: row.int4(3)?,
            hashes: row.int4_array(4)?,
            backend_pid: row.int4(5)?,
        })
    }
}

impl From<&FactsRow> for ServerFacts {
    fn from(row: &FactsRow) -> Self {
        let hashtext_mismatch = if row.hashes.len() != HASHTEXT_PROBES.len() {
            Some((
                "<probe count>".to_owned(),
                HASHTEXT_PROBES.len() as i32,
                row.hashes.len() as i32,
            ))
        } else {
            HASHTEXT_PROBES
                .iter()
                .zip(&row.hashes)
                .find(|(probe, server)| hashtext(probe) != **server)
                .map(|(probe, server)| (probe.to_string(), hashtext(probe), *server))
        };
        let max_locks = usize::try_from(row.max_locks).unwrap_or(0);
        let slots = usize::try_from(row.max_connections).unwrap_or(0);
        ServerFacts {
            max_locks_per_transaction: max_locks,
            lock_table_capacity: max_locks.saturating_mul(slots),
            in_recovery: row.in_recovery,
            server_version_num: row.version_num,
            hashtext_mismatch,
        }
    }
}

impl ServerFacts {
    /// Facts assumed without asking a server: a primary with these
    /// lock-table settings whose `hashtext` matches the client's. For
    /// examples, unit tests, and lock calls whose checks were made another
    /// way (a session lock's own set-up).
    pub fn assumed(
        max_locks_per_transaction: i32,
        max_connections: i32,
        max_prepared_transactions: i32,
    ) -> Self {
        ServerFacts::from(&FactsRow {
            max_locks: max_locks_per_transaction,
            max_connections: max_connections + max_prepared_transactions,
            in_recovery: false,
            version_num: 150000,
            hashes: HASHTEXT_PROBES.iter().map(|p| hashtext(p)).collect(),
            backend_pid: 0,
        })
    }

    /// The shared lock table's capacity:
    /// `max_locks_per_transaction × (max_connections + max_prepared_transactions)`.
    pub fn lock_table_capacity(&self) -> usize {
        self.lock_table_capacity
    }

    /// The server's `max_locks_per_transaction` (the default lock budget).
    pub fn max_locks_per_transaction(&self) -> usize {
        self.max_locks_per_transaction
    }

    /// Whether the server was a hot standby (`pg_is_in_recovery()`).
    pub fn in_recovery(&self) -> bool {
        self.in_recovery
    }

    /// `server_version_num`, e.g. `150018`.
    pub fn server_version_num(&self) -> i32 {
        self.server_version_num
    }

    /// Whether [`HashText`](crate::key::HashText) keys match this server.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::HashtextMismatch`](crate::ErrorKind::HashtextMismatch)
    /// with the first probe that differed.
    pub fn check_hashtext(&self) -> Result<(), Error> {
        match &self.hashtext_mismatch {
            None => Ok(()),
            Some((probe, client, server)) => Err(Error::hashtext(probe.clone(), *client, *server)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of `SERVER_FACTS` as a driver hands it over.
    struct Row(FactsRow);

    impl crate::engine::ReplyRow for Row {
        type Error = String;
        fn int8(&self, i: usize) -> Result<i64, String> {
            Err(format!("column {i} is not int8"))
        }
        fn int4(&self, i: usize) -> Result<i32, String> {
            let r = &self.0;
            match i {
                0 => Ok(r.max_locks),
                1 => Ok(r.max_connections),
                3 => Ok(r.version_num),
                5 => Ok(r.backend_pid),
                _ => Err(format!("column {i} is not int4")),
            }
        }
        fn bool(&self, i: usize) -> Result<bool, String> {
            (i == 2)
                .then_some(self.0.in_recovery)
                .ok_or(format!("column {i}"))
        }
        fn int8_array(&self, i: usize) -> Result<Vec<i64>, String> {
            Err(format!("column {i} is not int8[]"))
        }
        fn int4_array(&self, i: usize) -> Result<Vec<i32>, String> {
            (i == 4)
                .then(|| self.0.hashes.clone())
                .ok_or(format!("column {i}"))
        }
    }

    /// The row is read by its column order, and the facts keep what the
    /// server said: its lock table's size and whether it is a standby.
    #[test]
    fn the_facts_are_read_from_their_row() {
        let row = FactsRow {
            max_locks: 32,
            max_connections: 50,
            in_recovery: true,
            version_num: 170002,
            hashes: vec![1, 2],
            backend_pid: 4242,
        };
        assert_eq!(FactsRow::read(&Row(row.clone())), Ok(row.clone()));
        let facts = ServerFacts::from(&row);
        assert!(facts.in_recovery());
        assert_eq!(facts.server_version_num(), 170002);
        assert_eq!(facts.lock_table_capacity(), 32 * 50);
        // `max_connections + max_prepared_transactions` backends.
        assert_eq!(
            ServerFacts::assumed(64, 100, 5).lock_table_capacity(),
            64 * 105
        );
        assert!(!ServerFacts::assumed(64, 100, 0).in_recovery());
    }

    #[test]
    fn mismatch_is_reported_with_the_probe() {
        let good = FactsRow {
            max_locks: 64,
            max_connections: 100,
            version_num: 150000,
            hashes: HASHTEXT_PROBES.iter().map(|p| hashtext(p)).collect(),
            ..FactsRow::default()
        };
        let facts = ServerFacts::from(&good);
        assert!(facts.check_hashtext().is_ok());
        assert_eq!(facts.lock_table_capacity(), 6400);
        let mut bad = good.clone();
        bad.hashes[2] ^= 1;
        let err = ServerFacts::from(&bad).check_hashtext().unwrap_err();
        assert!(err.to_string().contains("payroll-1405-01"), "{err}");
        bad.hashes.pop();
        assert!(ServerFacts::from(&bad).check_hashtext().is_err());
    }

    #[test]
    fn the_version_is_the_servers() {
        let row = FactsRow {
            version_num: 180001,
            ..FactsRow::default()
        };
        assert_eq!(ServerFacts::from(&row).server_version_num(), 180001);
        assert_eq!(
            ServerFacts::assumed(64, 100, 0).server_version_num(),
            150000
        );
    }
}
