//! What every adapter's `Locker` has alike, written once:
//! [`locker_basics!`](crate::locker_basics).

/// Writes, for an adapter's `Locker` struct (a field `inner` that is made
/// from a [`Policy`](crate::driver::Policy) with `From` and reads as one
/// with `AsRef`: an `Arc<Policy>`, or a
/// [`CancellingPolicy`](crate::driver::CancellingPolicy)), the parts every
/// stack's locker has alike: `AsRef<Policy>` (what [`Driver`] asks of it),
/// `with_facts` and `policy`; with `cancel_tls` after the name, also
/// `cancel_tls` (the stacks that send cancel requests through
/// tokio-postgres). The adapter writes the rest: `new`, which learns the
/// facts its own way, and its ways in.
///
/// ```ignore
/// #[derive(Clone, Debug)]
/// pub struct Locker {
///     inner: std::sync::Arc<lockkit::driver::Policy>,
/// }
///
/// lockkit::locker_basics!(Locker);
/// ```
///
/// [`Driver`]: crate::driver::Driver
#[doc(hidden)]
#[macro_export]
macro_rules! locker_basics {
    ($locker:ident) => {
        /// The configuration and facts, as the engine sees them.
        impl ::core::convert::AsRef<$crate::driver::Policy> for $locker {
            fn as_ref(&self) -> &$crate::driver::Policy {
                ::core::convert::AsRef::as_ref(&self.inner)
            }
        }

        impl $locker {
            /// A locker with facts known in advance (no query): for tests,
            /// and for a fleet that knows its server's settings. On the
            /// stacks that recognise deadlocks, timeouts and a full lock
            /// table by the server's message (Diesel, diesel-async), it
            /// assumes the messages are English. It has not seen a
            /// connection, so (on the stacks that send cancel requests) a
            /// cut-off lock call sends one only through `cancel_tls` or
            /// `cancel_to`.
            pub fn with_facts(config: $crate::Config, facts: $crate::ServerFacts) -> $locker {
                $locker {
                    inner: $crate::driver::Policy::new(config, facts).into(),
                }
            }

            /// The configuration, the server's facts and the lock budget.
            pub fn policy(&self) -> &$crate::driver::Policy {
                ::core::convert::AsRef::as_ref(&self.inner)
            }
        }
    };
    ($locker:ident, cancel_tls) => {
        $crate::locker_basics!($locker);

        impl $locker {
            /// Sends the cancel request of a dropped lock call through
            /// `tls`, the TLS connector the connections were made with
            /// (postgres-openssl's `MakeTlsConnector`, postgres-native-tls's,
            /// tokio-postgres-rustls's; on diesel-async, the one its
            /// connections are set up with, e.g. in
            /// `ManagerConfig::custom_setup`).
            ///
            /// An optimization, never needed for safety. A lock call cut off
            /// in flight on a connection that `new` proved to reach
            /// PostgreSQL itself (its cancel key is its backend's own, which
            /// a pooler's never is) sends a cancel request, so that the
            /// server stops waiting at once; everywhere else no request goes
            /// and the wait is bounded on the server instead
            /// (`Policy::bounds_waits`).
            /// With `sslmode=require` (or `verify-ca`, `verify-full`) the
            /// request must go over TLS, which needs the connector: without
            /// it, such a locker bounds its waits as through a pooler.
            pub fn cancel_tls(self, tls: impl $crate::driver::CancelTls) -> $locker {
                $locker {
                    inner: self.inner.tls(tls),
                }
            }
        }
    };
}
