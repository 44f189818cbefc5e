//! The wait-for graph of one snapshot: who waits directly for whom, the
//! cycles in it (deadlocks), and its drawing as trees.
//!
//! `pg_blocking_pids` names, for a waiter, every session it waits for: the
//! holders of conflicting locks and every conflicting request queued
//! ahead of it. In a queue of five on one key, the fifth is blocked by the
//! holder and the four ahead, so the same waiter is reached along several
//! paths; that is no cycle. A cycle is a session that waits, through
//! others, for itself: a strongly connected component of more than one
//! session ([`cycles`]).

use super::*;

/// The sessions a waiter waits for, by waiter.
pub(crate) type Edges = BTreeMap<i32, BTreeSet<i32>>;

/// The wait-for cycles of `edges` (each waiter to every session it waits
/// for): each strongly connected component of more than one session, its
/// pids ascending, the cycles ordered by their smallest pid. A session
/// reached twice along two paths (a waiter behind both the holder and the
/// waiter ahead of it) is in none. Iterative (Tarjan's algorithm), so a
/// queue of thousands takes no deep recursion.
pub(crate) fn cycles(edges: &Edges) -> Vec<Vec<i32>> {
    let none = BTreeSet::new();
    let successors = |v: i32| edges.get(&v).unwrap_or(&none).iter();
    // pid -> (its visit index, the smallest index reachable from it).
    let mut index: BTreeMap<i32, (usize, usize)> = BTreeMap::new();
    let mut on_stack: BTreeSet<i32> = BTreeSet::new();
    let mut stack: Vec<i32> = Vec::new();
    let mut found = Vec::new();
    let mut next = 0_usize;
    for &start in edges.keys() {
        if index.contains_key(&start) {
            continue;
        }
        let mut path = Vec::new();
        index.insert(start, (next, next));
        next += 1;
        stack.push(start);
        on_stack.insert(start);
        path.push((start, successors(start)));
        while let Some((v, successors_of_v)) = path.last_mut() {
            let v = *v;
            if let Some(&w) = successors_of_v.next() {
                match index.get(&w).copied() {
                    None => {
                        index.insert(w, (next, next));
                        next += 1;
                        stack.push(w);
                        on_stack.insert(w);
                        path.push((w, successors(w)));
                    }
                    Some((w_index, _)) if on_stack.contains(&w) => {
                        let low = &mut index.get_mut(&v).expect("visited").1;
                        *low = (*low).min(w_index);
                    }
                    Some(_) => {}
                }
                continue;
            }
            path.pop();
            let (v_index, v_low) = index[&v];
            if let Some(&(u, _)) = path.last() {
                let low = &mut index.get_mut(&u).expect("visited").1;
                *low = (*low).min(v_low);
            }
            if v_low == v_index {
                let mut component = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack.remove(&w);
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort_unstable();
                    found.push(component);
                }
            }
        }
    }
    found.sort();
    found
}

/// The sessions each waiter waits for directly: of those `edges` name,
/// the ones no other of them waits for. In a queue on one key that is the
/// holder for the first waiter and the waiter just ahead for each other
/// (a run of shared requests ahead of an exclusive one: each of them).
/// A waiter in a cycle keeps every edge, so the cycle stays whole.
pub(crate) fn direct(edges: &Edges, in_cycle: &BTreeSet<i32>) -> Edges {
    let none = BTreeSet::new();
    let of = |v: i32| edges.get(&v).unwrap_or(&none);
    edges
        .iter()
        .map(|(&waiter, blockers)| {
            if in_cycle.contains(&waiter) {
                return (waiter, blockers.clone());
            }
            // The blockers that wait for the most first: the latest in a
            // queue covers those ahead of it, so few are candidates.
            let mut by_reach: Vec<i32> = blockers.iter().copied().collect();
            by_reach.sort_by_key(|&b| (std::cmp::Reverse(of(b).len()), b));
            let mut covered: BTreeSet<i32> = BTreeSet::new();
            let mut candidates = Vec::new();
            for b in by_reach {
                if covered.contains(&b) {
                    continue;
                }
                candidates.push(b);
                covered.extend(of(b).iter().copied().filter(|c| *c != b));
            }
            let kept: BTreeSet<i32> = candidates
                .iter()
                .copied()
                .filter(|b| !covered.contains(b))
                .collect();
            // Blockers that wait for one another (a cycle ahead): keep them.
            let kept = if kept.is_empty() {
                candidates.into_iter().collect()
            } else {
                kept
            };
            (waiter, kept)
        })
        .collect()
}

