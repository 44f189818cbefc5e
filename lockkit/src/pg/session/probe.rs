//! The pooler probe: whether a connection goes through a
//! transaction-mode pooler, the check the session-level form makes before
//! every lock ([`probe_pooler`], [`probe`], [`backends`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

use super::conn::{Direct, Lease, Source};
#[cfg(doc)]
use super::form::SessionForm;
use crate::engine::error::{Error, ErrorKind};
use crate::engine::sql;

/// How long [`probe_pooler`] (and a session-level lock's probe) may take
/// unless [`SessionLock::probe_timeout`](super::SessionLock::probe_timeout)
/// says otherwise.
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The pooler probe did not finish within its timeout
/// ([`SessionLock::probe_timeout`](super::SessionLock::probe_timeout)): typically a pool or pooler with no
/// second connection free. Nothing was locked, and the probe's connections
/// were closed (or returned to the pool), so it holds none of them longer
/// than the timeout. The source of an [`ErrorKind::Timeout`] without a
/// SQLSTATE; find it with `std::error::Error::source` and `downcast_ref`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the pooler probe did not finish within {timeout:?} (no second connection free in the pool?); nothing was locked")]
pub struct ProbeTimeout {
    /// The timeout that expired.
    pub timeout: Duration,
}

/// What [`probe_pooler`] saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolerProbe {
    backend_pid: i32,
    pub(super) evidence: Option<String>,
}

impl PoolerProbe {
    /// The server backend the probed connection was on first.
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// Whether the connection goes through a transaction-mode pooler.
    pub fn is_transaction_pooled(&self) -> bool {
        self.evidence.is_some()
    }

    /// What gave the pooler away, when it did.
    pub fn evidence(&self) -> Option<&str> {
        self.evidence.as_deref()
    }
}

/// Whether connections made from `config` (without TLS) go through a
/// transaction-mode pooler: the check the [`SessionForm::SessionLevel`]
/// form makes before every lock (the default form needs none). Bounded by
/// [`DEFAULT_PROBE_TIMEOUT`]; use
/// [`SessionLock::probe_pooler`](super::SessionLock::probe_pooler) for TLS,
/// a pool or another bound.
///
/// On its own connection it reads `pg_backend_pid()` in two transactions;
/// then a second client opens a transaction, and the first reads its pid
/// again. Directly connected, the pid never changes and the second client
/// has another. Behind a transaction-mode pooler the backend is returned to
/// the pool after each transaction: pgbouncer hands the one released last
/// to the next client, so the second client gets the first one's backend,
/// or, when it does not, the first client moves to another. The first
/// connection also marks its backend with a session-wide setting
/// (`lockkit.pooler_probe`, taken off again when no pooler was seen): a
/// client that finds another client's mark on its fresh connection, or
/// loses its own, was handed a backend by a pooler. Concurrent probes
/// (a fleet of session-level lockers) thus mark the pooled backends for
/// one another, where the pids alone let some of them miss the pooler. A
/// session-mode pooler keeps each client on one backend (and its
/// `DISCARD ALL` clears the mark) and is not reported. The probe is still
/// a heuristic (the very first probes on a fresh pool rely on the pooler's
/// reuse order); that is why the default session form does not rely on
/// it.
///
/// # Errors
///
/// [`ProbeTimeout`] (inside [`ErrorKind::Timeout`]) when the probe did not
/// finish within the bound, e.g. because the pool had no second connection
/// free; when a connection or a query fails.
///
/// # Cancel safety
///
/// Cancel safe: both connections are closed when the future drops.
pub async fn probe_pooler(config: &tokio_postgres::Config) -> Result<PoolerProbe, Error> {
    let config = config.clone();
    let source = Source::Connect(Arc::new(Direct { config, tls: NoTls }));
    probe(&source, DEFAULT_PROBE_TIMEOUT).await
}

/// [`probe_pooler`] on connections from `source`, bounded by `timeout`.
pub(super) async fn probe(source: &Source, timeout: Duration) -> Result<PoolerProbe, Error> {
    bounded(timeout, async {
        let mut lease = source.lease().await?;
        let first = backend_pid(lease.client()).await?;
        let probe = backends(source, &lease, first).await?;
        // Only statements in autocommit ran on it: a pooled connection
        // may go back.
        lease.clean = true;
        Ok(probe)
    })
    .await
}

