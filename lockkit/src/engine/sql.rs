//! Every SQL text lockkit sends, in one place, shared by the driver adapters.
//!
//! Each statement names each of its parameters once, in order (`$1`, `$2`,
//! …): a driver that numbers its binds itself, as Diesel does, can then send
//! it as it is.
//!
//! The batch statements take their keys as arrays already in the global lock
//! order (the engine's plan) and lock them row by row as `unnest` yields
//! them. `unnest` is called in a target list, so the server expands the
//! arrays in a `ProjectSet` node, one row per element in array order, each
//! row locked before the next is made; several arrays are expanded in
//! lockstep. Nothing here sorts, so the order cannot be lost to a query plan
//! (the `ORDER BY` in a hand-rolled lock query may be applied *after* the
//! lock function ran). `unnest` in `FROM`, a function scan, yields the same
//! order but first materializes every row: a whole 64-key transaction with
//! the statement sent by hand costs 0.97× the function-scan form (the
//! paired report's "64 keys by hand, unnest in the target list vs in FROM"
//! row, `cargo bench -p lockkit-tests --bench locks`). `BigInt` keys come
//! before `Pair` keys; an adapter sends the bigint statement first and the
//! pair statement second, pipelined.
//!
//! Every statement that answers a row starts it with a tag, an `int8`
//! constant of its own ([`Sql::tag`](crate::driver::Sql::tag): the ASCII
//! bytes of `lockkit` and the statement's number), and all but the one-key
//! locks follow it with a count; the engine checks both. A reply that does
//! not come from lockkit's own statement (a foreign prepared statement of
//! the same name behind a pooler) is an error, never a success. The tags
//! are produced by the rows of the lock functions, so a tag proves the
//! function ran. An `int8` rather than the statement's name as `text`: the
//! name in a leading comment still shows in `pg_stat_activity`, and a
//! number is cheaper to send and compare (see [`LOCK_BIGINT`]).

// The session locks' and inspection's texts are sent by the tokio-postgres
// adapter alone (`pg`, which publishes the inspection's as
// `lockkit::inspect`); a build without it leaves them unused.
#![cfg_attr(
    not(feature = "tokio-postgres"),
    allow(dead_code, unused_imports, unreachable_pub)
)]
use std::fmt::{self, Write as _};
use std::time::Duration;

use crate::engine::plan::Mode;
#[cfg(feature = "tokio-postgres")]
use crate::fencing::FencingToken;
use crate::key::LockKey;

/// `$1 int8`: one exclusive `BigInt` lock; `(tag, void)`. The lock
/// function is called in the target list, next to the tag, rather than in
/// `FROM` (a function scan, which materializes its row: measurably slower
/// on the one-lock hot path); the row exists only once the function has
/// returned, so the tag alone proves it ran, and no count follows it (the
/// statement locks one key or fails). The second column (`void`) is not
/// read. A `text` tag followed by a count is slower; the "lockkit's
/// statement vs its text-tagged form" row of
/// `cargo bench -p lockkit-tests --bench locks` compares the two
/// (BENCHMARKS.md).
pub const LOCK_BIGINT: &str =
    "/* lockkit:lock_bigint */ SELECT 7813573191525823489::int8 AS tag, pg_advisory_xact_lock($1) AS locked";
/// `$1 int8`: one shared `BigInt` lock; `(tag, void)`.
pub(crate) const LOCK_BIGINT_SHARED: &str =
    "/* lockkit:lock_bigint_shared */ SELECT 7813573191525823490::int8 AS tag, \
     pg_advisory_xact_lock_shared($1) AS locked";
/// `$1 int4, $2 int4`: one exclusive `Pair` lock; `(tag, void)`.
pub(crate) const LOCK_PAIR: &str =
    "/* lockkit:lock_pair */ SELECT 7813573191525823491::int8 AS tag, \
     pg_advisory_xact_lock($1, $2) AS locked";
/// `$1 int4, $2 int4`: one shared `Pair` lock; `(tag, void)`.
pub(crate) const LOCK_PAIR_SHARED: &str =
    "/* lockkit:lock_pair_shared */ SELECT 7813573191525823492::int8 AS tag, \
     pg_advisory_xact_lock_shared($1, $2) AS locked";

/// `$1 int8`: try one exclusive `BigInt` lock; `(tag, 1 granted | 0 busy)`.
pub(crate) const TRY_BIGINT: &str =
    "/* lockkit:try_bigint */ SELECT 7813573191525823493::int8 AS tag, pg_try_advisory_xact_lock($1)::int::int8 AS n";
/// `$1 int8`: try one shared `BigInt` lock; `(tag, 1 | 0)`.
pub(crate) const TRY_BIGINT_SHARED: &str =
    "/* lockkit:try_bigint_shared */ SELECT 7813573191525823494::int8 AS tag, \
     pg_try_advisory_xact_lock_shared($1)::int::int8 AS n";
/// `$1 int4, $2 int4`: try one exclusive `Pair` lock; `(tag, 1 | 0)`.
pub(crate) const TRY_PAIR: &str =
    "/* lockkit:try_pair */ SELECT 7813573191525823495::int8 AS tag, pg_try_advisory_xact_lock($1, $2)::int::int8 AS n";
/// `$1 int4, $2 int4`: try one shared `Pair` lock; `(tag, 1 | 0)`.
pub(crate) const TRY_PAIR_SHARED: &str =
    "/* lockkit:try_pair_shared */ SELECT 7813573191525823496::int8 AS tag, \
     pg_try_advisory_xact_lock_shared($1, $2)::int::int8 AS n";

/// `$1 int4` (the semaphore's slot-0 object), `$2 int4` (its permits),
/// `$3 int4` (the slot to try first): try the semaphore's slots, from the
/// first, in one statement, and stop at the first granted;
/// `(tag, slot + 1 | 0)`. The slots are `Pair` keys of class
/// [`SEMAPHORE_CLASS`](crate::key::SEMAPHORE_CLASS) (KEYS.md, "Semaphore
/// slots"). `generate_series` is read row by row under the `LIMIT`, so no
/// slot after the granted one is tried.
pub(crate) const TRY_PERMIT: &str =
    "/* lockkit:try_permit */ SELECT 7813573191525823506::int8 AS tag, \
     COALESCE((SELECT (i + p.first) % p.n + 1 \
     FROM (SELECT $1::int4 AS base, $2::int4 AS n, $3::int4 AS first) AS p, \
     generate_series(0, p.n - 1) AS i \
     WHERE pg_try_advisory_xact_lock(-1439830384, p.base | ((i + p.first) % p.n)) \
     LIMIT 1), 0)::int8 AS n";

/// The three parts of a fencing token (docs/FENCING.md), in the two
/// renderings lockkit reads, side by side so that they cannot drift:
/// - as `text`, `token_part!(text timeline)` (the current WAL file's
///   name: its first 8 hex digits are the timeline), `token_part!(text
///   flush)` (the flushed WAL position, `X/Y`) and `token_part!(text
///   counter)`, read by
///   [`FencingToken::from_server`](crate::fencing::FencingToken::from_server):
///   the session forms' statements;
/// - as `int8`, `token_part!(int8 timeline)`, `token_part!(int8 flush)`
///   and `token_part!(int8 counter)`, read by
///   [`FencingToken::from_columns`](crate::fencing::FencingToken::from_columns):
///   the engine's minting form ([`minting`]), whose reply every stack reads
///   as typed columns.
///
/// The `text` one costs the server about half as much as the `int8` one
/// (the timeline's `::bit(32)` cast above all): BENCHMARKS.md.
macro_rules! token_part {
    (text timeline) => {
        "pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn())"
    };
    (text flush) => {
        "pg_catalog.pg_current_wal_flush_lsn()::text"
    };
    (text counter) => {
        "pg_catalog.nextval('lockkit.fencing_counter'::pg_catalog.regclass)::text"
    };
    (int8 timeline) => {
        "('x' || substr(pg_catalog.pg_walfile_name(\
         pg_catalog.pg_current_wal_lsn()), 1, 8))::bit(32)::int8"
    };
    (int8 flush) => {
        "(pg_catalog.pg_current_wal_flush_lsn() - '0/0'::pg_catalog.pg_lsn)::int8"
    };
    (int8 counter) => {
        "pg_catalog.nextval('lockkit.fencing_counter'::pg_catalog.regclass)"
    };
}

