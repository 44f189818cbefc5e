//! Who holds and who awaits advisory locks on the server, with the key types
//! behind the keys.
//!
//! [`advisory_locks`] reads `pg_locks` with `pg_stat_activity` and
//! `pg_blocking_pids` in one query; a [`KeyRegistry`] of the application's
//! key types names the namespace behind each key, from the namespace tag in
//! the top 16 bits of a hashed `BigInt` key or the class of a `Pair` key
//! (`docs/KEYS.md`).
//! [`KeyRegistry::linked`] knows every key type of the program (each type
//! that derives `AdvisoryKey`); [`published_key_types`] reads those the
//! applications published to the server
//! ([`Locker::publish_key_types`](crate::Locker::publish_key_types)), for
//! [`KeyRegistry::register_published`]. [`AdvisoryLockRow::lockkit_call`]
//! names the lockkit call a session runs, and
//! [`AdvisoryLockRow::fencing_token`] the token a session lock holds its
//! key with.
//!
//! # Example
//!
//! ```no_run
//! use lockkit::inspect::{advisory_locks, KeyRegistry};
//! use lockkit::AdvisoryKey;
//!
//! #[derive(AdvisoryKey)]
//! struct Order {
//!     id: i64,
//! }
//!
//! # async fn run(client: &tokio_postgres::Client) -> Result<(), lockkit::Error> {
//! let registry = KeyRegistry::new().register::<Order>();
//! assert!(registry.collisions().is_empty());
//! for row in advisory_locks(client, &registry).await? {
//!     let what = row.types.first().map_or("?", |t| t.namespace());
//!     println!("{:?} {what} {} granted={} blocked by {:?}", row.pid, row.key, row.granted, row.blocked_by);
//! }
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_postgres::types::Type;
use tokio_postgres::Client;

use crate::engine::error::Error;
use crate::engine::plan::Mode;
use crate::engine::sql;
use crate::fencing::FencingToken;
use crate::key::{AdvisoryKey, KeyForm, KeySpec, LockKey};

pub use crate::pg::publish::{published_key_types, PublishedKeyType};

/// The inspection statements (see [`sql`](crate::driver::sql)).
pub use crate::engine::sql::{
    ADVISORY_LOCKS, CLEAR_ACTIVITY_SNAPSHOT, RELATION_LOCK_QUEUES, SESSION_HOLDERS,
};

/// What `pg_stat_activity.query` shows for another role's session when the
/// inspecting role lacks `pg_read_all_stats`.
const HIDDEN_QUERY: &str = "<insufficient privilege>";

/// One advisory lock held or awaited, from [`advisory_locks`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct AdvisoryLockRow {
    /// The key.
    pub key: LockKey,
    /// Shared (`ShareLock`) or exclusive (`ExclusiveLock`).
    pub mode: Mode,
    /// Held (`true`) or awaited.
    pub granted: bool,
    /// The server process; `None` for a prepared transaction.
    pub pid: Option<i32>,
    /// The session's `application_name`.
    pub application_name: Option<String>,
    /// The session's role.
    pub user: Option<String>,
    /// The session's state (`active`, `idle`, `idle in transaction`, …);
    /// `None` when not visible to the inspecting role.
    pub state: Option<String>,
    /// Session- or transaction-level, as far as can be known ([`Scope`]).
    pub scope: Scope,
    /// How long the session's current transaction has been open; `None`
    /// outside a transaction or when not visible. An `idle` session is
    /// outside any, even while it runs one of the short transactions a
    /// backend runs on its own to catch up with catalog invalidations.
    pub transaction_age: Option<Duration>,
    /// How long an awaited lock has been waited for (PostgreSQL 14+).
    pub waited: Option<Duration>,
    /// The processes an awaited lock waits for (`pg_blocking_pids`); `0`
    /// stands for a prepared transaction (whose rows have no `pid`).
    pub blocked_by: Vec<i32>,
    /// The session's current or last query; `None` when not visible (see
    /// [`query_hidden`](Self::query_hidden)).
    pub query: Option<String>,
    /// Whether the server hid the query because the inspecting role may not
    /// see other roles' sessions (it needs `pg_read_all_stats`).
    pub query_hidden: bool,
    /// The registered key types the key decodes to: one normally, several
    /// when their tags collide, none when unknown (or a raw or `hashtext`
    /// key, which carry no tag).
    pub types: Vec<KeyType>,
    /// The fencing token a [`SessionLock`](crate::SessionLock) holds this
    /// key with ([`SessionLock::fencing_tokens`](crate::SessionLock::fencing_tokens)),
    /// as its connection's keepalive names it in `pg_stat_activity.query`:
    /// from the lock's first keepalive on, within one keepalive cadence of
    /// the grant, and until its connection's next statement (a multiplexed
    /// connection names the tokens of the keys that fit in 1,000 bytes).
    /// `None` for any other lock, for an awaited one, and while the query
    /// is another statement or hidden. A transaction-scoped lock's token
    /// ([`Config::fencing_tokens`](crate::Config::fencing_tokens)) is never
    /// shown: its transaction is the application's, and only the
    /// application's statements show there.
    pub fencing_token: Option<FencingToken>,
}

