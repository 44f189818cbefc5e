//! docs/KEYS.md read as data, for the tests that hold an implementation of
//! the key format (the derive, the SQL functions) against the document.

/// The text of docs/KEYS.md.
///
/// # Panics
///
/// When the file cannot be read.
pub fn text() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/KEYS.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// The tables of the section of `doc` whose heading starts with `heading`:
/// each a list of rows (header and `| --- |` line left out) of trimmed
/// cells.
///
/// # Panics
///
/// When there is no such section.
pub fn tables(doc: &str, heading: &str) -> Vec<Vec<Vec<String>>> {
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with(heading))
        .unwrap_or_else(|| panic!("no section {heading:?} in docs/KEYS.md"));
    let mut tables = Vec::new();
    let mut lines = section.lines().peekable();
    while lines.peek().is_some() {
        let block: Vec<&str> = lines
            .by_ref()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .collect();
        if block.len() > 2 {
            tables.push(
                block[2..]
                    .iter()
                    .map(|l| {
                        l.trim()
                            .trim_matches('|')
                            .split('|')
                            .map(|c| c.trim().to_owned())
                            .collect()
                    })
                    .collect(),
            );
        }
    }
    tables
}
