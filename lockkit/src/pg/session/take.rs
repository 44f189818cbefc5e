//! Taking a lock on a connection of its own, in either form: the checks
//! before it is handed out, the lock statement, and the guard made of it.

use std::future::Future;
use std::num::NonZeroU8;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join;
use tokio::sync::watch;
use tokio_postgres::Client;

use super::conn::Lease;
use super::guard::{Hold, Holding, SessionGuard, Shared};
use super::keeper::watch_connection;
use super::mux::MuxTry;
#[cfg(doc)]
use super::simple::simple_round;
use super::simple::{take_permit, take_xact_lock, Taken};
use super::wire::{key_query, one_bool, one_row, within, within_take, AppName, NOTHING_HELD};
use super::{SessionForm, SessionLock};
use crate::driver::Canceller;
use crate::engine::error::{DriverError, Error, ErrorKind};
use crate::engine::facts::ServerFacts;
use crate::engine::plan::Mode;
use crate::engine::sql::{self, SettingScope, CHECK_CLIENT};
use crate::engine::Request;
use crate::engine::Wait;
use crate::key::{AdvisoryKey, KeyForm, LockKey};
use crate::pg::locker::server_facts;

impl SessionLock {
    pub(super) async fn acquire<K: AdvisoryKey>(
        &self,
        value: K,
        mode: Mode,
        wait: Wait,
    ) -> Result<Result<SessionGuard<K>, K>, Error> {
        if self.form != SessionForm::Multiplexed {
            return self
                .acquire_own(value, Take::Key(mode), wait, self.form)
                .await;
        }
        // A free key is taken on a multiplexed connection, in one round
        // trip. A wait never runs there (a connection waiting for one key
        // would delay every other lock's statements on it): it takes a
        // connection of its own, in the default form.
        match self.try_multiplexed(value, mode).await? {
            MuxTry::Held(guard) => Ok(Ok(guard)),
            MuxTry::Busy(value) if matches!(wait, Wait::Try) => Ok(Err(value)),
            MuxTry::Busy(value) | MuxTry::Elsewhere(value) => {
                let take = Take::Key(mode);
                self.acquire_own(value, take, wait, SessionForm::Transaction)
                    .await
            }
        }
    }