impl AdvisoryLockRow {
    /// A row with only the lock itself known; the other fields are public
    /// to fill in (for tools that build rows from elsewhere, and tests).
    pub fn new(key: LockKey, mode: Mode, granted: bool, pid: Option<i32>) -> Self {
        AdvisoryLockRow {
            key,
            mode,
            granted,
            pid,
            application_name: None,
            user: None,
            state: None,
            scope: Scope::Unknown,
            transaction_age: None,
            waited: None,
            blocked_by: Vec::new(),
            query: None,
            query_hidden: false,
            types: Vec::new(),
            fencing_token: None,
        }
    }
}

impl AdvisoryLockRow {
    /// The lockkit call behind the session's current (or last) statement,
    /// from the marker every lockkit lock statement starts with
    /// (`/* lockkit:batch_bigint */`, see [`sql`](crate::driver::sql)):
    /// `lock`, `lock_shared`, `try_lock`, `try_lock_shared`, `lock_batch`,
    /// `try_lock_batch`, `try_acquire_permit` (a semaphore permit's try),
    /// `lock_timeout` (the steps of a timed call around
    /// its lock statement), or `session lock` for a [`SessionLock`](crate::SessionLock)'s
    /// session (one lock's, or a multiplexed connection's, named
    /// [`MULTIPLEXED_NAME`](crate::pg::MULTIPLEXED_NAME)). `None` for any
    /// other statement. Reading the marker costs the lock calls nothing:
    /// their statements carry it already.
    pub fn lockkit_call(&self) -> Option<&'static str> {
        if self.session_lock_namespace().is_some()
            || self.application_name.as_deref() == Some(crate::pg::MULTIPLEXED_NAME)
        {
            return Some("session lock");
        }
        lockkit_call(self.query.as_deref()?)
    }

    /// The key type's namespace of a [`SessionLock`](crate::SessionLock)'s
    /// session, from its `application_name`
    /// (`lockkit session lock <namespace> <key>`); `None` for any other
    /// session.
    pub fn session_lock_namespace(&self) -> Option<&str> {
        session_lock_namespace(self.application_name.as_deref()?)
    }
}

/// The lockkit call a statement's text belongs to: see
/// [`AdvisoryLockRow::lockkit_call`].
///
/// ```
/// use lockkit::driver::sql;
/// use lockkit::inspect::lockkit_call;
///
/// assert_eq!(lockkit_call(sql::BATCH_BIGINT_EXCLUSIVE), Some("lock_batch"));
/// assert_eq!(lockkit_call("SELECT pg_advisory_xact_lock(1)"), None);
/// ```
pub fn lockkit_call(query: &str) -> Option<&'static str> {
    let marker = query.trim_start().strip_prefix("/* lockkit:")?;
    let name = &marker[..marker.find(" */")?];
    Some(match name {
        "lock_bigint" | "lock_pair" => "lock",
        "lock_bigint_shared" | "lock_pair_shared" => "lock_shared",
        "try_bigint" | "try_pair" => "try_lock",
        "try_bigint_shared" | "try_pair_shared" => "try_lock_shared",
        "try_batch_bigint" | "try_batch_pair" => "try_lock_batch",
        "try_permit" => "try_acquire_permit",
        n if n.starts_with("batch_") => "lock_batch",
        n if n.ends_with("_timeouts") => "lock_timeout",
        _ => return None,
    })
}

