//! `HashText` keys: the client's `hashtext` is the server's, they exclude SQL
//! that locks `hashtext(...)` and vice versa, and a locker refuses them on a
//! server whose `hashtext` differs.

use std::time::Duration;

use lockkit::driver::HASHTEXT_PROBES;
use lockkit::key::{hashtext, hashtext_with, ByteOrder, HashText};
use lockkit::ErrorKind;
use lockkit::{AdvisoryKey, Batch, Config, LockKey, Locker, ServerFacts};
use lockkit_tests::TestServer;

use crate::common::{advisory_rows, backend_pid, held_by, locker};

/// This module's keys, in a namespace of their own.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.hashtext")]
struct Key {
    id: i64,
}

/// A small deterministic generator (xorshift64*), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }

    /// ASCII (control characters too, never NUL) and 2-, 3- and 4-byte
    /// UTF-8, emoji among them.
    fn char(&mut self) -> char {
        loop {
            let code = match self.below(5) {
                0 => 1 + self.below(0x7f),
                1 => 0x80 + self.below(0x780),
                2 => 0x800 + self.below(0xf800),
                3 => 0x1f300 + self.below(0x700),
                _ => 0x10000 + self.below(0x100000),
            };
            if let Some(c) = char::from_u32(code) {
                return c;
            }
        }
    }

    fn string(&mut self) -> String {
        let len = self.below(200);
        (0..len).map(|_| self.char()).collect()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn client_hashtext_equals_the_servers() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = db.connect().await;
    let encoding: String = client
        .query_one("SHOW server_encoding", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(encoding, "UTF8");

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut strings: Vec<String> = HASHTEXT_PROBES.iter().map(|s| s.to_string()).collect();
    strings.extend((0..6000).map(|_| rng.string()));
    assert!(strings.iter().any(|s| s.chars().any(|c| c.len_utf8() == 4)));
    assert!(strings.iter().any(|s| s.is_empty()));

    let rows = client
        .query(
            "SELECT hashtext(x) FROM unnest($1::text[]) WITH ORDINALITY AS t(x, i) ORDER BY i",
            &[&strings],
        )
        .await
        .unwrap();
    let server: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(server.len(), strings.len());
    let wrong: Vec<(&String, i32, i32)> = strings
        .iter()
        .zip(&server)
        .filter(|(s, h)| hashtext(s) != **h)
        .map(|(s, h)| (s, hashtext(s), *h))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} differ, e.g. {:?}",
        wrong.len(),
        strings.len(),
        &wrong[..wrong.len().min(3)]
    );
    for (s, h) in strings.iter().zip(&server) {
        assert_eq!(HashText(s).lock_key(), LockKey::BigInt(i64::from(*h)));
    }
    // Control: the comparison can fail; the other byte order disagrees.
    let big = strings
        .iter()
        .zip(&server)
        .filter(|(s, h)| hashtext_with(ByteOrder::Big, s) != **h)
        .count();
    assert!(big > strings.len() / 2, "only {big} differ in big-endian");
}

#[tokio::test(flavor = "multi_thread")]
async fn hashtext_keys_and_sql_hashtext_locks_exclude_each_other() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut raw = db.connect().await;
    let mut a = db.connect().await;
    let locker = locker(&a, Config::default()).await;
    let same = "lockkit-tests.hashtext same-key";
    let other = "lockkit-tests.hashtext other-key";

    // SQL holds, lockkit sees it busy.
    let rtx = raw.transaction().await.unwrap();
    rtx.execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&same])
        .await
        .unwrap();
    let tx = locker.begin(&mut a).await.unwrap();
    let back = tx.try_lock(HashText(same)).await.unwrap().unwrap_err();
    assert_eq!(back, HashText(same));
    let err = tx
        .lock_timeout(HashText(same), Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(
        tx.try_lock(HashText(other)).await.unwrap().is_ok(),
        "control: another string is free"
    );
    rtx.commit().await.unwrap();

    // lockkit holds, SQL sees it busy.
    let _ = tx.lock(HashText(same)).await.unwrap();
    let rtx = raw.transaction().await.unwrap();
    let try_sql = "SELECT pg_try_advisory_xact_lock(hashtext($1))";
    let got: bool = rtx.query_one(try_sql, &[&same]).await.unwrap().get(0);
    assert!(!got, "SQL must not get a key lockkit holds");
    let got: bool = rtx.query_one(try_sql, &[&other]).await.unwrap().get(0);
    assert!(!got, "nor the other one");
    let third = "lockkit-tests.hashtext third-key";
    let got: bool = rtx.query_one(try_sql, &[&third]).await.unwrap().get(0);
    assert!(got, "control: a string lockkit does not hold is free");
    rtx.rollback().await.unwrap();
    tx.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn hashtext_mismatch_refuses_only_hashtext_keys() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let mut wrong: Vec<i32> = HASHTEXT_PROBES.iter().map(|p| hashtext(p)).collect();
    wrong[1] = wrong[1].wrapping_add(1);
    let locker = Locker::with_facts(
        Config::default(),
        ServerFacts::from(&lockkit::driver::FactsRow {
            max_locks: 64,
            max_connections: 100,
            version_num: 150000,
            hashes: wrong.clone(),
            ..Default::default()
        }),
    );
    let text = "lockkit-tests.hashtext mismatch";

    let tx = locker.begin(&mut a).await.unwrap();
    let err = tx.lock(HashText(text)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::HashtextMismatch, "{err}");
    let message = err.to_string();
    assert!(
        message.contains(&format!("{:?}", HASHTEXT_PROBES[1])),
        "{message}"
    );
    assert!(
        message.contains(&format!(
            "= {} but the server says {}",
            hashtext(HASHTEXT_PROBES[1]),
            wrong[1]
        )),
        "{message}"
    );
    let err = tx.try_lock(HashText(text)).await.unwrap_err();
    assert!(err.kind() == ErrorKind::HashtextMismatch, "{err}");
    let mixed = Batch::new().with(&HashText(text)).with(&Key { id: 1 });
    let err = tx.lock_batch(&mixed).await.unwrap_err();
    assert!(err.kind() == ErrorKind::HashtextMismatch, "{err}");
    let err = tx.try_lock_batch(&mixed).await.unwrap_err();
    assert!(err.kind() == ErrorKind::HashtextMismatch, "{err}");
    assert_eq!(advisory_rows(&observer, pid).await, 0);

    // Other keys are fine.
    let held = tx.lock(Key { id: 1 }).await.unwrap();
    assert!(held_by(&observer, pid, held.key()).await);
    let _ = tx
        .lock_batch(&Batch::new().with(&Key { id: 2 }).with(&Key { id: 3 }))
        .await
        .unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 3);
    drop(held);
    tx.rollback().await.unwrap();
}
