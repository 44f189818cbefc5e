//! `lockkit inspect`'s summary: what thousands of locks come to, in at
//! most [`SUMMARY_LINES`] lines, the default when the table would have
//! more than [`FULL_ROWS`] rows (`--full` lists them all).

use super::*;

/// The most rows `inspect` lists without `--full`.
pub(crate) const FULL_ROWS: usize = 40;

/// The most lines a summary takes.
pub(crate) const SUMMARY_LINES: usize = 40;

/// Holders and key types listed, the largest first.
const TOP: usize = 6;
/// Semaphores and waiters listed.
const FEW: usize = 3;

/// Whether `rows` would make a table longer than [`FULL_ROWS`]: a row per
/// lock, a semaphore's slots one row.
pub(crate) fn is_long(rows: &[AdvisoryLockRow]) -> bool {
    let (others, semaphores) = split_semaphores(rows);
    others.len() + semaphores.len() > FULL_ROWS
}

/// The summary: the totals and the longest wait, then the sessions that
/// hold the most locks, the key types, the semaphores and the longest
/// waits, each the largest first, then the notes, in at most
/// [`SUMMARY_LINES`] lines.
pub(crate) fn summary_text(
    rows: &[AdvisoryLockRow],
    relations: Option<&[RelationLockRow]>,
    collisions: &[Collision],
    sources: &Sources<'_>,
) -> String {
    let names = &sources.semaphores;
    let calls = calls(rows, names);
    let (others, semaphores) = split_semaphores(rows);
    let held = rows.iter().filter(|r| r.granted).count();
    let awaited: Vec<&AdvisoryLockRow> = rows.iter().filter(|r| !r.granted).collect();
    let waiting_sessions: BTreeSet<Option<i32>> = awaited.iter().map(|r| r.pid).collect();
    let mut lines: Vec<String> = Vec::new();
    let longest = awaited
        .iter()
        .filter(|r| r.waited.is_some())
        .max_by_key(|r| r.waited);
    lines.push(format!(
        "{} advisory locks: {held} held, {} awaited by {} session(s){}",
        rows.len(),
        awaited.len(),
        waiting_sessions.len(),
        match longest {
            Some(r) => format!(
                "; the longest wait {} by {} for {}",
                age_text(r.waited),
                pid_text(r.pid),
                what(r, names)
            ),
            None => String::new(),
        }
    ));
    // One count of locks, the first line's: the table `--full` prints
    // has fewer rows when a semaphore's slots make one entry.
    lines.push(
        "a summary: --full lists every lock, --graph dot|mermaid draws who waits for whom".into(),
    );

    // Holders: by pid, with the session's first row describing it.
    let mut by_pid: BTreeMap<Option<i32>, (&AdvisoryLockRow, usize, usize)> = BTreeMap::new();
    for r in rows {
        let e = by_pid.entry(r.pid).or_insert((r, 0, 0));
        if r.granted {
            e.1 += 1;
        } else {
            e.2 += 1;
        }
    }
    let mut holders: Vec<_> = by_pid.into_iter().filter(|(_, (_, h, _))| *h > 0).collect();
    holders.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(&b.0)));
    lines.push(String::new());
    lines.push(format!(
        "holders ({} session(s), the most locks first):",
        holders.len()
    ));
    lines.push(format!(
        "  {:<9} {:<28} {:<11} {:<19} {:>8} {:>6} {:>7}  CALL",
        "PID", "APPLICATION", "SCOPE", "STATE", "XACT AGE", "HELD", "WAITING"
    ));
    for (pid, (r, h, w)) in holders.iter().take(TOP) {
        lines.push(format!(
            "  {:<9} {:<28} {:<11} {:<19} {:>8} {:>6} {:>7}  {}",
            pid_text(*pid),
            one_line(&app_text(r), 28),
            scope_text(r),
            r.state.as_deref().unwrap_or(""),
            age_text(r.transaction_age),
            h,
            w,
            pid.and_then(|p| calls.get(&p))
                .map(|c| one_line(c, 70))
                .unwrap_or_default(),
        ));
    }
    if holders.len() > TOP {
        let rest: usize = holders.iter().skip(TOP).map(|(_, (_, h, _))| h).sum();
        lines.push(format!(
            "  … and {} more session(s), holding {rest} lock(s)",
            holders.len() - TOP
        ));
    }

    // Key types (a semaphore's slots count under the semaphore).
    let mut types: BTreeMap<String, (usize, usize, BTreeSet<Option<i32>>)> = BTreeMap::new();
    for r in &others {
        let e = types.entry(type_names(r, names)).or_default();
        if r.granted {
            e.0 += 1;
            e.2.insert(r.pid);
        } else {
            e.1 += 1;
        }
    }
    let mut types: Vec<_> = types.into_iter().collect();
    types.sort_by(|a, b| {
        (b.1 .0 + b.1 .1)
            .cmp(&(a.1 .0 + a.1 .1))
            .then(a.0.cmp(&b.0))
    });
    if !types.is_empty() {
        lines.push(String::new());
        lines.push(format!(
            "key types ({}, the most locks first):",
            types.len()
        ));
        lines.push(format!(
            "  {:<40} {:>7} {:>8} {:>8}",
            "TYPE", "HELD", "AWAITED", "HOLDERS"
        ));
        for (name, (h, w, by)) in types.iter().take(TOP) {
            lines.push(format!(
                "  {:<40} {:>7} {:>8} {:>8}",
                one_line(name, 40),
                h,
                w,
                by.len()
            ));
        }
        if types.len() > TOP {
            let rest: usize = types.iter().skip(TOP).map(|(_, (h, w, _))| h + w).sum();
            lines.push(format!(
                "  … and {} more type(s), {rest} lock(s)",
                types.len() - TOP
            ));
        }
    }

    if !semaphores.is_empty() {
        let mut sorted: Vec<&semaphore::Semaphore<'_>> = semaphores.iter().collect();
        sorted.sort_by_key(|s| std::cmp::Reverse((s.waiting(), s.held())));
        lines.push(String::new());
        lines.push(format!(
            "semaphores ({}, the most waiters first):",
            sorted.len()
        ));
        for s in sorted.iter().take(FEW) {
            let longest = s.waiters.iter().filter_map(|(_, r)| r.waited).max();
            lines.push(format!(
                "  {}: {} permit(s) held, {} session(s) wait{}",
                semaphore_name(s.base, names),
                s.held(),
                s.waiting(),
                longest
                    .map(|d| format!(", the longest {:.1}s", d.as_secs_f64()))
                    .unwrap_or_default()
            ));
        }
        if sorted.len() > FEW {
            lines.push(format!("  … and {} more", sorted.len() - FEW));
        }
    }

    if !awaited.is_empty() {
        let mut waits = awaited.clone();
        waits.sort_by_key(|r| std::cmp::Reverse(r.waited));
        lines.push(String::new());
        lines.push(format!(
            "waits ({} session(s), the longest first):",
            waiting_sessions.len()
        ));
        for r in waits.iter().take(FEW) {
            let blocked: Vec<String> = r
                .blocked_by
                .iter()
                .take(5)
                .map(|&b| blocker_text(b))
                .collect();
            let more = if r.blocked_by.len() > 5 { ",…" } else { "" };
            lines.push(format!(
                "  {}{} waits {} for {}, behind {}{more}",
                pid_text(r.pid),
                match app_text(r) {
                    a if a.is_empty() => String::new(),
                    a => format!(" [{}]", one_line(&a, 28)),
                },
                age_text(r.waited),
                what(r, names),
                blocked.join(","),
            ));
        }
        if waits.len() > FEW {
            lines.push(format!(
                "  … and {} more awaited lock(s)",
                waits.len() - FEW
            ));
        }
    }

    let mut notes = Vec::new();
    if let Some(relations) = relations {
        let waiting = relations.iter().filter(|r| !r.granted).count();
        notes.push(format!(
            "{} relation lock(s) on relations someone waits for, {waiting} awaited",
            relations.len()
        ));
    } else if sources.relation_waiters > 0 {
        notes.push(format!(
            "{} session(s) wait for relation locks (--all)",
            sources.relation_waiters
        ));
    }
    let hidden = rows.iter().filter(|r| r.query_hidden).count();
    if hidden > 0 {
        notes.push(format!(
            "{hidden} lock(s) of sessions whose queries this role may not see (pg_read_all_stats)"
        ));
    }
    let unknown = rows.iter().filter(|r| unknown_type(r)).count();
    if unknown > 0 {
        notes.push(format!(
            "{unknown} key(s) of unknown types (publish_key_types, or -n NAMESPACE)"
        ));
    }
    if !collisions.is_empty() {
        notes.push(format!(
            "{} key type collision(s) (--full)",
            collisions.len()
        ));
    }
    if let Some(error) = &sources.published_error {
        notes.push(format!(
            "the published key types could not be read: {}",
            one_line(error, 80)
        ));
    }
    if !notes.is_empty() {
        lines.push(String::new());
        lines.push(format!("note: {}", notes.join("; ")));
    }
    lines.truncate(SUMMARY_LINES);
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// What an awaited lock is: `a permit of semaphore Exporters`, `exclusive
/// 42 (Order)`.
fn what(r: &AdvisoryLockRow, names: &SemaphoreNames) -> String {
    match semaphore_of(r.key) {
        Some((base, _)) => format!("a permit of {}", semaphore_name(base, names)),
        None => format!("{} {} ({})", mode_name(r.mode), r.key, type_names(r, names)),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::row;
    use super::*;

    /// 5,000 locks of one holder, 100 of others, waiters: at most 40
    /// lines, with the totals, the largest holder first and the longest
    /// wait.
    #[test]
    fn thousands_of_locks_in_forty_lines() {
        let mut rows: Vec<AdvisoryLockRow> = (0..5_000).map(|k| row(10, true, &[], k)).collect();
        for pid in 20..120 {
            rows.push(row(pid, true, &[], 100_000 + i64::from(pid)));
        }
        for (i, pid) in (200..260).enumerate() {
            let mut r = row(pid, false, &[10], 7);
            r.waited = Some(Duration::from_millis(100 * i as u64));
            rows.push(r);
        }
        assert!(is_long(&rows));
        assert!(!is_long(&rows[..FULL_ROWS]));
        let text = summary_text(&rows, None, &[], &Sources::default());
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines.len() <= SUMMARY_LINES,
            "{} lines:\n{text}",
            lines.len()
        );
        assert!(
            lines[0].starts_with("5160 advisory locks: 5100 held, 60 awaited by 60 session(s); the longest wait 5.9s by 259"),
            "{text}"
        );
        // One count of the locks: a semaphore's slots making one table
        // row no longer gives a second, smaller one.
        assert!(!text.contains(" rows"), "{text}");
        let first = lines.iter().position(|l| l.starts_with("  PID")).unwrap();
        assert!(lines[first + 1].starts_with("  10 "), "{text}");
        assert!(lines[first + 1].contains(" 5000 "), "{text}");
        assert!(
            text.contains("… and 95 more session(s), holding 95 lock(s)"),
            "{text}"
        );
        assert!(text.contains("  259 waits 5.9s for exclusive 7"), "{text}");
    }
}
