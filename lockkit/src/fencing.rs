//! Fencing tokens: a number minted by the server with a lock's grant, larger
//! than every token minted before, for the protected resource to refuse a
//! stale holder's write.
//!
//! A lock's holder can be stale without knowing it: paused past its lease
//! (see [`session`](crate::session#the-lease)), or cut off by a failover,
//! it wakes up still believing it holds its key while another holder has
//! taken it. Both can then write. A token lets the resource tell them
//! apart: it remembers the newest token it has seen and refuses an older
//! one.
//!
//! Tokens are opt-in. Set to mint them, lockkit mints one with every
//! grant, in the grant's own statement (no round trip more), and the guard
//! hands it out:
//!
//! - transaction-scoped locks and permits, on every stack: a locker whose
//!   [`Config`](crate::Config) says
//!   [`fencing_tokens(true)`](crate::Config::fencing_tokens), then
//!   [`Held::fencing_token`](crate::Held::fencing_token) and
//!   [`HeldBatch::fencing_token`](crate::HeldBatch::fencing_token);
//! - session locks and permits: a [`SessionLock`](crate::SessionLock) set to
//!   [`fencing_tokens(true)`](crate::SessionLock::fencing_tokens), then
//!   [`SessionGuard::fencing_token`](crate::SessionGuard::fencing_token).
//!
//! The counter and the fence are part of lockkit's SQL script
//! ([`sql`](crate::sql), installed by `lockkit sql install`):
//! `lockkit.fencing_token()` mints the same
//! number for any other client, and `lockkit.fence(resource, token)` checks
//! one.
//!
//! # The layout
//!
//! A token is a 128-bit unsigned integer,
//! `timeline × 2^112 + flush × 2^48 + counter`:
//!
//! - `timeline`: the server's WAL timeline when it minted the token (1 on a
//!   new cluster; every promotion of a standby starts a larger one),
//!   below 2^16;
//! - `flush`: the server's flushed WAL position (`pg_current_wal_flush_lsn()`
//!   as a 64-bit number), which only grows, over a crash and its recovery
//!   too;
//! - `counter`: `nextval('lockkit.fencing_counter')`, below 2^48.
//!
//! Compared as numbers, tokens order by timeline first, then by flushed
//! WAL, then by counter. docs/FENCING.md says why each part is there, what
//! it assumes, and gives vectors.
//!
//! # Using a token
//!
//! For a resource in the same PostgreSQL, in the protected write's
//! transaction ([`sql::fence`](crate::sql::fence) from Rust):
//!
//! ```sql
//! UPDATE invoices SET paid = true
//!  WHERE id = 42 AND lockkit.fence('invoice:42', $1::numeric);
//! ```
//!
//! The same from Rust, with a session lock's token:
//!
//! ```no_run
//! # async fn run(config: tokio_postgres::Config, client: &mut tokio_postgres::Client)
//! #     -> Result<(), lockkit::Error> {
//! use lockkit::key::HashText;
//! use lockkit::SessionLock;
//!
//! let sessions = SessionLock::new(config).fencing_tokens(true);
//! let guard = sessions.lock(HashText("report-42")).await?;
//! let token = guard.fencing_token().expect("minted with the grant");
//! // Later, maybe after a pause past the lease: the write lands only if
//! // no newer holder has written since.
//! let tx = client.transaction().await?;
//! if lockkit::sql::fence(&tx, "report:42", token).await? {
//!     tx.execute("UPDATE reports SET done = true WHERE id = 42", &[]).await?;
//!     tx.commit().await?;
//! }
//! # Ok(())
//! # }
//!
//! ```
//!
//! For another resource (an object store's conditional write, a service's
//! API), send the token with the write and have the resource keep the
//! newest it has seen per resource and refuse an older one: as a decimal
//! string ([`Display`](std::fmt::Display), compare numerically, or as
//! fixed-width strings with [`FencingToken::to_padded_string`]), or as its
//! parts.

use std::fmt;
use std::str::FromStr;

/// A fencing token minted by the server with a lock's grant (see the
/// [module docs](self)). Ordered as the number it is: a larger token was
/// minted later.
///
/// ```
/// use lockkit::fencing::FencingToken;
///
/// let token = FencingToken::from_parts(1, 0x0300_0060, 7).unwrap();
/// assert_eq!(token.to_string(), "5192296858548994755000703029084167");
/// assert_eq!(token.to_string().parse::<FencingToken>().unwrap(), token);
/// assert!(FencingToken::from_parts(2, 0, 1).unwrap() > token); // a promotion
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u128);