/// The key type's namespace in a [`SessionLock`](crate::SessionLock)'s
/// `application_name`, `lockkit session lock <namespace> <key>` (cut at
/// 63 bytes by the server, which may cut the key).
///
/// ```
/// use lockkit::inspect::session_lock_namespace;
///
/// assert_eq!(session_lock_namespace("lockkit session lock Payroll -35533"), Some("Payroll"));
/// assert_eq!(session_lock_namespace("billing"), None);
/// ```
pub fn session_lock_namespace(application_name: &str) -> Option<&str> {
    let rest = application_name.strip_prefix("lockkit session lock ")?;
    let namespace = rest.split(' ').next()?;
    (!namespace.is_empty()).then_some(namespace)
}

/// Whether a lock is held at session level (`pg_advisory_lock`, until
/// unlocked or the session ends) or transaction level
/// (`pg_advisory_xact_lock`, until the transaction ends).
///
/// `pg_locks` has no column for it, so it is inferred only where that is
/// sound, and is [`Scope::Unknown`] otherwise:
/// - a lock of a prepared transaction (no pid) is transaction-level;
/// - a lock held by a session that has been idle outside any transaction
///   block since before `pg_locks` was read is session-level, since a
///   transaction-level lock does not outlive its transaction
///   ([`SESSION_HOLDERS`]; the short transactions an idle backend runs on
///   its own to catch up with invalidations take no advisory lock);
/// - a session inside a transaction (active, or idle in transaction) may
///   hold either kind, and an awaited lock's kind is not shown anywhere.
///
/// "Idle since before" is read from `state_change`, which any message the
/// holder's backend processes moves, even one that runs no transaction. So
/// a session lock reads [`Scope::Unknown`] when its session sends anything
/// while the inspection runs, e.g. tokio-postgres closing the statement
/// that `execute(&str)` prepared, just after the reply. The next
/// inspection reads it as [`Scope::Session`] again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scope {
    /// Held until unlocked or the session ends.
    Session,
    /// Held until the transaction ends.
    Transaction,
    /// Either; nothing visible tells them apart.
    Unknown,
}

impl Scope {
    /// `session`, `transaction` or `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Session => "session",
            Scope::Transaction => "transaction",
            Scope::Unknown => "unknown",
        }
    }
}

fn seconds(value: Option<f64>) -> Option<Duration> {
    value
        .filter(|s| s.is_finite())
        .map(|s| Duration::from_secs_f64(s.max(0.0)))
}

/// Reads every advisory lock of the current database, held or awaited
/// ([`ADVISORY_LOCKS`]), decodes the keys through `registry`, and infers
/// each held lock's [`Scope`] ([`SESSION_HOLDERS`], a second statement).
///
/// Uses unnamed statements, so it also works through a transaction-mode
/// pooler. When some holder is idle, two more statements follow: one
/// discards the session's `pg_stat_activity` snapshot
/// ([`CLEAR_ACTIVITY_SNAPSHOT`]; PostgreSQL keeps one per transaction),
/// so that [`SESSION_HOLDERS`] reads a view taken after `pg_locks`, also
/// inside an explicit transaction.
///
/// # Errors
///
/// When a query fails, e.g. [`ErrorKind::Database`](crate::ErrorKind::Database) with code `42501` when the
/// role may not read `pg_locks` or `pg_stat_activity`.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn advisory_locks(
    client: &Client,
    registry: &KeyRegistry,
) -> Result<Vec<AdvisoryLockRow>, Error> {
    let rows = client.query_typed(ADVISORY_LOCKS, &[]).await?;
    let mut out = Vec::with_capacity(rows.len());
    let mut read_at: Option<String> = None;
    for row in rows {
        let classid: i64 = row.try_get(0)?;
        let objid: i64 = row.try_get(1)?;
        let objsubid: i16 = row.try_get(2)?;
        let Some(key) = LockKey::from_pg_locks(classid as u32, objid as u32, objsubid) else {
            continue;
        };
        let mode = match row.try_get::<_, &str>(3)? {
            "ShareLock" => Mode::Shared,
            _ => Mode::Exclusive,
        };
        let query: Option<String> = row.try_get(9)?;
        let query_hidden = query.as_deref() == Some(HIDDEN_QUERY);
        let pid: Option<i32> = row.try_get(5)?;
        let granted: bool = row.try_get(4)?;
        read_at = row.try_get(13)?;
        out.push(AdvisoryLockRow {
            key,
            mode,
            granted,
            pid,
            application_name: row.try_get(6)?,
            user: row.try_get(7)?,
            state: row.try_get(8)?,
            scope: if pid.is_none() && granted {
                Scope::Transaction
            } else {
                Scope::Unknown
            },
            transaction_age: seconds(row.try_get(12)?),
            waited: seconds(row.try_get(10)?),
            blocked_by: row.try_get(11)?,
            fencing_token: query
                .as_deref()
                .filter(|_| granted && !query_hidden)
                .and_then(|query| sql::announced_token(query, key)),
            query: if query_hidden { None } else { query },
            query_hidden,
            types: registry.decode(key).into_iter().cloned().collect(),
        });
    }
    let maybe_session = out
        .iter()
        .any(|r| r.granted && r.pid.is_some() && r.state.as_deref() == Some("idle"));
    if let (true, Some(read_at)) = (maybe_session, read_at) {
        client.query_typed(CLEAR_ACTIVITY_SNAPSHOT, &[]).await?;
        let idle = client
            .query_typed(SESSION_HOLDERS, &[(&read_at, Type::TEXT)])
            .await?;
        let idle: Vec<i32> = idle
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()?;
        for r in out.iter_mut().filter(|r| r.granted) {
            if r.pid.is_some_and(|p| idle.contains(&p)) {
                r.scope = Scope::Session;
            }
        }
    }
    Ok(out)
}

