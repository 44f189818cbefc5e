//! How `lockkit` prints: the lock table, the semaphores, the wait-chain
//! tree, JSON.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use lockkit::inspect::{
    AdvisoryLockRow, Collision, Marker, PublishedKeyType, RelationLockRow, Scope,
};
use lockkit::key::{semaphore_of, SEMAPHORE_CLASS};
use lockkit::{LockKey, Mode};
use serde_json::{json, Value};

mod semaphore;

mod graph;
mod summary;
mod waits;

use waits::{wait_chains, WaitGraph};

pub(crate) use graph::{graph, GraphFormat};
pub(crate) use semaphore::semaphore_names;
use semaphore::{semaphore_name, semaphore_text, split_semaphores};

/// The names of the semaphores known by their base (the object of slot 0):
/// see [`semaphore_names`].
pub(crate) type SemaphoreNames = BTreeMap<i32, String>;

/// A key with its `pg_locks` columns, as JSON.
pub(crate) fn key_json(key: LockKey) -> Value {
    let id = key.to_pg_locks();
    let mut doc = match key {
        LockKey::BigInt(v) => json!({"form": "bigint", "key": v}),
        LockKey::Pair(c, o) => json!({"form": "pair", "class": c, "object": o}),
    };
    doc["classid"] = json!(id.classid);
    doc["objid"] = json!(id.objid);
    doc["objsubid"] = json!(id.objsubid);
    doc
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Shared => "shared",
        _ => "exclusive",
    }
}

/// The semaphore of a semaphore slot's key; else the registered types of
/// the key; else the key type a session lock's `application_name` names;
/// else what the key itself says: the namespace tag of a BigInt key, the
/// class of a Pair key.
fn type_names(row: &AdvisoryLockRow, names: &SemaphoreNames) -> String {
    if let Some((base, _)) = semaphore_of(row.key) {
        return semaphore_name(base, names);
    }
    if row.types.is_empty() {
        if let Some(namespace) = row.session_lock_namespace() {
            return namespace.to_owned();
        }
        return match row.key {
            LockKey::BigInt(_) => format!("? tag 0x{:04x}", row.key.tag().unwrap_or(0)),
            LockKey::Pair(class, _) => format!("? class {class}"),
        };
    }
    let mut names: Vec<&str> = row.types.iter().map(|t| t.namespace()).collect();
    names.dedup();
    names.join("|")
}

/// Whether the key's type is unknown: nothing registered or published
/// names it, nor a session lock's `application_name`, and it is no
/// semaphore slot.
fn unknown_type(row: &AdvisoryLockRow) -> bool {
    row.types.is_empty()
        && row.session_lock_namespace().is_none()
        && semaphore_of(row.key).is_none()
}

/// The APPLICATION column: `session lock <type>` for a lockkit session
/// lock's session, else its `application_name`.
fn app_text(row: &AdvisoryLockRow) -> Cow<'_, str> {
    match row.session_lock_namespace() {
        Some(namespace) => Cow::Owned(format!("session lock {namespace}")),
        None => Cow::Borrowed(row.application_name.as_deref().unwrap_or("")),
    }
}

