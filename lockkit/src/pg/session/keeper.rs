//! Keeping the held locks alive: the one keepalive loop of the session
//! locks, a keeper task per [`SessionLock`](super::SessionLock) cadence
//! that ticks every held lock of its own connection and every multiplexed
//! connection ([`Kept`]), and the watch on a connection lockkit opened.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

/// The keepalive cadence unless
/// [`SessionLock::keepalive`](super::SessionLock::keepalive) says otherwise.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(5);

/// How many keepalive cadences a held lock's session may run no statement
/// before the server ends it: its lease
/// ([`SessionLock::lease`](super::SessionLock::lease)).
pub const LEASE_CADENCES: u32 = 3;

/// The shortest lease, whatever the cadence: a runtime busy for a moment
/// must not cost a lock.
pub const MIN_LEASE: Duration = Duration::from_secs(1);

/// The lease of a lock kept alive at `cadence`: [`LEASE_CADENCES`]
/// cadences, at least [`MIN_LEASE`] (15 s at [`DEFAULT_KEEPALIVE`]). Its
/// session set-up asks the server to end the session once it has been
/// idle that long: a keepalive goes out once per cadence, so a holder that
/// still runs never comes near it, and one that stopped (a paused process,
/// a stopped container, a swapped-out VM) loses the lock within it.
pub(super) fn lease_of(cadence: Duration) -> Duration {
    cadence.saturating_mul(LEASE_CADENCES).max(MIN_LEASE)
}

/// A future a [`Kept`] hands the keeper.
pub(super) type Tick = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What a keeper keeps alive: a lock held on a connection of its own
/// ([`Shared`](super::held::Shared)) or a multiplexed connection
/// ([`MuxConn`](super::mux_conn::MuxConn)). Each says what one tick does
/// on its connection; the keeper owns when ticks run.
pub(super) trait Kept: Send + Sync + 'static {
    /// One tick at the cadence: the keepalive, bounded by one cadence;
    /// when it fails or gets no reply in time, what it kept is given up.
    fn tick(self: Arc<Self>) -> Tick;

    /// The connection lockkit opened for it ended: given up at once.
    fn connection_ended(self: Arc<Self>) -> Tick;

    /// The keeper's runtime shut down, so that no tick runs any more: gives
    /// up what it keeps now, unless a statement is in flight on it (whoever
    /// runs that statement ends it). Whether it is still to be kept.
    fn abandon(&self) -> bool;
}

/// Keeps the held locks of a [`SessionLock`](super::SessionLock) (and of
/// its clones with the same cadence) alive: one task, started by the first
/// registration and ending when a tick finds nothing kept, ticks every
/// [`Kept`] once per cadence, each tick bounded by the cadence and none
/// waiting for another.
/// A lock registers by pushing onto a list under a short mutex: no task
/// spawned and no worker woken per lock.
pub(super) struct Keeper {
    pub(super) cadence: Duration,
    state: std::sync::Mutex<KeeperState>,
}

struct KeeperState {
    /// What was registered since the last tick (and still alive then).
    held: Vec<Weak<dyn Kept>>,
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

    /// The lease of the locks this keeper keeps ([`lease_of`]).
    pub(super) fn lease(&self) -> Duration {
        lease_of(self.cadence)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, KeeperState> {
        // Nothing under this mutex can panic half-way; a poisoned one is
        // still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `kept` alive from the next tick on (within one cadence), for
    /// as long as it lives; starts the keeper task if none runs.
    pub(super) fn register(self: &Arc<Self>, kept: Arc<dyn Kept>) {
        let start = {
            let mut state = self.state();
            if state.held.len() >= state.prune_at {
                state.held.retain(|held| held.strong_count() > 0);
                state.prune_at = (state.held.len() * 2).max(64);
            }
            state.held.push(Arc::downgrade(&kept));
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
        // Each tick runs on its own: one that gets no reply (bounded by a
        // cadence) never delays the next tick of the others.
        let mut keeping = FuturesUnordered::new();
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                Some(()) = keeping.next(), if !keeping.is_empty() => continue,
            }
            let held: Vec<Arc<dyn Kept>> = {
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
            for kept in held {
                keeping.push(kept.tick());
            }
        }
    }
}

/// Marks the keeper stopped if its task is dropped before it ends (its
/// runtime shutting down), and gives up what it was keeping
/// ([`Kept::abandon`]): no task would notice a lock go any more, and
/// `lost()` must not wait for nothing. Their connections close, which ends
/// each lock on the server.
struct Running<'a>(Option<&'a Keeper>);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let Some(keeper) = self.0.take() else {
            return;
        };
        let mut state = keeper.state();
        state.running = false;
        // One with a statement in flight stays listed, for the next keeper.
        state
            .held
            .retain(|held| held.upgrade().is_some_and(|kept| kept.abandon()));
    }
}

/// Gives `kept` up as soon as the connection lockkit opened for it ends
/// (`ended` flips, or its task is gone).
pub(super) async fn watch_connection(kept: Weak<dyn Kept>, mut ended: watch::Receiver<bool>) {
    let _ = ended.wait_for(|ended| *ended).await;
    if let Some(kept) = kept.upgrade() {
        kept.connection_ended().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_three_cadences_and_at_least_a_second() {
        assert_eq!(lease_of(DEFAULT_KEEPALIVE), Duration::from_secs(15));
        assert_eq!(
            lease_of(Duration::from_millis(400)),
            Duration::from_millis(1_200)
        );
        assert_eq!(lease_of(Duration::from_millis(100)), MIN_LEASE);
        assert_eq!(lease_of(Duration::MAX), Duration::MAX);
        let keeper = Keeper::new(Duration::from_secs(2));
        assert_eq!(keeper.lease(), Duration::from_secs(6));
    }
}
