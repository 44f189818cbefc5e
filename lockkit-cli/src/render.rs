//! How `lockkit` prints: the lock table, the wait-chain tree, JSON.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use lockkit::inspect::{AdvisoryLockRow, Collision, Marker};
use lockkit::{LockKey, Mode};
use serde_json::{json, Value};

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

fn type_names(row: &AdvisoryLockRow) -> String {
    if row.types.is_empty() {
        return "?".into();
    }
    let mut names: Vec<&str> = row.types.iter().map(|t| t.namespace()).collect();
    names.dedup();
    names.join("|")
}

fn collision_text(c: &Collision) -> String {
    let what = match c.marker {
        Marker::Tag(tag) => format!("BigInt tag 0x{tag:04x}"),
        Marker::PairClass(class) => format!("Pair class {class}"),
        _ => "marker".into(),
    };
    let names: Vec<&str> = c.types.iter().map(|t| t.namespace()).collect();
    format!("{} share the {what}", names.join(", "))
}

/// The rows and collisions as one JSON document.
pub(crate) fn inspect_json(rows: &[AdvisoryLockRow], collisions: &[Collision]) -> Value {
    let locks: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "key": key_json(r.key),
                "mode": mode_name(r.mode),
                "granted": r.granted,
                "pid": r.pid,
                "application_name": r.application_name,
                "user": r.user,
                "state": r.state,
                "waited_seconds": r.waited.map(|d| d.as_secs_f64()),
                "blocked_by": r.blocked_by,
                "query": r.query,
                "query_hidden": r.query_hidden,
                "types": r.types.iter().map(|t| json!({"name": t.name(), "namespace": t.namespace()})).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "locks": locks,
        "collisions": collisions.iter().map(collision_text).collect::<Vec<_>>(),
    })
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

fn pid_text(pid: Option<i32>) -> String {
    pid.map_or_else(|| "prepared".into(), |p| p.to_string())
}

/// The table, the wait chains and the notes, for a terminal.
pub(crate) fn inspect_text(rows: &[AdvisoryLockRow], collisions: &[Collision]) -> String {
    let mut out = String::new();
    if rows.is_empty() {
        out.push_str("no advisory locks held or awaited in this database\n");
    } else {
        let _ = writeln!(
            out,
            "{:<9} {:<16} {:<9} {:<7} {:>8} {:<12} {:<28} {:<16} QUERY",
            "PID", "APPLICATION", "MODE", "STATE", "WAITED", "BLOCKED BY", "KEY", "TYPE"
        );
        for r in rows {
            let blocked: Vec<String> = r.blocked_by.iter().map(i32::to_string).collect();
            let query = match (&r.query, r.query_hidden) {
                (_, true) => "<hidden: needs pg_read_all_stats>".to_owned(),
                (Some(q), false) => one_line(q, 60),
                (None, false) => String::new(),
            };
            let _ = writeln!(
                out,
                "{:<9} {:<16} {:<9} {:<7} {:>8} {:<12} {:<28} {:<16} {}",
                pid_text(r.pid),
                one_line(r.application_name.as_deref().unwrap_or(""), 16),
                mode_name(r.mode),
                if r.granted { "held" } else { "waiting" },
                r.waited
                    .map_or(String::new(), |d| format!("{:.1}s", d.as_secs_f64())),
                blocked.join(","),
                r.key.to_string(),
                type_names(r),
                query,
            );
        }
        let chains = wait_chains(rows);
        if !chains.is_empty() {
            out.push_str("\nwait chains (a holder, then who waits for it):\n");
            out.push_str(&chains);
        }
    }
    let hidden = rows.iter().filter(|r| r.query_hidden).count();
    if hidden > 0 {
        let _ = writeln!(
            out,
            "\nnote: {hidden} lock(s) belong to sessions whose queries this role may not see; \
             grant it pg_read_all_stats to see them"
        );
    }
    for c in collisions {
        let _ = writeln!(
            out,
            "warning: registered namespaces collide: {}",
            collision_text(c)
        );
    }
    out
}

