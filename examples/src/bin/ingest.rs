//! The ingestion study of the design notes (the README's main command):
//!
//! ```sh
//! cargo run --release -p lockkit-examples --bin ingest
//! cargo run --release -p lockkit-examples --bin ingest -- --help
//! ```
//!
//! Uses `DATABASE_URL` when it is set, else starts a throwaway server.
//! Prints the table, then its reading computed from the run's figures, and
//! writes the latency chart to `target/ingest/latency.svg` (`--svg PATH`,
//! `--no-svg`). Progress goes to stderr: a bar on a terminal, plain lines
//! otherwise (`--quiet`: none).

use std::process::ExitCode;

use clap::Parser;
use lockkit_examples::ingest::{self, Options};

#[tokio::main]
async fn main() -> ExitCode {
    let options = Options::parse();
    if !options.quiet {
        eprintln!("starting the server…");
    }
    let db = ingest::database(&options);
    let report = match ingest::run(&options, &db).await {
        Ok(report) => report,
        Err(e) => {
            eprintln!("ingest: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = options.chart() {
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
        let written = parent
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(path, ingest::latency_svg(&report)));
        if let Err(e) = written {
            eprintln!("ingest: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if options.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.json()).expect("JSON values serialize")
        );
        if let (Some(path), false) = (options.chart(), options.quiet) {
            eprintln!("ingest: the latency chart (SVG): {}", path.display());
        }
    } else {
        print!("{}", report.table());
        let reading = report.reading();
        if !reading.is_empty() {
            println!("\n{reading}");
        }
        if let Some(path) = options.chart() {
            println!("\nThe latency chart (SVG): {}", path.display());
        }
    }
    if report.outcomes.iter().all(|o| o.as_expected()) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