/// `work`, the probe, for at most `timeout`: past it, a [`ProbeTimeout`].
pub(super) async fn bounded<T>(
    timeout: Duration,
    work: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout, work).await {
        Ok(result) => result,
        Err(_) => Err(Error::with_source(
            ErrorKind::Timeout,
            format!("the pooler probe did not finish within {timeout:?}"),
            ProbeTimeout { timeout },
        )),
    }
}

/// The probe proper, with the first connection already open (`lease`, from
/// `source`) and its backend `first`: see [`probe_pooler`].
pub(super) async fn backends(
    source: &Source,
    lease: &Lease,
    first: i32,
) -> Result<PoolerProbe, Error> {
    let client = lease.client();
    let pooled = |evidence: String| PoolerProbe {
        backend_pid: first,
        evidence: Some(evidence),
    };
    // A session-wide mark of this probe on the backend, read back
    // below: a backend that carries the mark of another client was
    // handed over by a pooler (a direct connection, and a session-mode
    // pooler's `DISCARD ALL`, start every client clean). Concurrent
    // probes mark the pooled backends for one another, so they see the
    // pooler where backend pids alone let several of them miss it.
    let mark = format!("{:016x}", fastrand::u64(1..));
    let (again, found) = read_mark(client, Some(&mark)).await?;
    if again != first {
        return Ok(pooled(format!(
            "the next transaction ran on backend {again}"
        )));
    }
    if let Some(found) = found {
        return Ok(pooled(format!(
            "backend {again} carries another client's pooler probe mark {found}"
        )));
    }
    let mut other = source.lease().await?;
    other.client().batch_execute(sql::PROBE_BEGIN).await?;
    let (other_pid, other_found) = read_mark(other.client(), None).await?;
    let after = if other_pid == first {
        None
    } else {
        Some(read_mark(client, None).await?)
    };
    other.clean = other
        .client()
        .batch_execute(sql::SESSION_ROLLBACK)
        .await
        .is_ok();
    drop(other);
    let evidence = match (after, other_found) {
        (None, _) => Some(
            "another client's transaction was given it while this connection was idle".into(),
        ),
        (_, Some(found)) => Some(format!(
            "another client's transaction was given backend {other_pid}, which carries the pooler probe mark {found}"
        )),
        (Some((after, _)), None) if after != first => Some(format!(
            "while another client's transaction was open, this connection moved to backend {after}"
        )),
        (Some((_, found)), None) if found.as_deref() != Some(mark.as_str()) => Some(format!(
            "this connection's backend lost its pooler probe mark (found {found:?})"
        )),
        (Some(_), None) => None,
    };
    if let Some(evidence) = evidence {
        return Ok(pooled(evidence));
    }
    // Directly connected (or session-pooled): take the mark off, so
    // that a pooled connection leased again is not mistaken for one a
    // pooler handed over.
    client.batch_execute(sql::PROBE_UNMARK).await?;
    Ok(PoolerProbe {
        backend_pid: first,
        evidence: None,
    })
}

/// `pg_backend_pid()` and the pooler probe's mark on the backend, if any,
/// in one transaction; with `set`, marks it with `set` afterwards, in the
/// same transaction (so on the same backend). The mark answered is the one
/// found before; with `set`, it is `None` when it was `set` already.
async fn read_mark(client: &Client, set: Option<&str>) -> Result<(i32, Option<String>), Error> {
    let mut query = String::with_capacity(128);
    sql::write_read_mark(&mut query, set);
    let messages = client.simple_query(&query).await?;
    let row = messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .ok_or_else(|| Error::unexpected("the pooler probe's query returned no row".into()))?;
    let pid = row
        .get(0)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::unexpected("pg_backend_pid() returned no pid".into()))?;
    let found = row
        .get(1)
        .filter(|mark| !mark.is_empty() && Some(*mark) != set)
        .map(str::to_owned);
    Ok((pid, found))
}

/// `pg_backend_pid()` in a statement of its own (its own transaction).
async fn backend_pid(client: &Client) -> Result<i32, Error> {
    let messages = client.simple_query(sql::BACKEND_PID).await?;
    messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0).and_then(|v| v.parse().ok()),
            _ => None,
        })
        .ok_or_else(|| Error::unexpected("pg_backend_pid() returned no row".into()))
}
