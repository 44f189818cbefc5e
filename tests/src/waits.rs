//! Counted contention: how many lock requests really waited, as the server
//! saw them.
//!
//! A concurrency test that finds no overlap proves something only if its
//! workers contended. [`WaitCounter`] watches `pg_locks` from a session of
//! its own, on a thread of its own (so it serves async and threaded tests
//! alike), and counts each request for one of the watched keys that shows
//! up there as not granted: a lock that was not granted at once. Polling
//! misses short waits, so the counts are lower bounds, never estimates: a
//! wait is counted only if the server was seen making a request wait.
//! Nothing in the workload changes: the counter sends nothing on its
//! connections.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use lockkit::LockKey;
use tokio_postgres::NoTls;

/// The waits a [`WaitCounter`] saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Waits {
    /// Requests for a watched key seen waiting (not granted) in `pg_locks`,
    /// each counted once however long it waited.
    pub waits: u64,
    /// Of those, exclusive requests seen waiting while the key was granted
    /// in shared mode: writers that arrived while readers were inside.
    pub writers_behind_readers: u64,
    /// The most watched requests seen waiting at once.
    pub max_waiting_at_once: u64,
    /// How many times `pg_locks` was read.
    pub polls: u64,
}

impl Waits {
    /// Prints the counts under `what` and asserts that at least `min`
    /// requests waited, so the test that found no overlap had contention
    /// to find one in.
    ///
    /// # Panics
    ///
    /// If fewer than `min` waits were seen.
    pub fn assert_waited(&self, what: &str, min: u64) {
        println!("{what}: {self:?}");
        assert!(
            self.waits >= min,
            "{what}: only {} requests were seen waiting (at least {min} needed for the test to mean anything): {self:?}",
            self.waits
        );
    }

    /// Prints the counts under `what` and asserts that at least `min`
    /// writers were seen waiting behind readers.
    ///
    /// # Panics
    ///
    /// If fewer than `min` were seen.
    pub fn assert_writers_waited_behind_readers(&self, what: &str, min: u64) {
        println!("{what}: {self:?}");
        assert!(
            self.writers_behind_readers >= min,
            "{what}: only {} writers were seen waiting behind readers (at least {min} needed): {self:?}",
            self.writers_behind_readers
        );
    }
}

/// Watches `pg_locks` for waiting requests on a set of keys until stopped.
#[derive(Debug)]
pub struct WaitCounter {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Waits>>,
}

/// One waiting request: backend pid, the key's `pg_locks` columns, mode.
type Request = (i32, u32, u32, i16, String);

const WAITING: &str = "SELECT w.pid, w.classid, w.objid, w.objsubid, w.mode, \
     EXISTS (SELECT 1 FROM pg_locks g WHERE g.locktype = 'advisory' AND g.granted \
       AND g.mode = 'ShareLock' AND g.database IS NOT DISTINCT FROM w.database \
       AND g.classid = w.classid AND g.objid = w.objid AND g.objsubid = w.objsubid) \
     FROM pg_locks w WHERE w.locktype = 'advisory' AND NOT w.granted";

impl WaitCounter {
    /// Starts watching `keys` on the server `config` connects to. Returns
    /// once the watching session is connected, so no wait after this call
    /// goes unseen for want of a connection.
    ///
    /// # Panics
    ///
    /// If the watcher cannot connect.
    pub fn start(config: tokio_postgres::Config, keys: impl IntoIterator<Item = LockKey>) -> Self {
        let keys: HashSet<(u32, u32, i16)> = keys
            .into_iter()
            .map(|k| {
                let id = k.to_pg_locks();
                (id.classid, id.objid, id.objsubid)
            })
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = std::thread::spawn({
            let stop = Arc::clone(&stop);
            move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the wait counter's runtime");
                rt.block_on(watch(config, keys, stop, ready_tx))
            }
        });
        ready_rx
            .recv()
            .expect("the wait counter could not connect (its thread panicked)");
        WaitCounter {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops watching and returns what was seen.
    ///
    /// # Panics
    ///
    /// If the watcher failed (lost its connection).
    pub fn stop(mut self) -> Waits {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .take()
            .expect("stopped once")
            .join()
            .expect("the wait counter failed")
    }
}

impl Drop for WaitCounter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

async fn watch(
    config: tokio_postgres::Config,
    keys: HashSet<(u32, u32, i16)>,
    stop: Arc<AtomicBool>,
    ready: mpsc::Sender<()>,
) -> Waits {
    let (client, connection) = config
        .connect(NoTls)
        .await
        .expect("the wait counter connects");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let statement = client.prepare(WAITING).await.expect("prepare");
    ready.send(()).expect("the starter waits for this");
    let mut waits = Waits::default();
    let mut before: HashSet<Request> = HashSet::new();
    while !stop.load(Ordering::SeqCst) {
        let rows = client.query(&statement, &[]).await.expect("pg_locks");
        waits.polls += 1;
        let mut now = HashSet::with_capacity(rows.len());
        for row in rows {
            let key = (row.get(1), row.get(2), row.get(3));
            if !keys.contains(&key) {
                continue;
            }
            let request: Request = (row.get(0), key.0, key.1, key.2, row.get(4));
            // A waiting request stays waiting until it is granted or
            // cancelled, so one seen in the poll before is the same wait.
            if !before.contains(&request) {
                waits.waits += 1;
                if request.4 == "ExclusiveLock" && row.get::<_, bool>(5) {
                    waits.writers_behind_readers += 1;
                }
            }
            now.insert(request);
        }
        waits.max_waiting_at_once = waits.max_waiting_at_once.max(now.len() as u64);
        before = now;
        // Not a synchronization: how often to look. Short, so short waits
        // are seen; not zero, so the watcher leaves the CPU to the workload.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    waits
}

/// Waits until some session other than `observer`'s is seen in `pg_locks`
/// waiting (not granted) for `key`, and returns its backend pid: the event
/// a test that cancels or releases "while the other one waits" must wait
/// for, instead of sleeping and assuming. Polls every 10 ms.
///
/// # Panics
///
/// After 60 s without such a waiter (a bound against a hang, generous for
/// a loaded machine, not a timing claim), or if `pg_locks` cannot be read.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn wait_until_awaited(observer: &tokio_postgres::Client, key: LockKey) -> i32 {
    let id = key.to_pg_locks();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let row = observer
            .query_opt(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND classid = $1 AND objid = $2 AND objsubid = $3 \
                 AND pid <> pg_backend_pid() LIMIT 1",
                &[&id.classid, &id.objid, &id.objsubid],
            )
            .await
            .expect("pg_locks");
        if let Some(row) = row {
            return row.get(0);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nobody was seen waiting for {key} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
