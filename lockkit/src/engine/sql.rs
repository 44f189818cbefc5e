//! Every SQL text lockkit sends, in one place, shared by the driver adapters.
//!
//! The batch statements take their keys as arrays already in the global lock
//! order ([`Plan`](crate::driver::Plan)) and lock them row by row as
//! `unnest` yields them: a function scan returns its rows in array order, and
//! nothing here sorts, so the order cannot be lost to a query plan (the
//! `ORDER BY` in a hand-rolled lock query may be applied *after* the lock
//! function ran). `BigInt` keys come before `Pair` keys; an adapter sends the
//! bigint statement first and the pair statement second, pipelined.

use crate::engine::plan::Mode;
use crate::key::LockKey;

/// `$1 int8`: one exclusive `BigInt` lock.
pub const LOCK_BIGINT: &str = "SELECT pg_advisory_xact_lock($1)";
/// `$1 int8`: one shared `BigInt` lock.
pub const LOCK_BIGINT_SHARED: &str = "SELECT pg_advisory_xact_lock_shared($1)";
/// `$1 int4, $2 int4`: one exclusive `Pair` lock.
pub const LOCK_PAIR: &str = "SELECT pg_advisory_xact_lock($1, $2)";
/// `$1 int4, $2 int4`: one shared `Pair` lock.
pub const LOCK_PAIR_SHARED: &str = "SELECT pg_advisory_xact_lock_shared($1, $2)";

/// `$1 int8`: try one exclusive `BigInt` lock; returns one `bool`.
pub const TRY_BIGINT: &str = "SELECT pg_try_advisory_xact_lock($1)";
/// `$1 int8`: try one shared `BigInt` lock; returns one `bool`.
pub const TRY_BIGINT_SHARED: &str = "SELECT pg_try_advisory_xact_lock_shared($1)";
/// `$1 int4, $2 int4`: try one exclusive `Pair` lock; returns one `bool`.
pub const TRY_PAIR: &str = "SELECT pg_try_advisory_xact_lock($1, $2)";
/// `$1 int4, $2 int4`: try one shared `Pair` lock; returns one `bool`.
pub const TRY_PAIR_SHARED: &str = "SELECT pg_try_advisory_xact_lock_shared($1, $2)";

/// `$1 int8[], $2 bool[]` (shared?): lock every key in array order; returns
/// one `int8`, the number of keys locked.
pub const BATCH_BIGINT: &str = "SELECT count(CASE WHEN s THEN pg_advisory_xact_lock_shared(k) \
     ELSE pg_advisory_xact_lock(k) END) FROM unnest($1::int8[], $2::bool[]) AS t(k, s)";

/// `$1 int4[], $2 int4[], $3 bool[]`: lock every `(class, object)` in array
/// order; returns one `int8`, the number of keys locked.
pub const BATCH_PAIR: &str = "SELECT count(CASE WHEN s THEN pg_advisory_xact_lock_shared(c, o) \
     ELSE pg_advisory_xact_lock(c, o) END) FROM unnest($1::int4[], $2::int4[], $3::bool[]) AS t(c, o, s)";

/// `$1 int8[]`: [`BATCH_BIGINT`] when every key is exclusive, the common
/// case: no mode array to send and no `CASE` per key.
pub const BATCH_BIGINT_EXCLUSIVE: &str =
    "SELECT count(pg_advisory_xact_lock(k)) FROM unnest($1::int8[]) AS t(k)";

/// `$1 int4[], $2 int4[]`: [`BATCH_PAIR`] when every key is exclusive.
pub const BATCH_PAIR_EXCLUSIVE: &str =
    "SELECT count(pg_advisory_xact_lock(c, o)) FROM unnest($1::int4[], $2::int4[]) AS t(c, o)";

/// `$1 int8[], $2 bool[]`: try every key in array order; returns one `int8[]`,
/// the keys that were busy. Run inside a savepoint that is rolled back when
/// any key was busy.
pub const TRY_BATCH_BIGINT: &str = "SELECT coalesce(array_agg(k) FILTER (WHERE NOT ok), '{}') FROM \
     (SELECT k, CASE WHEN s THEN pg_try_advisory_xact_lock_shared(k) ELSE pg_try_advisory_xact_lock(k) END AS ok \
      FROM unnest($1::int8[], $2::bool[]) AS t(k, s) OFFSET 0) AS x";

/// `$1 int4[], $2 int4[], $3 bool[]`: try every `(class, object)` in array
/// order; returns `int4[]` classes and `int4[]` objects of the busy keys.
pub const TRY_BATCH_PAIR: &str = "SELECT coalesce(array_agg(c) FILTER (WHERE NOT ok), '{}'), \
     coalesce(array_agg(o) FILTER (WHERE NOT ok), '{}') FROM \
     (SELECT c, o, CASE WHEN s THEN pg_try_advisory_xact_lock_shared(c, o) ELSE pg_try_advisory_xact_lock(c, o) END AS ok \
      FROM unnest($1::int4[], $2::int4[], $3::bool[]) AS t(c, o, s) OFFSET 0) AS x";

