//! The locked transaction under load: lockkit beside raw tokio-postgres and
//! pgbench, at 1, 4 and 16 connections, on a real PostgreSQL server (the
//! harness's throwaway server, or `DATABASE_URL`).
//!
//! ```text
//! cargo bench -p lockkit-tests --bench saturation
//! ```
//!
//! Every transaction is `BEGIN`, one lock on a key no transaction took
//! before, one prepared `INSERT` of that key into a log table, `COMMIT`,
//! written four ways:
//!
//! - `raw`: by hand on tokio-postgres, `client.transaction()`, then
//!   `SELECT pg_advisory_xact_lock($1)` and the `INSERT`, both prepared once
//!   per connection, then `commit()`: the baseline of every ratio;
//! - `default`: lockkit's default locker (`Config::default()`, its
//!   statements sent unnamed), `LockClient::begin`, `lock`, the prepared
//!   `INSERT` on the transaction, `commit`;
//! - `Prepared`: the same with `StatementMode::Prepared`;
//! - `pgbench`: PostgreSQL's own client (`pgbench -M prepared`, a custom
//!   script doing the same four statements), found as `LOCKKIT_PGBENCH`,
//!   else in `LOCKKIT_PG_BINDIR`, else in `/usr/lib/postgresql/*/bin`, else
//!   on `PATH`. Its figure excludes its connection time, as it prints it.
//!
//! Each cell (connections × side) runs in slices, one per pass over the
//! whole grid, the sides taking turns in each, so that the machine's drift
//! spreads over all of them: compare ratios within one run, never figures
//! across runs. `LOCKKIT_SATURATION_SECS` sets the whole seconds per cell
//! (default 4) and `LOCKKIT_SATURATION_SLICES` the slices it runs in
//! (default 4; a slice lasts at least a second: pgbench's `-T` counts whole
//! seconds). `LOCKKIT_SATURATION_CONNECTIONS=1,4` sets the widths (default
//! 1, 4 and 16), `LOCKKIT_SATURATION_ONLY=raw,default` the sides (`raw`,
//! `default`, `prepared`, `pgbench`; the first is the ratios' baseline), for
//! diagnostics such as counting one side's context switches.
//! `LOCKKIT_SATURATION_RUNTIME=current` runs the client on tokio's
//! current-thread runtime instead of the multi-thread one (a diagnostic: every
//! task on one thread, no hand-off between threads). Run without `--bench`
//! (`cargo test --benches`), it does a smoke run of one-second cells at 1 and
//! 4 connections.
//!
//! After the run, the log table is checked against the counts: one row per
//! committed transaction of every side, pgbench's included.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Config, LockClient, Locker, StatementMode};
use lockkit_tests::TestServer;
use tokio::sync::Barrier;

/// The key type locked.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
struct Item {
    id: i64,
}

/// The four ways of writing the transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Raw,
    Default,
    Prepared,
    Pgbench,
}

const SIDES: [Side; 4] = [Side::Raw, Side::Default, Side::Prepared, Side::Pgbench];

impl Side {
    /// Its name in `LOCKKIT_SATURATION_ONLY`.
    fn short(self) -> &'static str {
        match self {
            Side::Raw => "raw",
            Side::Default => "default",
            Side::Prepared => "prepared",
            Side::Pgbench => "pgbench",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Side::Raw => "raw tokio-postgres",
            Side::Default => "lockkit default",
            Side::Prepared => "lockkit Prepared",
            Side::Pgbench => "pgbench -M prepared",
        }
    }
}

/// What the run measures.
struct Plan {
    connections: Vec<usize>,
    /// Slices per cell, one per pass over the grid.
    passes: u32,
    slice: Duration,
}

impl Plan {
    fn from_env(bench_run: bool) -> Plan {
        let secs = std::env::var("LOCKKIT_SATURATION_SECS")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .filter(|s| *s > 0)
            .unwrap_or(4);
        let passes = std::env::var("LOCKKIT_SATURATION_SLICES")
            .ok()
            .and_then(|s| s.parse::<u32>().ok())
            .filter(|s| *s > 0)
            .unwrap_or(4);
        if bench_run {
            Plan {
                connections: std::env::var("LOCKKIT_SATURATION_CONNECTIONS")
                    .ok()
                    .map(|list| {
                        list.split(',')
                            .map(|n| n.trim().parse().expect("a number of connections"))
                            .collect()
                    })
                    .unwrap_or_else(|| vec![1, 4, 16]),
                passes,
                slice: Duration::from_secs((secs / u64::from(passes)).max(1)),
            }
        } else {
            Plan {
                connections: vec![1, 4],
                passes: 1,
                slice: Duration::from_secs(1),
            }
        }
    }
}