/// The three parts of a fencing token ([`token_part!`]) as the columns
/// `timeline`, `flush` and `counter`: `token_columns!(int8)`, appended to a
/// lock statement's row by [`minting`]; `token_columns!(text)`, the whole
/// row of [`FENCING_TOKEN`].
macro_rules! token_columns {
    ($rendering:ident) => {
        concat!(
            token_part!($rendering timeline),
            " AS timeline, ",
            token_part!($rendering flush),
            " AS flush, ",
            token_part!($rendering counter),
            " AS counter"
        )
    };
}

/// The minting form of the lock statement `text`
/// ([`Config::fencing_tokens`](crate::Config::fencing_tokens)): its row,
/// then the token's three parts ([`token_columns!`]), read after the
/// statement ran. `OFFSET 0` keeps the statement a subquery of its own,
/// which runs (and takes its locks) before the outer query reads its row;
/// a statement that fails mints nothing. The same parameters, in the same
/// order.
pub(crate) fn minting(text: &str) -> String {
    format!(
        concat!(
            "/* lockkit:minting */ SELECT s.*, ",
            token_columns!(int8),
            " FROM ({} OFFSET 0) AS s"
        ),
        text
    )
}

/// `$1 int8[], $2 bool[]` (shared?): lock every key in array order;
/// `(tag, keys locked)`.
pub(crate) const BATCH_BIGINT: &str = "/* lockkit:batch_bigint */ SELECT 7813573191525823497::int8 AS tag, \
     count(CASE WHEN s THEN pg_advisory_xact_lock_shared(k) ELSE pg_advisory_xact_lock(k) END) AS n \
     FROM (SELECT unnest($1::int8[]) AS k, unnest($2::bool[]) AS s) AS t";
/// `$1 int4[], $2 int4[], $3 bool[]`: lock every `(class, object)` in array
/// order; `(tag, keys locked)`.
pub(crate) const BATCH_PAIR: &str = "/* lockkit:batch_pair */ SELECT 7813573191525823498::int8 AS tag, \
     count(CASE WHEN s THEN pg_advisory_xact_lock_shared(c, o) ELSE pg_advisory_xact_lock(c, o) END) AS n \
     FROM (SELECT unnest($1::int4[]) AS c, unnest($2::int4[]) AS o, unnest($3::bool[]) AS s) AS t";
/// `$1 int8[]`: the batch of `BigInt` keys when every key is exclusive,
/// the common case: no mode array to send and no `CASE` per key.
pub const BATCH_BIGINT_EXCLUSIVE: &str =
    "/* lockkit:batch_bigint_exclusive */ SELECT 7813573191525823499::int8 AS tag, \
     count(pg_advisory_xact_lock(k)) AS n FROM (SELECT unnest($1::int8[]) AS k) AS t";
/// `$1 int4[], $2 int4[]`: [`BATCH_PAIR`] when every key is exclusive.
pub(crate) const BATCH_PAIR_EXCLUSIVE: &str =
    "/* lockkit:batch_pair_exclusive */ SELECT 7813573191525823500::int8 AS tag, \
     count(pg_advisory_xact_lock(c, o)) AS n \
     FROM (SELECT unnest($1::int4[]) AS c, unnest($2::int4[]) AS o) AS t";

/// `$1 int8[], $2 bool[]`: try every key in array order;
/// `(tag, keys tried, busy int8[])`. Run inside [`SAVEPOINT`], rolled back
/// when any key was busy.
pub(crate) const TRY_BATCH_BIGINT: &str = "/* lockkit:try_batch_bigint */ SELECT 7813573191525823501::int8 AS tag, count(*)::int8 AS n, \
     coalesce(array_agg(k) FILTER (WHERE NOT ok), '{}') AS busy FROM \
     (SELECT k, CASE WHEN s THEN pg_try_advisory_xact_lock_shared(k) ELSE pg_try_advisory_xact_lock(k) END AS ok \
      FROM (SELECT unnest($1::int8[]) AS k, unnest($2::bool[]) AS s) AS t OFFSET 0) AS x";
/// `$1 int4[], $2 int4[], $3 bool[]`: try every `(class, object)` in array
/// order; `(tag, keys tried, busy classes int4[], busy objects int4[])`.
pub(crate) const TRY_BATCH_PAIR: &str = "/* lockkit:try_batch_pair */ SELECT 7813573191525823502::int8 AS tag, count(*)::int8 AS n, \
     coalesce(array_agg(c) FILTER (WHERE NOT ok), '{}') AS busy_class, \
     coalesce(array_agg(o) FILTER (WHERE NOT ok), '{}') AS busy_object FROM \
     (SELECT c, o, CASE WHEN s THEN pg_try_advisory_xact_lock_shared(c, o) ELSE pg_try_advisory_xact_lock(c, o) END AS ok \
      FROM (SELECT unnest($1::int4[]) AS c, unnest($2::int4[]) AS o, unnest($3::bool[]) AS s) AS t \
      OFFSET 0) AS x";

/// The savepoint a timeout or try-batch runs in, so that a failure releases
/// what it took and leaves the transaction usable.
pub(crate) const SAVEPOINT: &str = "SAVEPOINT lockkit_acquire";
/// Releases [`SAVEPOINT`] after success.
pub(crate) const RELEASE: &str = "RELEASE SAVEPOINT lockkit_acquire";
/// Aborts the transaction, on purpose: a bounded wait's failure (a
/// deadlock, the caller's own timeout), once the call's savepoint is rolled
/// back, ends the transaction as the same failure of an unbounded wait
/// does, releasing its locks at once (a deadlock's victim lets the other
/// go) and failing what the application sends next (`25P02`) until it
/// rolls back. Always fails, with a message that says why (`22P02`).
/// Simple query protocol.
pub(crate) const ABORT_TRANSACTION: &str =
    "SELECT CAST('lockkit: a lock call failed, and aborted its transaction' AS int4)";
/// Undoes [`SAVEPOINT`] after a failure: releases the locks it took, restores
/// the timeouts, and makes an aborted transaction usable again. Two
/// statements: send it with the simple query protocol.
pub(crate) const ROLLBACK: &str =
    "ROLLBACK TO SAVEPOINT lockkit_acquire; RELEASE SAVEPOINT lockkit_acquire";

