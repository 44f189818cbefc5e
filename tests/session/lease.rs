//! The lease: a holder that stops answering loses its session locks on the
//! server, on a server with no idle timeout of its own. Holder A, a process
//! of its own (`hold-session-locks`), takes keys and is stopped with
//! `SIGSTOP`; B, here, takes every key once the server has ended A's
//! sessions; A, continued, sees every lock lost. For the default, the
//! session-level and the multiplexed forms and for a session permit. The control: a plain
//! transaction-scoped lock whose client says nothing more keeps its key on
//! the same server, so without the lease a stopped holder keeps its key.
//! Behind a pgbouncer shared with an application, a lease ends its own lock
//! only (its control: a naive session-wide timeout that ends the
//! application's transaction).

use std::future::Future;
use std::io::{BufRead, BufReader};
use std::num::NonZeroU8;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lockkit::session::MIN_LEASE;
use lockkit::SessionLock;
use lockkit_tests::fixtures::Feed;
use lockkit_tests::TestServer;

/// The stopped holder's keepalive cadence: its lease is [`MIN_LEASE`].
pub(crate) const CADENCE_MS: u64 = 300;
/// How many keys the stopped holder takes.
pub(crate) const KEYS: i64 = 4;
/// The bound on every wait of these tests, far above the lease: the claim
/// is that the wait ends at all (the server ended the stopped holder's
/// sessions), not how fast on a loaded machine.
pub(crate) const PATIENT: Duration = Duration::from_secs(60);

/// A `hold-session-locks` child, its lines read on a thread; killed when
/// dropped (continued first, should it be stopped).
pub(crate) struct Holder {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Holder {
    /// A holder of [`KEYS`] keys from `first` in `form`, at a keepalive
    /// cadence of [`CADENCE_MS`], with `extra` arguments after those.
    pub(crate) fn start(url: &str, form: &str, first: i64, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_hold-session-locks"))
            .args([
                url,
                &KEYS.to_string(),
                &first.to_string(),
                form,
                &CADENCE_MS.to_string(),
            ])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("hold-session-locks");
        let stdout = child.stdout.take().expect("piped");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        Holder { child, lines }
    }

    /// The child's next line, waiting at most [`PATIENT`].
    pub(crate) async fn line(&self, what: &str) -> String {
        let deadline = Instant::now() + PATIENT;
        loop {
            match self.lines.try_recv() {
                Ok(line) => return line,
                Err(mpsc::TryRecvError::Empty) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("no line from the holder ({what}): {e:?}"),
            }
        }
    }

    /// Sends `line` to the child's standard input (read once it runs).
    pub(crate) fn send(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().expect("piped");
        writeln!(stdin, "{line}").expect("the holder's stdin");
        stdin.flush().expect("the holder's stdin");
    }

