//! A semaphore's slots, as `lockkit inspect` shows them: one entry per
//! semaphore (KEYS.md, "Semaphore slots"), in the table's notes and in
//! JSON.

use super::*;

/// A semaphore as the output names it: `semaphore Exporters` when `names`
/// knows it, else `semaphore 0x35aae600`, its base (the object of its slot
/// 0, KEYS.md "Semaphore slots") in hex.
pub(super) fn semaphore_name(base: i32, names: &SemaphoreNames) -> String {
    match names.get(&base) {
        Some(name) => format!("semaphore {name}"),
        None => format!("semaphore 0x{:08x}", base as u32),
    }
}

/// The names of the semaphores that can be named, by base. A semaphore's
/// base is a one-way hash of the key that names it (KEYS.md), so a name is
/// found only from a key computed here:
/// - each type of `registry` (registered with `-n`, or published) names
///   the semaphore of its value without fields (a unit struct such as
///   `struct Exporters;`, the usual name of a fleet-wide semaphore), in its
///   key form;
/// - a `SessionLock`'s connection names its key in its `application_name`
///   (`lockkit session lock Exporters -123…`): the semaphore of that key,
///   when it holds or waits for a permit, is `Exporters -123…`.
pub(crate) fn semaphore_names(
    registry: &lockkit::inspect::KeyRegistry,
    rows: &[AdvisoryLockRow],
) -> SemaphoreNames {
    use lockkit::key::{semaphore_base, KeyForm};
    use lockkit_cli::keyarg::{compute, Form, KeyRequest};
    let mut names = SemaphoreNames::new();
    for t in registry.types() {
        let mut request = KeyRequest::new(Some(t.namespace()), Vec::new());
        match t.form() {
            KeyForm::BigInt => request.form = Form::BigInt,
            KeyForm::Pair => {
                request.form = Form::Pair;
                request.class = Some(t.pair_class());
            }
            _ => continue,
        }
        let Ok(keys) = compute(&request) else {
            continue;
        };
        for key in [keys.bigint, keys.pair].into_iter().flatten() {
            names
                .entry(semaphore_base(key))
                .or_insert_with(|| t.namespace().to_owned());
        }
    }
    for r in rows.iter().filter(|r| semaphore_of(r.key).is_some()) {
        let Some(app) = r.application_name.as_deref() else {
            continue;
        };
        let Some(namespace) = r.session_lock_namespace() else {
            continue;
        };
        let Some(key) = app
            .strip_prefix("lockkit session lock ")
            .and_then(|rest| rest.strip_prefix(namespace))
            .and_then(|rest| parse_key(rest.trim()))
        else {
            continue;
        };
        names
            .entry(semaphore_base(key))
            .or_insert_with(|| format!("{namespace} {key}"));
    }
    names
}

/// A key as `LockKey` displays it: `-42` or `(1, -2)`.
fn parse_key(text: &str) -> Option<LockKey> {
    if let Some(pair) = text.strip_prefix('(').and_then(|t| t.strip_suffix(')')) {
        let (class, object) = pair.split_once(',')?;
        return Some(LockKey::Pair(
            class.trim().parse().ok()?,
            object.trim().parse().ok()?,
        ));
    }
    text.parse().ok().map(LockKey::BigInt)
}