/// Gives up the transaction open on the session: rolls it back, which
/// releases every transaction-scoped lock it holds (an error alone would
/// not, inside a savepoint: it releases only the savepoint's locks), and
/// in the same statement begins a new transaction (`AND CHAIN`,
/// PostgreSQL 12+), which the second statement fails, so that the
/// statements the application still sends fail (`25P02`) instead of
/// running outside any transaction. Simple query protocol (two
/// statements; the second fails, on a server without PL/pgSQL too).
///
/// The session is never outside a transaction block in between: the
/// cancel request of the cut-off call may land during this query, and the
/// server checks for a cancel before each statement of a simple query. A
/// separate `ROLLBACK; BEGIN` would leave the session outside any
/// transaction when the cancel landed between the two, and the
/// application's next write would commit at once
/// (`tests/lockkit/failed_calls.rs`,
/// `no_prefix_of_give_up_leaves_the_session_outside_a_transaction`). A
/// cancel landing anywhere fails the transaction it lands in: the new one, as the second statement
/// does; or, before the rollback, the old one, whose statements then fail
/// as well (inside a savepoint, its locks outside the savepoint go when the
/// stack's pool discards the connection, its transaction manager in
/// error).
///
/// An adapter that does not own its stack's `COMMIT` queues it from a
/// destructor, behind a lock call or a savepoint cut off in flight, and
/// puts its stack's transaction manager in error so that nothing is
/// reported committed: whatever the cut-off statements and their cancel
/// request do on the server (the request is ignored when it lands after
/// the lock was granted and the session is idle), no lock stays held.
pub const GIVE_UP: &str = "ROLLBACK AND CHAIN; DO $lockkit$ BEGIN RAISE EXCEPTION \
     'lockkit: a lock call or a savepoint was cut off in flight; its transaction was rolled back'; \
     END $lockkit$";

/// Rolls back a tokio-postgres [`LockTx`](crate::pg::LockTx) at depth 0
/// whose lock call was cut off: queued by hand when it drops (ahead of
/// tokio-postgres's own `ROLLBACK`), and sent by `rollback` (again when a
/// late cancel request lands on it), so that a cancel request of the
/// cut-off call cannot leave the transaction open.
#[cfg(feature = "tokio-postgres")]
pub(crate) const TX_ROLLBACK: &str = "ROLLBACK";

/// How long one bounded lock wait lasts on the server, in milliseconds, as
/// an SQL expression (a macro, so that every statement that bounds a wait
/// spells it the same way): the server's `deadlock_timeout` and one second
/// more. A wait that nobody can cancel at once (a lock call cut off on a
/// connection whose cancel request could reach a pooler, a client gone) then
/// ends on the server within that bound, and frees its connection; and
/// since the server checks a wait for a deadlock once it has lasted
/// `deadlock_timeout`, every bounded wait is still checked.
macro_rules! wait_slice_ms {
    () => {
        "(1000 + 1000 * extract(epoch FROM current_setting('deadlock_timeout')::interval))::int8"
    };
}
// The session forms bound their waits with the same expression.
#[allow(unused_imports)]
pub(crate) use wait_slice_ms;

/// Arms a bounded wait ([`Policy::bounds_waits`](crate::driver::Policy::bounds_waits)),
/// sent before the call's [`SAVEPOINT`] so that what it sets outlives a
/// rollback to it: when the caller's `lock_timeout` is off (`0`, the
/// default), saves it and sets it to [`wait_slice_ms`], and records that the
/// wait is lockkit's slice (`lockkit.slice`, transaction-local); a caller's
/// own `lock_timeout` is left as it is, and bounds the wait. `(tag, 1)` for
/// a slice, `(tag, 0)` for the caller's bound.
pub(crate) const ARM_SLICE: &str = concat!(
    "/* lockkit:arm_slice */ SELECT 7813573191525823507::int8 AS tag, s.sliced::int4::int8 AS n, \
     set_config('lockkit.slice_saved_lock_timeout', current_setting('lock_timeout'), true) AS a, \
     set_config('lockkit.slice', s.sliced::text, true) AS b, \
     set_config('lock_timeout', CASE WHEN s.sliced THEN ",
    wait_slice_ms!(),
    "::text || 'ms' ELSE current_setting('lock_timeout') END, true) AS c \
     FROM (SELECT current_setting('lock_timeout')::interval = interval '0' AS sliced) AS s"
);

/// Ends what [`ARM_SLICE`] armed, after the call's savepoint was released
/// or rolled back: restores the caller's `lock_timeout`, clears
/// `lockkit.slice`, and answers whether the wait was lockkit's slice:
/// `(tag, 1)` or `(tag, 0)`. A lock timeout (`55P03`) of a wait that was
/// lockkit's slice is the slice's end, and the call waits again.
///
/// When nothing was armed in this transaction (the statement run as
/// [`ARM_SLICE`] was not lockkit's: a foreign prepared statement of that
/// name behind a pooler), it changes nothing and answers a `NULL` tag,
/// which the reply check refuses.
pub(crate) const END_SLICE: &str =
    "/* lockkit:end_slice */ SELECT CASE WHEN s.l IS NOT NULL AND s.sliced IS NOT NULL \
     THEN 7813573191525823508::int8 END AS tag, coalesce(s.sliced, false)::int4::int8 AS n, \
     set_config('lock_timeout', coalesce(s.l, current_setting('lock_timeout')), true) AS a, \
     set_config('lockkit.slice', '', true) AS b FROM \
     (SELECT nullif(current_setting('lockkit.slice_saved_lock_timeout', true), '') AS l, \
      nullif(current_setting('lockkit.slice', true), '')::bool AS sliced) AS s";

/// `$1 int8` (milliseconds, at least 1): saves the caller's `lock_timeout`
/// and `statement_timeout` (transaction-local), records the deadline (as
/// ISO 8601 with a numeric offset, through `to_json`, so that
/// [`ARM_TIMEOUTS`] reads back the same instant whatever the session's
/// `DateStyle` and `TimeZone`), and sets both timeouts to `$1`; `(tag, 0)`.
/// The target list is evaluated left to right, so the saved values are the
/// caller's.
pub(crate) const SET_TIMEOUTS: &str = "/* lockkit:set_timeouts */ SELECT 7813573191525823503::int8 AS tag, 0::int8 AS n, \
     set_config('lockkit.saved_lock_timeout', current_setting('lock_timeout'), true) AS a, \
     set_config('lockkit.saved_statement_timeout', current_setting('statement_timeout'), true) AS b, \
     set_config('lockkit.deadline', to_json(clock_timestamp() + p.ms * interval '1 millisecond') #>> '{}', true) AS c, \
     set_config('lock_timeout', p.ms::text || 'ms', true) AS d, \
     set_config('statement_timeout', p.ms::text || 'ms', true) AS e \
     FROM (SELECT $1::int8 AS ms) AS p";
/// Sets both timeouts to what is left until the deadline of
/// [`SET_TIMEOUTS`] (at least 1 ms), so that the second lock statement of a
/// batch gets only the rest of the time; `(tag, 0)`.
///
/// When the deadline is missing (the statement run as [`SET_TIMEOUTS`] in
/// this transaction was not lockkit's: a foreign prepared statement of that
/// name behind a pooler), it changes nothing and answers a `NULL` tag,
/// which the reply check refuses: the clash is an unexpected reply, never a
/// server error of its own (`42704` for a setting never set on the
/// backend, `22007` for one set in an earlier transaction, now empty).
pub(crate) const ARM_TIMEOUTS: &str =
    "/* lockkit:arm_timeouts */ SELECT CASE WHEN d.r IS NOT NULL THEN 7813573191525823504::int8 END AS tag, 0::int8 AS n, \
     set_config('lock_timeout', coalesce(d.r, current_setting('lock_timeout')), true) AS a, \
     set_config('statement_timeout', coalesce(d.r, current_setting('statement_timeout')), true) AS b FROM \
     (SELECT greatest(1, ceil(extract(epoch FROM nullif(current_setting('lockkit.deadline', true), '')::timestamptz \
      - clock_timestamp()) * 1000))::int8::text || 'ms' AS r) AS d";
