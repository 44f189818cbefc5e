//! The ingestion study of the design notes (the README's main command):
//!
//! ```sh
//! cargo run --release -p lockkit-examples --bin ingest
//! cargo run --release -p lockkit-examples --bin ingest -- --help
//! ```
//!
//! Uses `DATABASE_URL` when it is set, else starts a throwaway server.

use std::process::ExitCode;

use clap::Parser;
use lockkit_examples::ingest::{self, Options};
use lockkit_examples::Database;

#[tokio::main]
async fn main() -> ExitCode {
    let options = Options::parse();
    if !options.quiet {
        eprintln!("starting the server…");
    }
    let db = Database::from_env(&ingest::server_settings(&options));
    let report = match ingest::run(&options, &db).await {
        Ok(report) => report,
        Err(e) => {
            eprintln!("ingest: {e}");
            return ExitCode::FAILURE;
        }
    };
    if options.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.json()).expect("JSON values serialize")
        );
    } else {
        print!("{}", report.table());
    }
    if let Some(path) = &options.svg {
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
        let written = parent
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(path, ingest::latency_svg(&report)));
        if let Err(e) = written {
            eprintln!("ingest: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if report.outcomes.iter().all(|o| o.as_expected()) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