/// The slots of one semaphore that `pg_locks` shows, as one entry: the
/// rows of its slots held and of its slots awaited, each with its slot.
#[derive(Debug)]
pub(super) struct Semaphore<'a> {
    /// The object of its slot 0 ([`lockkit::key::semaphore_base`]).
    pub(super) base: i32,
    pub(super) holders: Vec<(u8, &'a AdvisoryLockRow)>,
    pub(super) waiters: Vec<(u8, &'a AdvisoryLockRow)>,
}

impl Semaphore<'_> {
    /// Its slots held (a slot is held by one session, unless someone took
    /// it shared outside lockkit).
    pub(super) fn held(&self) -> usize {
        self.holders
            .iter()
            .map(|&(slot, _)| slot)
            .collect::<BTreeSet<_>>()
            .len()
    }

    /// Its JSON object: its name, base and class, how many slots are held
    /// and how many sessions wait, and its holders' and waiters' rows (each
    /// as `lock` writes one, with its slot).
    pub(super) fn json(
        &self,
        lock: &impl Fn(&AdvisoryLockRow) -> Value,
        names: &SemaphoreNames,
    ) -> Value {
        let slots = |rows: &[(u8, &AdvisoryLockRow)]| -> Vec<Value> {
            rows.iter()
                .map(|&(slot, r)| {
                    let mut doc = lock(r);
                    doc["slot"] = json!(slot);
                    doc
                })
                .collect()
        };
        json!({
            "semaphore": format!("0x{:08x}", self.base as u32),
            "name": names.get(&self.base),
            "base": self.base,
            "class": SEMAPHORE_CLASS,
            "held": self.held(),
            "waiting": self.waiting(),
            "holders": slots(&self.holders),
            "waiters": slots(&self.waiters),
        })
    }

    /// The sessions waiting for one of its slots.
    pub(super) fn waiting(&self) -> usize {
        self.waiters
            .iter()
            .map(|(_, r)| r.pid)
            .collect::<BTreeSet<_>>()
            .len()
    }
}

/// The rows split in two: the rows of every other key, in order, and the
/// semaphores whose slots the rest are, in order of first appearance, each
/// one entry ([`semaphore_of`]).
pub(super) fn split_semaphores(
    rows: &[AdvisoryLockRow],
) -> (Vec<&AdvisoryLockRow>, Vec<Semaphore<'_>>) {
    let mut others = Vec::new();
    let mut semaphores: Vec<Semaphore<'_>> = Vec::new();
    for r in rows {
        let Some((base, slot)) = semaphore_of(r.key) else {
            others.push(r);
            continue;
        };
        let i = match semaphores.iter().position(|s| s.base == base) {
            Some(i) => i,
            None => {
                semaphores.push(Semaphore {
                    base,
                    holders: Vec::new(),
                    waiters: Vec::new(),
                });
                semaphores.len() - 1
            }
        };
        let semaphore = &mut semaphores[i];
        if r.granted {
            semaphore.holders.push((slot, r));
        } else {
            semaphore.waiters.push((slot, r));
        }
    }
    for s in &mut semaphores {
        s.holders.sort_by_key(|&(slot, r)| (slot, r.pid));
        s.waiters.sort_by_key(|&(slot, r)| (slot, r.pid));
    }
    (others, semaphores)
}

/// A session of a semaphore's entry: `101 [app] (slot 0)`, or for a
/// waiter `104 [app] (for slot 0, 2.3s)`.
fn slot_session(slot: u8, r: &AdvisoryLockRow) -> String {
    let app = app_text(r);
    let app = if app.is_empty() {
        String::new()
    } else {
        format!(" [{}]", one_line(&app, 40))
    };
    let waited = if r.granted {
        String::new()
    } else {
        r.waited
            .map(|d| format!(", {:.1}s", d.as_secs_f64()))
            .unwrap_or_default()
    };
    let slot = match (r.granted, r.fencing_token) {
        (true, Some(token)) => format!("slot {slot}, fencing token {token}"),
        (true, None) => format!("slot {slot}"),
        (false, _) => format!("for slot {slot}"),
    };
    format!("{}{app} ({slot}{waited})", pid_text(r.pid))
}

/// A semaphore's entry, one line: `semaphore 0x35aae600: 3 slots held, by
/// 101 (slot 0), …; 1 session waits: 104 (for slot 0, 2.3s)`.
pub(super) fn semaphore_text(s: &Semaphore<'_>, names: &SemaphoreNames) -> String {
    let held = s.held();
    let holders: Vec<String> = s
        .holders
        .iter()
        .map(|&(slot, r)| slot_session(slot, r))
        .collect();
    let waiters = match s.waiting() {
        0 => "no session waits".to_owned(),
        n => {
            let waiters: Vec<String> = s
                .waiters
                .iter()
                .map(|&(slot, r)| slot_session(slot, r))
                .collect();
            format!(
                "{n} session{} {}: {}",
                if n == 1 { "" } else { "s" },
                if n == 1 { "waits" } else { "wait" },
                waiters.join(", ")
            )
        }
    };
    let holders = if holders.is_empty() {
        String::new()
    } else {
        format!(", by {}", holders.join(", "))
    };
    format!(
        "{}: {held} slot{} held{holders}; {waiters}\n",
        semaphore_name(s.base, names),
        if held == 1 { "" } else { "s" },
    )
}

