//! The default form ([`SessionForm::Transaction`]): the lock taken inside
//! a transaction of its own, held open on the lock's connection. One
//! entry, [`lock`]; the permits of a semaphore are taken this way too.

use std::future::Future;
use std::num::NonZeroU8;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio_postgres::Client;

use super::conn::{Lease, Settings};
#[cfg(doc)]
use super::form::SessionForm;
use super::simple::{take_permit, take_xact_lock, Granted, HeldTx, Taken};
#[cfg(doc)]
use super::wire::simple_round;
use super::wire::AppName;
use crate::engine::error::{Error, ErrorKind};
use crate::engine::facts::ServerFacts;
use crate::engine::plan::Mode;
use crate::engine::{Policy, Request, Wait};
use crate::key::{AdvisoryKey, LockKey};
use crate::pg::locker::server_facts;
use crate::{Config, OrderCheck, StatementMode};

/// What a lock on a connection of its own takes: a key in a mode, or a
/// permit of the semaphore of this many permits the key names.
#[derive(Clone, Copy, Debug)]
pub(super) enum Take {
    Key(Mode),
    Permit(NonZeroU8),
}

/// Takes `take` of `value` on `lease` in the default form, named `name`,
/// its transaction ended by the server once idle for `lease_for`: the key
/// granted with its fencing token when the settings mint them (`None`:
/// busy), and the backend pid.
pub(super) async fn lock<K: AdvisoryKey>(
    settings: &Settings,
    lease: &Lease,
    (value, key): (&K, LockKey),
    take: Take,
    wait: Wait,
    (name, lease_for): (&AppName, Duration),
    hashtext: bool,
) -> Result<(Option<Granted>, i32), Error> {
    let client = lease.client();
    let policy = policy(settings, client, hashtext).await?;
    let known = HeldTx {
        check_interval_known: &settings.check_interval_known,
        lease: lease_for,
        mint: settings.fencing,
    };
    let allow_standby = settings.allow_standby;
    match take {
        Take::Key(mode) => {
            let request = Request::key_of::<K>(key, mode);
            let take = take_xact_lock((client, &policy), request, wait, name, known);
            lock_in_transaction(take, allow_standby).await
        }
        Take::Permit(permits) => {
            let take = take_permit((client, &policy), (value, permits), wait, name, known);
            lock_in_transaction(take, allow_standby).await
        }
    }
}

/// The default form's policy: the lock's settings (a standby refused
/// unless allowed; one key per transaction, so no order to check; the
/// statements unnamed, in the simple protocol) on the server's facts,
/// which the engine checks before anything is sent (the standby, the
/// `hashtext` of a `HashText` key, the lock budget).
///
/// The facts are read at the `SessionLock`'s first lock in this form
/// (one round trip; its clones share them), and again whenever the facts
/// on hand would refuse the lock (a standby since promoted): a refusal
/// always rests on facts read for it. A `HashText` key's lock reads them
/// every time, since its key is the server's `hashtext` (another server
/// since may hash otherwise). Either way they are answered before the
/// lock's query goes out: a statement sent behind an answer that leaves
/// the connection idle is one a transaction-mode pooler may hand, still
/// running, to its next client should this connection close meanwhile (a
/// cut-off call on a pooled connection closes it). A lock the facts on
/// hand let through is checked again on what its own query answers
/// ([`lock_in_transaction`]).
///
/// # Errors
///
/// When the facts cannot be read.
async fn policy(settings: &Settings, client: &Client, hashtext: bool) -> Result<Policy, Error> {
    let config = Config::default()
        .allow_standby(settings.allow_standby)
        .order_check(OrderCheck::Off)
        .statements(StatementMode::Unnamed);
    let on_hand = match hashtext {
        true => None,
        false => cached(&settings.facts).clone(),
    };
    let facts = match on_hand {
        Some(facts) if settings.allow_standby || !facts.in_recovery() => facts,
        _ => {
            let facts = ServerFacts::from(&server_facts(client).await?);
            *cached(&settings.facts) = Some(facts.clone());
            facts
        }
    };
    Ok(Policy::new(config, facts))
}

/// The facts on hand, whatever a panic elsewhere left (a whole value).
fn cached(facts: &Mutex<Option<ServerFacts>>) -> MutexGuard<'_, Option<ServerFacts>> {
    facts.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The default form: `take` opens the transaction, sets it up and
/// takes the lock in one simple-protocol query (one message, one round
/// trip; see [`simple_round`]); then the standby, which can have changed
/// since the policy's facts were read (a failover), is checked on the
/// query's set-up row. Answers the key granted with its token (`None`:
/// busy) and the backend pid.
async fn lock_in_transaction(
    take: impl Future<Output = Result<Taken, Error>>,
    allow_standby: bool,
) -> Result<(Option<Granted>, i32), Error> {
    // One query: `BEGIN; set-up; lock`. Should BEGIN fail, nothing after
    // it runs (a simple query stops at its first error). It is the last
    // thing sent, and the simple protocol leaves no portal open, so the
    // held transaction holds no snapshot (no `backend_xmin`), with no
    // statement after it.
    let (setup, granted) = take.await?;
    let (in_recovery, backend_pid) = setup;
    if in_recovery && !allow_standby {
        return Err(Error::new(ErrorKind::HotStandby));
    }
    Ok((granted?, backend_pid))
}