/// Restores what [`SET_TIMEOUTS`] saved; `(tag, 0)`.
///
/// As [`ARM_TIMEOUTS`], when nothing was saved in this transaction it
/// changes nothing and answers a `NULL` tag.
pub(crate) const RESTORE_TIMEOUTS: &str = "/* lockkit:restore_timeouts */ SELECT CASE WHEN s.l IS NOT NULL AND s.s IS NOT NULL \
     THEN 7813573191525823505::int8 END AS tag, 0::int8 AS n, \
     set_config('lock_timeout', coalesce(s.l, current_setting('lock_timeout')), true) AS a, \
     set_config('statement_timeout', coalesce(s.s, current_setting('statement_timeout')), true) AS b FROM \
     (SELECT nullif(current_setting('lockkit.saved_lock_timeout', true), '') AS l, \
      nullif(current_setting('lockkit.saved_statement_timeout', true), '') AS s) AS s";

/// `$1 text[]` (hashtext probes): the server facts a locker (and each
/// session lock) learns once: `max_locks_per_transaction int4`,
/// `max_connections + max_prepared_transactions int4` (the lock table's
/// slots), `pg_is_in_recovery() bool`, `server_version_num int4`,
/// `hashtext` of each probe `int4[]`, and `pg_backend_pid() int4` (which a
/// session lock keeps). See [`FactsRow`](crate::driver::FactsRow).
pub const SERVER_FACTS: &str = "SELECT current_setting('max_locks_per_transaction')::int4 AS max_locks, \
     (current_setting('max_connections')::int4 + current_setting('max_prepared_transactions')::int4) AS max_connections, \
     pg_is_in_recovery() AS in_recovery, current_setting('server_version_num')::int4 AS version_num, \
     ARRAY(SELECT hashtext(p) FROM unnest($1::text[]) WITH ORDINALITY AS t(p, i) ORDER BY i) AS hashes, \
     pg_backend_pid() AS backend_pid";

/// The server's `lc_messages`, as one `text` column `lc_messages`: the
/// Diesel adapters ask it on connecting
/// ([`driver::diesel::MESSAGES`](crate::driver::diesel::MESSAGES)), since
/// reading Diesel's errors needs English messages.
#[cfg(feature = "diesel")]
pub(crate) const LC_MESSAGES: &str = "SELECT current_setting('lc_messages') AS lc_messages";

// ---- Session locks (`SessionLock`) ---------------------------------------

/// Opens the transaction a default (transaction-held) session lock lives in.
/// `READ COMMITTED` whatever `default_transaction_isolation` says: between
/// statements such a transaction holds no snapshot, so its backend has no
/// `backend_xmin` and does not hold back VACUUM while the lock is held.
pub(crate) const SESSION_BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// What a default session lock checks and sets in its transaction,
/// `application_name` given as a literal: appends it to `out` for the
/// simple query protocol, sent in one query with [`SESSION_BEGIN`] before it
/// and the lock statement after it
/// ([`Statement::write_simple`](crate::driver::Statement::write_simple)),
/// and answers how many commands it wrote. Its first command answers one
/// row: `pg_is_in_recovery() bool`, `pg_backend_pid() int4`, and, only when
/// `check_interval_known` is false, two more columns, the last one `NULL`
/// exactly when the server has no `client_connection_check_interval`
/// (before PostgreSQL 14).
///
/// It names the lock's transaction in `pg_stat_activity`
/// (`application_name`, transaction-local so a leased pool connection gets
/// its own name back at the rollback) and, on PostgreSQL 14+, makes a
/// waiting backend notice within a second that its client went away
/// (`client_connection_check_interval`, transaction-local). With
/// `check_interval_known` (the caller saw the server has the setting), both
/// are `SET LOCAL` commands after a two-column `SELECT`: three commands,
/// less of the server's work than the other form (BENCHMARKS.md), whose
/// one `SELECT` asks the version in a `CASE` and sets
/// both with `set_config`. On a server without the setting, the `SET LOCAL`
/// form fails (`42704`, nothing is locked). Not `pg_settings`, and not
/// [`SERVER_FACTS`] (run only for `HashText` keys): both cost several times
/// a round trip.
///
/// Its last command is the lock's lease: `SET LOCAL
/// idle_in_transaction_session_timeout` to `lease` (whole milliseconds, as
/// [`timeout_millis`] renders them), whatever the server or the role set.
/// A holder that stops answering (a paused process, a stopped container)
/// sends no keepalive, and the server ends its session once the transaction
/// has been idle for the lease: the lock passes to the next taker. One more
/// command in both forms: four with `check_interval_known`, two without.
///
/// `application_name` (anything `Display`, formatted straight into `out`)
/// is quoted as an escape string literal (`E'…'`, backslashes and quotes
/// doubled), which reads the same whatever `standard_conforming_strings`
/// says; a NUL, which no PostgreSQL string can hold, is dropped.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn write_session_setup(
    out: &mut String,
    application_name: impl fmt::Display,
    check_interval_known: bool,
    lease: Duration,
) -> usize {
    let commands = if check_interval_known {
        out.push_str("SELECT pg_is_in_recovery(), pg_backend_pid(); SET LOCAL application_name = ");
        write_escaped(out, application_name);
        out.push_str("; SET LOCAL client_connection_check_interval = 1000");
        3
    } else {
        out.push_str(
            "SELECT pg_is_in_recovery(), pg_backend_pid(), set_config('application_name', ",
        );
        write_escaped(out, application_name);
        out.push_str(
            ", true), CASE WHEN current_setting('server_version_num')::int4 >= 140000 \
             THEN set_config('client_connection_check_interval', '1000', true) END",
        );
        1
    };
    out.push_str("; ");
    write_lease(out, SettingScope::Transaction, lease);
    commands + 1
}

/// `SET LOCAL idle_in_transaction_session_timeout = …`
/// ([`SettingScope::Transaction`], a held transaction's lease) or `SET
/// idle_session_timeout = …` ([`SettingScope::Session`], a session-level
/// lock's lease, PostgreSQL 14+; on a pooled connection for the lock's time,
/// then [`RESET_SESSION_LEASE`]) for
/// `lease`, appended to `out`, in whole milliseconds as [`timeout_millis`]
/// renders them.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn write_lease(out: &mut String, scope: SettingScope, lease: Duration) {
    out.push_str(match scope {
        SettingScope::Session => "SET idle_session_timeout = ",
        SettingScope::Transaction => "SET LOCAL idle_in_transaction_session_timeout = ",
    });
    // Writing to a String cannot fail.
    let _ = write!(out, "{}", timeout_millis(lease));
}

/// Gives a pooled connection the server's `idle_session_timeout` and
/// `client_connection_check_interval` back after a session-level lock set
/// its lease ([`write_lease`]) and [`CHECK_CLIENT`] on it.
#[cfg(feature = "tokio-postgres")]
pub(crate) const RESET_SESSION_LEASE: &str =
    "RESET idle_session_timeout; RESET client_connection_check_interval";

/// `SET application_name = E'…'`, session-wide, appended to `out`: how a
/// session-level lock (not in a transaction) names its backend, on a
/// connection of lockkit's own. Never on a connection a pool or a
/// transaction-mode pooler shares, where the name would outlive the lock.
/// Quoted as [`write_session_setup`] quotes it.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn write_session_name(out: &mut String, application_name: impl fmt::Display) {
    out.push_str("SET application_name = ");
    write_escaped(out, application_name);
}

/// `text` as an escape string literal, `E'…'`.
fn write_escaped(out: &mut String, text: impl fmt::Display) {
    out.push_str("E'");
    // Writing to a String cannot fail, and `Escaped` never fails either.
    let _ = write!(Escaped(out), "{text}");
    out.push('\'');
}

/// Appends what is written to it to a `String`, escaped for the inside of
/// an `E'…'` literal: backslashes and quotes doubled, NULs dropped. Runs
/// without special characters are copied whole.
struct Escaped<'a>(&'a mut String);