    /// Takes `take` of `value` on a connection of its own, held in `form`
    /// (a permit always in the default form).
    pub(super) async fn acquire_own<K: AdvisoryKey>(
        &self,
        value: K,
        take: Take,
        wait: Wait,
        form: SessionForm,
    ) -> Result<Result<SessionGuard<K>, K>, Error> {
        let key = value.lock_key();
        let hashtext = K::KEY_SPEC.form() == KeyForm::HashText;
        let name = AppName(K::KEY_SPEC.namespace(), key);
        let (lease, canceller) = self.lease().await?;
        let client = lease.client();
        let known = &self.check_interval_known;
        let mut cancel = CancelOnDrop::new(client, &canceller);
        let taking = async {
            match (form, take) {
                (SessionForm::SessionLevel, Take::Key(mode)) => self
                    .lock_session_level(&lease, (key, &name), mode, wait, hashtext)
                    .await
                    .map(|(granted, pid)| (granted.then_some(key), pid)),
                (_, Take::Key(mode)) => {
                    let request = Request::key_of::<K>(key, mode);
                    let take = take_xact_lock(client, request, wait, &name, known);
                    self.lock_in_transaction(&lease, take, hashtext).await
                }
                (_, Take::Permit(permits)) => {
                    let take = take_permit(client, (&value, permits), wait, &name, known);
                    self.lock_in_transaction(&lease, take, hashtext).await
                }
            }
        };
        // A silent path, or a pooler with no free server connection, fails
        // the take as a timeout (the connection is then closed below): only
        // a wait for the key as long as it takes is unbounded.
        let taken = match self.take_bound(wait, form) {
            Some(bound) => within_take(bound, taking).await,
            None => taking.await,
        };
        cancel.disarm();
        drop(cancel);
        let mode = match take {
            Take::Key(mode) => mode,
            Take::Permit(_) => Mode::Exclusive,
        };
        match taken {
            Ok((Some(key), backend_pid)) => {
                Ok(Ok(self.hold(value, key, mode, form, backend_pid, lease)))
            }
            Ok((None, _)) => {
                self.discard(lease, form, true).await;
                Ok(Err(value))
            }
            Err(e) => {
                self.discard(lease, form, false).await;
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
            match form == SessionForm::SessionLevel && self.pooler_check {
                true => bound.saturating_add(self.probe_timeout),
                false => bound,
            },
        )
    }

    /// The default form: `take` opens the transaction, sets it up and
    /// takes the lock in one simple-protocol query (one message, one round
    /// trip; see [`simple_round`]); then the server's facts are checked.
    /// Answers the key granted (`None`: busy) and the backend pid.
    async fn lock_in_transaction(
        &self,
        lease: &Lease,
        take: impl Future<Output = Result<Taken, Error>>,
        hashtext: bool,
    ) -> Result<(Option<LockKey>, i32), Error> {
        let client = lease.client();
        // The facts (HashText keys only) go first, outside the transaction:
        // they are the server's, not the backend's. Then one query:
        // `BEGIN; set-up; lock`. Should BEGIN fail, nothing after it runs
        // (a simple query stops at its first error). It is the last thing
        // sent, and the simple protocol leaves no portal open, so the held
        // transaction holds no snapshot (no `backend_xmin`), with no
        // statement after it.
        let (facts, taken) = match hashtext {
            true => {
                let (facts, taken) = join(server_facts(client), take).await;
                (Some(facts), taken)
            }
            false => (None, take.await),
        };
        let (setup, granted) = taken?;
        let (in_recovery, backend_pid) = setup;
        if in_recovery && !self.allow_standby {
            return Err(Error::new(ErrorKind::HotStandby));
        }
        if let Some(facts) = facts {
            ServerFacts::from(&facts?).check_hashtext()?;
        }
        Ok((granted?, backend_pid))
    }

    /// The plain session-level form: facts, the pooler probe, the lock's
    /// name, then `pg_advisory_lock`.
    async fn lock_session_level(
        &self,
        lease: &Lease,
        (key, name): (LockKey, &AppName),
        mode: Mode,
        wait: Wait,
        hashtext: bool,
    ) -> Result<(bool, i32), Error> {
        let client = lease.client();
        let row = server_facts(client).await?;
        let (facts, backend_pid) = (ServerFacts::from(&row), row.backend_pid);
        self.refuse(&facts, hashtext)?;
        if self.pooler_check {
            let probe = self
                .bounded(self.probe_backends(lease, backend_pid))
                .await?;
            if let Some(evidence) = probe.evidence {
                return Err(Error::pooled(backend_pid, evidence));
            }
        }
        // Session-wide, so only on a connection of lockkit's own (a pooled
        // lease keeps its own name and settings), which no transaction-mode
        // pooler shares once the probe has passed: the lock's name and, on
        // PostgreSQL 14+, the client check, in one round trip.
        if lease.is_owned() {
            let mut setup = String::with_capacity(128);
            sql::write_session_name(&mut setup, name);
            if facts.server_version_num() >= 140000 {
                setup.push_str("; ");
                setup.push_str(CHECK_CLIENT);
            }
            client.batch_execute(&setup).await?;
        }
        let context = match wait {
            Wait::Timeout(timeout) => {
                let mut set = String::with_capacity(32);
                sql::write_lock_timeout(&mut set, SettingScope::Session, timeout);
                client.batch_execute(&set).await?;
                Some(timeout)
            }
            Wait::Forever | Wait::Try => None,
        };
        let started = std::time::Instant::now();
        let rows = key_query(
            client,
            sql::session_lock(key, mode, matches!(wait, Wait::Try)),
            key,
        )
        .await
        .map_err(|e| {
            DriverError::from(e).into_error_in(context.map(|t| (t, started.elapsed())), 1)
        })?;
        let granted = match wait {
            Wait::Try => one_bool(&rows)?,
            Wait::Forever | Wait::Timeout(_) => {
                one_row(&rows, "the lock statement")?;
                true
            }
        };
        if let Wait::Timeout(_) = wait {
            client.batch_execute(sql::RESET_LOCK_TIMEOUT).await?;
        }
        Ok((granted, backend_pid))
    }

    fn refuse(&self, facts: &crate::ServerFacts, hashtext: bool) -> Result<(), Error> {
        if facts.in_recovery() && !self.allow_standby {
            return Err(Error::new(ErrorKind::HotStandby));
        }
        if hashtext {
            facts.check_hashtext()?;
        }
        Ok(())
    }

    /// Gives a connection back after a failed or busy acquisition: a pooled
    /// one only once nothing can be held on it.
    ///
    /// The rollback waits at most one cadence: on a path gone silent the
    /// lease is dropped unclean instead (detached from its pool and closed).
    async fn discard(&self, mut lease: Lease, form: SessionForm, busy: bool) {
        if lease.is_owned() {
            return; // Dropping it closes the session.
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
            // A busy try took nothing; after an error, who knows.
            SessionForm::SessionLevel => busy,
        };
    }

    fn hold<K>(
        &self,
        value: K,
        key: LockKey,
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
        });
        // A connection lockkit opened tells when it ends: its lock is gone
        // at once. (It cost a connection and authentication; one more task
        // is nothing next to that.) A leased one is watched by the keeper.
        if let Some(ended) = ended {
            tokio::spawn(watch_connection(Arc::downgrade(&shared), ended));
        }
        self.keeper.register(&shared);
        SessionGuard {
            value,
            key,
            mode,
            form,
            backend_pid,
            hold: Hold::Own(Holding(shared)),
        }
    }
}

/// What a lock on a connection of its own takes: a key in a mode, or a
/// permit of the semaphore of this many permits the key names.
#[derive(Clone, Copy, Debug)]
pub(super) enum Take {
    Key(Mode),
    Permit(NonZeroU8),
}

/// Cancels what is in flight on a session lock's connection if dropped
/// armed: a dropped lock call must not leave the server waiting for its
/// lock. The cancelling is [`Canceller::cancel_until_answered`], as for a
/// transaction's call cut off in flight.
struct CancelOnDrop<'a> {
    armed: Option<(&'a Client, &'a Canceller)>,
}

impl<'a> CancelOnDrop<'a> {
    /// Armed: dropped before [`disarm`](Self::disarm), it cancels what is in
    /// flight on `client` through `canceller`.
    fn new(client: &'a Client, canceller: &'a Canceller) -> Self {
        CancelOnDrop {
            armed: Some((client, canceller)),
        }
    }

    /// The statements completed: nothing to cancel.
    fn disarm(&mut self) {
        self.armed = None;
    }
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if let Some((client, canceller)) = self.armed.take() {
            canceller.cancel_until_answered(client);
        }
    }
}
