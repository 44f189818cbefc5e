//! Progress as plain lines, for a stderr that is not a terminal (CI logs,
//! `| tee`), where the progress bar draws nothing: one line per phase of
//! each strategy, and one at each quarter of its ingest.

use std::fmt;
use std::io::IsTerminal as _;
use std::time::Instant;

/// Where the progress lines go: stderr, or nowhere (`--quiet`, or stderr
/// a terminal, which gets the bar instead).
#[derive(Clone, Debug)]
pub(crate) struct Lines {
    on: bool,
    started: Instant,
}

impl Lines {
    /// Lines on stderr unless `quiet` or stderr is a terminal.
    pub(crate) fn new(quiet: bool) -> Self {
        Lines {
            on: !quiet && !std::io::stderr().is_terminal(),
            started: Instant::now(),
        }
    }

    /// Prints one line, with the time since the study started.
    pub(crate) fn say(&self, line: fmt::Arguments<'_>) {
        if self.on {
            let t = self.started.elapsed().as_secs_f64();
            eprintln!("ingest [{t:>7.1} s] {line}");
        }
    }

    /// Prints a line when the ingest of `strategy` went from `done.0` to
    /// `done.1` of `total` events across a quarter (25, 50 or 75 %).
    pub(crate) fn quarter(&self, strategy: &str, done: (u64, u64), total: u64) {
        if let Some(percent) = crossed(done, total) {
            let after = done.1;
            self.say(format_args!(
                "{strategy}: {after} of {total} events ({percent} %)"
            ));
        }
    }
}

/// The quarter (25, 50 or 75 %) that going from `before` to `after` of
/// `total` crossed, if any (the end is the phase's own line).
fn crossed((before, after): (u64, u64), total: u64) -> Option<u64> {
    let quarter = |n: u64| (n.saturating_mul(4) / total.max(1)).min(4);
    let crossed = quarter(after);
    (crossed > quarter(before) && crossed < 4).then_some(crossed * 25)
}

#[cfg(test)]
mod tests {
    use super::crossed;

    #[test]
    fn one_line_per_quarter_crossed() {
        let lines: Vec<u64> = (0..40)
            .filter_map(|i| crossed((i * 100, (i + 1) * 100), 4000))
            .collect();
        assert_eq!(lines, [25, 50, 75]);
        assert_eq!(crossed((0, 4000), 4000), None, "the end has its own line");
        assert_eq!(crossed((900, 1100), 4000), Some(25));
        assert_eq!(crossed((0, 10), 0), None);
    }
}