impl fmt::Write for Escaped<'_> {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        let mut rest = text;
        while let Some(i) = rest.bytes().position(|b| matches!(b, b'\\' | b'\'' | 0)) {
            self.0.push_str(&rest[..i]);
            match rest.as_bytes()[i] {
                b'\\' => self.0.push_str("\\\\"),
                b'\'' => self.0.push_str("''"),
                _ => {} // NUL
            }
            rest = &rest[i + 1..];
        }
        self.0.push_str(rest);
        Ok(())
    }
}

/// The keepalive a session lock's connection runs at its cadence: inside
/// the lock's transaction it resets `idle_in_transaction_session_timeout`,
/// and its reply (or its absence) tells whether the connection is alive.
/// Sent with the simple protocol, it also closes every pipeline of
/// extended-protocol statements on that connection: it drops their unnamed
/// portal, which would otherwise keep its snapshot (and the backend's
/// `backend_xmin`, holding back VACUUM) until the next statement.
pub(crate) const KEEPALIVE: &str = "SELECT 1";

/// What opens the comment of [`keepalive_announcing`], which
/// [`announced_token`] looks for.
#[cfg(feature = "tokio-postgres")]
const ANNOUNCE: &str = "/* lockkit:tokens";

/// The most bytes [`keepalive_announcing`] writes: the server shows at most
/// `track_activity_query_size` bytes of a query (1,024 by default).
#[cfg(feature = "tokio-postgres")]
const ANNOUNCE_MAX: usize = 1000;

/// [`KEEPALIVE`] on a session lock's connection whose locks carry fencing
/// tokens: a comment names each key and its token,
/// `SELECT 1 /* lockkit:tokens 42=… 7/-3=… */` (a `Pair` key's halves split
/// by `/`, tokens in decimal). `pg_stat_activity.query` shows it until the
/// connection's next statement: that is how `lockkit inspect` shows a held
/// lock's token ([`announced_token`]), at no cost to the lock calls. Keys
/// that would take the text past [`ANNOUNCE_MAX`] bytes are left out, and
/// ` …` says so.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn keepalive_announcing(
    tokens: impl IntoIterator<Item = (LockKey, FencingToken)>,
) -> String {
    const CLOSE: &str = " */";
    const MORE: &str = " \u{2026}";
    let mut out = String::with_capacity(96);
    out.push_str(KEEPALIVE);
    out.push(' ');
    out.push_str(ANNOUNCE);
    let mut entry = String::with_capacity(64);
    for (key, token) in tokens {
        entry.clear();
        let _ = match key {
            LockKey::BigInt(v) => write!(entry, " {v}={token}"),
            LockKey::Pair(class, object) => write!(entry, " {class}/{object}={token}"),
        };
        if out.len() + entry.len() + MORE.len() + CLOSE.len() > ANNOUNCE_MAX {
            out.push_str(MORE);
            break;
        }
        out.push_str(&entry);
    }
    out.push_str(CLOSE);
    out
}

/// The fencing token that a session lock's keepalive
/// ([`keepalive_announcing`]) names for `key` in `query`, the text
/// `pg_stat_activity` shows; `None` when it names none (another statement,
/// even one that quotes the comment, or a key left out). A text the server
/// cut short (no closing ` */`) loses its last entry, which may be cut:
/// never a token other than the one minted.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn announced_token(query: &str, key: LockKey) -> Option<FencingToken> {
    let rest = query
        .strip_prefix(KEEPALIVE)?
        .strip_prefix(' ')?
        .strip_prefix(ANNOUNCE)?;
    let body = match rest.find(" */") {
        Some(end) => &rest[..end],
        None => &rest[..rest.rfind(' ').unwrap_or(0)],
    };
    body.split(' ').find_map(|entry| {
        let (named, token) = entry.split_once('=')?;
        let named = match named.split_once('/') {
            Some((class, object)) => LockKey::Pair(class.parse().ok()?, object.parse().ok()?),
            None => LockKey::BigInt(named.parse().ok()?),
        };
        (named == key).then(|| token.parse().ok()).flatten()
    })
}

/// Ends the transaction of a default session lock, and the lock with it.
pub(crate) const SESSION_ROLLBACK: &str = "ROLLBACK";

/// PostgreSQL 14+: a backend waiting for a lock notices within a second that
/// its client went away (a cancelled `lock()`), instead of only when it
/// next writes to the socket, which would be after it got the lock.
pub(crate) const CHECK_CLIENT: &str = "SET client_connection_check_interval = 1000";

/// How long a [`write_lock_timeout`] setting lasts.
#[cfg(feature = "tokio-postgres")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SettingScope {
    /// `SET`: the session's, until [`RESET_LOCK_TIMEOUT`] (a session-level
    /// lock's wait, on a connection of its own).
    Session,
    /// `SET LOCAL`: until the end of the transaction (an attempt of
    /// `run_ddl`).
    Transaction,
}

/// `SET lock_timeout = '…'` ([`SettingScope::Session`]) or `SET LOCAL
/// lock_timeout = '…'` ([`SettingScope::Transaction`]) for `timeout`,
/// appended to `out`. The value is [`timeout_setting`]'s, whole
/// milliseconds of [`timeout_millis`], as [`SET_TIMEOUTS`] sets it for a
/// transaction-scoped lock call: every lock timeout lockkit sets is the
/// same rendering of its duration, whatever its scope.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn write_lock_timeout(out: &mut String, scope: SettingScope, timeout: Duration) {
    out.push_str(match scope {
        SettingScope::Session => "SET lock_timeout = '",
        SettingScope::Transaction => "SET LOCAL lock_timeout = '",
    });
    write_timeout_setting(out, timeout);
    out.push('\'');
}

/// Puts the session's `lock_timeout` back to its default after a
/// [`SettingScope::Session`] [`write_lock_timeout`].
#[cfg(feature = "tokio-postgres")]
pub(crate) const RESET_LOCK_TIMEOUT: &str = "RESET lock_timeout";

/// Opens the transaction another client of the pool holds while the pooler
/// probe reads its backend ([`write_read_mark`]), so that a
/// transaction-mode pooler must give it a backend of its own.
#[cfg(feature = "tokio-postgres")]
pub(crate) const PROBE_BEGIN: &str = "BEGIN";

/// The session-wide setting the pooler probe marks its backend with.
#[cfg(feature = "tokio-postgres")]
const PROBE_MARK: &str = "lockkit.pooler_probe";

/// Takes the pooler probe's mark ([`write_read_mark`]) off the session.
#[cfg(feature = "tokio-postgres")]
pub(crate) const PROBE_UNMARK: &str = "SELECT set_config('lockkit.pooler_probe', '', false)";

/// The pooler probe's read of its backend, appended to `out` for the simple
/// query protocol: `pg_backend_pid()` and the probe's mark on the backend
/// (`text`, empty when there is none), in one row; with `set`, a second
/// statement then marks the backend with `set`, session-wide, in the same
/// query (so on the same backend). `set` is written as it is, unquoted: the
/// probe's marks are hexadecimal digits.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn write_read_mark(out: &mut String, set: Option<&str>) {
    // Writing to a String cannot fail.
    let _ = write!(
        out,
        "SELECT pg_backend_pid(), current_setting('{PROBE_MARK}', true)"
    );
    if let Some(set) = set {
        let _ = write!(out, "; SELECT set_config('{PROBE_MARK}', '{set}', false)");
    }
}

/// `pg_backend_pid()` in a statement of its own (its own transaction); one
/// `int4`.
#[cfg(feature = "tokio-postgres")]
pub(crate) const BACKEND_PID: &str = "SELECT pg_backend_pid()";

/// `$1 int8`, `$2 int8`, `$3 int2`: whether this session holds the advisory
/// lock `(classid, objid, objsubid)` of `pg_locks`.
pub(crate) const HOLDS: &str = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
     AND pid = pg_backend_pid() AND granted AND classid = $1::oid \
     AND objid = $2::oid AND objsubid = $3)";

