//! The lock calls of a `LockTx`, written once for both of its faces:
//! [`tx::LockTx`](crate::tx::LockTx) (sqlx, diesel-async, Diesel, over a
//! [`Driver`]) and tokio-postgres's [`pg::LockTx`](crate::pg::LockTx).
//!
//! The faces differ in their receivers and their guards' lifetime, not in
//! what a call does:
//!
//! - the generic face borrows its connection `&mut` (sqlx and Diesel need
//!   it for every statement), so its calls take `&mut self` and its guards
//!   borrow the connection (`'t`), which lets queries run while they live;
//! - tokio-postgres's owns its `Transaction` (ended by `commit(self)`) and
//!   takes `&self`, so that a lock call can be pipelined with the
//!   transaction's next statement; its guards borrow the `LockTx`, so none
//!   outlives the commit.
//!
//! Each face's public calls are one line each: they name the call's mode,
//! wait and call site, and hand the functions here how to make what the
//! call needs of their receiver (its [`Parts`], made when the call's future
//! first runs, so that until then the future holds only the receiver). The
//! functions ask the engine for the call and run it through the face's
//! driver by the same [`driver::run_one`] and [`driver::drive`] on every
//! stack. The calls' docs are written once too, in the `calls/` files both
//! faces include.

use std::borrow::{Borrow, BorrowMut};
use std::marker::PhantomData;
use std::num::NonZeroU8;
use std::panic::Location;

use crate::driver::{self, Driver};
use crate::engine::{Grant, Policy, Request, TxState, Wait};
use crate::{AdvisoryKey, Busy, Error, Held, HeldBatch, Mode};

/// Where a lock call was made, for the order check and the errors.
pub(crate) type Site = &'static Location<'static>;

/// What a lock call needs of its face: what the transaction holds, the
/// connection and the driver (borrowed from the face, or made for the call:
/// `C` and `R`), the savepoint depth. Each face's `parts` makes it.
pub(crate) struct Parts<'s, D: Driver, C, R> {
    pub(crate) state: &'s TxState,
    pub(crate) conn: C,
    pub(crate) driver: R,
    pub(crate) depth: u32,
    pub(crate) stack: PhantomData<fn() -> D>,
}

/// How a face holds its connection for a call: whether the call has it to
/// itself until it ends (the generic face borrows it `&mut`), so that
/// nothing the application sends can run between two of the call's
/// rounds. tokio-postgres's face lets the application pipeline statements
/// behind a call.
pub(crate) trait Exclusivity {
    /// Whether the call has the connection to itself.
    const EXCLUSIVE: bool;
}

impl<T: ?Sized> Exclusivity for &mut T {
    const EXCLUSIVE: bool = true;
}

#[cfg(feature = "tokio-postgres")]
impl Exclusivity for crate::pg::exec::PgConn<'_> {
    const EXCLUSIVE: bool = false;
}

impl<D: Driver, C: BorrowMut<D::Conn>, R: Borrow<D>> Parts<'_, D, C, R> {
    /// The connection and the driver, for the driver's calls.
    fn split(&mut self) -> (&TxState, &mut D::Conn, &D, u32) {
        (
            self.state,
            self.conn.borrow_mut(),
            self.driver.borrow(),
            self.depth,
        )
    }
}

/// A lock that waits as long as it takes: the engine's one-statement call.
pub(crate) async fn lock_one<
    'a,
    'g,
    D: Driver,
    C: BorrowMut<D::Conn> + Exclusivity,
    R: Borrow<D>,
    K: AdvisoryKey,
>(
    parts: impl FnOnce() -> Result<Parts<'a, D, C, R>, Error>,
    value: K,
    mode: Mode,
    site: Site,
) -> Result<Held<'g, K>, Error> {
    Grant::lock(send_one(parts, &value, mode, false, site).await, value)
}

/// A try: the engine's one-statement call.
pub(crate) async fn try_lock_one<
    'a,
    'g,
    D: Driver,
    C: BorrowMut<D::Conn> + Exclusivity,
    R: Borrow<D>,
    K: AdvisoryKey,
>(
    parts: impl FnOnce() -> Result<Parts<'a, D, C, R>, Error>,
    value: K,
    mode: Mode,
    site: Site,
) -> Result<Result<Held<'g, K>, K>, Error> {
    Grant::try_lock(send_one(parts, &value, mode, true, site).await, value)
}

/// A lock of one key with a timeout: the engine's general call.
pub(crate) async fn lock_waiting<
    'a,
    'g,
    D: Driver,
    C: BorrowMut<D::Conn>,
    R: Borrow<D>,
    K: AdvisoryKey,
>(
    parts: impl FnOnce() -> Result<Parts<'a, D, C, R>, Error>,
    value: K,
    mode: Mode,
    timeout: std::time::Duration,
    site: Site,
) -> Result<Held<'g, K>, Error> {
    let request = Request::one(&value, mode).at(site);
    Grant::lock(drive(parts, request, Wait::Timeout(timeout)).await, value)
}

/// A batch's keys, waiting as `wait` says.
pub(crate) async fn lock_batch<'a, 'g, D: Driver, C: BorrowMut<D::Conn>, R: Borrow<D>>(
    parts: impl FnOnce() -> Result<Parts<'a, D, C, R>, Error>,
    request: Request,
    wait: Wait,
) -> Result<HeldBatch<'g>, Error> {
    Grant::lock_batch(drive(parts, request, wait).await)
}

/// A batch's try: every key at once, or none.
pub(crate) async fn try_lock_batch<'a, 'g, D: Driver, C: BorrowMut<D::Conn>, R: Borrow<D>>(
    parts: impl FnOnce() -> Result<Parts<'a, D, C, R>, Error>,
    request: Request,
) -> Result<Result<HeldBatch<'g>, Busy>, Error> {
    Grant::try_lock_batch(drive(parts, request, Wait::Try).await)
}

