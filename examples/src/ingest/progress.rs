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
    pub(crate) fn quarter(&self, strategy: &str, (before, after): (u64, u64), total: u64) {
        let quarter = |n: u64| (n.saturating_mul(4) / total.max(1)).min(4);
        let crossed = quarter(after);
        if crossed > quarter(before) && crossed < 4 {
            self.say(format_args!(
                "{strategy}: {after} of {total} events ({} %)",
                crossed * 25
            ));
        }
    }
}
