//! The default form ([`SessionForm::Transaction`]): the lock taken inside
//! a transaction of its own, held open on the lock's connection. One
//! entry, [`lock`]; the permits of a semaphore are taken this way too.

use std::future::Future;
use std::num::NonZeroU8;
use std::time::Duration;

use futures_util::future::join;

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
use crate::engine::{Request, Wait};
use crate::key::{AdvisoryKey, LockKey};
use crate::pg::locker::server_facts;

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
    let known = HeldTx {
        check_interval_known: &settings.check_interval_known,
        lease: lease_for,
        mint: settings.fencing,
    };
    let allow_standby = settings.allow_standby;
    match take {
        Take::Key(mode) => {
            let request = Request::key_of::<K>(key, mode);
            let take = take_xact_lock(client, request, wait, name, known);
            lock_in_transaction(lease, take, hashtext, allow_standby).await
        }
        Take::Permit(permits) => {
            let take = take_permit(client, (value, permits), wait, name, known);
            lock_in_transaction(lease, take, hashtext, allow_standby).await
        }
    }
}

/// The default form: `take` opens the transaction, sets it up and
/// takes the lock in one simple-protocol query (one message, one round
/// trip; see [`simple_round`]); then the server's facts are checked.
/// Answers the key granted with its token (`None`: busy) and the backend
/// pid.
async fn lock_in_transaction(
    lease: &Lease,
    take: impl Future<Output = Result<Taken, Error>>,
    hashtext: bool,
    allow_standby: bool,
) -> Result<(Option<Granted>, i32), Error> {
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
    if in_recovery && !allow_standby {
        return Err(Error::new(ErrorKind::HotStandby));
    }
    if let Some(facts) = facts {
        ServerFacts::from(&facts?).check_hashtext()?;
    }
    Ok((granted?, backend_pid))
}
