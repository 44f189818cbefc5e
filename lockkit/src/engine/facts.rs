//! What a locker learns about its server once, so a lock costs no extra round
//! trip: the lock budget, whether it is a hot standby, its version, and
//! whether its `hashtext` matches the client's.

use crate::engine::error::Error;
use crate::key::hashtext::hashtext;

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
    in_recovery: bool,
    server_version_num: i32,
    hashtext_mismatch: Option<(String, i32, i32)>,
}

impl ServerFacts {
    /// Builds the facts from the row of [`sql::SERVER_FACTS`](crate::driver::sql::SERVER_FACTS)
    /// run with [`HASHTEXT_PROBES`]: `server_hashtext` is the server's value
    /// for each probe, in order.
    pub fn new(
        max_locks_per_transaction: i32,
        in_recovery: bool,
        server_version_num: i32,
        server_hashtext: &[i32],
    ) -> Self {
        let hashtext_mismatch = HASHTEXT_PROBES
            .iter()
            .zip(server_hashtext)
            .find(|(probe, server)| hashtext(probe) != **server)
            .map(|(probe, server)| (probe.to_string(), hashtext(probe), *server));
        ServerFacts {
            max_locks_per_transaction: usize::try_from(max_locks_per_transaction).unwrap_or(0),
            in_recovery,
            server_version_num,
            hashtext_mismatch,
        }
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

    /// Whether [`HashText`](crate::HashText) keys match this server.
    ///
    /// # Errors
    ///
    /// [`Error::HashtextMismatch`] with the first probe that differed.
    pub fn check_hashtext(&self) -> Result<(), Error> {
        match &self.hashtext_mismatch {
            None => Ok(()),
            Some((probe, client, server)) => Err(Error::HashtextMismatch {
                probe: probe.clone(),
                client: *client,
                server: *server,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_is_reported_with_the_probe() {
        let good: Vec<i32> = HASHTEXT_PROBES.iter().map(|p| hashtext(p)).collect();
        assert!(ServerFacts::new(64, false, 150000, &good)
            .check_hashtext()
            .is_ok());
        let mut bad = good.clone();
        bad[2] ^= 1;
        let err = ServerFacts::new(64, false, 150000, &bad)
            .check_hashtext()
            .unwrap_err();
        assert!(
            matches!(err, Error::HashtextMismatch { ref probe, .. } if probe == "payroll-1405-01")
        );
    }
}
