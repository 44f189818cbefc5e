//! The lock calls of a `LockTx`, written once for both of its faces:
//! [`tx::LockTx`](crate::tx::LockTx) (sqlx, diesel-async, Diesel, over a
//! [`Driver`](crate::driver::Driver)) and tokio-postgres's
//! [`pg::LockTx`](crate::pg::LockTx).
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
//! [`lock_tx_calls!`] writes every public lock call, its docs (the
//! `lock_tx/*.md` files, by their path in the crate: a macro's
//! `include_str!` reads relative to the file that invokes it), the
//! bookkeeping reads, and the steps the calls share (the permit's
//! try-then-wait, the general call for one key or a batch, the guards).
//! The calls reach the connection through the face's
//! [`Driver`](crate::driver::Driver) (tokio-postgres's is `pg::exec::Pg`),
//! by the same `driver::run_one` and `driver::drive` on every stack. Each
//! face writes only what the macro calls: `parts`, what a lock call needs
//! of it (what the transaction holds, the connection, the driver, the
//! savepoint depth; the generic face first checks that a transaction is
//! open); `tx_state`, what the transaction holds; and `out`, what a call
//! returns made from its future.

/// Writes the lock calls of a `LockTx` face (see the module docs).
///
/// - `recv`: the calls' receiver, `&` (`&self`) or `&mut` (`&mut self`);
/// - `locker`: the locker's type;
/// - `driver`: the [`Driver`](crate::driver::Driver) that runs the calls;
/// - `guard`: the guards' lifetime (`'_`: the receiver's);
/// - `ret`: a macro that writes a call's return type from `[K]` (the key
///   type, or nothing) and the call's output;
/// - `batch_docs`: what the face adds to `lock_batch`'s docs.
macro_rules! lock_tx_calls {
    (
        recv: [$($recv:tt)*],
        locker: $locker:ty,
        driver: $d:ty,
        guard: $g:lifetime,
        ret: $ret:ident,
        batch_docs: [$(#[$batch_doc:meta])*] $(,)?
    ) => {
        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/locker.md"))]
        pub fn locker(&self) -> &$locker {
            &self.locker
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/depth.md"))]
        pub fn depth(&self) -> u32 {
            self.depth
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/held_count.md"))]
        pub fn held_count(&self) -> usize {
            self.tx_state().held_count()
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/holds.md"))]
        pub fn holds<K: $crate::AdvisoryKey + ?Sized>(&self, key: &K, mode: $crate::Mode) -> bool {
            self.tx_state().holds(key.lock_key(), mode)
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/is_poisoned.md"))]
        pub fn is_poisoned(&self) -> bool {
            self.tx_state().is_poisoned()
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/lock.md"))]
        #[track_caller]
        pub fn lock<K: $crate::AdvisoryKey>(
            $($recv)* self,
            key: K,
        ) -> $ret!([K] Result<$crate::Held<$g, K>, $crate::Error>) {
            let site = ::std::panic::Location::caller();
            Self::out(self.lock_one(key, $crate::Mode::Exclusive, site))
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/lock_shared.md"))]
        #[track_caller]
        pub fn lock_shared<K: $crate::AdvisoryKey>(
            $($recv)* self,
            key: K,
        ) -> $ret!([K] Result<$crate::Held<$g, K>, $crate::Error>) {
            let site = ::std::panic::Location::caller();
            Self::out(self.lock_one(key, $crate::Mode::Shared, site))
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/lock_timeout.md"))]
        #[track_caller]
        pub fn lock_timeout<K: $crate::AdvisoryKey>(
            $($recv)* self,
            key: K,
            timeout: ::std::time::Duration,
        ) -> $ret!([K] Result<$crate::Held<$g, K>, $crate::Error>) {
            let site = ::std::panic::Location::caller();
            let wait = $crate::engine::Wait::Timeout(timeout);
            Self::out(self.lock_waiting(key, $crate::Mode::Exclusive, wait, site))
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/lock_shared_timeout.md"))]
        #[track_caller]
        pub fn lock_shared_timeout<K: $crate::AdvisoryKey>(
            $($recv)* self,
            key: K,
            timeout: ::std::time::Duration,
        ) -> $ret!([K] Result<$crate::Held<$g, K>, $crate::Error>) {
            let site = ::std::panic::Location::caller();
            let wait = $crate::engine::Wait::Timeout(timeout);
            Self::out(self.lock_waiting(key, $crate::Mode::Shared, wait, site))
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/try_lock.md"))]
        #[track_caller]
        pub fn try_lock<K: $crate::AdvisoryKey>(
            $($recv)* self,
            key: K,
        ) -> $ret!([K] Result<Result<$crate::Held<$g, K>, K>, $crate::Error>) {
            let site = ::std::panic::Location::caller();
            Self::out(self.try_lock_one(key, $crate::Mode::Exclusive, site))
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/try_lock_shared.md"))]
        #[track_caller]
        pub fn try_lock_shared<K: $crate::AdvisoryKey>(
            $($recv)* self,
            key: K,
        ) -> $ret!([K] Result<Result<$crate::Held<$g, K>, K>, $crate::Error>) {
            let site = ::std::panic::Location::caller();
            Self::out(self.try_lock_one(key, $crate::Mode::Shared, site))
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/lock_batch.md"))]
        $(#[$batch_doc])*
        #[track_caller]
        pub fn lock_batch(
            $($recv)* self,
            batch: &$crate::Batch,
        ) -> $ret!([] Result<$crate::HeldBatch<$g>, $crate::Error>) {
            let request = $crate::engine::Request::batch(batch).at(::std::panic::Location::caller());
            Self::out(self.lock_request(request, $crate::engine::Wait::Forever))
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/lock_batch_timeout.md"))]
        #[track_caller]
        pub fn lock_batch_timeout(
            $($recv)* self,
            batch: &$crate::Batch,
            timeout: ::std::time::Duration,
        ) -> $ret!([] Result<$crate::HeldBatch<$g>, $crate::Error>) {
            let request = $crate::engine::Request::batch(batch).at(::std::panic::Location::caller());
            Self::out(self.lock_request(request, $crate::engine::Wait::Timeout(timeout)))
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/try_lock_batch.md"))]
        #[track_caller]
        pub fn try_lock_batch(
            $($recv)* self,
            batch: &$crate::Batch,
        ) -> $ret!([] Result<Result<$crate::HeldBatch<$g>, $crate::Busy>, $crate::Error>) {
            let request = $crate::engine::Request::batch(batch).at(::std::panic::Location::caller());
            Self::out(async move {
                let outcome = self.drive(request, $crate::engine::Wait::Try).await;
                $crate::engine::Grant::try_lock_batch(outcome)
            })
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/acquire_permit.md"))]
        #[track_caller]
        pub fn acquire_permit<K: $crate::AdvisoryKey>(
            $($recv)* self,
            key: K,
            permits: ::std::num::NonZeroU8,
        ) -> $ret!([K] Result<$crate::Held<$g, K>, $crate::Error>) {
            let site = ::std::panic::Location::caller();
            Self::out(self.permit(key, permits, $crate::engine::Wait::Forever, site))
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/acquire_permit_timeout.md"))]
        #[track_caller]
        pub fn acquire_permit_timeout<K: $crate::AdvisoryKey>(
            $($recv)* self,
            key: K,
            permits: ::std::num::NonZeroU8,
            timeout: ::std::time::Duration,
        ) -> $ret!([K] Result<$crate::Held<$g, K>, $crate::Error>) {
            let site = ::std::panic::Location::caller();
            let wait = $crate::engine::Wait::Timeout(timeout);
            Self::out(self.permit(key, permits, wait, site))
        }

        #[doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lock_tx/try_acquire_permit.md"))]
        #[track_caller]
        pub fn try_acquire_permit<K: $crate::AdvisoryKey>(
            $($recv)* self,
            key: K,
            permits: ::std::num::NonZeroU8,
        ) -> $ret!([K] Result<Result<$crate::Held<$g, K>, K>, $crate::Error>) {
            let site = ::std::panic::Location::caller();
            Self::out(async move {
                $crate::engine::Grant::try_lock(self.try_permit(&key, permits, site).await, key)
            })
        }

        /// A lock that waits as long as it takes: the engine's
        /// one-statement call.
        async fn lock_one<K: $crate::AdvisoryKey>(
            $($recv)* self,
            value: K,
            mode: $crate::Mode,
            site: &'static ::std::panic::Location<'static>,
        ) -> Result<$crate::Held<$g, K>, $crate::Error> {
            $crate::engine::Grant::lock(self.send_one(&value, mode, false, site).await, value)
        }

        /// A try: the engine's one-statement call.
        async fn try_lock_one<K: $crate::AdvisoryKey>(
            $($recv)* self,
            value: K,
            mode: $crate::Mode,
            site: &'static ::std::panic::Location<'static>,
        ) -> Result<Result<$crate::Held<$g, K>, K>, $crate::Error> {
            $crate::engine::Grant::try_lock(self.send_one(&value, mode, true, site).await, value)
        }

        /// A lock of one key with a timeout: the engine's general call.
        async fn lock_waiting<K: $crate::AdvisoryKey>(
            $($recv)* self,
            value: K,
            mode: $crate::Mode,
            wait: $crate::engine::Wait,
            site: &'static ::std::panic::Location<'static>,
        ) -> Result<$crate::Held<$g, K>, $crate::Error> {
            let request = $crate::engine::Request::one(&value, mode).at(site);
            $crate::engine::Grant::lock(self.drive(request, wait).await, value)
        }

        /// A batch's keys, waiting as `wait` says.
        async fn lock_request(
            $($recv)* self,
            request: $crate::engine::Request,
            wait: $crate::engine::Wait,
        ) -> Result<$crate::HeldBatch<$g>, $crate::Error> {
            $crate::engine::Grant::lock_batch(self.drive(request, wait).await)
        }

        /// A permit's try, then, when every slot is busy, the wait for one.
        async fn permit<K: $crate::AdvisoryKey>(
            $($recv)* self,
            value: K,
            permits: ::std::num::NonZeroU8,
            wait: $crate::engine::Wait,
            site: &'static ::std::panic::Location<'static>,
        ) -> Result<$crate::Held<$g, K>, $crate::Error> {
            let tried = self.try_permit(&value, permits, site).await;
            match $crate::engine::Grant::try_lock(tried, value)? {
                Ok(held) => Ok(held),
                Err(value) => {
                    let request = $crate::engine::Request::permit_slot(&value, permits).at(site);
                    $crate::engine::Grant::lock(self.drive(request, wait).await, value)
                }
            }
        }

        /// A one-key call of one statement (a lock that waits, or a try),
        /// run by the driver: the engine's fast path.
        ///
        /// Always inlined, as the engine's hot path is: the statement's
        /// future is then built in the lock call's own state, not returned
        /// from here and copied there.
        #[inline(always)]
        async fn send_one<K: $crate::AdvisoryKey>(
            $($recv)* self,
            value: &K,
            mode: $crate::Mode,
            try_only: bool,
            site: &'static ::std::panic::Location<'static>,
        ) -> Result<Result<$crate::engine::Grant, $crate::Busy>, $crate::Error> {
            let (state, mut conn, driver, depth) = self.parts()?;
            let policy = AsRef::<$crate::engine::Policy>::as_ref(&driver);
            let call = state.acquire_one(policy, depth, (value, mode), try_only, Some(site))?;
            $crate::driver::run_one::<$d>(&mut conn, &driver, call).await
        }

        /// A permit's try, run by the driver.
        async fn try_permit<K: $crate::AdvisoryKey>(
            $($recv)* self,
            value: &K,
            permits: ::std::num::NonZeroU8,
            site: &'static ::std::panic::Location<'static>,
        ) -> Result<Result<$crate::engine::Grant, $crate::Busy>, $crate::Error> {
            let (state, mut conn, driver, depth) = self.parts()?;
            let policy = AsRef::<$crate::engine::Policy>::as_ref(&driver);
            let call = state.acquire_permit(policy, depth, (value, permits), Some(site))?;
            $crate::driver::run_one::<$d>(&mut conn, &driver, call).await
        }

        /// The engine's general call for `request`, run by the driver round
        /// after round, in the call's span.
        async fn drive(
            $($recv)* self,
            request: $crate::engine::Request,
            wait: $crate::engine::Wait,
        ) -> Result<Result<$crate::engine::Grant, $crate::Busy>, $crate::Error> {
            let (state, mut conn, driver, depth) = self.parts()?;
            let policy = AsRef::<$crate::engine::Policy>::as_ref(&driver);
            let call = state.acquire(policy, depth, request, wait)?;
            let mode = policy.config().statement_mode();
            let conn: &mut <$d as $crate::driver::Driver>::Conn = &mut conn;
            let driver: &$d = &driver;
            call.run(|call| $crate::driver::drive::<$d>(conn, driver, mode, call))
                .await
        }
    };
}

pub(crate) use lock_tx_calls;
