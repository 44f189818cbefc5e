//! Taking a lock on a connection of its own, in the default or the
//! session-level form ([`Own::acquire`]): the connection (in a pending
//! slot), the bound on the take, the form's lock, then the guard made of
//! it, or the connection given back or drained.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::conn::{Lease, Settings};
use super::drain::{drain, Cleanup, Taking};
use super::form::SessionForm;
use super::guard::SessionGuard;
use super::held::{Holding, Shared};
use super::keeper::{watch_connection, Keeper, Kept};
use super::simple::Granted;
use super::wire::{within, within_take, AppName, NOTHING_HELD};
use super::xact::Take;
use super::{level, xact};
use crate::engine::error::Error;
use crate::engine::plan::Mode;
use crate::engine::sql;
use crate::engine::Wait;
use crate::key::{AdvisoryKey, KeyForm};

/// A [`SessionLock`](super::SessionLock)'s takes on a connection of their
/// own: its settings, and the keeper its held locks register with.
pub(super) struct Own<'a> {
    settings: &'a Settings,
    keeper: &'a Arc<Keeper>,
}

impl<'a> Own<'a> {
    /// The takes of a lock with `settings`, kept alive by `keeper`.
    pub(super) fn new(settings: &'a Settings, keeper: &'a Arc<Keeper>) -> Self {
        Own { settings, keeper }
    }

    /// Takes `take` of `value` on a connection of its own, held in `form`
    /// (a permit always in the default form).
    pub(super) async fn acquire<K: AdvisoryKey>(
        &self,
        value: K,
        take: Take,
        wait: Wait,
        form: SessionForm,
    ) -> Result<Result<SessionGuard<K>, K>, Error> {
        let key = value.lock_key();
        let hashtext = K::KEY_SPEC.form() == KeyForm::HashText;
        let name = AppName(K::KEY_SPEC.namespace(), key);
        let settings = self.settings;
        let mode = match take {
            Take::Key(mode) => mode,
            Take::Permit(_) => Mode::Exclusive,
        };
        let bound = self.take_bound(wait, form);
        let lease = settings.pending_lease(bound).await?;
        // Dropped with the call (cut off), the connection is drained, never
        // closed under a statement in flight.
        let cleanup = match form {
            SessionForm::SessionLevel => Cleanup::Unlock(key, mode),
            SessionForm::Transaction | SessionForm::Multiplexed => Cleanup::Rollback,
        };
        let taking = Taking::new(lease, cleanup);
        let lease = taking.lease();
        let take_it = async {
            match (form, take) {
                (SessionForm::SessionLevel, Take::Key(mode)) => {
                    let held = (key, &name, self.keeper.lease());
                    level::lock(settings, lease, held, mode, wait, hashtext).await
                }
                (_, take) => {
                    let value = (&value, key);
                    let held = (&name, self.keeper.lease());
                    xact::lock(settings, lease, value, take, wait, held, hashtext).await
                }
            }
        };
        // A silent path, or a pooler with no free server connection, fails
        // the take as a timeout (the connection is then drained): only a
        // wait for the key as long as it takes is unbounded here, and the
        // server bounds each of its slices.
        let taken = match bound {
            Some(bound) => within_take(bound, take_it).await,
            None => take_it.await,
        };
        match taken {
            Ok((Some(granted), backend_pid)) => {
                let mut lease = taking.keep();
                lease.hold();
                Ok(Ok(self.hold(
                    value,
                    granted,
                    mode,
                    form,
                    backend_pid,
                    lease,
                )))
            }
            Ok((None, _)) => {
                self.discard(taking.keep(), form, None).await;
                Ok(Err(value))
            }
            // The server's error: its statement ended.
            Err(e) if answered(&e) => {
                self.discard(taking.keep(), form, Some(&e)).await;
                Err(e)
            }
            // No answer (the take's bound passed: a statement may still be
            // queued in a pooler), or the connection lost: drained.
            Err(e) => {
                drop(taking);
                Err(e)
            }
        }
    }

