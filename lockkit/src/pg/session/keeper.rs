//! Keeping the held locks alive: one keeper task per
//! [`SessionLock`](super::SessionLock) at its keepalive cadence, and the
//! watch on a connection lockkit opened.

use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

use super::held::Shared;
use super::wire::within_cadence;
use crate::engine::sql;

/// The keepalive cadence unless
/// [`SessionLock::keepalive`](super::SessionLock::keepalive) says otherwise.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(5);

/// Keeps the held locks of a [`SessionLock`](super::SessionLock) (and of
/// its clones with the same cadence) alive: one task, started by the first
/// lock and ending when a tick finds no lock held, starts the keepalive on
/// every held lock's connection once per cadence, each bounded by the
/// cadence and none waiting for another.
/// A lock registers by pushing onto a list under a short mutex: no task
/// spawned and no worker woken per lock.
pub(super) struct Keeper {
    pub(super) cadence: Duration,
    state: std::sync::Mutex<KeeperState>,
}

struct KeeperState {
    /// The locks registered since the last tick (and still alive then).
    held: Vec<Weak<Shared>>,
    /// Length at which a registration drops the entries of locks already
    /// gone, so that a busy cadence does not pile them up.
    prune_at: usize,
    /// Whether a keeper task is running (or about to).
    running: bool,
}

impl Keeper {
    pub(super) fn new(cadence: Duration) -> Arc<Self> {
        Arc::new(Keeper {
            cadence,
            state: std::sync::Mutex::new(KeeperState {
                held: Vec::new(),
                prune_at: 64,
                running: false,
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, KeeperState> {
        // Nothing under this mutex can panic half-way; a poisoned one is
        // still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `shared` alive from the next tick on (within one cadence);
    /// starts the keeper task if none runs.
    pub(super) fn register(self: &Arc<Self>, shared: &Arc<Shared>) {
        let start = {
            let mut state = self.state();
            if state.held.len() >= state.prune_at {
                state.held.retain(|held| held.strong_count() > 0);
                state.prune_at = (state.held.len() * 2).max(64);
            }
            state.held.push(Arc::downgrade(shared));
            !std::mem::replace(&mut state.running, true)
        };
        if start {
            tokio::spawn(self.clone().run());
        }
    }

    async fn run(self: Arc<Self>) {
        // Should the task be dropped (its runtime shutting down), the locks
        // it kept are given up, and the next registration starts another.
        let mut running = Running(Some(&self));
        let mut ticks = tokio::time::interval_at(Instant::now() + self.cadence, self.cadence);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // Each lock's keepalive runs on its own: one that gets no reply
        // (bounded by a cadence) never delays the next tick of the others.
        let mut keeping = FuturesUnordered::new();
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                Some(()) = keeping.next(), if !keeping.is_empty() => continue,
            }
            let held: Vec<Arc<Shared>> = {
                let mut state = self.state();
                state.held.retain(|held| held.strong_count() > 0);
                if state.held.is_empty() {
                    // Under the mutex: a registration after this starts a
                    // new task. (A keepalive in flight holds its lock, so
                    // nothing is in flight here.)
                    state.running = false;
                    running.0 = None;
                    return;
                }
                state.held.iter().filter_map(Weak::upgrade).collect()
            };
            for shared in held {
                keeping.push(async move { keep_alive(&shared).await });
            }
        }
    }
}

/// Marks the keeper stopped if its task is dropped before it ends (its
/// runtime shutting down), and gives up the locks it was keeping: no task
/// would notice them go any more, and `lost()` must not wait for nothing.
/// Their connections close, which ends each lock on the server; a lock
/// whose connection is in use right now is ended by whoever uses it.
struct Running<'a>(Option<&'a Keeper>);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let Some(keeper) = self.0.take() else {
            return;
        };
        let mut state = keeper.state();
        state.running = false;
        // A lock in use stays listed, for the next keeper.
        state.held.retain(|held| {
            let Some(shared) = held.upgrade() else {
                return false;
            };
            let Ok(slot) = shared.lease.try_lock() else {
                return true;
            };
            if slot.is_some() {
                tracing::warn!(key = %shared.key, backend_pid = shared.backend_pid,
                    "lockkit: the runtime of the session locks' keeper shut down; giving the lock up");
                shared.give_up(slot);
            }
            false
        });
    }
}

/// One keepalive on a held lock's connection, bounded by one cadence; when
/// it fails or gets no reply in time, the lock is given up.
async fn keep_alive(shared: &Shared) {
    let slot = shared.lease.lock().await;
    let Some(lease) = slot.as_ref() else {
        return; // released meanwhile
    };
    let reply = within_cadence(shared.cadence, async {
        Ok(lease.client().batch_execute(sql::KEEPALIVE).await?)
    })
    .await;
    if let Err(e) = reply {
        tracing::warn!(key = %shared.key, backend_pid = shared.backend_pid, error = %e,
            "lockkit: a session lock's keepalive failed; the lock is gone");
    } else {
        return;
    }
    // Under the same lock as the statement that failed on it, so that no
    // release can run a ROLLBACK (and report the lock held) after a
    // failure. The connection is closed, never back to a pool unclean.
    shared.give_up(slot);
}

/// Ends the lock of a connection lockkit opened as soon as the connection
/// ends (`ended` flips, or its task is gone).
pub(super) async fn watch_connection(shared: Weak<Shared>, mut ended: watch::Receiver<bool>) {
    let _ = ended.wait_for(|ended| *ended).await;
    let Some(shared) = shared.upgrade() else {
        return; // released and dropped
    };
    let slot = shared.lease.lock().await;
    if slot.is_some() {
        tracing::warn!(key = %shared.key, backend_pid = shared.backend_pid,
            "lockkit: a session lock's connection ended; the lock is gone");
        shared.give_up(slot);
    }
}