/// The session lock statement for `key` (`$1 int8`, or `$1, $2 int4`):
/// waiting forms return one `text` (the `void` result cast, for the simple
/// protocol), `try_only` forms one `bool`.
pub(crate) fn session_lock(key: LockKey, mode: Mode, try_only: bool) -> &'static str {
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

/// Appends the waiting or trying lock `$f` of `$args` with a fencing
/// token's parts minted right after the grant, in the same statement:
/// `OFFSET 0` keeps the lock in a subquery of its own, which runs before
/// the outer query reads its row.
#[cfg(feature = "tokio-postgres")]
macro_rules! minting {
    (wait $f:literal, $args:literal) => {
        concat!(
            "SELECT true, ",
            token_columns!(text),
            " FROM (SELECT ",
            $f,
            "(",
            $args,
            ") OFFSET 0) AS granted"
        )
    };
    (try $f:literal, $args:literal) => {
        concat!(
            "SELECT t.granted, CASE WHEN t.granted THEN ",
            token_part!(text timeline),
            " END, CASE WHEN t.granted THEN ",
            token_part!(text flush),
            " END, CASE WHEN t.granted THEN ",
            token_part!(text counter),
            " END FROM (SELECT ",
            $f,
            "(",
            $args,
            ") AS granted OFFSET 0) AS t"
        )
    };
}

/// [`session_lock`] with a fencing token minted with the grant
/// ([`crate::fencing`]): every form returns one row, `granted bool`
/// (always `true` when waiting) and the token's three parts as `text`
/// ([`token_part!`]; `NULL` when a try found the key busy, and then none
/// is minted).
#[cfg(feature = "tokio-postgres")]
pub(crate) fn session_lock_minting(key: LockKey, mode: Mode, try_only: bool) -> &'static str {
    match (key, mode, try_only) {
        (LockKey::BigInt(_), Mode::Exclusive, false) => minting!(wait "pg_advisory_lock", "$1"),
        (LockKey::BigInt(_), Mode::Shared, false) => minting!(wait "pg_advisory_lock_shared", "$1"),
        (LockKey::BigInt(_), Mode::Exclusive, true) => minting!(try "pg_try_advisory_lock", "$1"),
        (LockKey::BigInt(_), Mode::Shared, true) => {
            minting!(try "pg_try_advisory_lock_shared", "$1")
        }
        (LockKey::Pair(..), Mode::Exclusive, false) => minting!(wait "pg_advisory_lock", "$1, $2"),
        (LockKey::Pair(..), Mode::Shared, false) => {
            minting!(wait "pg_advisory_lock_shared", "$1, $2")
        }
        (LockKey::Pair(..), Mode::Exclusive, true) => {
            minting!(try "pg_try_advisory_lock", "$1, $2")
        }
        (LockKey::Pair(..), Mode::Shared, true) => {
            minting!(try "pg_try_advisory_lock_shared", "$1, $2")
        }
    }
}

/// Mints a fencing token: its three parts ([`token_columns!`]) in one row.
/// Sent after a default session lock's statements, in the same query, when
/// its `SessionLock` mints tokens: one command.
#[cfg(feature = "tokio-postgres")]
pub(crate) const FENCING_TOKEN: &str = concat!("SELECT ", token_columns!(text));

/// [`lockkit::sql::fence`](crate::sql::fence): `$1` the resource (`text`),
/// `$2` the token as its decimal `text`; returns one `bool` (`NULL` for a
/// `NULL` argument).
#[cfg(feature = "tokio-postgres")]
pub(crate) const FENCE: &str = "SELECT lockkit.fence($1::text, $2::text::numeric)";

/// The session unlock statement for `key`; returns one `bool`.
pub(crate) fn session_unlock(key: LockKey, mode: Mode) -> &'static str {
    match (key, mode) {
        (LockKey::BigInt(_), Mode::Exclusive) => "SELECT pg_advisory_unlock($1)",
        (LockKey::BigInt(_), Mode::Shared) => "SELECT pg_advisory_unlock_shared($1)",
        (LockKey::Pair(..), Mode::Exclusive) => "SELECT pg_advisory_unlock($1, $2)",
        (LockKey::Pair(..), Mode::Shared) => "SELECT pg_advisory_unlock_shared($1, $2)",
    }
}

/// A timeout as a setting value, appended to `out`: whole milliseconds, at
/// least 1 (0 would mean "no timeout" to the server); the one rendering of
/// a timeout as a setting value.
fn write_timeout_setting(out: &mut String, timeout: Duration) {
    // Writing to a String cannot fail.
    let _ = write!(out, "{}ms", timeout_millis(timeout));
}