/// The lockkit call of each session (by pid) whose current or last
/// statement is lockkit's, with its locks by type as `pg_locks` shows them
/// now: `lock_batch 3×Account`. The counts are the session's advisory
/// locks held and awaited, that is its transaction's, this call's and
/// earlier ones'. A session waiting for a semaphore's slot waits for a
/// permit, whatever statement asks for it: `acquire_permit semaphore
/// Exporters; holds 1×Job`.
fn calls(rows: &[AdvisoryLockRow], names: &SemaphoreNames) -> BTreeMap<i32, String> {
    // pid -> (its call, (type, locks) in first-seen order, the semaphore
    // it waits for a permit of).
    type Counts = Vec<(String, usize)>;
    let mut by_pid: BTreeMap<i32, (&'static str, Counts, Option<i32>)> = BTreeMap::new();
    for r in rows {
        let (Some(pid), Some(call)) = (r.pid, r.lockkit_call()) else {
            continue;
        };
        let (_, counts, permit) = by_pid.entry(pid).or_insert((call, Vec::new(), None));
        if let (false, Some((base, _))) = (r.granted, semaphore_of(r.key)) {
            *permit = Some(base);
            continue;
        }
        // A slot held is a permit, not a lock of a type named `semaphore`.
        let name = match semaphore_of(r.key) {
            Some((base, _)) => format!("permit of {}", semaphore_name(base, names)),
            None => type_names(r, names),
        };
        match counts.iter_mut().find(|(n, _)| *n == name) {
            Some((_, n)) => *n += 1,
            None => counts.push((name, 1)),
        }
    }
    by_pid
        .into_iter()
        .map(|(pid, (call, counts, permit))| {
            let counts: Vec<String> = counts
                .iter()
                .map(|(n, c)| match n.strip_prefix("permit of ") {
                    Some(semaphore) if *c == 1 => format!("a permit of {semaphore}"),
                    Some(semaphore) => format!("{c} permits of {semaphore}"),
                    None => format!("{c}×{n}"),
                })
                .collect();
            let text = match permit {
                Some(base) if counts.is_empty() => {
                    format!("acquire_permit {}", semaphore_name(base, names))
                }
                Some(base) => format!(
                    "acquire_permit {}; holds {}",
                    semaphore_name(base, names),
                    counts.join(", ")
                ),
                None => format!("{call} {}", counts.join(", ")),
            };
            (pid, text)
        })
        .collect()
}

/// Whether the session is one of lockkit's own connections: a
/// `SessionLock`'s (`lockkit session lock <type> <key>`) or a multiplexed
/// one's (`lockkit session locks`).
fn lockkit_connection(row: &AdvisoryLockRow) -> bool {
    row.session_lock_namespace().is_some()
        || row.application_name.as_deref() == Some(lockkit::pg::MULTIPLEXED_NAME)
}

/// The SCOPE of a held lock: the library's inference, and for lockkit's
/// own connections inside their transaction `transaction`: lockkit takes
/// only transaction locks there (a `SessionLock` holds its lock in a
/// transaction kept open; its session-level form runs outside any, where
/// the library's inference already says `session`).
pub(crate) fn scope_text(row: &AdvisoryLockRow) -> &'static str {
    let in_transaction = matches!(
        row.state.as_deref(),
        Some("idle in transaction" | "active" | "idle in transaction (aborted)")
    );
    if row.scope == Scope::Unknown && in_transaction && lockkit_connection(row) {
        return Scope::Transaction.as_str();
    }
    row.scope.as_str()
}

/// The QUERY column: the lockkit call, else the statement text.
fn query_text<'a>(row: &'a AdvisoryLockRow, calls: &'a BTreeMap<i32, String>) -> Option<&'a str> {
    row.pid
        .and_then(|p| calls.get(&p))
        .map(String::as_str)
        .or(row.query.as_deref())
}

/// Where the published key types come from, for the notes.
#[derive(Debug, Default)]
pub(crate) struct Sources<'a> {
    /// The key types published to the server; `None` when none ever were.
    pub(crate) published: Option<&'a [PublishedKeyType]>,
    /// Why the published types could not be read, if they could not.
    pub(crate) published_error: Option<String>,
    /// Sessions that wait for relation locks, when `--all` was not given.
    pub(crate) relation_waiters: usize,
    /// The semaphores' names.
    pub(crate) semaphores: SemaphoreNames,
}

fn collision_text(c: &Collision, published: &[PublishedKeyType]) -> String {
    let what = match c.marker {
        Marker::Tag(tag) => format!("BigInt tag 0x{tag:04x}"),
        Marker::PairClass(class) => format!("Pair class {class}"),
        _ => "marker".into(),
    };
    let names: Vec<String> = c
        .types
        .iter()
        .map(|t| {
            let mut apps: Vec<&str> = published
                .iter()
                .filter(|p| p.namespace == t.namespace())
                .map(|p| p.application.as_str())
                .collect();
            apps.dedup();
            if apps.is_empty() {
                t.namespace().to_owned()
            } else {
                format!("{} (published by {})", t.namespace(), apps.join(", "))
            }
        })
        .collect();
    format!("{} share the {what}", names.join(", "))
}

fn secs(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64())
}