/// The wait-for graph of one snapshot's locks: who waits, who holds what,
/// who waits directly for whom, and the cycles.
pub(crate) struct WaitGraph<'e, 'a> {
    /// Each waiter's awaited lock (a session waits for one at a time).
    pub(crate) waits: BTreeMap<i32, &'e Entry<'a>>,
    /// Each holder's locks; a prepared transaction's under
    /// [`PREPARED_PID`].
    pub(crate) held: BTreeMap<i32, Vec<&'e Entry<'a>>>,
    /// Each waiter to the sessions it waits for directly ([`direct`]).
    pub(crate) direct: Edges,
    /// The wait-for cycles ([`cycles`]).
    pub(crate) cycles: Vec<Vec<i32>>,
}

impl<'e, 'a> WaitGraph<'e, 'a> {
    pub(crate) fn new(entries: &'e [Entry<'a>]) -> Self {
        let mut waits: BTreeMap<i32, &Entry<'_>> = BTreeMap::new();
        let mut edges = Edges::new();
        for e in entries.iter().filter(|e| !e.granted) {
            let Some(pid) = e.pid else { continue };
            waits.insert(pid, e);
            edges
                .entry(pid)
                .or_default()
                .extend(e.blocked_by.iter().copied().filter(|&b| b != pid));
        }
        // A prepared transaction's locks have no pid; `pg_blocking_pids`
        // names a prepared transaction as process 0.
        let mut held: BTreeMap<i32, Vec<&Entry<'_>>> = BTreeMap::new();
        for e in entries.iter().filter(|e| e.granted) {
            held.entry(e.pid.unwrap_or(PREPARED_PID))
                .or_default()
                .push(e);
        }
        let cycles = cycles(&edges);
        let in_cycle: BTreeSet<i32> = cycles.iter().flatten().copied().collect();
        let direct = direct(&edges, &in_cycle);
        WaitGraph {
            waits,
            held,
            direct,
            cycles,
        }
    }

    /// A session as the tree and the graph name it: a waiter with its
    /// application, how long it waited, the lock and its call; a holder
    /// with its application, up to three locks (and how many more), its
    /// state and transaction age (how long its transaction locks have at
    /// most been held), and its call.
    pub(crate) fn label(&self, pid: i32) -> String {
        let app = |e: &Entry<'_>| {
            e.app
                .as_deref()
                .filter(|a| !a.is_empty())
                .map(|a| format!(" [{}]", one_line(a, 40)))
                .unwrap_or_default()
        };
        let session = |e: &Entry<'_>| {
            let mut parts = Vec::new();
            if let Some(state) = e.state {
                parts.push(state.to_owned());
            }
            if let Some(age) = e.transaction_age {
                parts.push(format!("transaction {:.1}s", age.as_secs_f64()));
            }
            if parts.is_empty() {
                String::new()
            } else {
                format!(" <{}>", parts.join(", "))
            }
        };
        let held_text = |es: &[&Entry<'_>]| {
            let what: Vec<&str> = es.iter().take(3).map(|e| e.what.as_str()).collect();
            let more = if es.len() > 3 {
                format!(" and {} more", es.len() - 3)
            } else {
                String::new()
            };
            format!("{}{more}", what.join(", "))
        };
        if let Some(e) = self.waits.get(&pid) {
            let waited = e
                .waited
                .map(|d| format!(" {:.1}s", d.as_secs_f64()))
                .unwrap_or_default();
            let query = e
                .query
                .map(|q| format!(": {}", one_line(q, 60)))
                .unwrap_or_default();
            format!("{pid}{} waits{waited} for {}{query}", app(e), e.what)
        } else if pid == PREPARED_PID {
            match self.held.get(&pid) {
                Some(es) => format!("prepared transaction holds {}", held_text(es)),
                None => "a prepared transaction (pg_blocking_pids 0)".to_owned(),
            }
        } else if let Some(es) = self.held.get(&pid) {
            let query = es[0]
                .query
                .map(|q| format!(": {}", one_line(q, 60)))
                .unwrap_or_default();
            format!(
                "{pid}{} holds {}{}{query}",
                app(es[0]),
                held_text(es),
                session(es[0]),
            )
        } else {
            format!("{pid} (holds no lock shown here)")
        }
    }
}

