//! The server settings that decide how locks behave, as `lockkit check`
//! reports them: each with what it means for lockkit and a recommendation
//! where one applies.

use std::time::Duration;

/// The settings `lockkit check` reads from `pg_settings`, in report order.
pub const NAMES: [&str; 6] = [
    "log_lock_waits",
    "deadlock_timeout",
    "lock_timeout",
    "statement_timeout",
    "idle_in_transaction_session_timeout",
    "idle_session_timeout",
];

/// The statement reading them: `name text, setting text, unit text`
/// (the unit of a time setting, e.g. `ms`; `NULL` for a bool). A setting
/// the server does not have (`idle_session_timeout` before PostgreSQL 14)
/// has no row.
pub const SETTINGS_SQL: &str = "SELECT name, setting, unit FROM pg_settings \
     WHERE name IN ('log_lock_waits', 'deadlock_timeout', 'lock_timeout', 'statement_timeout', \
     'idle_in_transaction_session_timeout', 'idle_session_timeout')";

/// The keep-alive interval of a session lock that `lockkit check` assumes
/// unless told otherwise (`--session-keepalive`): `SessionLock`'s own
/// default.
pub const DEFAULT_KEEPALIVE: Duration = lockkit::pg::DEFAULT_KEEPALIVE;

/// One setting, assessed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Assessment {
    /// The setting's name.
    pub name: &'static str,
    /// Its value as shown (`on`, `1s`, `off`).
    pub value: String,
    /// What it means for lockkit.
    pub meaning: String,
    /// What to change, if anything.
    pub recommendation: Option<String>,
}