/// The rows and collisions as one JSON document (and the relation-lock
/// queues with `--all`).
pub(crate) fn inspect_json(
    rows: &[AdvisoryLockRow],
    relations: Option<&[RelationLockRow]>,
    collisions: &[Collision],
    sources: &Sources<'_>,
) -> Value {
    let names = &sources.semaphores;
    let calls = calls(rows, names);
    let (others, semaphores) = split_semaphores(rows);
    let lock = |r: &AdvisoryLockRow| {
        json!({
                "lockkit_call": r.pid.and_then(|p| calls.get(&p)),
                "session_lock_type": r.session_lock_namespace(),
                "key": key_json(r.key),
                "mode": mode_name(r.mode),
                "granted": r.granted,
                "pid": r.pid,
                "application_name": r.application_name,
                "user": r.user,
                "state": r.state,
                "scope": scope_text(r),
                "transaction_age_seconds": secs(r.transaction_age),
                "tag": r.key.tag(),
                "waited_seconds": secs(r.waited),
                "blocked_by": r.blocked_by,
                "query": r.query,
                "query_hidden": r.query_hidden,
                "fencing_token": r.fencing_token.map(|t| t.to_string()),
                "types": r.types.iter().map(|t| json!({"name": t.name(), "namespace": t.namespace()})).collect::<Vec<_>>(),
        })
    };
    let locks: Vec<Value> = others.into_iter().map(lock).collect();
    let semaphores: Vec<Value> = semaphores.iter().map(|s| s.json(&lock, names)).collect();
    let published = sources.published.unwrap_or_default();
    let mut doc = json!({
        "locks": locks,
        "semaphores": semaphores,
        "collisions": collisions.iter().map(|c| collision_text(c, published)).collect::<Vec<_>>(),
        "published_key_types": sources.published.map(<[PublishedKeyType]>::len),
        "published_key_types_error": sources.published_error,
        "relation_waiters": sources.relation_waiters,
    });
    if let Some(relations) = relations {
        doc["relation_locks"] = relations
            .iter()
            .map(|r| {
                json!({
                    "relation": r.relation,
                    "mode": r.mode,
                    "granted": r.granted,
                    "pid": r.pid,
                    "application_name": r.application_name,
                    "user": r.user,
                    "state": r.state,
                    "transaction_age_seconds": secs(r.transaction_age),
                    "waited_seconds": secs(r.waited),
                    "blocked_by": r.blocked_by,
                    "query": r.query,
                })
            })
            .collect();
    }
    doc
}

fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() > max {
        let cut: String = flat.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    } else {
        flat
    }
}

/// The pid `pg_blocking_pids` gives a prepared transaction.
const PREPARED_PID: i32 = 0;

/// A blocker of `blocked_by`: a pid, or `prepared` for a prepared
/// transaction.
fn blocker_text(pid: i32) -> String {
    if pid == PREPARED_PID {
        "prepared".into()
    } else {
        pid.to_string()
    }
}

fn pid_text(pid: Option<i32>) -> String {
    pid.map_or_else(|| "prepared".into(), |p| p.to_string())
}

fn age_text(d: Option<Duration>) -> String {
    d.map_or(String::new(), |d| format!("{:.1}s", d.as_secs_f64()))
}

/// A time as UTC ISO 8601, to the millisecond: `2024-05-01T12:34:56.789Z`.
pub(crate) fn timestamp(at: std::time::SystemTime) -> String {
    let since = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's days-to-civil, for the proleptic Gregorian calendar.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60,
        since.subsec_millis()
    )
}

pub(crate) use summary::{is_long, summary_text};

