//! The plain session-level form ([`SessionForm::SessionLevel`]):
//! `pg_advisory_lock` on the lock's session, after the pooler probe. One
//! entry, [`lock`].

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::conn::{Lease, Settings};
#[cfg(doc)]
use super::form::SessionForm;
use super::probe;
use super::simple::Granted;
use super::wire::{granted_with_token, key_query, one_bool, one_row, AppName};
use crate::engine::error::{DriverError, Error, ErrorKind};
use crate::engine::facts::ServerFacts;
use crate::engine::plan::Mode;
use crate::engine::sql::{self, SettingScope, CHECK_CLIENT};
use crate::engine::Wait;
use crate::key::LockKey;
use crate::pg::locker::server_facts;
use tokio_postgres::error::SqlState;

/// The plain session-level form: facts, the pooler probe, the lock's
/// name (on a connection of lockkit's own) and (PostgreSQL 14+) its lease
/// `lease_for` as `idle_session_timeout`, then `pg_advisory_lock` (with a
/// fencing token when the settings mint them): the key granted with its
/// token (`None`: busy) and the backend pid.
pub(super) async fn lock(
    settings: &Settings,
    lease: &Lease,
    (key, name, lease_for): (LockKey, &AppName, Duration),
    mode: Mode,
    wait: Wait,
    hashtext: bool,
) -> Result<(Option<Granted>, i32), Error> {
    let client = lease.client();
    let row = server_facts(client).await?;
    let (facts, backend_pid) = (ServerFacts::from(&row), row.backend_pid);
    refuse(settings, &facts, hashtext)?;
    if settings.pooler_check {
        let probe = probe::backends(&settings.source, lease, backend_pid);
        let probe = probe::bounded(settings.probe_timeout, probe).await?;
        if let Some(evidence) = probe.evidence {
            return Err(Error::pooled(backend_pid, evidence));
        }
    }
    // Session-wide, so only on a connection of lockkit's own (a pooled
    // lease keeps its own name and settings), which no transaction-mode
    // pooler shares once the probe has passed: the lock's name and, on
    // PostgreSQL 14+, the client check and the lease (the session ends once
    // idle that long: a holder that stopped loses its lock), in one round
    // trip.
    if lease.is_owned() {
        let mut setup = String::with_capacity(128);
        sql::write_session_name(&mut setup, name);
        if facts.server_version_num() >= 140000 {
            setup.push_str("; ");
            setup.push_str(CHECK_CLIENT);
            setup.push_str("; ");
            sql::write_lease(&mut setup, SettingScope::Session, lease_for);
        }
        client.batch_execute(&setup).await?;
    } else if facts.server_version_num() >= 140000 {
        // A connection leased from the application's pool keeps its own
        // name and settings, save the client check (the server then ends
        // the session of a client gone within a second) and the lease,
        // which it has for the lock's time only: both reset before the
        // connection goes back (flagged before they are sent, so that a
        // cut-off `SET` is reset too).
        let mut setup = String::from(CHECK_CLIENT);
        setup.push_str("; ");
        sql::write_lease(&mut setup, SettingScope::Session, lease_for);
        lease.session_lease.store(true, Ordering::Release);
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
    // A wait as long as it takes waits in slices the server bounds, as
    // the default form's does: a lock cut off, or whose client is gone,
    // frees its connection within one slice. A caller's own
    // `lock_timeout` bounds the wait instead.
    let sliced = match wait {
        Wait::Forever => arm_slices(client).await?,
        Wait::Timeout(_) | Wait::Try => false,
    };
    let try_only = matches!(wait, Wait::Try);
    let statement = match settings.fencing {
        true => sql::session_lock_minting(key, mode, try_only),
        false => sql::session_lock(key, mode, try_only),
    };
    let started = std::time::Instant::now();
    let rows = loop {
        match key_query(client, statement, key).await {
            // One slice ended with the key still busy: the next.
            Err(e) if sliced && e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => continue,
            Ok(rows) => break rows,
            Err(e) => {
                let elapsed = context.map(|t| (t, started.elapsed()));
                let e = DriverError::from(e).into_error_in(elapsed, 1);
                if !settings.fencing {
                    return Err(e);
                }
                // A lock granted before its token failed stays on the
                // session (a statement's error ends no session-level lock):
                // let it go now, so that nothing is held when the error is
                // seen. (The caller closes the connection after an error
                // too, but the server ends the session a moment later.)
                let _ = key_query(client, sql::session_unlock(key, mode), key).await;
                return Err(Error::not_installed_or(e, "a fencing token"));
            }
        }
    };
    if sliced {
        client.batch_execute(UNARM_SLICES).await?;
    }
    let granted = match (settings.fencing, wait) {
        (true, _) => granted_with_token(&rows)?.map(|token| (key, Some(token))),
        (false, Wait::Try) => one_bool(&rows)?.then_some((key, None)),
        (false, Wait::Forever | Wait::Timeout(_)) => {
            one_row(&rows, "the lock statement")?;
            Some((key, None))
        }
    };
    if let Wait::Timeout(_) = wait {
        client.batch_execute(sql::RESET_LOCK_TIMEOUT).await?;
    }
    Ok((granted, backend_pid))
}

/// Sets the session's `lock_timeout` to one slice of a bounded wait
/// ([`wait_slice_ms`](crate::engine::sql::wait_slice_ms)) when it is off
/// (`0`, the default), and says whether it did: a `lock_timeout` of the
/// caller's own is left as it is, and bounds the wait.
///
/// # Errors
///
/// When the statement fails, or its answer is not one `bool`.
async fn arm_slices(client: &tokio_postgres::Client) -> Result<bool, Error> {
    let rows = client.query_typed(ARM_SLICES, &[]).await?;
    one_bool(&rows)
}

/// [`arm_slices`]' statement: one `bool`, whether the wait is sliced.
const ARM_SLICES: &str = concat!(
    "/* lockkit:arm_slices */ SELECT s.sliced, set_config('lock_timeout', CASE WHEN s.sliced THEN ",
    crate::engine::sql::wait_slice_ms!(),
    "::text || 'ms' ELSE current_setting('lock_timeout') END, false) \
     FROM (SELECT current_setting('lock_timeout')::interval = interval '0' AS sliced) AS s"
);

/// Turns the slices off again once the wait ended: the session's
/// `lock_timeout` back to `0`, as it was.
const UNARM_SLICES: &str = "SET lock_timeout = 0";

/// The standby and `hashtext` checks before a session-level lock.
fn refuse(settings: &Settings, facts: &crate::ServerFacts, hashtext: bool) -> Result<(), Error> {
    if facts.in_recovery() && !settings.allow_standby {
        return Err(Error::new(ErrorKind::HotStandby));
    }
    if hashtext {
        facts.check_hashtext()?;
    }
    Ok(())
}
