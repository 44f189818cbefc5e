//! Fencing tokens on session locks: every grant of a `SessionLock` set to
//! mint them comes with a token larger than every earlier one, in every
//! form and for permits; a database without lockkit's SQL functions refuses
//! typed, holding nothing; and the stale holder, reproduced: holder A (a
//! process of its own) takes keys and their tokens and is stopped with
//! `SIGSTOP` past its lease, B takes the keys with larger tokens and writes
//! through the fence, and A, continued, writes with its old tokens: the
//! fence refuses them. The control without the fence shows A's stale write
//! landing after B's.

use std::num::NonZeroU8;
use std::time::Duration;

use lockkit::fencing::FencingToken;
use lockkit::inspect::{AdvisoryLockRow, KeyRegistry};
use lockkit::pg::{SessionForm, SessionGuard};
use lockkit::AdvisoryKey;
use lockkit::{ErrorKind, SessionLock};
use lockkit_tests::fixtures::Feed;
use lockkit_tests::observe::{holders_elsewhere, wait_until_keepalive_ran};
use lockkit_tests::{PgBouncer, TestServer};
use tokio_postgres::{Client, NoTls};

use crate::lease::{Holder, KEYS, PATIENT};
use crate::pooler::Background;

/// A database of its own on the shared server, with lockkit's SQL
/// functions installed: its URL and a client.
async fn installed(db: &TestServer, name: &str) -> (String, Client) {
    let url = db.create_database(name).await;
    let client = connect(&url).await;
    lockkit::sql::install(&client).await.expect("install");
    (url, client)
}

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("connect");
    tokio::spawn(connection);
    client
}

/// The `SessionLock` of `form` (`permit`: the default form, taking
/// permits), minting tokens.
fn minting(url: &str, form: &str) -> SessionLock {
    let sessions = SessionLock::new(url.parse().unwrap()).fencing_tokens(true);
    match form {
        "transaction" | "permit" => sessions,
        "level" => sessions.form(SessionForm::SessionLevel),
        "multiplexed" => sessions.form(SessionForm::Multiplexed).connections(2),
        _ => unreachable!("{form}"),
    }
}

/// Takes `key` through `sessions` (a permit for `permit`), waiting.
async fn take(sessions: &SessionLock, form: &str, key: Feed) -> SessionGuard<Feed> {
    let taken = async {
        match form {
            "permit" => sessions.acquire_permit(key, NonZeroU8::MIN).await,
            _ => sessions.lock(key).await,
        }
    };
    tokio::time::timeout(PATIENT, taken)
        .await
        .unwrap_or_else(|_| panic!("{form}: {key:?} was not granted"))
        .unwrap_or_else(|e| panic!("{form}: {e}"))
}

const FORMS: [&str; 4] = ["transaction", "level", "multiplexed", "permit"];

/// One key taken again and again, in every form in turn, by `SessionLock`s
/// of their own: each grant's token is larger than the one before. Tries
/// mint too; a busy try hands no guard, and a `SessionLock` that does not
/// mint hands no token.
#[tokio::test(flavor = "multi_thread")]
async fn every_grant_mints_a_larger_token_in_every_form() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (url, _client) = installed(db, "lockkit_fencing_forms").await;
    let locks: Vec<(&str, SessionLock)> = FORMS.iter().map(|f| (*f, minting(&url, f))).collect();
    let key = Feed { id: 950_000 };
    let mut last: Option<FencingToken> = None;
    for round in 0..5 {
        for (form, sessions) in &locks {
            let guard = match round % 2 {
                0 => take(sessions, form, key).await,
                _ if *form == "permit" => sessions
                    .try_acquire_permit(key, NonZeroU8::MIN)
                    .await
                    .unwrap()
                    .expect("free"),
                _ => sessions.try_lock(key).await.unwrap().expect("free"),
            };
            let token = guard.fencing_token().expect("minted");
            if let Some(last) = last {
                assert!(token > last, "{form}: {token} after {last}");
            }
            last = Some(token);
            // Busy for everyone else meanwhile, and no token for them.
            if *form != "permit" {
                let other = minting(&url, "transaction");
                assert!(other.try_lock(key).await.unwrap().is_err(), "{form}");
            }
            assert!(guard.release().await.unwrap(), "{form}");
        }
    }
    // lockkit.fencing_token(), what another client calls, mints in the
    // same order: between two of lockkit's grants.
    let (_, client) = (url.clone(), connect(&url).await);
    let sql: FencingToken = lockkit_tests::support::fencing_token_from_sql(&client).await;
    assert!(sql > last.unwrap(), "{sql} after {last:?}");
    let guard = take(&locks[0].1, "transaction", key).await;
    assert!(guard.fencing_token().unwrap() > sql);
    assert!(guard.release().await.unwrap());

    let plain = SessionLock::new(url.parse().unwrap());
    let guard = plain.lock(key).await.unwrap();
    assert_eq!(guard.fencing_token(), None);
    assert!(guard.release().await.unwrap());
}