/// The table, the wait chains and the notes, for a terminal (and the
/// relation-lock queues with `--all`).
pub(crate) fn inspect_text(
    rows: &[AdvisoryLockRow],
    relations: Option<&[RelationLockRow]>,
    collisions: &[Collision],
    sources: &Sources<'_>,
) -> String {
    let mut out = String::new();
    let names = &sources.semaphores;
    let calls = calls(rows, names);
    let (others, semaphores) = split_semaphores(rows);
    // Wide enough for every name, up to a bound.
    let app_width = others
        .iter()
        .map(|r| app_text(r).chars().count())
        .max()
        .unwrap_or(0)
        .clamp(16, 40);
    if rows.is_empty() {
        out.push_str("no advisory locks held or awaited in this database\n");
        if sources.relation_waiters > 0 {
            let _ = writeln!(
                out,
                "but {} session(s) wait for relation locks (a DDL lock queue?): \
                 `lockkit inspect --all` shows them and who they wait for",
                sources.relation_waiters
            );
        }
    } else if !others.is_empty() {
        let _ = writeln!(
            out,
            "{:<9} {:<app_width$} {:<9} {:<7} {:<11} {:<19} {:>8} {:>8} {:<12} {:<28} {:<16} QUERY",
            "PID",
            "APPLICATION",
            "MODE",
            "LOCK",
            "SCOPE",
            "HOLDER STATE",
            "XACT AGE",
            "WAITED",
            "BLOCKED BY",
            "KEY",
            "TYPE"
        );
        for r in &others {
            let blocked: Vec<String> = r.blocked_by.iter().map(|&b| blocker_text(b)).collect();
            let mut query = match (query_text(r, &calls), r.query_hidden) {
                (_, true) => "<hidden: needs pg_read_all_stats>".to_owned(),
                (Some(q), false) => one_line(q, 60),
                (None, false) => String::new(),
            };
            if let Some(token) = r.fencing_token {
                let sep = if query.is_empty() { "" } else { ", " };
                let _ = write!(query, "{sep}fencing token {token}");
            }
            let _ = writeln!(
                out,
                "{:<9} {:<app_width$} {:<9} {:<7} {:<11} {:<19} {:>8} {:>8} {:<12} {:<28} {:<16} {}",
                pid_text(r.pid),
                one_line(&app_text(r), app_width),
                mode_name(r.mode),
                if r.granted { "held" } else { "waiting" },
                if r.granted { scope_text(r) } else { "" },
                r.state.as_deref().unwrap_or(""),
                age_text(r.transaction_age),
                age_text(r.waited),
                blocked.join(","),
                r.key.to_string(),
                type_names(r, names),
                query,
            );
        }
    }
    if !semaphores.is_empty() {
        if !others.is_empty() {
            out.push('\n');
        }
        out.push_str(
            "semaphores (a permit is one of its slot keys held; KEYS.md, \"Semaphore slots\"):\n",
        );
        for s in &semaphores {
            out.push_str(&semaphore_text(s, names));
        }
    }
    if let Some(relations) = relations.filter(|r| !r.is_empty()) {
        let _ = writeln!(
            out,
            "\nrelation-lock queues (every lock on a relation someone waits for):\n\
             {:<9} {:<16} {:<20} {:<7} {:<19} {:>8} {:>8} {:<12} {:<24} QUERY",
            "PID",
            "APPLICATION",
            "MODE",
            "LOCK",
            "HOLDER STATE",
            "XACT AGE",
            "WAITED",
            "BLOCKED BY",
            "RELATION"
        );
        for r in relations {
            let blocked: Vec<String> = r.blocked_by.iter().map(|&b| blocker_text(b)).collect();
            let _ = writeln!(
                out,
                "{:<9} {:<16} {:<20} {:<7} {:<19} {:>8} {:>8} {:<12} {:<24} {}",
                pid_text(r.pid),
                one_line(r.application_name.as_deref().unwrap_or(""), 16),
                r.mode,
                if r.granted { "held" } else { "waiting" },
                r.state.as_deref().unwrap_or(""),
                age_text(r.transaction_age),
                age_text(r.waited),
                blocked.join(","),
                r.relation,
                r.query
                    .as_deref()
                    .map(|q| one_line(q, 60))
                    .unwrap_or_default(),
            );
        }
    }
    let mut entries: Vec<Entry<'_>> = rows
        .iter()
        .map(|r| Entry::advisory(r, &calls, names))
        .collect();
    entries.extend(relations.unwrap_or_default().iter().map(Entry::relation));
    let chains = wait_chains(&entries);
    if !chains.is_empty() {
        out.push_str("\nwait chains (a holder, then who waits for it):\n");
        out.push_str(&chains);
    }
    let hidden = rows.iter().filter(|r| r.query_hidden).count();
    if hidden > 0 {
        let _ = writeln!(
            out,
            "\nnote: {hidden} lock(s) belong to sessions whose queries this role may not see; \
             grant it pg_read_all_stats to see them"
        );
    }
    if others
        .iter()
        .any(|r| r.granted && scope_text(r) == Scope::Unknown.as_str())
    {
        let _ = writeln!(
            out,
            "\nnote: SCOPE is `session` for a holder idle outside any transaction (only session locks \
             outlive a transaction), `transaction` for a prepared transaction and for lockkit's own \
             connections in their transaction, and `unknown` otherwise: pg_locks does not tell \
             session locks from transaction locks"
        );
    }
    let unknown: BTreeSet<String> = rows
        .iter()
        .filter(|r| unknown_type(r) && r.key.tag().is_some())
        .map(|r| type_names(r, names))
        .collect();
    let unknown_pairs = rows
        .iter()
        .any(|r| unknown_type(r) && matches!(r.key, LockKey::Pair(..)));
    if !unknown.is_empty() || unknown_pairs {
        let tags: Vec<&str> = unknown.iter().map(String::as_str).collect();
        let _ = writeln!(
            out,
            "\nnote: {} key(s) of unknown types{}. To name them: the application publishes its \
             key types at startup (`locker.publish_key_types(&mut client, \"app-name\")`, read \
             from the server by every later inspect), or name them here with -n NAMESPACE, \
             LOCKKIT_NAMESPACES or a namespaces file (`lockkit key NAMESPACE` prints a \
             namespace's tag); raw and hashtext keys carry no tag",
            rows.iter().filter(|r| unknown_type(r)).count(),
            if tags.is_empty() {
                String::new()
            } else {
                format!(" ({})", tags.join(", "))
            }
        );
    }
    if let Some(error) = &sources.published_error {
        let _ = writeln!(
            out,
            "\nnote: the published key types could not be read: {error}"
        );
    }
    let published = sources.published.unwrap_or_default();
    for c in collisions {
        let _ = writeln!(
            out,
            "warning: key types collide: {}",
            collision_text(c, published)
        );
    }
    out
}