/// A timeout in whole milliseconds, at least 1 and at most `i32::MAX` (the
/// settings' range).
pub(crate) fn timeout_millis(timeout: Duration) -> i64 {
    timeout.as_millis().clamp(1, i32::MAX as u128) as i64
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
/// (seconds since the holder's transaction began, `NULL` outside one; an
/// `idle` backend is outside any, even while `xact_start` shows one of the
/// short transactions it runs on its own, see [`SESSION_HOLDERS`]),
/// `read_at text` (this statement's start, a lower bound of the moment
/// `pg_locks` was read, for [`SESSION_HOLDERS`]; ISO 8601 with a numeric
/// offset, through `to_json`, so it reads back as the same instant whatever
/// the session's `DateStyle` and `TimeZone`: `timestamptz::text` may carry a
/// zone abbreviation that reads back as another zone, or not at all).
pub const ADVISORY_LOCKS: &str = "SELECT l.classid::int8, l.objid::int8, l.objsubid::int2, \
     l.mode, l.granted, l.pid, a.application_name, a.usename::text, a.state, a.query, \
     extract(epoch FROM clock_timestamp() - (to_jsonb(l) ->> 'waitstart')::timestamptz)::float8, \
     CASE WHEN l.granted OR l.pid IS NULL THEN '{}'::int4[] ELSE pg_blocking_pids(l.pid) END, \
     CASE WHEN a.state <> 'idle' THEN \
         extract(epoch FROM clock_timestamp() - a.xact_start)::float8 END, \
     to_json(statement_timestamp()) #>> '{}' \
     FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
     WHERE l.locktype = 'advisory' \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
     ORDER BY l.granted DESC, l.classid, l.objid, l.objsubid, l.pid";

/// `$1 text` (a timestamp, [`ADVISORY_LOCKS`]'s `read_at`): the backends
/// that have been idle outside any transaction block since before `$1`, so
/// hold only session-level locks, and held them at `$1`. Sent after
/// [`ADVISORY_LOCKS`] and [`CLEAR_ACTIVITY_SNAPSHOT`], so its
/// `pg_stat_activity` snapshot is taken after `pg_locks` was read (a
/// backend that began a transaction in between is not idle, or its
/// `state_change` is later than `$1`). `backend_start` excludes a new
/// backend that reused a pid.
///
/// Not `xact_start IS NULL`: an idle backend runs short transactions of its
/// own, with no query of its client, to catch up with other sessions'
/// catalog invalidations or to deliver notifications; `pg_stat_activity`
/// then shows it `idle` with an `xact_start`. It takes no advisory lock
/// there, and `state` alone says it is outside any transaction block.
///
/// Columns: `pid int4`.
pub const SESSION_HOLDERS: &str = "SELECT pid FROM pg_stat_activity \
     WHERE state = 'idle' \
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

// ---- Published key types (`Locker::publish_key_types`) -------------------

/// Creates the table of published key types when it is missing: one row
/// per key type of each application that publishes, which `lockkit
/// inspect` reads to name the types behind keys. Run after
/// [`PUBLISH_LOCK`] in the same transaction, so that concurrent publishers
/// on a fresh database do not race (two concurrent `CREATE TABLE IF NOT
/// EXISTS` of one table fail one of them with `23505`). A role that may not
/// create tables in `public` can be given the table by its owner, made
/// with this statement.
pub const CREATE_KEY_TYPES: &str = "CREATE TABLE IF NOT EXISTS public.lockkit_key_types (\
     application text NOT NULL, \
     type_name text NOT NULL, \
     namespace text NOT NULL, \
     form text NOT NULL, \
     tag int4 NOT NULL, \
     pair_class int4 NOT NULL, \
     published_at timestamptz NOT NULL DEFAULT now(), \
     PRIMARY KEY (application, type_name))";

/// `$1 int8`: the lock that serializes publishers (an exclusive
/// transaction lock on lockkit's own key `KeySpec::new("lockkit.key_types")`
/// of `0_i64`).
pub const PUBLISH_LOCK: &str = "SELECT pg_advisory_xact_lock($1)";

/// `$1 text` (application), `$2 text[]` (type names), `$3 text[]`
/// (namespaces), `$4 text[]` (forms), `$5 int4[]` (tags), `$6 int4[]` (pair
/// classes): inserts or updates one row per type; an application's
/// republished type takes its new spec and time.
pub(crate) const PUBLISH_KEY_TYPES: &str = "INSERT INTO public.lockkit_key_types \
     (application, type_name, namespace, form, tag, pair_class) \
     SELECT $1, t.type_name, t.namespace, t.form, t.tag, t.pair_class \
     FROM unnest($2::text[], $3::text[], $4::text[], $5::int4[], $6::int4[]) \
     AS t(type_name, namespace, form, tag, pair_class) \
     ON CONFLICT (application, type_name) DO UPDATE SET namespace = excluded.namespace, \
     form = excluded.form, tag = excluded.tag, pair_class = excluded.pair_class, \
     published_at = now()";

/// Whether the table of published key types exists; `bool`.
pub(crate) const KEY_TYPES_EXIST: &str =
    "SELECT to_regclass('public.lockkit_key_types') IS NOT NULL";

/// The published key types. Columns: `application text`, `type_name
/// text`, `namespace text`, `form text`, `pair_class int4`.
pub(crate) const PUBLISHED_KEY_TYPES: &str =
    "SELECT application, type_name, namespace, form, pair_class \
     FROM public.lockkit_key_types ORDER BY namespace, application, type_name";

// ---- Keys from SQL (`lockkit::sql`) -----------------------------------------

/// The check [`install`](crate::sql::install) runs after installing: a
/// KEYS.md golden vector (`Order { id: 42 }` as a BigInt key, its Pair
/// class and object) and the format version, computed by the installed
/// functions.
#[cfg(feature = "tokio-postgres")]
pub(crate) const INSTALL_CHECK: &str = "SELECT lockkit.format_version(), \
     lockkit.key('Order', lockkit.int(42::int8)), \
     lockkit.pair_class('Order'), \
     lockkit.pair_object('Order', lockkit.int(42::int8))";

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout_setting(timeout: Duration) -> String {
        let mut out = String::new();
        write_timeout_setting(&mut out, timeout);
        out
    }

    /// A keepalive names each key's token, and the parser reads back
    /// exactly those: every key form, any sign, and nothing for a key it
    /// does not name or for another statement.
    #[cfg(feature = "tokio-postgres")]
    #[test]
    fn a_keepalive_announces_tokens_that_read_back() {
        let token = |n: u64| FencingToken::from_parts(1, 0x0300_0060, n).unwrap();
        let held = [
            (LockKey::BigInt(42), token(7)),
            (LockKey::BigInt(i64::MIN), token(8)),
            (LockKey::Pair(-3, 9), token(9)),
            (LockKey::Pair(i32::MAX, i32::MIN), token(10)),
        ];
        let text = keepalive_announcing(held);
        assert!(
            text.starts_with("SELECT 1 /* lockkit:tokens 42=5192"),
            "{text}"
        );
        assert!(text.ends_with(" */"), "{text}");
        for (key, token) in held {
            assert_eq!(announced_token(&text, key), Some(token), "{key} in {text}");
        }
        assert_eq!(announced_token(&text, LockKey::BigInt(9)), None);
        assert_eq!(announced_token(&text, LockKey::Pair(9, -3)), None);
        assert_eq!(announced_token(&text, LockKey::BigInt(-3)), None);
        assert_eq!(announced_token(KEEPALIVE, LockKey::BigInt(42)), None);
        assert_eq!(announced_token("SELECT 42=1", LockKey::BigInt(42)), None);
        // Only lockkit's keepalive, not a statement that quotes its comment.
        let quoted = format!("SELECT 2; {text}");
        assert_eq!(announced_token(&quoted, LockKey::BigInt(42)), None);
        let quoted = format!("UPDATE t SET c = 1 {}", &text["SELECT 1 ".len()..]);
        assert_eq!(announced_token(&quoted, LockKey::BigInt(42)), None);
    }

    /// The text stays within what the server shows of a query; the keys
    /// past it are left out and said to be; a text the server cut short
    /// never reads as a cut token.
    #[cfg(feature = "tokio-postgres")]
    #[test]
    fn an_announcement_stays_short_and_a_cut_one_reads_no_cut_token() {
        let token = |n: u64| FencingToken::from_parts(1, 0x0300_0060, n).unwrap();
        let text =
            keepalive_announcing((0..1000).map(|k| (LockKey::BigInt(k), token(100 + k as u64))));
        assert!(text.len() <= ANNOUNCE_MAX, "{}", text.len());
        assert!(text.ends_with(" \u{2026} */"), "{text}");
        assert_eq!(announced_token(&text, LockKey::BigInt(0)), Some(token(100)));
        assert_eq!(announced_token(&text, LockKey::BigInt(999)), None);
        let full = keepalive_announcing([
            (LockKey::BigInt(1), token(1)),
            (LockKey::BigInt(2), token(2)),
        ]);
        let last = full.rfind('=').unwrap();
        for cut in last..full.len() {
            let shown = &full[..cut];
            assert_eq!(
                announced_token(shown, LockKey::BigInt(1)),
                Some(token(1)),
                "{shown}"
            );
            // Whole only once the space after it is shown.
            let whole = shown[last..].contains(' ');
            let expected = whole.then(|| token(2));
            assert_eq!(
                announced_token(shown, LockKey::BigInt(2)),
                expected,
                "{shown}"
            );
        }
        assert_eq!(announced_token(&full, LockKey::BigInt(2)), Some(token(2)));
    }

    /// An entry is named when it fits with room left for ` …` and the
    /// close, to the byte: 25 entries of 37 bytes and one of 42 after the
    /// 26 bytes of `SELECT 1 /* lockkit:tokens` leave exactly the 7 bytes
    /// of ` … */` within the 1,000; the next entry does not fit.
    #[cfg(feature = "tokio-postgres")]
    #[test]
    fn an_announcement_fills_its_bytes_exactly() {
        let token = FencingToken::from_parts(1, 0x0300_0060, 7).unwrap();
        assert_eq!(token.to_string().len(), 34);
        let keys = std::iter::repeat_n(LockKey::BigInt(1), 25)
            .chain([LockKey::BigInt(123_456), LockKey::BigInt(2)]);
        let text = keepalive_announcing(keys.map(|k| (k, token)));
        assert_eq!(text.len(), ANNOUNCE_MAX, "{text}");
        assert!(
            text.ends_with(" 123456=5192296858548994755000703029084167 \u{2026} */"),
            "{text}"
        );
        assert_eq!(announced_token(&text, LockKey::BigInt(2)), None);
        // One byte more (a key of 7 digits) does not fit.
        let keys = std::iter::repeat_n(LockKey::BigInt(1), 25).chain([LockKey::BigInt(1_234_567)]);
        let text = keepalive_announcing(keys.map(|k| (k, token)));
        assert_eq!(announced_token(&text, LockKey::BigInt(1_234_567)), None);
        assert!(text.ends_with("4167 \u{2026} */"), "{text}");
    }

    #[test]
    fn timeout_is_never_zero() {
        assert_eq!(timeout_setting(Duration::ZERO), "1ms");
        assert_eq!(timeout_setting(Duration::from_micros(1500)), "1ms");
        assert_eq!(timeout_setting(Duration::from_secs(2)), "2000ms");
        assert_eq!(timeout_setting(Duration::MAX), format!("{}ms", i32::MAX));
    }

    /// Every `lock_timeout` lockkit sets is `write_timeout_setting`'s value,
    /// session-wide or transaction-local.
    #[cfg(feature = "tokio-postgres")]
    #[test]
    fn lock_timeout_is_the_timeout_setting_in_either_scope() {
        let mut out = String::new();
        write_lock_timeout(&mut out, SettingScope::Session, Duration::from_millis(1500));
        assert_eq!(out, "SET lock_timeout = '1500ms'");
        out.clear();
        write_lock_timeout(&mut out, SettingScope::Transaction, Duration::ZERO);
        assert_eq!(out, "SET LOCAL lock_timeout = '1ms'");
    }

    #[cfg(feature = "tokio-postgres")]
    #[test]
    fn the_pooler_probe_reads_and_sets_its_mark() {
        let mut out = String::new();
        write_read_mark(&mut out, None);
        assert_eq!(
            out,
            "SELECT pg_backend_pid(), current_setting('lockkit.pooler_probe', true)"
        );
        out.clear();
        write_read_mark(&mut out, Some("00ff"));
        assert_eq!(
            out,
            "SELECT pg_backend_pid(), current_setting('lockkit.pooler_probe', true); \
             SELECT set_config('lockkit.pooler_probe', '00ff', false)"
        );
    }

    #[cfg(feature = "tokio-postgres")]
    #[test]
    fn session_setup_quotes_the_name() {
        let lease = Duration::from_secs(15);
        let mut out = String::new();
        assert_eq!(
            write_session_setup(&mut out, "lockkit session lock (1, -2)", false, lease),
            2
        );
        assert!(
            out.contains("set_config('application_name', E'lockkit session lock (1, -2)', true)"),
            "{out}"
        );
        out.clear();
        assert_eq!(write_session_setup(&mut out, "a'b\\c\0d", false, lease), 2);
        assert!(out.contains("E'a''b\\\\cd'"), "{out}");
        out.clear();
        assert_eq!(write_session_setup(&mut out, "a'b", true, lease), 4);
        assert_eq!(out.split("; ").count(), 4, "{out}");
        assert!(
            out.contains("SET LOCAL application_name = E'a''b'"),
            "{out}"
        );
    }

    /// A minting statement wraps the plain one whole, as a subquery that
    /// runs first, and appends the token's three parts.
    #[test]
    fn minting_wraps_the_statement() {
        let text = minting(LOCK_BIGINT);
        assert!(
            text.starts_with("/* lockkit:minting */ SELECT s.*, "),
            "{text}"
        );
        assert!(
            text.ends_with(&format!("FROM ({LOCK_BIGINT} OFFSET 0) AS s")),
            "{text}"
        );
        for column in ["AS timeline", "AS flush", "AS counter"] {
            assert_eq!(text.matches(column).count(), 1, "{text}");
        }
        assert_eq!(text.matches("$1").count(), 1, "{text}");
    }

    /// A lease is whole milliseconds, never zero (which would turn the
    /// server's timeout off), in both scopes.
    #[cfg(feature = "tokio-postgres")]
    #[test]
    fn a_lease_is_whole_milliseconds_and_never_off() {
        let lease = |scope, lease| {
            let mut out = String::new();
            write_lease(&mut out, scope, lease);
            out
        };
        assert_eq!(
            lease(SettingScope::Transaction, Duration::from_millis(15_000)),
            "SET LOCAL idle_in_transaction_session_timeout = 15000"
        );
        assert_eq!(
            lease(SettingScope::Session, Duration::from_micros(10)),
            "SET idle_session_timeout = 1"
        );
        assert_eq!(
            lease(SettingScope::Transaction, Duration::MAX),
            format!(
                "SET LOCAL idle_in_transaction_session_timeout = {}",
                i32::MAX
            )
        );
    }

    /// A minting lock statement locks as its plain one does, in its own key
    /// space and mode, and mints only after it (in a subquery of its own).
    #[cfg(feature = "tokio-postgres")]
    #[test]
    fn minting_session_lock_wraps_the_plain_one() {
        for key in [LockKey::BigInt(1), LockKey::Pair(1, 2)] {
            for mode in [Mode::Exclusive, Mode::Shared] {
                for try_only in [false, true] {
                    let plain = session_lock(key, mode, try_only);
                    let call = plain
                        .trim_start_matches("SELECT ")
                        .trim_end_matches("::text");
                    let minting = session_lock_minting(key, mode, try_only);
                    assert!(minting.contains(&format!("(SELECT {call}")), "{minting}");
                    assert!(minting.contains(" OFFSET 0) AS "), "{minting}");
                    assert!(
                        minting.contains("nextval('lockkit.fencing_counter'"),
                        "{minting}"
                    );
                    assert_eq!(
                        minting.contains("CASE WHEN t.granted"),
                        try_only,
                        "{minting}"
                    );
                }
            }
        }
    }

    /// Each session lock statement locks in its own key space and mode,
    /// waiting (its `void` cast to `text`) or trying.
    #[test]
    fn session_lock_matches_its_key_mode_and_wait() {
        for (key, args) in [(LockKey::BigInt(1), "$1"), (LockKey::Pair(1, 2), "$1, $2")] {
            for (mode, suffix) in [(Mode::Exclusive, ""), (Mode::Shared, "_shared")] {
                assert_eq!(
                    session_lock(key, mode, false),
                    format!("SELECT pg_advisory_lock{suffix}({args})::text")
                );
                assert_eq!(
                    session_lock(key, mode, true),
                    format!("SELECT pg_try_advisory_lock{suffix}({args})")
                );
            }
        }
    }

    /// Text in an `E'…'` literal: quotes and backslashes doubled, NULs
    /// dropped, the rest copied as it is, after every special character.
    #[test]
    fn escaped_text_doubles_quotes_and_backslashes() {
        let mut out = String::new();
        write_escaped(&mut out, "it's\\a\\0b\u{0}c'");
        assert_eq!(out, r"E'it''s\\a\\0bc'''");
        let mut plain = String::new();
        write_escaped(&mut plain, "lockkit worker 7");
        assert_eq!(plain, "E'lockkit worker 7'");
    }

    /// Each session unlock statement unlocks in its own key space and mode.
    #[test]
    fn session_unlock_matches_its_key_and_mode() {
        let cases = [
            (
                LockKey::BigInt(1),
                Mode::Exclusive,
                "pg_advisory_unlock($1)",
            ),
            (
                LockKey::BigInt(1),
                Mode::Shared,
                "pg_advisory_unlock_shared($1)",
            ),
            (
                LockKey::Pair(1, 2),
                Mode::Exclusive,
                "pg_advisory_unlock($1, $2)",
            ),
            (
                LockKey::Pair(1, 2),
                Mode::Shared,
                "pg_advisory_unlock_shared($1, $2)",
            ),
        ];
        for (key, mode, call) in cases {
            assert_eq!(session_unlock(key, mode), format!("SELECT {call}"));
        }
    }
}