/// On a database without lockkit's SQL functions, a minting lock call
/// fails with `NotInstalled` in every form, and holds nothing: the key is
/// free for a lock that does not mint. The fence too.
#[tokio::test(flavor = "multi_thread")]
async fn without_the_sql_functions_a_minting_lock_is_refused_and_holds_nothing() {
    let db = TestServer::shared();
    let _log = db.guard();
    let url = db.create_database("lockkit_fencing_bare").await;
    let observer = connect(&url).await;
    let key = Feed { id: 950_100 };
    for form in FORMS {
        let sessions = minting(&url, form);
        let e = match form {
            "permit" => sessions.acquire_permit(key, NonZeroU8::MIN).await.err(),
            _ => sessions.lock(key).await.err(),
        }
        .unwrap_or_else(|| panic!("{form}: granted without the functions"));
        assert_eq!(e.kind(), ErrorKind::NotInstalled, "{form}: {e}");
        assert!(e.to_string().contains("lockkit sql install"), "{form}: {e}");
        // Nothing held when the error is seen: not after a moment.
        assert_eq!(
            holders_elsewhere(&observer, key.lock_key()).await,
            0,
            "{form}: the key is held after the error"
        );
        let plain = SessionLock::new(url.parse().unwrap());
        let free = match form {
            "permit" => plain.try_acquire_permit(key, NonZeroU8::MIN).await,
            _ => plain.try_lock(key).await,
        };
        let guard = free
            .unwrap()
            .unwrap_or_else(|_| panic!("{form}: the key is held"));
        assert!(guard.release().await.unwrap(), "{form}");
    }
    let client = connect(&url).await;
    let token = FencingToken::from_parts(1, 0, 1).unwrap();
    let e = lockkit::sql::fence(&client, "r", token).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotInstalled, "{e}");
}

/// The fence: an older token is refused, an equal or newer one accepted.
#[tokio::test(flavor = "multi_thread")]
async fn the_fence_accepts_the_newest_token_and_refuses_an_older_one() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (_url, client) = installed(db, "lockkit_fencing_fence").await;
    let t = |counter| FencingToken::from_parts(1, 100, counter).unwrap();
    for (token, accepted) in [(t(5), true), (t(5), true), (t(4), false), (t(6), true)] {
        let got = lockkit::sql::fence(&client, "invoice:42", token)
            .await
            .unwrap();
        assert_eq!(got, accepted, "{token}");
    }
    // A promotion's token passes every token of the older timeline.
    let promoted = FencingToken::from_parts(2, 0, 1).unwrap();
    assert!(lockkit::sql::fence(&client, "invoice:42", promoted)
        .await
        .unwrap());
    assert!(!lockkit::sql::fence(&client, "invoice:42", t(1 << 40))
        .await
        .unwrap());
    // Other resources keep their own.
    assert!(lockkit::sql::fence(&client, "invoice:43", t(1))
        .await
        .unwrap());
}