/// One lock, advisory or relation, as the wait-chain tree draws it.
pub(crate) struct Entry<'a> {
    pid: Option<i32>,
    granted: bool,
    blocked_by: &'a [i32],
    /// `exclusive 42 (Order)` or `AccessShareLock on accounts`.
    what: String,
    app: Option<Cow<'a, str>>,
    state: Option<&'a str>,
    transaction_age: Option<Duration>,
    waited: Option<Duration>,
    query: Option<&'a str>,
}

impl<'a> Entry<'a> {
    /// An advisory lock; `calls` are the sessions' lockkit calls
    /// ([`calls`]).
    pub(crate) fn advisory(
        r: &'a AdvisoryLockRow,
        calls: &'a BTreeMap<i32, String>,
        names: &SemaphoreNames,
    ) -> Self {
        Entry {
            pid: r.pid,
            granted: r.granted,
            blocked_by: &r.blocked_by,
            what: match semaphore_of(r.key) {
                Some((base, slot)) => {
                    format!("a permit of {} (slot {slot})", semaphore_name(base, names))
                }
                None => format!("{} {} ({})", mode_name(r.mode), r.key, type_names(r, names)),
            },
            app: r.application_name.as_ref().map(|_| app_text(r)),
            state: r.state.as_deref(),
            transaction_age: r.transaction_age,
            waited: r.waited,
            query: query_text(r, calls),
        }
    }

    pub(crate) fn relation(r: &'a RelationLockRow) -> Self {
        Entry {
            pid: r.pid,
            granted: r.granted,
            blocked_by: &r.blocked_by,
            what: format!("{} on {}", r.mode, r.relation),
            app: r.application_name.as_deref().map(Cow::Borrowed),
            state: r.state.as_deref(),
            transaction_age: r.transaction_age,
            waited: r.waited,
            query: r.query.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn row(pid: i32, granted: bool, blocked_by: &[i32], key: i64) -> AdvisoryLockRow {
        let mut r = AdvisoryLockRow::new(LockKey::BigInt(key), Mode::Exclusive, granted, Some(pid));
        r.blocked_by = blocked_by.to_vec();
        r
    }

    #[test]
    fn timestamps_in_utc() {
        use std::time::{Duration, UNIX_EPOCH};
        assert_eq!(timestamp(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let at = UNIX_EPOCH + Duration::from_millis(1_709_210_096_789);
        assert_eq!(timestamp(at), "2024-02-29T12:34:56.789Z");
    }
}