/// A time setting's value in milliseconds, from `pg_settings` (`setting`,
/// `unit`); `None` when it is not a time in a known unit.
pub fn millis(setting: &str, unit: Option<&str>) -> Option<u64> {
    let n: u64 = setting.parse().ok()?;
    let factor = match unit? {
        "us" => return Some(n / 1000),
        "ms" => 1,
        "s" => 1000,
        "min" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    n.checked_mul(factor)
}

fn show(ms: u64) -> String {
    match ms {
        0 => "off".into(),
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    }
}

/// Assesses one setting, given as `pg_settings` has it. `keepalive` is the
/// session locks' keep-alive interval: a session lock's connection idles
/// that long between keep-alives. `None` for a setting not in [`NAMES`] or
/// a value that does not parse.
pub fn assess(
    name: &str,
    setting: &str,
    unit: Option<&str>,
    keepalive: Duration,
) -> Option<Assessment> {
    let name = *NAMES.iter().find(|n| **n == name)?;
    let keepalive_ms = u64::try_from(keepalive.as_millis()).unwrap_or(u64::MAX);
    let (value, meaning, recommendation) = if name == "log_lock_waits" {
        let on = match setting {
            "on" => true,
            "off" => false,
            _ => return None,
        };
        (
            setting.to_owned(),
            "whether the server logs every lock wait longer than deadlock_timeout, \
             with the waiting and the holding processes"
                .to_owned(),
            (!on).then(|| {
                "turn it on (ALTER SYSTEM SET log_lock_waits = on; SELECT pg_reload_conf()): \
                 lock waits that bite only sometimes are then found in the server log"
                    .to_owned()
            }),
        )
    } else {
        let ms = millis(setting, unit)?;
        let value = show(ms);
        match name {
            "deadlock_timeout" => (
                value.clone(),
                "how long a lock wait lasts before the server checks for a deadlock (a deadlock \
                 among lockkit's own sorted locks cannot happen; one with other locks fails \
                 with 40P01 after this long), and the threshold of log_lock_waits"
                    .to_owned(),
                (ms > 5000).then(|| {
                    format!(
                        "deadlocks are broken only after {value} and shorter lock waits are never \
                         logged: consider the default, 1s"
                    )
                }),
            ),
            "lock_timeout" if ms == 0 => (
                value,
                "lock waits are not bounded by default: an untimed lockkit lock waits as long as \
                 its holder holds; lockkit's timed calls set their own bound for the call"
                    .to_owned(),
                Some(
                    "keep it off globally, but run DDL (migrations) under a short lock_timeout \
                     and retry: an ALTER TABLE waiting for its lock blocks every later reader of \
                     the table"
                        .to_owned(),
                ),
            ),
            "lock_timeout" => (
                value.clone(),
                format!(
                    "every lock wait is bounded: an untimed lockkit lock fails with 55P03 \
                     (lock_not_available) after {value}; lockkit's timed calls set their own \
                     bound for the call"
                ),
                None,
            ),
            "statement_timeout" if ms == 0 => (
                value,
                "statements are not bounded; a lock wait is part of its statement's time"
                    .to_owned(),
                None,
            ),
            "statement_timeout" => (
                value.clone(),
                format!(
                    "a lock call (a statement) that waits longer than {value} is cancelled with \
                     57014 (query_canceled); lockkit's timed calls set their own bound for the call"
                ),
                None,
            ),
            "idle_in_transaction_session_timeout" if ms == 0 => (
                value,
                "off: a session idle inside a transaction is never terminated, so a session \
                 lock's open transaction stays until it ends (and a transaction an \
                 application forgot open keeps its locks)"
                    .to_owned(),
                None,
            ),
            "idle_in_transaction_session_timeout" => (
                value.clone(),
                format!(
                    "a session idle inside a transaction for {value} is terminated, which \
                     releases every lock it holds: a transaction holding lockkit locks while the \
                     application awaits something else loses them, and its next statement fails"
                ),
                (ms > 0 && ms < keepalive_ms).then(|| {
                    format!(
                        "{value} is shorter than a session lock's keep-alive interval ({}): a \
                         connection that waits that long inside a transaction is terminated and \
                         its locks released; raise it above the keep-alive or set it per role",
                        show(keepalive_ms)
                    )
                }),
            ),
            "idle_session_timeout" if ms == 0 => (
                value,
                "off: a session idle outside a transaction is never terminated, so a \
                 session-level lock stays until its session ends"
                    .to_owned(),
                None,
            ),
            "idle_session_timeout" => (
                value.clone(),
                format!(
                    "a session idle outside a transaction for {value} is terminated, which \
                     releases its session locks: a session lock's dedicated connection is idle \
                     between keep-alives"
                ),
                (ms > 0 && ms < keepalive_ms).then(|| {
                    format!(
                        "{value} is shorter than a session lock's keep-alive interval ({}): the \
                         server would end a session lock's connection, and release the lock, \
                         between two keep-alives; raise it above the keep-alive or turn it off \
                         for the role that takes session locks",
                        show(keepalive_ms)
                    )
                }),
            ),
            _ => return None,
        }
    };
    Some(Assessment {
        name,
        value,
        meaning,
        recommendation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: Duration = DEFAULT_KEEPALIVE;

    #[test]
    fn units_and_values() {
        assert_eq!(millis("1000", Some("ms")), Some(1000));
        assert_eq!(millis("2", Some("s")), Some(2000));
        assert_eq!(millis("2", Some("min")), Some(120_000));
        assert_eq!(millis("x", Some("ms")), None);
        assert_eq!(millis("5", None), None);
        assert_eq!(show(0), "off");
        assert_eq!(show(1500), "1500ms");
        assert_eq!(show(2000), "2s");
    }

    #[test]
    fn recommendations() {
        let rec = |name, setting, unit| assess(name, setting, unit, K).unwrap().recommendation;
        assert!(rec("log_lock_waits", "off", None).is_some());
        assert!(rec("log_lock_waits", "on", None).is_none());
        assert!(rec("deadlock_timeout", "1000", Some("ms")).is_none());
        assert!(rec("deadlock_timeout", "60000", Some("ms")).is_some());
        assert!(rec("lock_timeout", "0", Some("ms")).is_some());
        assert!(rec("idle_in_transaction_session_timeout", "0", Some("ms")).is_none());
        assert!(rec("idle_in_transaction_session_timeout", "4000", Some("ms")).is_some());
        assert!(rec("idle_in_transaction_session_timeout", "60000", Some("ms")).is_none());
        assert!(rec("idle_session_timeout", "4000", Some("ms")).is_some());
        // Off reads as off, not as a time.
        let off = assess("idle_in_transaction_session_timeout", "0", Some("ms"), K).unwrap();
        assert_eq!(off.value, "off");
        assert!(off.meaning.starts_with("off: "), "{}", off.meaning);
        assert!(!off.meaning.contains("for off"), "{}", off.meaning);
        let off = assess("idle_session_timeout", "0", Some("ms"), K).unwrap();
        assert!(off.meaning.starts_with("off: "), "{}", off.meaning);
        // The keep-alive is a parameter.
        let short = assess(
            "idle_session_timeout",
            "5000",
            Some("ms"),
            Duration::from_secs(1),
        );
        assert!(short.unwrap().recommendation.is_none());
        assert!(assess("work_mem", "4096", Some("kB"), K).is_none());
        assert!(assess("log_lock_waits", "maybe", None, K).is_none());
    }
}