/// One relation lock held or awaited on a relation someone waits for, from
/// [`relation_lock_queues`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RelationLockRow {
    /// The relation's name (as `regclass` prints it).
    pub relation: String,
    /// The lock mode (`AccessShareLock`, `AccessExclusiveLock`, …).
    pub mode: String,
    /// Held (`true`) or awaited.
    pub granted: bool,
    /// The server process; `None` for a prepared transaction.
    pub pid: Option<i32>,
    /// The session's `application_name`.
    pub application_name: Option<String>,
    /// The session's role.
    pub user: Option<String>,
    /// The session's state.
    pub state: Option<String>,
    /// How long an awaited lock has been waited for (PostgreSQL 14+).
    pub waited: Option<Duration>,
    /// The processes an awaited lock waits for (`pg_blocking_pids`): the
    /// holders of conflicting locks and the requests queued ahead of it; `0`
    /// stands for a prepared transaction (whose rows have no `pid`).
    pub blocked_by: Vec<i32>,
    /// How long the session's transaction has been open.
    pub transaction_age: Option<Duration>,
    /// The session's current or last query; `None` when not visible.
    pub query: Option<String>,
}

/// Reads the relation-lock queues of the current database
/// ([`RELATION_LOCK_QUEUES`]): every relation lock, held or awaited, on a
/// relation that someone waits for. This shows a stuck DDL lock queue: an
/// `ALTER TABLE` waiting for `AccessExclusiveLock` behind a long reader, and
/// the new readers queued behind the `ALTER TABLE`.
///
/// # Errors
///
/// When the query fails, e.g. [`ErrorKind::Database`](crate::ErrorKind::Database) with code `42501` when the
/// role may not read `pg_locks` or `pg_stat_activity`.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn relation_lock_queues(client: &Client) -> Result<Vec<RelationLockRow>, Error> {
    let rows = client.query_typed(RELATION_LOCK_QUEUES, &[]).await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let query: Option<String> = row.try_get(7)?;
        out.push(RelationLockRow {
            relation: row.try_get(0)?,
            mode: row.try_get(1)?,
            granted: row.try_get(2)?,
            pid: row.try_get(3)?,
            application_name: row.try_get(4)?,
            user: row.try_get(5)?,
            state: row.try_get(6)?,
            waited: seconds(row.try_get(8)?),
            blocked_by: row.try_get(9)?,
            transaction_age: seconds(row.try_get(10)?),
            query: query.filter(|q| q != HIDDEN_QUERY),
        });
    }
    Ok(out)
}

/// A registered key type: what a [`KeyRegistry`] knows of it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KeyType {
    name: String,
    namespace: String,
    form: KeyForm,
    tag: u16,
    pair_class: i32,
}

impl KeyType {
    /// The type's name (`std::any::type_name`, or the name given to
    /// [`KeyRegistry::register_spec`]).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The type's namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The key space the type's keys are in.
    pub fn form(&self) -> KeyForm {
        self.form
    }