impl WaitGraph<'_, '_> {
    /// A session as a node of `--graph`: its pid, application, state and
    /// transaction age (how long its transaction locks have at most been
    /// held), up to three locks it holds with their key types (and how
    /// many more), and its lockkit call or statement.
    pub(crate) fn node(&self, pid: i32) -> String {
        let held = self.held.get(&pid).map(Vec::as_slice).unwrap_or_default();
        let first = held.first().copied().or(self.waits.get(&pid).copied());
        let mut label = if pid == PREPARED_PID {
            "prepared transaction".to_owned()
        } else {
            pid.to_string()
        };
        let Some(e) = first else {
            label.push_str(" (holds no lock shown here)");
            return label;
        };
        if let Some(app) = e.app.as_deref().filter(|a| !a.is_empty()) {
            let _ = write!(label, " [{}]", one_line(app, 40));
        }
        let mut session = Vec::new();
        if let Some(state) = e.state {
            session.push(state.to_owned());
        }
        if let Some(age) = e.transaction_age {
            session.push(format!("transaction {:.1}s", age.as_secs_f64()));
        }
        if !session.is_empty() {
            let _ = write!(label, " <{}>", session.join(", "));
        }
        if !held.is_empty() {
            let what: Vec<&str> = held.iter().take(3).map(|e| e.what.as_str()).collect();
            let _ = write!(label, "; holds {}", what.join(", "));
            if held.len() > 3 {
                let _ = write!(label, " and {} more", held.len() - 3);
            }
        }
        if let Some(query) = e.query {
            let _ = write!(label, "; {}", one_line(query, 60));
        }
        label
    }
}

/// How deep the tree indents; a longer queue goes on unindented, with a
/// line that says so.
const MAX_DEPTH: usize = 64;

/// The wait-for graph drawn as trees: each root is a session others wait
/// for that waits for nobody; under each session, those that wait for it
/// directly. A waiter that waits directly for several (an exclusive request
/// behind a run of shared ones) is drawn under the first, and under each
/// other as `N also waits behind M`. A cycle (a deadlock, or one the server
/// is about to find) is drawn from its smallest pid, and the edge that
/// closes it as `N (cycle: a deadlock)`; nothing else is.
pub(crate) fn wait_chains(entries: &[Entry<'_>]) -> String {
    let graph = WaitGraph::new(entries);
    if graph.waits.is_empty() {
        return String::new();
    }
    let mut waiters_of: Edges = Edges::new();
    for (&waiter, blockers) in &graph.direct {
        for &b in blockers {
            waiters_of.entry(b).or_default().insert(waiter);
        }
    }
    let mut tree = Tree {
        waiters_of: &waiters_of,
        graph: &graph,
        seen: BTreeSet::new(),
        path: BTreeSet::new(),
        out: String::new(),
    };
    let roots: Vec<i32> = waiters_of
        .keys()
        .copied()
        .filter(|b| !graph.waits.contains_key(b))
        .collect();
    for root in roots {
        tree.draw(root, None, "", true, 0);
    }
    // What no root reaches waits in or behind a cycle: each cycle from its
    // smallest pid, then anything left (nothing, when the snapshot is
    // whole).
    let starts: Vec<i32> = graph.cycles.iter().map(|c| c[0]).collect();
    for start in starts {
        if !tree.seen.contains(&start) {
            tree.draw(start, None, "", true, 0);
        }
    }
    while let Some(&p) = graph.waits.keys().find(|p| !tree.seen.contains(p)) {
        tree.draw(p, None, "", true, 0);
    }
    tree.out
}

/// Draws the wait-for graph depth first.
struct Tree<'g, 'e, 'a> {
    waiters_of: &'g Edges,
    graph: &'g WaitGraph<'e, 'a>,
    /// Sessions drawn.
    seen: BTreeSet<i32>,
    /// Sessions on the path from the root to the one being drawn.
    path: BTreeSet<i32>,
    out: String,
}