/// The pgbench program, when one is found.
fn pgbench() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("LOCKKIT_PGBENCH") {
        return Some(PathBuf::from(path));
    }
    if let Some(dir) = std::env::var_os("LOCKKIT_PG_BINDIR") {
        let path = PathBuf::from(dir).join("pgbench");
        if path.is_file() {
            return Some(path);
        }
    }
    let mut installed: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin/pgbench"))
        .filter(|p| p.is_file())
        .collect();
    // The newest major version: its directory name, as a number.
    installed.sort_by_key(|p| {
        p.ancestors()
            .nth(2)
            .and_then(|d| d.file_name()?.to_str()?.parse::<u32>().ok())
    });
    if let Some(path) = installed.pop() {
        return Some(path);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("pgbench"))
            .find(|p| p.is_file())
    })
}

/// One slice of a lockkit or raw cell: `connections` tasks running
/// transactions until `time` is up; the transactions committed within it,
/// and every one committed (the last, late one included).
async fn slice(
    side: Side,
    lockers: &(Locker, Locker),
    insert: &str,
    connections: usize,
    time: Duration,
    next_key: &Arc<AtomicI64>,
) -> (usize, usize) {
    let barrier = Arc::new(Barrier::new(connections));
    let start = Arc::new(std::sync::OnceLock::<Instant>::new());
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let client = TestServer::shared().connect().await;
        let (barrier, start, next_key) = (
            Arc::clone(&barrier),
            Arc::clone(&start),
            Arc::clone(next_key),
        );
        let insert = insert.to_owned();
        let locker = match side {
            Side::Prepared => lockers.1.clone(),
            _ => lockers.0.clone(),
        };
        tasks.push(tokio::spawn(async move {
            let mut in_time = 0;
            let mut all = 0;
            match side {
                Side::Raw => {
                    let mut client = client;
                    let lock = client
                        .prepare("SELECT pg_advisory_xact_lock($1)")
                        .await
                        .expect("prepare the lock");
                    let insert = client.prepare(&insert).await.expect("prepare the insert");
                    barrier.wait().await;
                    let start = *start.get_or_init(Instant::now);
                    while start.elapsed() < time {
                        let id = next_key.fetch_add(1, Ordering::Relaxed);
                        let tx = client.transaction().await.expect("begin");
                        tx.query_one(&lock, &[&id]).await.expect("lock");
                        tx.execute(&insert, &[&id]).await.expect("insert");
                        tx.commit().await.expect("commit");
                        all += 1;
                        in_time += usize::from(start.elapsed() <= time);
                    }
                }
                _ => {
                    let mut conn = LockClient::new(&locker, client);
                    let insert = conn.prepare(&insert).await.expect("prepare the insert");
                    barrier.wait().await;
                    let start = *start.get_or_init(Instant::now);
                    while start.elapsed() < time {
                        let id = next_key.fetch_add(1, Ordering::Relaxed);
                        let tx = conn.begin().await.expect("begin");
                        let held = tx.lock(Item { id }).await.expect("lock");
                        tx.execute(&insert, &[&id]).await.expect("insert");
                        drop(held);
                        tx.commit().await.expect("commit");
                        all += 1;
                        in_time += usize::from(start.elapsed() <= time);
                    }
                }
            }
            (in_time, all)
        }));
    }
    let mut sum = (0, 0);
    for task in tasks {
        let (in_time, all) = task.await.expect("worker");
        sum.0 += in_time;
        sum.1 += all;
    }
    sum
}

/// One slice of a pgbench cell: the transactions per second it prints
/// (without its connection time) and the transactions it processed.
fn pgbench_slice(
    program: &PathBuf,
    script: &PathBuf,
    connections: usize,
    time: Duration,
) -> (f64, usize) {
    let threads = connections.min(
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    );
    let out = Command::new(program)
        .args(["-n", "-M", "prepared", "-f"])
        .arg(script)
        .args([
            "-c",
            &connections.to_string(),
            "-j",
            &threads.to_string(),
            "-T",
            &time.as_secs().to_string(),
        ])
        .arg(TestServer::shared().url())
        .output()
        .expect("run pgbench");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "pgbench failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |prefix: &str| -> &str {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("pgbench printed no {prefix:?}: {text}"))
            .trim()
    };
    let failed = field("number of failed transactions:");
    assert!(
        failed.starts_with("0 "),
        "pgbench transactions failed: {text}"
    );
    let processed: usize = field("number of transactions actually processed:")
        .split('/')
        .next()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("pgbench's count: {text}"));
    let tps: f64 = field("tps =")
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("pgbench's tps: {text}"));
    (tps, processed)
}