#[cfg(test)]
mod tests {
    use super::super::tests::row;
    use super::super::*;
    use super::*;

    /// Three holders and a waiter of one semaphore are one entry, in the
    /// text and in JSON; another semaphore is another entry, and a lock of
    /// another key keeps its row.
    #[test]
    fn a_semaphore_is_one_entry() {
        use lockkit::key::{semaphore_base, semaphore_slot};
        let named = LockKey::BigInt(42);
        let slot = |pid: i32, granted: bool, blocked_by: &[i32], s: u8| {
            let mut r = AdvisoryLockRow::new(
                semaphore_slot(named, s),
                Mode::Exclusive,
                granted,
                Some(pid),
            );
            r.blocked_by = blocked_by.to_vec();
            r
        };
        let other = LockKey::Pair(1, 2);
        let rows = [
            row(7, true, &[], 9),
            slot(10, true, &[], 0),
            slot(11, true, &[], 1),
            slot(12, true, &[], 2),
            slot(13, false, &[11], 1),
            AdvisoryLockRow::new(semaphore_slot(other, 4), Mode::Exclusive, true, None),
        ];
        let base = format!("0x{:08x}", semaphore_base(named) as u32);
        let text = inspect_text(&rows, None, &[], &Sources::default());
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("PID "), "{text}");
        assert!(lines[1].starts_with("7 "), "{text}");
        assert!(
            !text.contains(&SEMAPHORE_CLASS.to_string()),
            "no slot row in the table: {text}"
        );
        let entry = format!(
            "semaphore {base}: 3 slots held, by 10 (slot 0), 11 (slot 1), 12 (slot 2); \
             1 session waits: 13 (for slot 1)"
        );
        assert!(lines.contains(&entry.as_str()), "{text}");
        let entry = format!(
            "semaphore 0x{:08x}: 1 slot held, by prepared (slot 4); no session waits",
            semaphore_base(other) as u32
        );
        assert!(lines.contains(&entry.as_str()), "{text}");
        assert!(
            text.contains(&format!("11 holds a permit of semaphore {base} (slot 1)")),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "└── 13 waits for a permit of semaphore {base} (slot 1)"
            )),
            "{text}"
        );
        // Only the BigInt key is of an unknown type: a slot is a semaphore's.
        assert!(text.contains("note: 1 key(s) of unknown types"), "{text}");

        let doc = inspect_json(&rows, None, &[], &Sources::default());
        assert_eq!(doc["locks"].as_array().unwrap().len(), 1, "{doc:#}");
        assert_eq!(doc["locks"][0]["pid"], 7);
        let semaphores = doc["semaphores"].as_array().unwrap();
        assert_eq!(semaphores.len(), 2, "{doc:#}");
        let s = &semaphores[0];
        assert_eq!(s["semaphore"], base.as_str());
        assert_eq!(s["base"], semaphore_base(named));
        assert_eq!(s["class"], SEMAPHORE_CLASS);
        assert_eq!(s["held"], 3);
        assert_eq!(s["waiting"], 1);
        let pids = |k: &str| -> Vec<Value> {
            s[k].as_array()
                .unwrap()
                .iter()
                .map(|h| h["pid"].clone())
                .collect()
        };
        assert_eq!(pids("holders"), [json!(10), json!(11), json!(12)]);
        assert_eq!(pids("waiters"), [json!(13)]);
        assert_eq!(s["holders"][1]["slot"], 1);
        assert_eq!(s["waiters"][0]["blocked_by"], json!([11]));

        // Only semaphores: no table, and not "no advisory locks".
        let text = inspect_text(&rows[1..], None, &[], &Sources::default());
        assert!(text.starts_with("semaphores "), "{text}");
        assert!(!text.contains("no advisory locks"), "{text}");
    }
}