    /// The namespace tag of the type's `BigInt` keys (top 16 bits).
    pub fn tag(&self) -> u16 {
        self.tag
    }

    /// The class of the type's `Pair` keys.
    pub fn pair_class(&self) -> i32 {
        self.pair_class
    }

    /// What in a key names this type: the tag for hashed `BigInt` keys, the
    /// class for `Pair` keys, nothing for raw and `hashtext` keys.
    fn marker(&self) -> Option<Marker> {
        match self.form {
            KeyForm::BigInt => Some(Marker::Tag(self.tag)),
            KeyForm::Pair | KeyForm::PairExact => Some(Marker::PairClass(self.pair_class)),
            _ => None,
        }
    }
}

/// What two registered types share, so that their keys cannot be told
/// apart in `pg_locks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Marker {
    /// The 16-bit namespace tag of hashed `BigInt` keys.
    Tag(u16),
    /// The class of `Pair` keys.
    PairClass(i32),
}

/// Registered types whose keys carry the same [`Marker`]: a key with it is
/// ambiguous. For `BigInt` keys this is only a naming problem (the 48-bit
/// bodies keep the keys apart); for `Pair` keys in the same class, two
/// types' keys can be equal, and so exclude each other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Collision {
    /// The shared tag or class.
    pub marker: Marker,
    /// The types that share it, in registration order.
    pub types: Vec<KeyType>,
}

/// The application's key types, to name the type behind a key seen in
/// `pg_locks`.
///
/// ```
/// use lockkit::inspect::KeyRegistry;
/// use lockkit::{AdvisoryKey, KeySpec, LockKey};
///
/// #[derive(AdvisoryKey)]
/// struct Order { id: i64 }
///
/// let registry = KeyRegistry::new()
///     .register::<Order>()
///     .register_spec("Event", KeySpec::new("Event"));
/// // KEYS.md golden vector `Order { id: 42 }`.
/// let types = registry.decode(LockKey::BigInt(-7205368663365046133));
/// assert_eq!(types.len(), 1);
/// assert_eq!(types[0].namespace(), "Order");
/// assert!(registry.collisions().is_empty());
/// ```
#[derive(Clone, Debug, Default)]
pub struct KeyRegistry {
    types: Vec<KeyType>,
}

