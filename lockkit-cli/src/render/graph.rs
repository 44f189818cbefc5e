//! `lockkit inspect --graph`: the wait-for graph as Graphviz DOT or
//! Mermaid, to render or paste into a ticket.

use super::*;

/// The formats of `--graph`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum GraphFormat {
    /// Graphviz DOT (`dot -Tsvg`).
    Dot,
    /// A Mermaid flowchart.
    Mermaid,
}

/// A session of the graph: `p123`, or `prepared` for a prepared
/// transaction (`pg_blocking_pids` names one 0).
fn node_id(pid: i32) -> String {
    if pid == PREPARED_PID {
        "prepared".into()
    } else {
        format!("p{pid}")
    }
}

/// The wait-for graph: a node per session that waits or is waited for
/// (its pid, application and state), an edge from each waiter to each
/// session it waits for, labelled with the lock it waits for. Relation
/// locks are in it when `relations` is given (`--all`).
pub(crate) fn graph(
    rows: &[AdvisoryLockRow],
    relations: Option<&[RelationLockRow]>,
    sources: &Sources<'_>,
    format: GraphFormat,
) -> String {
    let names = &sources.semaphores;
    let calls = calls(rows, names);
    let mut entries: Vec<Entry<'_>> = rows
        .iter()
        .map(|r| Entry::advisory(r, &calls, names))
        .collect();
    entries.extend(relations.unwrap_or_default().iter().map(Entry::relation));
    // pid -> its label (the first entry seen of it describes the session).
    let mut nodes: BTreeMap<i32, String> = BTreeMap::new();
    let describe = |e: &Entry<'_>, pid: i32| {
        let mut label = if pid == PREPARED_PID {
            "prepared transaction".to_owned()
        } else {
            pid.to_string()
        };
        if let Some(app) = e.app.as_deref().filter(|a| !a.is_empty()) {
            let _ = write!(label, " [{}]", one_line(app, 40));
        }
        if let Some(state) = e.state {
            let _ = write!(label, " {state}");
        }
        label
    };
    let mut edges: Vec<(i32, i32, String)> = Vec::new();
    for e in entries.iter().filter(|e| !e.granted) {
        let Some(pid) = e.pid else { continue };
        nodes.entry(pid).or_insert_with(|| describe(e, pid));
        let waited = e
            .waited
            .map(|d| format!(", {:.1}s", d.as_secs_f64()))
            .unwrap_or_default();
        for &blocker in e.blocked_by {
            edges.push((pid, blocker, format!("{}{waited}", e.what)));
        }
    }
    let blockers: BTreeSet<i32> = edges.iter().map(|&(_, b, _)| b).collect();
    for b in blockers {
        if nodes.contains_key(&b) {
            continue;
        }
        let label = entries
            .iter()
            .find(|e| e.pid.unwrap_or(PREPARED_PID) == b)
            .map(|e| describe(e, b))
            .unwrap_or_else(|| {
                if b == PREPARED_PID {
                    "prepared transaction".into()
                } else {
                    b.to_string()
                }
            });
        nodes.insert(b, label);
    }
    match format {
        GraphFormat::Dot => dot(&nodes, &edges),
        GraphFormat::Mermaid => mermaid(&nodes, &edges),
    }
}

/// A DOT string literal's contents.
fn dot_escape(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"")
}

fn dot(nodes: &BTreeMap<i32, String>, edges: &[(i32, i32, String)]) -> String {
    let mut out = String::from(
        "// lockkit inspect --graph dot: an edge from each waiter to the session it waits for\n\
         digraph lockkit_waits {\n  rankdir=LR;\n  node [shape=box];\n",
    );
    for (pid, label) in nodes {
        let _ = writeln!(
            out,
            "  \"{}\" [label=\"{}\"];",
            node_id(*pid),
            dot_escape(label)
        );
    }
    for (waiter, blocker, what) in edges {
        let _ = writeln!(
            out,
            "  \"{}\" -> \"{}\" [label=\"{}\"];",
            node_id(*waiter),
            node_id(*blocker),
            dot_escape(what)
        );
    }
    out.push_str("}\n");
    out
}

/// A Mermaid string's contents: its quotes and the characters Mermaid
/// reads as markup, as entity codes.
fn mermaid_escape(text: &str) -> String {
    text.replace('"', "#quot;")
        .replace('<', "#lt;")
        .replace('>', "#gt;")
}

fn mermaid(nodes: &BTreeMap<i32, String>, edges: &[(i32, i32, String)]) -> String {
    let mut out = String::from(
        "%% lockkit inspect --graph mermaid: an edge from each waiter to the session it waits for\n\
         flowchart LR\n",
    );
    for (pid, label) in nodes {
        let _ = writeln!(out, "  {}[\"{}\"]", node_id(*pid), mermaid_escape(label));
    }
    for (waiter, blocker, what) in edges {
        let _ = writeln!(
            out,
            "  {} -->|\"{}\"| {}",
            node_id(*waiter),
            mermaid_escape(what),
            node_id(*blocker)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::tests::row;
    use super::*;

    /// Two waiters of one holder, and a quote in an application name: a
    /// node each, an edge each, labels escaped.
    #[test]
    fn draws_nodes_and_edges() {
        let mut holder = row(10, true, &[], 1);
        holder.application_name = Some("a \"quoted\" app".into());
        let rows = [
            holder,
            row(11, false, &[10], 1),
            row(12, false, &[10, 11], 1),
        ];
        let text = graph(&rows, None, &Sources::default(), GraphFormat::Dot);
        assert!(
            text.contains("\"p10\" [label=\"10 [a \\\"quoted\\\" app]\"];"),
            "{text}"
        );
        assert!(
            text.contains("\"p11\" -> \"p10\" [label=\"exclusive 1 (? tag 0x0000)\"];"),
            "{text}"
        );
        assert_eq!(text.matches(" -> ").count(), 3, "{text}");
        let text = graph(&rows, None, &Sources::default(), GraphFormat::Mermaid);
        assert!(
            text.contains("p10[\"10 [a #quot;quoted#quot; app]\"]"),
            "{text}"
        );
        assert!(
            text.contains("p12 -->|\"exclusive 1 (? tag 0x0000)\"| p11"),
            "{text}"
        );
        // No wait: no node, no edge.
        let text = graph(&rows[..1], None, &Sources::default(), GraphFormat::Dot);
        assert!(!text.contains("->") && !text.contains("p10"), "{text}");
    }
}