/// Where a token's parts sit in its number.
const TIMELINE_SHIFT: u32 = 112;
const FLUSH_SHIFT: u32 = 48;
/// The bound (exclusive) of the counter, and of a timeline.
const COUNTER_LIMIT: u64 = 1 << 48;
const TIMELINE_LIMIT: u32 = 1 << 16;

impl FencingToken {
    /// The token of these parts, or `None` when the timeline is not below
    /// 2^16 or the counter not below 2^48.
    pub fn from_parts(timeline: u32, flush: u64, counter: u64) -> Option<Self> {
        if timeline >= TIMELINE_LIMIT || counter >= COUNTER_LIMIT {
            return None;
        }
        Some(FencingToken(
            (u128::from(timeline) << TIMELINE_SHIFT)
                | (u128::from(flush) << FLUSH_SHIFT)
                | u128::from(counter),
        ))
    }

    /// The token of the three parts a server answers as text (lockkit's
    /// lock statements read them, docs/FENCING.md): the current WAL file's
    /// name (`pg_walfile_name`, its first 8 hex digits the timeline), the
    /// flushed WAL position as `pg_lsn` prints it (`X/Y`, hexadecimal
    /// halves), and the counter in decimal.
    #[cfg(feature = "tokio-postgres")]
    pub(crate) fn from_server(walfile: &str, flush: &str, counter: &str) -> Result<Self, String> {
        let bad = || format!("not a fencing token's parts: {walfile:?}, {flush:?}, {counter:?}");
        let timeline = walfile
            .get(..8)
            .filter(|_| walfile.len() == 24)
            .and_then(|t| u32::from_str_radix(t, 16).ok())
            .ok_or_else(bad)?;
        let (high, low) = flush.split_once('/').ok_or_else(bad)?;
        let half = |h: &str| u32::from_str_radix(h, 16).ok().filter(|_| !h.is_empty());
        let flush =
            (u64::from(half(high).ok_or_else(bad)?) << 32) | u64::from(half(low).ok_or_else(bad)?);
        let counter = counter.parse().map_err(|_| bad())?;
        FencingToken::from_parts(timeline, flush, counter).ok_or_else(bad)
    }

    /// The token of the three `int8` columns a minting lock statement
    /// answers after its own (`timeline`, `flush`, `counter`), or `None`
    /// when a part is out of its range.
    pub(crate) fn from_columns([timeline, flush, counter]: [i64; 3]) -> Option<Self> {
        let timeline = u32::try_from(timeline).ok()?;
        let flush = u64::try_from(flush).ok()?;
        let counter = u64::try_from(counter).ok()?;
        FencingToken::from_parts(timeline, flush, counter)
    }

    /// The token as the number it is.
    pub fn get(self) -> u128 {
        self.0
    }

    /// The WAL timeline of the server that minted it.
    pub fn timeline(self) -> u32 {
        (self.0 >> TIMELINE_SHIFT) as u32
    }

    /// The server's flushed WAL position when it minted it.
    pub fn flush(self) -> u64 {
        (self.0 >> FLUSH_SHIFT) as u64
    }

    /// The value of `lockkit.fencing_counter` it took.
    pub fn counter(self) -> u64 {
        (self.0 as u64) & (COUNTER_LIMIT - 1)
    }

    /// The decimal number zero-padded to 39 digits (the width of
    /// `u128::MAX`), for a resource that compares tokens as strings: two
    /// padded tokens compare as strings as they do as numbers.
    pub fn to_padded_string(self) -> String {
        format!("{:039}", self.0)
    }
}

impl fmt::Display for FencingToken {
    /// The decimal number, as `lockkit.fencing_token()` returns it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// A text that is not a fencing token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseTokenError(String);

impl fmt::Display for ParseTokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not a lockkit fencing token: {:?}", self.0)
    }
}

impl std::error::Error for ParseTokenError {}

impl FromStr for FencingToken {
    type Err = ParseTokenError;

