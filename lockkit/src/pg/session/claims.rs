//! The multiplexed form's table of connection slots and claimed keys: a
//! key is claimed at most once over all of a
//! [`SessionLock`](super::SessionLock)'s multiplexed connections, and each
//! claim goes to the slot with the fewest.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};

use tokio::sync::OnceCell;

use crate::engine::plan::Mode;
use crate::key::LockKey;

/// How many connections the
/// [`SessionForm::Multiplexed`](super::SessionForm::Multiplexed) form opens
/// at most unless
/// [`SessionLock::connections`](super::SessionLock::connections) says
/// otherwise.
pub const DEFAULT_CONNECTIONS: usize = 4;

/// An open connection's users below which a lock is taken on it rather than
/// on a connection not yet opened.
const SHARE_BEFORE_OPENING: usize = 16;

/// Why a key could not be claimed.
pub(super) enum Refused {
    /// This `SessionLock` holds the key in a mode that excludes the
    /// request.
    Busy,
    /// This `SessionLock` holds the key shared, and the request is shared.
    Elsewhere,
}

/// The multiplexed connections of a [`SessionLock`](super::SessionLock)
/// (shared by its clones), and the keys claimed on them: `C` is a
/// connection.
pub(super) struct Mux<C> {
    max: usize,
    state: std::sync::Mutex<State<C>>,
}

impl<C> std::fmt::Debug for Mux<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state();
        f.debug_struct("Mux")
            .field("max", &self.max)
            .field("claimed", &state.keys.len())
            .finish()
    }
}

/// One connection slot: the connection (opened on first use) and the
/// claims on it. A connection that ends leaves a new, empty cell.
pub(super) type Cell<C> = Arc<OnceCell<Arc<C>>>;

struct Slot<C> {
    cell: Cell<C>,
    users: usize,
}

struct State<C> {
    slots: Vec<Slot<C>>,
    /// Every key claimed: held, or with a statement for it in flight.
    keys: HashMap<LockKey, (Mode, Cell<C>)>,
}

impl<C> Mux<C> {
    pub(super) fn new(max: usize) -> Arc<Self> {
        Arc::new(Mux {
            max,
            state: std::sync::Mutex::new(State {
                slots: (0..max)
                    .map(|_| Slot {
                        cell: Cell::default(),
                        users: 0,
                    })
                    .collect(),
                keys: HashMap::new(),
            }),
        })
    }

    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// How many keys are claimed: held, or with a statement in flight.
    pub(super) fn claimed(&self) -> usize {
        self.state().keys.len()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State<C>> {
        // Nothing under this mutex can panic half-way.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `key` on the connection slot with the fewest claims (one not
    /// yet opened counts as [`SHARE_BEFORE_OPENING`]), or says why not.
    pub(super) fn claim(self: &Arc<Self>, key: LockKey, mode: Mode) -> Result<Claim<C>, Refused> {
        let mut state = self.state();
        if let Some((held, _)) = state.keys.get(&key) {
            return Err(match (held, mode) {
                (Mode::Shared, Mode::Shared) => Refused::Elsewhere,
                _ => Refused::Busy,
            });
        }
        let score = |slot: &Slot<C>| {
            slot.users
                + if slot.cell.initialized() {
                    0
                } else {
                    SHARE_BEFORE_OPENING
                }
        };
        let (index, slot) = state
            .slots
            .iter_mut()
            .enumerate()
            .min_by_key(|(_, slot)| score(slot))
            .expect("at least one connection");
        slot.users += 1;
        let cell = slot.cell.clone();
        state.keys.insert(key, (mode, cell.clone()));
        Ok(Claim {
            mux: self.clone(),
            key,
            mode,
            slot: index,
            cell,
        })
    }

    /// Forgets `conn`, which ended or is closing: its slot gets a new cell.
    pub(super) fn forget(&self, slot: usize, conn: &C) {
        let mut state = self.state();
        let slot = &mut state.slots[slot];
        if slot
            .cell
            .get()
            .is_some_and(|c| std::ptr::eq(Arc::as_ptr(c), conn))
        {
            *slot = Slot {
                cell: Cell::default(),
                users: 0,
            };
        }
    }

    /// Whether `conn`, on `slot`, held nothing and had no claim for a
    /// whole cadence (`used`: whether it had one); if so, its slot forgets
    /// it (under the table's lock, so that no claim can reach it after).
    pub(super) fn forget_idle(&self, slot: usize, conn: &Arc<C>, used: bool) -> bool {
        let mut state = self.state();
        let slot = &mut state.slots[slot];
        let ours = slot.cell.get().is_some_and(|c| Arc::ptr_eq(c, conn));
        if !ours {
            return true;
        }
        if used || slot.users > 0 {
            return false;
        }
        *slot = Slot {
            cell: Cell::default(),
            users: 0,
        };
        true
    }
}

/// A key claimed on one connection slot; dropped, the claim ends.
pub(super) struct Claim<C> {
    mux: Arc<Mux<C>>,
    pub(super) key: LockKey,
    pub(super) mode: Mode,
    pub(super) slot: usize,
    pub(super) cell: Cell<C>,
}

impl<C> Drop for Claim<C> {
    fn drop(&mut self) {
        let mut state = self.mux.state();
        if state
            .keys
            .get(&self.key)
            .is_some_and(|(_, cell)| Arc::ptr_eq(cell, &self.cell))
        {
            state.keys.remove(&self.key);
        }
        let slot = &mut state.slots[self.slot];
        if Arc::ptr_eq(&slot.cell, &self.cell) {
            slot.users -= 1;
        }
    }
}
