//! Every try form's docs say what its `Timeout` means, through one owner
//! per kind of lock: `LockTx::try_lock`'s errors for the transaction-scoped
//! tries of every stack (one face, `calls/*.md`), the `session` module's
//! "Bounded waits" for `SessionLock`'s tries.

/// The transaction-scoped tries' docs, shared by every stack.
const TX_TRIES: [(&str, &str); 4] = [
    (
        "try_lock",
        include_str!("../../lockkit/src/calls/try_lock.md"),
    ),
    (
        "try_lock_shared",
        include_str!("../../lockkit/src/calls/try_lock_shared.md"),
    ),
    (
        "try_lock_batch",
        include_str!("../../lockkit/src/calls/try_lock_batch.md"),
    ),
    (
        "try_acquire_permit",
        include_str!("../../lockkit/src/calls/try_acquire_permit.md"),
    ),
];

const SESSION_LOCK: &str = include_str!("../../lockkit/src/pg/session/lock.rs");

#[test]
fn every_try_says_what_its_timeout_means() {
    let owner = TX_TRIES[0].1;
    assert!(
        owner.contains("What a try's [`ErrorKind::Timeout`] means")
            && owner.contains("never waits for a free")
            && owner.contains("\"Bounded waits\""),
        "{owner}"
    );
    for (name, doc) in &TX_TRIES[1..] {
        assert!(
            doc.contains("As [`LockTx::try_lock`], whose errors say what a try's `Timeout` means"),
            "{name}: {doc}"
        );
    }
    // SessionLock: each try's doc comment, the lines above its `fn`.
    for name in ["try_lock", "try_lock_shared", "try_acquire_permit"] {
        let at = SESSION_LOCK
            .find(&format!("pub async fn {name}<"))
            .unwrap_or_else(|| panic!("no SessionLock::{name}"));
        let doc: String = SESSION_LOCK[..at]
            .lines()
            .rev()
            .skip(1)
            .take_while(|l| l.trim_start().starts_with("///"))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            doc.contains("[`ErrorKind::Timeout`]") && doc.contains("waits](super#bounded-waits)"),
            "SessionLock::{name}:\n{doc}"
        );
    }
}
