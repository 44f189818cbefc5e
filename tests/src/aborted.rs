//! The fixture of the adapters' tests that a closure form does not report a
//! commit of a transaction that a lock call's error aborted.

use lockkit::{Error, ErrorKind, LockKey};
use tokio_postgres::Client;

use crate::TestServer;

/// A scratch table, and another session holding one key in an open
/// transaction until [`Aborting::finish`].
#[derive(Debug)]
pub struct Aborting {
    observer: Client,
    holder: Client,
    table: String,
}

impl Aborting {
    /// A scratch table named after `prefix`, and `busy` held by another
    /// session.
    pub async fn new(db: &TestServer, prefix: &str, busy: LockKey) -> Self {
        let observer = db.connect().await;
        let table = crate::scratch_table(&observer, prefix).await;
        let holder = db.connect().await;
        crate::support::hold_in_transaction(&holder, [busy]).await;
        Aborting {
            observer,
            holder,
            table,
        }
    }

    /// The statement that writes a row (`$1`, an `int8`) into the table.
    pub fn insert(&self) -> String {
        format!("INSERT INTO {} VALUES ($1)", self.table)
    }

    /// The rows written and committed so far, in order.
    pub async fn ids(&self) -> Vec<i64> {
        let select = format!("SELECT id FROM {} ORDER BY id", self.table);
        let rows = self
            .observer
            .query(&select, &[])
            .await
            .expect("read the rows");
        rows.iter().map(|row| row.get(0)).collect()
    }

    /// Checks what the closure form answered for the transaction that wrote
    /// `row`: when its lock call `failed` (and the closure returned `Ok`),
    /// `TransactionAborted` and no row; else `Ok` and the row (the control).
    pub async fn check(&self, row: i64, failed: bool, answer: Result<(), Error>) {
        let count = format!("SELECT count(*) FROM {} WHERE id = $1", self.table);
        let rows: i64 = self
            .observer
            .query_one(&count, &[&row])
            .await
            .expect("count the rows")
            .get(0);
        if failed {
            let err = answer.expect_err("the aborted transaction's commit reported success");
            assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{err}");
            assert_eq!(rows, 0, "refused, yet committed");
        } else {
            answer.expect("the control commits");
            assert_eq!(rows, 1, "the control's write");
        }
    }

    /// Releases the busy key and drops the table.
    pub async fn finish(self) {
        self.holder
            .batch_execute("ROLLBACK")
            .await
            .expect("the holder lets go");
        self.observer
            .batch_execute(&format!("DROP TABLE {}", self.table))
            .await
            .expect("drop the scratch table");
    }
}