    /// Sends `signal` (`-STOP`, `-CONT`) to the child.
    pub(crate) fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal}");
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A stopped holder of `form` loses its `KEYS` keys from `first` on the
/// server, B takes each of them, and the holder, continued, sees them lost.
async fn a_stopped_holder_loses_its_keys(form: &str, first: i64) {
    let db = TestServer::shared();
    let _log = db.guard();
    a_stopped_holder_loses_its_keys_through(db, db.url(), form, first).await;
}

/// [`a_stopped_holder_loses_its_keys`], the holder connected through
/// `url` (the server's, or a pooler's in front of it), B directly.
async fn a_stopped_holder_loses_its_keys_through(
    db: &TestServer,
    url: &str,
    form: &str,
    first: i64,
) {
    let observer = db.connect().await;
    for setting in [
        "idle_in_transaction_session_timeout",
        "idle_session_timeout",
    ] {
        let row = observer.query_one(&format!("SHOW {setting}"), &[]).await;
        let value: String = row.unwrap().get(0);
        assert_eq!(
            value, "0",
            "{setting}: the server must have no idle timeout of its own"
        );
    }
    let holder = Holder::start(url, form, first, &[]);
    let held = holder.line("held").await;
    assert!(
        held.starts_with(&format!("held {KEYS} ")),
        "{form}: {held:?}"
    );

    holder.signal("-STOP");
    let stopped = Instant::now();
    let b = SessionLock::new(db.config());
    let mut guards = Vec::new();
    for id in first..first + KEYS {
        let taken: Pin<Box<dyn Future<Output = _>>> = match form {
            "permit" => Box::pin(b.acquire_permit(Feed { id }, NonZeroU8::MIN)),
            _ => Box::pin(b.lock(Feed { id })),
        };
        let guard = tokio::time::timeout(PATIENT, taken)
            .await
            .unwrap_or_else(|_| panic!("{form}: the stopped holder kept key {id}"))
            .expect("B's lock");
        guards.push(guard);
    }
    eprintln!(
        "{form}: B took every key {:?} after the holder stopped (lease {MIN_LEASE:?})",
        stopped.elapsed()
    );

    holder.signal("-CONT");
    let lost = holder.line("lost").await;
    assert_eq!(lost, format!("lost {KEYS}"), "{form}");
    for guard in guards {
        assert!(guard.release().await.unwrap(), "{form}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_holder_loses_its_default_form_locks_at_its_lease() {
    a_stopped_holder_loses_its_keys("transaction", 940_000).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_holder_loses_its_multiplexed_locks_at_its_lease() {
    a_stopped_holder_loses_its_keys("multiplexed", 940_100).await;
}

/// On a connection of its own, on PostgreSQL 14+ (every server CI runs),
/// through `idle_session_timeout`.
#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_holder_loses_its_session_level_locks_at_its_lease() {
    a_stopped_holder_loses_its_keys("level", 940_400).await;
}

/// On connections leased from the application's deadpool pool, where the
/// lease is set for the lock's time and reset before the connection goes
/// back (`session_level_leases_go_back_to_the_pool_reset`).
#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_holder_loses_its_pooled_session_level_locks_at_its_lease() {
    a_stopped_holder_loses_its_keys("level-pool", 940_500).await;
}

/// A session-level lock on a pooled connection sets its lease and client
/// check for the lock's time only: after a release, after a busy try, and
/// after a wait that timed out, the pool's connection has the server's
/// `idle_session_timeout` and `client_connection_check_interval` again. The first two go back to the pool (the
/// same backend comes out again); the timed-out one is closed, as every
/// connection after an error of its take.
#[tokio::test(flavor = "multi_thread")]
async fn session_level_leases_go_back_to_the_pool_reset() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = crate::pooler::pool_of(db.config(), 1);
    // The backend of the connection the pool hands out next, and its
    // `idle_session_timeout` and `client_connection_check_interval`.
    let next_from_pool = || async {
        let object = pool.get().await.unwrap();
        let row = object
            .query_one(
                "SELECT pg_backend_pid(), current_setting('idle_session_timeout') \
                 || ' ' || current_setting('client_connection_check_interval')",
                &[],
            )
            .await
            .unwrap();
        (row.get::<_, i32>(0), row.get::<_, String>(1))
    };
    let first = next_from_pool().await;
    assert_eq!(first.1, "0 0");
    let sessions = SessionLock::from_pool(pool.clone())
        .form(lockkit::pg::SessionForm::SessionLevel)
        // A direct server; the probe would need a second connection.
        .pooler_check(false)
        // A try waits one cadence for its answer: a long one, so that the
        // busy try below answers busy however loaded the machine. What is
        // checked, the lease's reset, does not depend on the cadence.
        .keepalive(PATIENT);
    let key = Feed { id: 940_600 };
    let guard = sessions.lock(key).await.unwrap();
    assert!(guard.release().await.unwrap());
    assert_eq!(next_from_pool().await, first, "after a release");

    let rival = SessionLock::new(db.config());
    let held = rival.lock(key).await.unwrap();
    assert!(sessions.try_lock(key).await.unwrap().is_err());
    assert_eq!(next_from_pool().await, first, "after a busy try");

    let e = sessions
        .lock_timeout(key, Duration::from_millis(50))
        .await
        .expect_err("held by the rival");
    assert_eq!(e.kind(), lockkit::ErrorKind::Timeout, "{e}");
    let after = next_from_pool().await;
    assert_ne!(
        after.0, first.0,
        "the timed-out take's connection went back to the pool"
    );
    assert_eq!(after.1, "0 0", "after a timed-out wait");
    assert!(held.release().await.unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_holder_loses_its_session_permits_at_its_lease() {
    a_stopped_holder_loses_its_keys("permit", 940_200).await;
}

/// The control: on the same server, a transaction holding a key whose
/// client sends nothing more (what the server sees of a stopped holder
/// without a lease) keeps the key for many leases.
#[tokio::test(flavor = "multi_thread")]
async fn control_without_a_lease_a_silent_holder_keeps_its_key() {
    let db = TestServer::shared();
    let _log = db.guard();
    let silent = db.connect().await;
    let key = Feed { id: 940_300 };
    let lockkit::LockKey::BigInt(bigint) = lockkit::AdvisoryKey::lock_key(&key) else {
        panic!("Feed is a bigint key");
    };
    silent
        .batch_execute(&format!("BEGIN; SELECT pg_advisory_xact_lock({bigint})"))
        .await
        .unwrap();
    // Waiting longer only makes the claim stronger: a load that delays the
    // sleep cannot make the key free.
    tokio::time::sleep(MIN_LEASE * 4).await;
    let b = SessionLock::new(db.config());
    assert!(
        b.try_lock(key).await.unwrap().is_err(),
        "the key was free: the server ended the silent holder's session by itself"
    );
    silent.batch_execute("ROLLBACK").await.unwrap();
}

/// The application's transaction on `app`: its backend, then whether it
/// survived idling for `idle` and committed.
async fn idle_past(
    app: &mut tokio_postgres::Client,
    idle: Duration,
) -> (i32, Result<(), tokio_postgres::Error>) {
    let tx = app.transaction().await.unwrap();
    let pid: i32 = tx
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    // Longer only makes the claim stronger.
    tokio::time::sleep(idle).await;
    let idled = async {
        tx.query_one("SELECT 1", &[]).await?;
        tx.commit().await
    };
    (pid, idled.await)
}

/// Behind a transaction-mode pgbouncer shared with an application that
/// knows nothing of lockkit, a lease is its own lock's only:
/// - released locks (default form, permit) hand their backend (a pool of
///   one) to the application, whose transaction there idles past three
///   leases and commits (the control: a lease set session-wide by a naive
///   client ends it);
/// - a holder stopped behind the pooler loses its keys (B takes them)
///   while the application's transactions go on through the same pooler
///   (some run meanwhile), none failing.
#[tokio::test(flavor = "multi_thread")]
async fn behind_a_shared_pooler_a_lease_ends_its_own_lock_only() {
    use crate::pooler::Background;
    use lockkit_tests::PgBouncer;

    let db = TestServer::shared();
    let _log = db.guard();
    // A release waits one cadence for its answer: a second, not a margin a
    // loaded machine overruns (the leases idled past scale with it).
    let cadence = Duration::from_secs(1);
    let connect = |config: tokio_postgres::Config| async move {
        let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    };

    let single = PgBouncer::one_server_connection(db);
    let sessions = SessionLock::new(single.config()).keepalive(cadence);
    let mut app = connect(single.config()).await;
    for (i, permit) in [false, true].into_iter().enumerate() {
        let key = Feed {
            id: 940_700 + i as i64,
        };
        let guard = match permit {
            true => sessions.acquire_permit(key, NonZeroU8::MIN).await,
            false => sessions.lock(key).await,
        }
        .unwrap();
        let pid = guard.backend_pid();
        assert!(guard.release().await.unwrap());
        let (backend, idled) = idle_past(&mut app, sessions.lease() * 3).await;
        assert_eq!(backend, pid, "the pool of one hands on the backend");
        idled.expect("the application's idle transaction was ended: the lease outlived its lock");
    }
    // The control: a lease set session-wide by a naive client outlives it
    // on the pooled backend, and the application's transaction is ended.
    let naive = connect(single.config()).await;
    naive
        .batch_execute("SET idle_in_transaction_session_timeout = '1s'")
        .await
        .unwrap();
    let (_, idled) = idle_past(&mut app, Duration::from_secs(3)).await;
    assert!(
        idled.is_err(),
        "the control's lease did not outlive its client"
    );
    drop(naive);

    let shared = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(KEYS as u32 + 2)
        .start();
    let apps = Background::start(&shared.config(), 2).await;
    let before = apps.transactions();
    a_stopped_holder_loses_its_keys_through(db, &shared.url(), "transaction", 940_800).await;
    let during = apps.transactions();
    // Every transaction succeeded (a failed one panics its client).
    apps.finish().await;
    assert!(
        during > before,
        "the application ran no transaction meanwhile"
    );
}
