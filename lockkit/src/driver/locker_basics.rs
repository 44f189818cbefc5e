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
            /// A lock call whose future is dropped while the server waits
            /// for the key sends a cancel request, so that the connection is
            /// usable again within about a round trip. By default the
            /// request goes in plain text, which PostgreSQL accepts before
            /// any TLS negotiation; that works with `sslmode` `disable` and
            /// `prefer`. With `sslmode=require` (or `verify-ca`,
            /// `verify-full`), tokio-postgres negotiates TLS for the request
            /// too, and fails without the connector: the server would go on
            /// waiting for the key, and the transaction's rollback with it.
            pub fn cancel_tls(self, tls: impl $crate::driver::CancelTls) -> $locker {
                $locker {
                    inner: self.inner.tls(tls),
                }
            }

            /// Sends the plain-text cancel request of a dropped lock call to
            /// the hosts of `config`, the `tokio_postgres::Config` the
            /// connections are made with, on a connection that stays open
            /// until the server (or the pooler) closes it, as libpq's does.
            ///
            /// Give it behind pgbouncer older than 1.19 (1.18 is Debian's and
            /// Ubuntu's): such a pgbouncer dies of a cancel request whose
            /// client closed it before the pooler forwarded it (pgbouncer's
            /// issue 801), and every client of the pooler loses its
            /// connection. Without `config`, lockkit cannot know where the
            /// connection went (tokio-postgres keeps the address private).
            /// A locker made with `new` on a connection that reaches
            /// PostgreSQL itself (its cancel key is its backend's own, which
            /// a pooler's never is) sends the request as tokio-postgres
            /// does, closed at once, which PostgreSQL handles; made through
            /// a pooler (or with `with_facts`), it sends none, and a cut-off
            /// call's statement waits for the key, the connection's next
            /// statements behind it. Through [`cancel_tls`](Self::cancel_tls),
            /// requests that must go over TLS (`sslmode=require`) already
            /// stay open until the server closes them; with `config`, one
            /// that may go in plain text goes to its hosts, kept open.
            ///
            /// With several hosts, the request goes to each: only the server
            /// whose session it names acts on it.
            pub fn cancel_to(self, config: &::tokio_postgres::Config) -> $locker {
                $locker {
                    inner: self.inner.cancel_to(config),
                }
            }
        }
    };
}