impl KeyRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `K` by its [`AdvisoryKey::KEY_SPEC`].
    pub fn register<K: AdvisoryKey + ?Sized>(self) -> Self {
        self.register_spec(std::any::type_name::<K>(), K::KEY_SPEC)
    }

    /// A registry of every key type of the program: each type that derives
    /// [`AdvisoryKey`] ([`linked_key_types`](crate::key::linked_key_types)),
    /// in the order of their paths.
    ///
    /// ```
    /// use lockkit::inspect::KeyRegistry;
    /// use lockkit::{AdvisoryKey, KeySpec};
    ///
    /// #[derive(AdvisoryKey)]
    /// #[advisory_key(namespace = "docs.registry")]
    /// struct Job {
    ///     id: i64,
    /// }
    ///
    /// let registry = KeyRegistry::linked();
    /// let key = KeySpec::new("docs.registry").key_of(&7_i64);
    /// assert_eq!(registry.decode(key)[0].namespace(), "docs.registry");
    /// ```
    pub fn linked() -> Self {
        let mut types: Vec<_> = crate::key::linked_key_types().collect();
        types.sort_by_key(|t| t.name());
        types
            .into_iter()
            .fold(Self::new(), |r, t| r.register_spec(t.name(), t.spec()))
    }

    /// Registers key types published to the server
    /// ([`published_key_types`]), each under its namespace: the same
    /// namespace published by several applications is one type (they lock
    /// the same keys on purpose). A type already registered with the same
    /// namespace, form and class is not registered again.
    pub fn register_published(mut self, types: &[PublishedKeyType]) -> Self {
        for published in types {
            let Some(spec) = published.spec() else {
                continue;
            };
            let known = self.types.iter().any(|t| {
                t.namespace == spec.namespace()
                    && t.form == spec.form()
                    && t.pair_class == spec.pair_class()
            });
            if !known {
                self = self.register_spec(spec.namespace(), spec);
            }
        }
        self
    }

    /// Registers a type by name and spec, e.g. a namespace given on a
    /// command line. Registering the same name and spec again does nothing.
    pub fn register_spec(mut self, name: impl Into<String>, spec: KeySpec<'_>) -> Self {
        let key_type = KeyType {
            name: name.into(),
            namespace: spec.namespace().to_owned(),
            form: spec.form(),
            tag: spec.tag(),
            pair_class: spec.pair_class(),
        };
        if !self.types.contains(&key_type) {
            self.types.push(key_type);
        }
        self
    }

    /// The registered types, in registration order.
    pub fn types(&self) -> &[KeyType] {
        &self.types
    }

    /// The registered types `key` may belong to: those of its tag (`BigInt`)
    /// or class (`Pair`). Several when tags collide; none when unknown.
    pub fn decode(&self, key: LockKey) -> Vec<&KeyType> {
        let marker = match key {
            LockKey::BigInt(_) => key.tag().map(Marker::Tag),
            LockKey::Pair(class, _) => Some(Marker::PairClass(class)),
        };
        self.types
            .iter()
            .filter(|t| marker.is_some() && t.marker() == marker)
            .collect()
    }

    /// Registered types whose tags (or pair classes) collide, including two
    /// types with one namespace.
    pub fn collisions(&self) -> Vec<Collision> {
        let mut by_marker: BTreeMap<Marker, Vec<KeyType>> = BTreeMap::new();
        for key_type in &self.types {
            if let Some(marker) = key_type.marker() {
                by_marker.entry(marker).or_default().push(key_type.clone());
            }
        }
        by_marker
            .into_iter()
            .filter(|(_, types)| types.len() > 1)
            .map(|(marker, types)| Collision { marker, types })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_by_tag_and_class() {
        let registry = KeyRegistry::new()
            .register_spec("Order", KeySpec::new("Order"))
            .register_spec("OrderPair", KeySpec::new("Order").pair())
            .register_spec("Classed", KeySpec::new("Classed").class(7))
            .register_spec("Raw", KeySpec::new("Raw").raw());
        let bigint = KeySpec::new("Order").key_of(&42_i64);
        let names = |key| {
            registry
                .decode(key)
                .iter()
                .map(|t| t.name().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(bigint), ["Order"]);
        assert_eq!(names(LockKey::Pair(-1677652607, 1)), ["OrderPair"]);
        assert_eq!(names(LockKey::Pair(7, 99)), ["Classed"]);
        assert!(names(LockKey::BigInt(0)).is_empty());
        assert!(registry.collisions().is_empty());
    }

    #[test]
    fn reports_collisions() {
        // Two types with one namespace, and two classes set by hand alike.
        let registry = KeyRegistry::new()
            .register_spec("a::Order", KeySpec::new("Order"))
            .register_spec("b::Order", KeySpec::new("Order"))
            .register_spec("a::Order", KeySpec::new("Order"))
            .register_spec("X", KeySpec::new("X").class(5))
            .register_spec("Y", KeySpec::new("Y").class(5))
            .register_spec("Z", KeySpec::new("Z"));
        let collisions = registry.collisions();
        assert_eq!(collisions.len(), 2, "{collisions:?}");
        assert_eq!(collisions[0].marker, Marker::Tag(0x9c01));
        assert_eq!(collisions[0].types.len(), 2);
        assert_eq!(collisions[1].marker, Marker::PairClass(5));
        assert_eq!(
            registry.decode(KeySpec::new("Order").key_of(&1_i64)).len(),
            2
        );
    }

    /// Distinct namespaces whose 16-bit tags are equal exist (the birthday
    /// bound says a few hundred suffice); the registry must report them.
    #[test]
    fn finds_a_real_tag_collision() {
        let mut seen: BTreeMap<u16, String> = BTreeMap::new();
        let (a, b) = (0..100_000)
            .find_map(|i| {
                let ns = format!("T{i}");
                let tag = KeySpec::try_new(&ns).unwrap().tag();
                seen.insert(tag, ns.clone()).map(|prev| (prev, ns))
            })
            .expect("a tag collision among 100000 namespaces");
        let registry = KeyRegistry::new()
            .register_spec(a.clone(), KeySpec::try_new(&a).unwrap())
            .register_spec(b.clone(), KeySpec::try_new(&b).unwrap());
        let collisions = registry.collisions();
        assert_eq!(collisions.len(), 1);
        assert_eq!(collisions[0].types[0].namespace(), a);
        assert_eq!(collisions[0].types[1].namespace(), b);
    }
}