impl Tree<'_, '_, '_> {
    fn draw(&mut self, pid: i32, parent: Option<i32>, prefix: &str, last: bool, depth: usize) {
        let (branch, next) = match (parent, last) {
            (None, _) => ("", String::new()),
            (Some(_), true) => ("└── ", format!("{prefix}    ")),
            (Some(_), false) => ("├── ", format!("{prefix}│   ")),
        };
        if self.path.contains(&pid) {
            let _ = writeln!(self.out, "{prefix}{branch}{pid} (cycle: a deadlock)");
            return;
        }
        if !self.seen.insert(pid) {
            let behind = parent.map_or_else(String::new, blocker_text);
            let _ = writeln!(self.out, "{prefix}{branch}{pid} also waits behind {behind}");
            return;
        }
        let _ = writeln!(self.out, "{prefix}{branch}{}", self.graph.label(pid));
        let Some(children) = self.waiters_of.get(&pid) else {
            return;
        };
        let (next, depth) = if depth >= MAX_DEPTH {
            let _ = writeln!(
                self.out,
                "{next}(more than {MAX_DEPTH} deep: those waiting behind {pid} go on unindented)"
            );
            (String::new(), 0)
        } else {
            (next, depth + 1)
        };
        self.path.insert(pid);
        let n = children.len();
        for (i, &child) in children.iter().enumerate() {
            self.draw(child, Some(pid), &next, i + 1 == n, depth);
        }
        self.path.remove(&pid);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::row;
    use super::*;

    fn edges(list: &[(i32, &[i32])]) -> Edges {
        list.iter()
            .map(|(w, bs)| (*w, bs.iter().copied().collect()))
            .collect()
    }

    fn chains(rows: &[AdvisoryLockRow]) -> String {
        let calls = BTreeMap::new();
        let names = SemaphoreNames::new();
        let entries: Vec<Entry<'_>> = rows
            .iter()
            .map(|r| Entry::advisory(r, &calls, &names))
            .collect();
        wait_chains(&entries)
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
        let text = chains(&rows);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("10 holds exclusive 1"), "{text}");
        assert!(lines[1].starts_with("├── 11 waits"), "{text}");
        assert!(lines[2].starts_with("│   └── 12 waits"), "{text}");
        assert!(lines[3].starts_with("└── 13 waits"), "{text}");
        assert!(lines[4].starts_with("20 waits"), "{text}");
        assert!(lines[5].starts_with("└── 21 waits"), "{text}");
        assert_eq!(lines[6], "    └── 20 (cycle: a deadlock)", "{text}");
        assert_eq!(lines.len(), 7, "{text}");
        assert!(chains(&rows[..1]).is_empty());
    }

    /// The queue: five waiters on one key, each blocked (as
    /// `pg_blocking_pids` says) by the holder and every waiter ahead. A
    /// chain, no cycle.
    #[test]
    fn a_queue_is_a_chain_not_a_cycle() {
        let mut rows = vec![row(10, true, &[], 1)];
        let queue = [11, 12, 13, 14, 15];
        for (i, &pid) in queue.iter().enumerate() {
            let mut blockers = vec![10];
            blockers.extend_from_slice(&queue[..i]);
            rows.push(row(pid, false, &blockers, 1));
        }
        let text = chains(&rows);
        assert!(!text.contains("cycle"), "{text}");
        assert!(!text.contains("also waits"), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 6, "{text}");
        assert!(lines[5].trim_start().starts_with("└── 15 waits"), "{text}");
    }

    /// An exclusive request behind a run of two shared ones: under the
    /// first, and "also waits behind" the second.
    #[test]
    fn a_waiter_behind_two_is_drawn_once_and_named_again() {
        let rows = [
            row(10, true, &[], 1),
            row(11, false, &[10], 1),
            row(12, false, &[10], 1),
            row(13, false, &[10, 11, 12], 1),
        ];
        let text = chains(&rows);
        assert!(!text.contains("cycle"), "{text}");
        assert_eq!(text.matches("13 waits").count(), 1, "{text}");
        assert!(text.contains("13 also waits behind 12"), "{text}");
    }

    #[test]
    fn cycles_are_components_not_revisits() {
        // A diamond and a queue: no cycle.
        let e = edges(&[(2, &[1]), (3, &[1, 2]), (4, &[1, 2, 3]), (5, &[2, 3])]);
        assert!(cycles(&e).is_empty());
        // Two cycles, one with a tail waiting behind it.
        let e = edges(&[
            (7, &[8]),
            (8, &[9]),
            (9, &[7]),
            (20, &[21]),
            (21, &[20]),
            (30, &[20, 1]),
        ]);
        assert_eq!(cycles(&e), vec![vec![7, 8, 9], vec![20, 21]]);
        // Self edges are no cycle (a session never blocks itself).
        assert!(cycles(&edges(&[(1, &[1])])).is_empty());
    }

    /// 5,000 waiters on 50 keys, 100 each behind an idle holder, each
    /// blocked (as `pg_blocking_pids` says) by the holder and every waiter
    /// ahead: no cycle, each waiter once in the tree, one direct edge each.
    #[test]
    fn five_thousand_waiters_on_fifty_keys_have_no_cycle() {
        let mut rows = Vec::new();
        for key in 0..50 {
            let holder = 100_000 + key as i32;
            rows.push(row(holder, true, &[], key));
            let queue: Vec<i32> = (0..100).map(|i| 1 + key as i32 * 100 + i).collect();
            for (i, &pid) in queue.iter().enumerate() {
                let mut blockers = vec![holder];
                blockers.extend_from_slice(&queue[..i]);
                rows.push(row(pid, false, &blockers, key));
            }
        }
        let calls = BTreeMap::new();
        let names = SemaphoreNames::new();
        let entries: Vec<Entry<'_>> = rows
            .iter()
            .map(|r| Entry::advisory(r, &calls, &names))
            .collect();
        let graph = WaitGraph::new(&entries);
        assert!(graph.cycles.is_empty());
        assert_eq!(graph.direct.len(), 5_000);
        assert!(graph.direct.values().all(|b| b.len() == 1));
        let text = wait_chains(&entries);
        assert!(!text.contains("cycle"));
        assert!(!text.contains("also waits"));
        assert_eq!(text.matches(" waits ").count(), 5_000);
    }
}