/// Holder A, stopped past its lease; B takes its keys with larger tokens
/// and writes through the fence; A, continued, writes with its old tokens.
/// Answers how many rows A wrote, and the writer of each resource's last
/// row.
async fn stale_holder(form: &str, first: i64, fenced: bool) -> (u64, Vec<String>) {
    let db = TestServer::shared();
    let _log = db.guard();
    let name = format!("lockkit_fencing_stale_{form}_{fenced}");
    let (url, client) = installed(db, &name).await;
    client
        .batch_execute(
            "CREATE TABLE writes (n serial PRIMARY KEY, resource text NOT NULL, \
             writer text NOT NULL, token numeric)",
        )
        .await
        .unwrap();
    let mut holder = Holder::start(&url, form, first, &["fencing"]);
    let held = holder.line("held").await;
    let old: Vec<FencingToken> = held
        .split_whitespace()
        .nth(3)
        .unwrap_or_else(|| panic!("{form}: {held:?}"))
        .split(',')
        .map(|t| t.parse().expect("a token"))
        .collect();
    assert_eq!(old.len(), KEYS as usize, "{form}: {held:?}");

    holder.signal("-STOP");
    let b = minting(&url, form);
    let mut guards = Vec::new();
    for (i, id) in (first..first + KEYS).enumerate() {
        let guard = take(&b, form, Feed { id }).await;
        let token = guard.fencing_token().expect("minted");
        assert!(token > old[i], "{form}: B's {token} after A's {}", old[i]);
        let resource = format!("feed:{id}");
        let tx_client = connect(&url).await;
        let written = match fenced {
            true => lockkit::sql::fence(&tx_client, &resource, token)
                .await
                .unwrap(),
            false => true,
        };
        assert!(written, "{form}: the fence refused the new holder");
        tx_client
            .execute(
                "INSERT INTO writes (resource, writer, token) VALUES ($1, 'B', $2::text::numeric)",
                &[&resource, &token.to_string()],
            )
            .await
            .unwrap();
        guards.push(guard);
    }

    // Read by A once it runs again: it writes before it notices anything.
    let how = if fenced { "fenced" } else { "unfenced" };
    holder.send(&format!("write {how} writes"));
    holder.signal("-CONT");
    let wrote = loop {
        let line = holder.line("wrote").await;
        if let Some(rows) = line.strip_prefix("wrote ") {
            break rows.parse::<u64>().expect("a count");
        }
        assert_eq!(line, format!("lost {KEYS}"), "{form}");
    };
    let last: Vec<String> = client
        .query(
            "SELECT DISTINCT ON (resource) writer FROM writes ORDER BY resource, n DESC",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    for guard in guards {
        assert!(guard.release().await.unwrap(), "{form}");
    }
    (wrote, last)
}

async fn a_stale_holder_is_fenced_off(form: &str, first: i64) {
    let (wrote, last) = stale_holder(form, first, true).await;
    assert_eq!(wrote, 0, "{form}: the fence let a stale write through");
    assert_eq!(last, vec!["B"; KEYS as usize], "{form}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stale_default_form_holder_is_fenced_off() {
    a_stale_holder_is_fenced_off("transaction", 951_000).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stale_multiplexed_holder_is_fenced_off() {
    a_stale_holder_is_fenced_off("multiplexed", 951_100).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stale_permit_holder_is_fenced_off() {
    a_stale_holder_is_fenced_off("permit", 951_200).await;
}

/// The control: without the fence, the stale holder's writes land after
/// the new holder's.
#[tokio::test(flavor = "multi_thread")]
async fn control_without_the_fence_a_stale_holder_overwrites() {
    let (wrote, last) = stale_holder("transaction", 951_300, false).await;
    assert_eq!(wrote, KEYS as u64);
    assert_eq!(last, vec!["holder"; KEYS as usize]);
}

/// What `lockkit inspect` reads for the lock `guard` holds, once its
/// connection's keepalive has run since the grant.
async fn inspected(observer: &Client, guard: &SessionGuard<Feed>) -> AdvisoryLockRow {
    wait_until_keepalive_ran(observer, guard.backend_pid()).await;
    let rows = lockkit::inspect::advisory_locks(observer, &KeyRegistry::new())
        .await
        .expect("inspect");
    rows.into_iter()
        .find(|r| r.granted && r.pid == Some(guard.backend_pid()) && r.key == guard.key())
        .expect("the lock has its row")
}

/// `lockkit inspect` shows the fencing token a session lock holds its key
/// with, in every form and for a permit, from its first keepalive on; two
/// keys on one multiplexed connection each show their own. The control:
/// a `SessionLock` that does not mint shows none once its keepalive ran,
/// and a released key has no row.
#[tokio::test(flavor = "multi_thread")]
async fn inspect_shows_the_token_each_session_lock_holds_its_key_with() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (url, observer) = installed(db, "lockkit_fencing_inspect").await;
    // Each inspection waits for a keepalive, which waits one cadence for
    // its answer before it gives the lock up (by design): 3 s, which the
    // CI form's runs beside other builds overran at 1 s once.
    let cadence = Duration::from_secs(3);
    for (i, form) in FORMS.iter().enumerate() {
        let sessions = minting(&url, form).keepalive(cadence);
        let first = take(
            &sessions,
            form,
            Feed {
                id: 950_300 + i as i64,
            },
        )
        .await;
        let second = match *form {
            "multiplexed" => Some(
                take(
                    &sessions,
                    form,
                    Feed {
                        id: 950_310 + i as i64,
                    },
                )
                .await,
            ),
            _ => None,
        };
        for guard in std::iter::once(&first).chain(second.as_ref()) {
            let row = inspected(&observer, guard).await;
            assert_eq!(
                row.fencing_token,
                guard.fencing_token(),
                "{form}: {:?}",
                row.query
            );
            assert!(row.fencing_token.is_some(), "{form}");
        }
        let key = first.key();
        assert!(first.release().await.unwrap(), "{form}");
        if let Some(second) = second {
            assert!(second.release().await.unwrap(), "{form}");
        }
        assert_eq!(holders_elsewhere(&observer, key).await, 0, "{form}");
    }
    // Behind a transaction-mode pgbouncer that an application's short
    // transactions share: the multiplexed and default forms' tokens show
    // the same, and the application's transactions all succeed.
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(4)
        .start();
    let mut through = bouncer.config();
    through.dbname("lockkit_fencing_inspect");
    let apps = Background::start(&through, 2).await;
    for (i, form) in ["multiplexed", "transaction"].into_iter().enumerate() {
        let sessions = SessionLock::new(through.clone())
            .fencing_tokens(true)
            .keepalive(cadence)
            .form(match form {
                "multiplexed" => SessionForm::Multiplexed,
                _ => SessionForm::Transaction,
            });
        let guard = take(
            &sessions,
            form,
            Feed {
                id: 950_330 + i as i64,
            },
        )
        .await;
        let row = inspected(&observer, &guard).await;
        assert_eq!(
            row.fencing_token,
            guard.fencing_token(),
            "{form} behind the pooler"
        );
        assert!(row.fencing_token.is_some(), "{form} behind the pooler");
        assert!(guard.release().await.unwrap(), "{form}");
    }
    assert!(
        apps.finish().await > 0,
        "the application ran no transaction"
    );

    // The control: no token minted, none shown.
    let plain = SessionLock::new(url.parse().unwrap()).keepalive(cadence);
    let guard = plain.lock(Feed { id: 950_320 }).await.unwrap();
    let row = inspected(&observer, &guard).await;
    assert_eq!(row.fencing_token, None, "{:?}", row.query);
    assert!(guard.release().await.unwrap());
}