/// The wait-for graph drawn as trees: each root is a session others wait
/// for that waits for nobody; its children wait for it. Sessions caught in
/// a cycle (a deadlock being detected) are drawn from the smallest pid.
pub(crate) fn wait_chains(rows: &[AdvisoryLockRow]) -> String {
    // waiter -> blockers, and blocker -> waiters.
    let mut waits: BTreeMap<i32, &AdvisoryLockRow> = BTreeMap::new();
    let mut waiters_of: BTreeMap<i32, BTreeSet<i32>> = BTreeMap::new();
    for r in rows.iter().filter(|r| !r.granted) {
        let Some(pid) = r.pid else { continue };
        waits.insert(pid, r);
        for &b in &r.blocked_by {
            waiters_of.entry(b).or_default().insert(pid);
        }
    }
    if waits.is_empty() {
        return String::new();
    }
    let mut held: BTreeMap<i32, Vec<&AdvisoryLockRow>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.granted) {
        if let Some(pid) = r.pid {
            held.entry(pid).or_default().push(r);
        }
    }
    let label = |pid: i32| -> String {
        let app = |r: &AdvisoryLockRow| {
            r.application_name
                .as_deref()
                .filter(|a| !a.is_empty())
                .map(|a| format!(" [{a}]"))
                .unwrap_or_default()
        };
        if let Some(r) = waits.get(&pid) {
            let waited = r
                .waited
                .map(|d| format!(" {:.1}s", d.as_secs_f64()))
                .unwrap_or_default();
            let query = r
                .query
                .as_deref()
                .map(|q| format!(": {}", one_line(q, 60)))
                .unwrap_or_default();
            format!(
                "{pid}{} waits{waited} for {} {} ({}){query}",
                app(r),
                mode_name(r.mode),
                r.key,
                type_names(r)
            )
        } else if let Some(rs) = held.get(&pid) {
            let keys: Vec<String> = rs
                .iter()
                .take(3)
                .map(|r| format!("{} {} ({})", mode_name(r.mode), r.key, type_names(r)))
                .collect();
            let more = if rs.len() > 3 {
                format!(" and {} more", rs.len() - 3)
            } else {
                String::new()
            };
            format!("{pid}{} holds {}{more}", app(rs[0]), keys.join(", "))
        } else {
            format!("{pid} (holds no advisory lock here)")
        }
    };
    let mut roots: Vec<i32> = waiters_of
        .keys()
        .copied()
        .filter(|b| !waits.contains_key(b))
        .collect();
    let mut tree = Tree {
        waiters_of: &waiters_of,
        label: &label,
        seen: BTreeSet::new(),
        out: String::new(),
    };
    loop {
        for root in roots.drain(..) {
            tree.draw(root, "", true, true);
        }
        // Waiters not reached: a cycle. Start from the smallest.
        match waits.keys().find(|p| !tree.seen.contains(p)) {
            Some(&p) => roots.push(p),
            None => break,
        }
    }
    tree.out
}

/// Draws the wait-for graph depth first.
struct Tree<'a> {
    waiters_of: &'a BTreeMap<i32, BTreeSet<i32>>,
    label: &'a dyn Fn(i32) -> String,
    seen: BTreeSet<i32>,
    out: String,
}

impl Tree<'_> {
    fn draw(&mut self, pid: i32, prefix: &str, last: bool, root: bool) {
        let (branch, next) = match (root, last) {
            (true, _) => ("", String::new()),
            (false, true) => ("└── ", format!("{prefix}    ")),
            (false, false) => ("├── ", format!("{prefix}│   ")),
        };
        if !self.seen.insert(pid) {
            let _ = writeln!(self.out, "{prefix}{branch}{pid} (cycle: a deadlock)");
            return;
        }
        let _ = writeln!(self.out, "{prefix}{branch}{}", (self.label)(pid));
        if let Some(children) = self.waiters_of.get(&pid) {
            let n = children.len();
            for (i, &child) in children.iter().enumerate() {
                self.draw(child, &next, i + 1 == n, false);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(pid: i32, granted: bool, blocked_by: &[i32], key: i64) -> AdvisoryLockRow {
        let mut r = AdvisoryLockRow::new(LockKey::BigInt(key), Mode::Exclusive, granted, Some(pid));
        r.blocked_by = blocked_by.to_vec();
        r
    }

    #[test]
    fn draws_chains_and_cycles() {
        let rows = [
            row(10, true, &[], 1),
            row(11, false, &[10], 1),
            row(12, false, &[11], 2),
            row(13, false, &[10], 1),
            row(20, false, &[21], 3),
            row(21, false, &[20], 4),
        ];
        let text = wait_chains(&rows);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("10 holds exclusive 1"), "{text}");
        assert!(lines[1].starts_with("├── 11 waits"), "{text}");
        assert!(lines[2].starts_with("│   └── 12 waits"), "{text}");
        assert!(lines[3].starts_with("└── 13 waits"), "{text}");
        assert!(lines[4].starts_with("20 waits"), "{text}");
        assert!(lines[5].starts_with("└── 21 waits"), "{text}");
        assert!(lines[6].contains("20 (cycle"), "{text}");
        assert_eq!(lines.len(), 7, "{text}");
        assert!(wait_chains(&rows[..1]).is_empty());
    }
}
