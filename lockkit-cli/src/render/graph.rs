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

/// The wait-for graph: a node per session that holds or waits for a
/// lock (a holder nobody waits for too), labelled as [`WaitGraph::node`]
/// says; an edge from each waiter to each session it waits for directly
/// ([`WaitGraph::direct`]: the holder, or the one queued just ahead),
/// labelled with the lock it waits for. Relation locks are in it when
/// `relations` is given (`--all`).
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
    let waits = WaitGraph::new(&entries);
    let mut edges: Vec<(i32, i32, String)> = Vec::new();
    for (&waiter, blockers) in &waits.direct {
        let e = waits.waits[&waiter];
        let waited = e
            .waited
            .map(|d| format!(", {:.1}s", d.as_secs_f64()))
            .unwrap_or_default();
        for &blocker in blockers {
            edges.push((waiter, blocker, format!("{}{waited}", e.what)));
        }
    }
    let pids: BTreeSet<i32> = waits
        .held
        .keys()
        .chain(waits.waits.keys())
        .copied()
        .chain(edges.iter().map(|&(_, b, _)| b))
        .collect();
    let nodes: BTreeMap<i32, String> = pids.into_iter().map(|p| (p, waits.node(p))).collect();
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
        "// lockkit inspect --graph dot: an edge from each waiter to each session it waits for directly\n\
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
        "%% lockkit inspect --graph mermaid: an edge from each waiter to each session it waits for directly\n\
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

    /// A queue of two behind one holder, a holder nobody waits for, and a
    /// quote in an application name: a node per session, an edge from
    /// each waiter to the one it waits for directly (the second waiter's
    /// `pg_blocking_pids` names the holder too), labels escaped.
    #[test]
    fn draws_nodes_and_direct_edges() {
        let mut holder = row(10, true, &[], 1);
        holder.application_name = Some("a \"quoted\" app".into());
        holder.state = Some("idle in transaction".into());
        holder.transaction_age = Some(Duration::from_millis(10_250));
        holder.query = Some("/* lockkit:try_bigint */ SELECT 1".into());
        let rows = [
            holder,
            row(11, false, &[10], 1),
            row(12, false, &[10, 11], 1),
            row(30, true, &[], 3),
        ];
        let text = graph(&rows, None, &Sources::default(), GraphFormat::Dot);
        assert!(
            text.contains(
                "\"p10\" [label=\"10 [a \\\"quoted\\\" app] <idle in transaction, transaction 10.2s>; \
                 holds exclusive 1 (? tag 0x0000); try_lock 1×? tag 0x0000\"];"
            ),
            "{text}"
        );
        assert!(
            text.contains("\"p30\" [label=\"30; holds exclusive 3"),
            "{text}"
        );
        assert!(
            text.contains("\"p11\" -> \"p10\" [label=\"exclusive 1 (? tag 0x0000)\"];"),
            "{text}"
        );
        assert!(text.contains("\"p12\" -> \"p11\" "), "{text}");
        assert_eq!(text.matches(" -> ").count(), 2, "{text}");
        let text = graph(&rows, None, &Sources::default(), GraphFormat::Mermaid);
        assert!(
            text.contains("p10[\"10 [a #quot;quoted#quot; app] #lt;idle in transaction"),
            "{text}"
        );
        assert!(
            text.contains("p12 -->|\"exclusive 1 (? tag 0x0000)\"| p11"),
            "{text}"
        );
        assert_eq!(text.matches(" -->").count(), 2, "{text}");
        // No wait: the holder alone.
        let text = graph(&rows[..1], None, &Sources::default(), GraphFormat::Dot);
        assert!(
            !text.contains("->") && text.contains("\"p10\" [label="),
            "{text}"
        );
    }
}