fn main() {
    // A real benchmark run (`cargo bench`), not `cargo test --benches`.
    let bench_run = std::env::args().any(|a| a == "--bench");
    let plan = Plan::from_env(bench_run);
    let program = pgbench();
    assert!(
        program.is_some() || !bench_run,
        "no pgbench: set LOCKKIT_PGBENCH to its path"
    );
    let rt = match std::env::var("LOCKKIT_SATURATION_RUNTIME").as_deref() {
        Ok("current") => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    }
    .enable_all()
    .build()
    .expect("tokio runtime");
    rt.block_on(async {
        let client = TestServer::shared().connect().await;
        let lockers = (
            Locker::new(&client, Config::default())
                .await
                .expect("default locker"),
            Locker::new(
                &client,
                Config::default().statements(StatementMode::Prepared),
            )
            .await
            .expect("prepared locker"),
        );
        let table = format!("lockkit_saturation_{}", std::process::id());
        client
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (key int8 NOT NULL)"
            ))
            .await
            .expect("create the log table");
        let insert = format!("INSERT INTO {table} (key) VALUES ($1)");
        // pgbench's keys are negative, lockkit's and raw's positive: every
        // key is taken once (pgbench's drawn at random from 2^62 of them).
        let script = std::env::temp_dir().join(format!("{table}.pgbench"));
        std::fs::write(
            &script,
            format!(
                "\\set k random(-4611686018427387904, -1)\n\
                 BEGIN;\n\
                 SELECT pg_advisory_xact_lock(:k);\n\
                 INSERT INTO {table} (key) VALUES (:k);\n\
                 COMMIT;\n"
            ),
        )
        .expect("write the pgbench script");
        let next_key = Arc::new(AtomicI64::new(1));
        let sides: Vec<Side> = SIDES
            .into_iter()
            .filter(|s| *s != Side::Pgbench || program.is_some())
            .filter(|s| {
                std::env::var("LOCKKIT_SATURATION_ONLY")
                    .map_or(true, |only| only.split(',').any(|o| o.trim() == s.short()))
            })
            .collect();
        // tps[connections][side], summed over the slices.
        let mut tps = vec![vec![0.0f64; sides.len()]; plan.connections.len()];
        let mut committed = 0usize;
        for pass in 0..plan.passes as usize {
            for (c, &connections) in plan.connections.iter().enumerate() {
                for turn in 0..sides.len() {
                    // Which side goes first moves round, cell by cell.
                    let s = (turn + pass + c) % sides.len();
                    let (t, all) = match sides[s] {
                        Side::Pgbench => {
                            let program = program.as_ref().expect("pgbench");
                            pgbench_slice(program, &script, connections, plan.slice)
                        }
                        side => {
                            let (in_time, all) =
                                slice(side, &lockers, &insert, connections, plan.slice, &next_key)
                                    .await;
                            (in_time as f64 / plan.slice.as_secs_f64(), all)
                        }
                    };
                    tps[c][s] += t / f64::from(plan.passes);
                    committed += all;
                }
            }
        }
        let rows: i64 = client
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .expect("count the log")
            .get(0);
        assert_eq!(
            rows as usize, committed,
            "one row per committed transaction"
        );
        client
            .batch_execute(&format!("DROP TABLE {table}"))
            .await
            .expect("drop the log table");
        let _ = std::fs::remove_file(&script);
        println!(
            "\nsaturation: BEGIN, one lock on a fresh key, one prepared INSERT, COMMIT \
             ({} s per cell in {} slices); transactions per second, and the ratio to raw",
            plan.slice.as_secs() * u64::from(plan.passes),
            plan.passes
        );
        let header: String = sides.iter().map(|s| format!(" {} |", s.name())).collect();
        println!("| connections |{header}");
        println!("| ---: |{}", " ---: |".repeat(sides.len()));
        for (c, &connections) in plan.connections.iter().enumerate() {
            let raw = tps[c][0];
            let cells: String = tps[c]
                .iter()
                .map(|t| format!(" {t:.0} ({:.2}×) |", t / raw))
                .collect();
            println!("| {connections} |{cells}");
        }
    });
}