/// The savepoint a timeout or try-batch runs in, so that a failure releases
/// what it took and leaves the transaction usable.
pub const SAVEPOINT: &str = "SAVEPOINT lockkit_acquire";
/// Releases [`SAVEPOINT`] after success.
pub const RELEASE: &str = "RELEASE SAVEPOINT lockkit_acquire";
/// Undoes [`SAVEPOINT`] after a failure: releases the locks it took, restores
/// the timeouts, and makes an aborted transaction usable again.
pub const ROLLBACK: &str =
    "ROLLBACK TO SAVEPOINT lockkit_acquire; RELEASE SAVEPOINT lockkit_acquire";

/// Saves the caller's `lock_timeout` and `statement_timeout` (transaction
/// local) so [`RESTORE_TIMEOUTS`] can put them back.
pub const SAVE_TIMEOUTS: &str = "SELECT \
     set_config('lockkit.saved_lock_timeout', current_setting('lock_timeout'), true), \
     set_config('lockkit.saved_statement_timeout', current_setting('statement_timeout'), true)";
/// `$1 text` (e.g. `'250ms'`): sets both timeouts for the lock statements.
/// `lock_timeout` bounds each key's wait, `statement_timeout` the whole
/// statement, so a batch is bounded as a whole, not per key.
pub const SET_TIMEOUTS: &str =
    "SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $1, true)";
/// Restores what [`SAVE_TIMEOUTS`] saved.
pub const RESTORE_TIMEOUTS: &str = "SELECT \
     set_config('lock_timeout', current_setting('lockkit.saved_lock_timeout'), true), \
     set_config('statement_timeout', current_setting('lockkit.saved_statement_timeout'), true)";

/// `$1 text[]` (hashtext probes): the server facts a locker (and each
/// session lock) learns once: `max_locks_per_transaction int4`,
/// `pg_is_in_recovery() bool`, `server_version_num int4`, `hashtext` of each
/// probe `int4[]`, and `pg_backend_pid() int4` (which a session lock keeps).
pub const SERVER_FACTS: &str = "SELECT current_setting('max_locks_per_transaction')::int4, \
     pg_is_in_recovery(), current_setting('server_version_num')::int4, \
     ARRAY(SELECT hashtext(p) FROM unnest($1::text[]) WITH ORDINALITY AS t(p, i) ORDER BY i), \
     pg_backend_pid()";

// ---- Session locks (`SessionLock`) ---------------------------------------

/// PostgreSQL 14+: a backend waiting for a lock notices within a second that
/// its client went away (a cancelled `lock()`), instead of only when it
/// next writes to the socket, which would be after it got the lock.
pub const CHECK_CLIENT: &str = "SET client_connection_check_interval = 1000";

/// `$1 int8`, `$2 int8`, `$3 int2`: whether this session holds the advisory
/// lock `(classid, objid, objsubid)` of `pg_locks`.
pub const HOLDS: &str = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
     AND pid = pg_backend_pid() AND granted AND classid = $1::oid \
     AND objid = $2::oid AND objsubid = $3)";

/// The session lock statement for `key` (`$1 int8`, or `$1, $2 int4`):
/// waiting forms return one `text` (the `void` result cast, for the simple
/// protocol), `try_only` forms one `bool`.
pub fn session_lock(key: LockKey, mode: Mode, try_only: bool) -> &'static str {
    match (key, mode, try_only) {
        (LockKey::BigInt(_), Mode::Exclusive, false) => "SELECT pg_advisory_lock($1)::text",
        (LockKey::BigInt(_), Mode::Shared, false) => "SELECT pg_advisory_lock_shared($1)::text",
        (LockKey::BigInt(_), Mode::Exclusive, true) => "SELECT pg_try_advisory_lock($1)",
        (LockKey::BigInt(_), Mode::Shared, true) => "SELECT pg_try_advisory_lock_shared($1)",
        (LockKey::Pair(..), Mode::Exclusive, false) => "SELECT pg_advisory_lock($1, $2)::text",
        (LockKey::Pair(..), Mode::Shared, false) => "SELECT pg_advisory_lock_shared($1, $2)::text",
        (LockKey::Pair(..), Mode::Exclusive, true) => "SELECT pg_try_advisory_lock($1, $2)",
        (LockKey::Pair(..), Mode::Shared, true) => "SELECT pg_try_advisory_lock_shared($1, $2)",
    }
}

/// The session unlock statement for `key`; returns one `bool`.
pub fn session_unlock(key: LockKey, mode: Mode) -> &'static str {
    match (key, mode) {
        (LockKey::BigInt(_), Mode::Exclusive) => "SELECT pg_advisory_unlock($1)",
        (LockKey::BigInt(_), Mode::Shared) => "SELECT pg_advisory_unlock_shared($1)",
        (LockKey::Pair(..), Mode::Exclusive) => "SELECT pg_advisory_unlock($1, $2)",
        (LockKey::Pair(..), Mode::Shared) => "SELECT pg_advisory_unlock_shared($1, $2)",
    }
}