    /// How long a take may wait for the server once its connection is
    /// open: a try one keepalive cadence, a timed call its timeout and one
    /// cadence, and the pooler probe's own bound on top when the
    /// session-level form runs it; `None` for a wait as long as it takes
    /// (a silent path cannot be told apart from a key held for long).
    fn take_bound(&self, wait: Wait, form: SessionForm) -> Option<Duration> {
        let cadence = self.keeper.cadence;
        let bound = match wait {
            Wait::Try => cadence,
            Wait::Timeout(timeout) => timeout.saturating_add(cadence),
            Wait::Forever => return None,
        };
        Some(
            match form == SessionForm::SessionLevel && self.settings.pooler_check {
                true => bound.saturating_add(self.settings.probe_timeout),
                false => bound,
            },
        )
    }

    /// Gives a connection back after a busy acquisition, or one that
    /// failed with the server's error (`failed`): nothing is in flight on
    /// it. A pooled one goes back only once nothing can be held on it.
    ///
    /// The rollback waits at most one cadence: on a path gone silent the
    /// lease is dropped unclean instead (detached from its pool and closed).
    /// A connection of lockkit's own ends when dropped, as a dropped client
    /// ends; after a busy try in the default form it is rolled back first,
    /// on a task ([`drain`]), so that the try answers at once: a client
    /// that leaves inside a transaction makes a transaction-mode pooler
    /// close the server connection, and open another for its next client.
    /// After the server's error of a statement it is rolled back first, so
    /// that the transaction's locks are gone when the error is seen (the
    /// server ends a transaction that an error aborted only after it sent
    /// the error).
    async fn discard(&self, mut lease: Lease, form: SessionForm, failed: Option<&Error>) {
        let busy = failed.is_none();
        if lease.is_owned() && busy {
            match form {
                SessionForm::Transaction | SessionForm::Multiplexed => {
                    drain(lease, Cleanup::Rollback);
                }
                // Outside a transaction, and taking nothing: dropping it
                // ends the session.
                SessionForm::SessionLevel => lease.clean = true,
            }
            return;
        }
        lease.clean = match form {
            SessionForm::Transaction | SessionForm::Multiplexed => {
                let rollback = async {
                    let client = lease.client();
                    Ok(client.batch_execute(sql::SESSION_ROLLBACK).await?)
                };
                within(self.keeper.cadence, NOTHING_HELD, rollback)
                    .await
                    .is_ok()
            }
            // A busy try took nothing (its lease reset, if it set one);
            // after an error, who knows.
            SessionForm::SessionLevel => {
                busy && within(
                    self.keeper.cadence,
                    NOTHING_HELD,
                    lease.reset_session_lease(),
                )
                .await
                .is_ok()
            }
        };
    }

    /// The guard of `value`'s lock, granted on `lease`: the lock's share
    /// registered with the keeper, and, on a connection lockkit opened,
    /// watched for the connection's end.
    fn hold<K>(
        &self,
        value: K,
        (key, token): Granted,
        mode: Mode,
        form: SessionForm,
        backend_pid: i32,
        lease: Lease,
    ) -> SessionGuard<K> {
        let ended = lease.ended.clone();
        let shared = Arc::new(Shared {
            lease: tokio::sync::Mutex::new(Some(lease)),
            lost: watch::Sender::new(false),
            key,
            mode,
            form,
            cadence: self.keeper.cadence,
            backend_pid,
            keepalive: match token {
                Some(token) => Cow::Owned(sql::keepalive_announcing([(key, token)])),
                None => Cow::Borrowed(sql::KEEPALIVE),
            },
        });
        // A connection lockkit opened tells when it ends: its lock is gone
        // at once. (It cost a connection and authentication; one more task
        // is nothing next to that.) A leased one is watched by the keeper.
        if let Some(ended) = ended {
            let kept: Arc<dyn Kept> = shared.clone();
            tokio::spawn(watch_connection(Arc::downgrade(&kept), ended));
        }
        self.keeper.register(shared.clone());
        let granted = (key, token);
        SessionGuard::own(value, granted, mode, form, backend_pid, Holding(shared))
    }
}

/// Whether `e` is the server's error of a statement, which ended it: not
/// a bound that passed with the statement unanswered, nor a lost
/// connection.
fn answered(e: &Error) -> bool {
    e.code().is_some() && !e.is_connection_lost()
}