    /// A decimal number below 2^128, with or without leading zeros
    /// ([`to_padded_string`](Self::to_padded_string)).
    fn from_str(text: &str) -> Result<Self, ParseTokenError> {
        let bad = || ParseTokenError(text.chars().take(64).collect());
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        text.parse().map(FencingToken).map_err(|_| bad())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectors of docs/FENCING.md.
    #[test]
    fn vectors() {
        for (parts, decimal) in [
            ((1, 0x0300_0060, 7), "5192296858548994755000703029084167"),
            ((2, 0x016B_3A28, 1), "10384593717076355615759202493923329"),
            ((1, 0, 1), "5192296858534827628530496329220097"),
            (
                (65_535, u64::MAX, (1 << 48) - 1),
                "340282366920938463463374607431768211455",
            ),
        ] {
            let (timeline, flush, counter) = parts;
            let token = FencingToken::from_parts(timeline, flush, counter).unwrap();
            assert_eq!(token.to_string(), decimal);
            assert_eq!(token.get().to_string(), decimal);
            assert_eq!(decimal.parse::<FencingToken>().unwrap(), token);
            assert_eq!(
                (token.timeline(), token.flush(), token.counter()),
                (timeline, flush, counter)
            );
            assert_eq!(token.to_padded_string().len(), 39);
            assert_eq!(
                token.to_padded_string().parse::<FencingToken>().unwrap(),
                token
            );
        }
    }

    /// What a server answers for the parts reads as the same token as the
    /// number `lockkit.fencing_token()` computes from them.
    #[cfg(feature = "tokio-postgres")]
    #[test]
    fn server_parts() {
        let token =
            FencingToken::from_server("000000010000000000000003", "0/3000060", "7").unwrap();
        assert_eq!(token.to_string(), "5192296858548994755000703029084167");
        let token =
            FencingToken::from_server("0000000200000001000000A7", "1/A7F00D08", "42").unwrap();
        assert_eq!(
            (token.timeline(), token.flush(), token.counter()),
            (2, 0x1_A7F0_0D08, 42)
        );
        for (walfile, flush, counter) in [
            ("00000001", "0/0", "1"),
            ("0000000G0000000000000003", "0/0", "1"),
            ("000000010000000000000003", "0", "1"),
            ("000000010000000000000003", "/1", "1"),
            ("000000010000000000000003", "1FFFFFFFF/0", "1"),
            ("000000010000000000000003", "0/0", "-1"),
            ("000000010000000000000003", "0/0", "281474976710656"),
            ("000100000000000000000003", "0/0", "1"),
        ] {
            assert!(
                FencingToken::from_server(walfile, flush, counter).is_err(),
                "{walfile} {flush} {counter}"
            );
        }
    }

    #[test]
    fn columns() {
        let token = FencingToken::from_columns([1, 0x0300_0060, 7]).unwrap();
        assert_eq!(token.to_string(), "5192296858548994755000703029084167");
        let token = FencingToken::from_columns([2, 0x1_A7F0_0D08, 42]).unwrap();
        assert_eq!(
            (token.timeline(), token.flush(), token.counter()),
            (2, 0x1_A7F0_0D08, 42)
        );
        for columns in [
            [-1, 0, 1],
            [1, -1, 1],
            [1, 0, -1],
            [1 << 16, 0, 1],
            [1, 0, 1 << 48],
        ] {
            assert_eq!(FencingToken::from_columns(columns), None, "{columns:?}");
        }
    }

    #[test]
    fn parts_out_of_range_are_refused() {
        assert_eq!(FencingToken::from_parts(1 << 16, 0, 1), None);
        assert_eq!(FencingToken::from_parts(1, 0, 1 << 48), None);
        assert!(FencingToken::from_parts(0, 0, 0).is_some());
        for text in [
            "",
            "-1",
            "+1",
            "1.0",
            " 1",
            "x",
            "340282366920938463463374607431768211456",
            // What the fence refuses, by class (docs/FENCING.md).
            "NaN",
            "Infinity",
            "-5",
            "5.5",
            "1e60",
        ] {
            assert!(text.parse::<FencingToken>().is_err(), "{text:?}");
        }
    }

    /// Timeline first, then flushed WAL, then counter.
    #[test]
    fn tokens_order_by_timeline_then_flush_then_counter() {
        let t =
            |timeline, flush, counter| FencingToken::from_parts(timeline, flush, counter).unwrap();
        assert!(t(2, 0, 1) > t(1, u64::MAX, (1 << 48) - 1));
        assert!(t(1, 2, 1) > t(1, 1, (1 << 48) - 1));
        assert!(t(1, 1, 2) > t(1, 1, 1));
        assert!(t(1, 1, 2).to_padded_string() > t(1, 1, 1).to_padded_string());
        assert!(t(2, 0, 1).to_padded_string() > t(1, u64::MAX, 5).to_padded_string());
    }
}