// ---- Inspection (`lockkit::inspect`) --------------------------------------

/// The inspection query: every advisory lock of the current database, held
/// or awaited, with its session (`pg_stat_activity`), how long it has
/// waited (`pg_locks.waitstart`, PostgreSQL 14+, read through `to_jsonb` so
/// older servers answer `NULL`) and the pids blocking it.
///
/// Columns: `classid int8`, `objid int8`, `objsubid int2`, `mode text`,
/// `granted bool`, `pid int4` (`NULL` for a prepared transaction),
/// `application_name text`, `usename text`, `state text`, `query text`,
/// `waited float8` (seconds), `blocked_by int4[]`, `xact_age float8`
/// (seconds since the holder's transaction began, `NULL` outside one),
/// `read_at text` (this statement's start, a lower bound of the moment
/// `pg_locks` was read, for [`SESSION_HOLDERS`]).
pub const ADVISORY_LOCKS: &str = "SELECT l.classid::int8, l.objid::int8, l.objsubid::int2, \
     l.mode, l.granted, l.pid, a.application_name, a.usename::text, a.state, a.query, \
     extract(epoch FROM clock_timestamp() - (to_jsonb(l) ->> 'waitstart')::timestamptz)::float8, \
     CASE WHEN l.granted OR l.pid IS NULL THEN '{}'::int4[] ELSE pg_blocking_pids(l.pid) END, \
     extract(epoch FROM clock_timestamp() - a.xact_start)::float8, \
     statement_timestamp()::text \
     FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
     WHERE l.locktype = 'advisory' \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
     ORDER BY l.granted DESC, l.classid, l.objid, l.objsubid, l.pid";

/// `$1 text` (a timestamp, [`ADVISORY_LOCKS`]'s `read_at`): the backends
/// that have been idle outside any transaction since before `$1`, so hold
/// only session-level locks, and held them at `$1`. Sent after
/// [`ADVISORY_LOCKS`] and [`CLEAR_ACTIVITY_SNAPSHOT`], so its
/// `pg_stat_activity` snapshot is taken after `pg_locks` was read (a
/// backend that began a transaction in between is not idle, or its
/// `state_change` is later than `$1`). `backend_start` excludes a new
/// backend that reused a pid.
///
/// Columns: `pid int4`.
pub const SESSION_HOLDERS: &str = "SELECT pid FROM pg_stat_activity \
     WHERE state = 'idle' AND xact_start IS NULL \
     AND state_change <= $1::timestamptz AND backend_start <= $1::timestamptz";

/// Discards this session's `pg_stat_activity` snapshot, which PostgreSQL
/// otherwise keeps until the end of the transaction, so the next statement
/// sees a fresh one even inside an explicit transaction.
pub const CLEAR_ACTIVITY_SNAPSHOT: &str = "SELECT pg_stat_clear_snapshot()";

/// Relation locks of the current database on every relation that someone
/// waits for, held or awaited: a DDL lock queue (an `ALTER TABLE` waiting
/// behind a long reader, new readers queued behind it).
///
/// Columns: `relation text` (`regclass` name), `mode text`, `granted bool`,
/// `pid int4`, `application_name text`, `usename text`, `state text`,
/// `query text`, `waited float8`, `blocked_by int4[]`, `xact_age float8`.
pub const RELATION_LOCK_QUEUES: &str = "SELECT l.relation::regclass::text, l.mode, l.granted, \
     l.pid, a.application_name, a.usename::text, a.state, a.query, \
     extract(epoch FROM clock_timestamp() - (to_jsonb(l) ->> 'waitstart')::timestamptz)::float8, \
     CASE WHEN l.granted OR l.pid IS NULL THEN '{}'::int4[] ELSE pg_blocking_pids(l.pid) END, \
     extract(epoch FROM clock_timestamp() - a.xact_start)::float8 \
     FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
     WHERE l.locktype = 'relation' \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
     AND l.relation IN (SELECT w.relation FROM pg_locks w \
         WHERE w.locktype = 'relation' AND NOT w.granted AND w.database = l.database) \
     ORDER BY l.relation, l.granted DESC, l.pid";

/// Formats a timeout for [`SET_TIMEOUTS`]: whole milliseconds, at least 1
/// (0 would mean "no timeout" to the server).
pub fn timeout_setting(timeout: std::time::Duration) -> String {
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128);
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timeout_is_never_zero() {
        assert_eq!(timeout_setting(Duration::ZERO), "1ms");
        assert_eq!(timeout_setting(Duration::from_micros(1500)), "1ms");
        assert_eq!(timeout_setting(Duration::from_secs(2)), "2000ms");
        assert_eq!(timeout_setting(Duration::MAX), format!("{}ms", i32::MAX));
    }
}