/// A permit's try, then, when every slot is busy, the wait for one.
pub(crate) async fn permit<
    'a,
    'g,
    D: Driver,
    C: BorrowMut<D::Conn>,
    R: Borrow<D>,
    K: AdvisoryKey,
>(
    parts: impl FnOnce() -> Result<Parts<'a, D, C, R>, Error>,
    value: K,
    permits: NonZeroU8,
    wait: Wait,
    site: Site,
) -> Result<Held<'g, K>, Error> {
    let mut parts = parts()?;
    let (state, conn, driver, depth) = parts.split();
    let policy: &Policy = driver.as_ref();
    let call = state.acquire_permit(policy, depth, (&value, permits), Some(site))?;
    let tried = driver::run_one::<D>(&mut *conn, driver, call).await;
    match Grant::try_lock(tried, value)? {
        Ok(held) => Ok(held),
        Err(value) => {
            let request = Request::permit_slot(&value, permits).at(site);
            let call = state
                .acquire(policy, depth, request, wait)?
                .sliced(driver::bounds_waits(driver));
            let mode = policy.config().statement_mode();
            let outcome = call
                .run(|call| driver::drive::<D>(conn, driver, mode, call))
                .await;
            Grant::lock(outcome, value)
        }
    }
}

/// A permit's try alone.
pub(crate) async fn try_permit<
    'a,
    'g,
    D: Driver,
    C: BorrowMut<D::Conn>,
    R: Borrow<D>,
    K: AdvisoryKey,
>(
    parts: impl FnOnce() -> Result<Parts<'a, D, C, R>, Error>,
    value: K,
    permits: NonZeroU8,
    site: Site,
) -> Result<Result<Held<'g, K>, K>, Error> {
    let mut parts = parts()?;
    let (state, conn, driver, depth) = parts.split();
    let call = state.acquire_permit(driver.as_ref(), depth, (&value, permits), Some(site))?;
    Grant::try_lock(driver::run_one::<D>(conn, driver, call).await, value)
}

/// A one-key call of one statement (a lock that waits, or a try), run by
/// the driver: the engine's fast path.
///
/// A lock whose wait is bounded on the server ([`driver::bounds_waits`])
/// runs as [`bounded_lock`] says, behind a box.
///
/// Always inlined, as the engine's hot path is: the statement's future is
/// then built in the lock call's own state, not returned from here and
/// copied there.
#[inline(always)]
async fn send_one<
    'a,
    D: Driver,
    C: BorrowMut<D::Conn> + Exclusivity,
    R: Borrow<D>,
    K: AdvisoryKey,
>(
    parts: impl FnOnce() -> Result<Parts<'a, D, C, R>, Error>,
    value: &K,
    mode: Mode,
    try_only: bool,
    site: Site,
) -> Result<Result<Grant, Busy>, Error> {
    let mut parts = parts()?;
    let (state, conn, driver, depth) = parts.split();
    // Behind a box: the common call's future stays as small as it is
    // unbounded.
    if !try_only && driver::bounds_waits(driver) {
        return Box::pin(bounded_lock::<D, K>(
            state,
            conn,
            driver,
            depth,
            (value, mode, site),
            C::EXCLUSIVE,
        ))
        .await;
    }
    let call = state.acquire_one(driver.as_ref(), depth, (value, mode), try_only, Some(site))?;
    driver::run_one::<D>(conn, driver, call).await
}

/// A one-key lock whose wait is bounded on the server
/// ([`driver::bounds_waits`]). Where the call has the connection to itself
/// (`exclusive`), it tries first, in the one statement of the unbounded
/// lock, and waits in slices only for a busy key: a free key costs the one
/// statement it costs unbounded (and the box). Where the application may pipeline statements behind
/// the call (tokio-postgres), a busy try would let them run before the lock
/// is held, so it waits in slices from the start.
async fn bounded_lock<D: Driver, K: AdvisoryKey>(
    state: &TxState,
    conn: &mut D::Conn,
    driver: &D,
    depth: u32,
    (value, mode, site): (&K, Mode, Site),
    exclusive: bool,
) -> Result<Result<Grant, Busy>, Error> {
    let policy: &Policy = driver.as_ref();
    if exclusive {
        let call = state.acquire_one_first(policy, depth, (value, mode), Some(site))?;
        if let Ok(grant) = driver::run_one::<D>(&mut *conn, driver, call).await? {
            return Ok(Ok(grant));
        }
    }
    let request = Request::one(value, mode).at(site);
    let call = state
        .acquire(policy, depth, request, Wait::Forever)?
        .sliced(true);
    let statements = policy.config().statement_mode();
    call.run(|call| driver::drive::<D>(conn, driver, statements, call))
        .await
}

/// The engine's general call for `request`, run by the driver round after
/// round, in the call's span.
async fn drive<'a, D: Driver, C: BorrowMut<D::Conn>, R: Borrow<D>>(
    parts: impl FnOnce() -> Result<Parts<'a, D, C, R>, Error>,
    request: Request,
    wait: Wait,
) -> Result<Result<Grant, Busy>, Error> {
    let mut parts = parts()?;
    let (state, conn, driver, depth) = parts.split();
    let policy: &Policy = driver.as_ref();
    let call = state
        .acquire(policy, depth, request, wait)?
        .sliced(driver::bounds_waits(driver));
    let mode = policy.config().statement_mode();
    call.run(|call| driver::drive::<D>(conn, driver, mode, call))
        .await
}
