//! The fleet's server, pooler and worker processes, the runner's chaos
//! (SIGKILL and restart, terminated backends, the `lockkit` command), the
//! `pg_locks` sampler, and the [`Report`] of a run.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockkit_tests::{PgBouncer, TestServer};
use serde_json::Value;
use tokio_postgres::{Client, NoTls};

/// The worker's keys: ids `0..KEYS` have a counter row (the worker's
/// `KEYS`).
const KEYS: i64 = 16;

/// Where to copy pgbouncer's log, with every packet it read, at the end of
/// a run (unset: not copied, and pgbouncer logs at its default level).
const POOLER_LOG: &str = "LOCKKIT_FLEET_PGBOUNCER_LOG";

/// Which faults the runner causes in a `Chaos::On` run: `all` (the
/// default), `kill` (SIGKILLs only), `terminate` (terminated backends
/// only) or `none` (the `lockkit` runs only), to tell which one a failure
/// comes from.
const CHAOS: &str = "LOCKKIT_FLEET_CHAOS";

/// The time of day (UTC, milliseconds), as pgbouncer's log prints it.
fn utc_now() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let day = now.as_millis() % 86_400_000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        day / 3_600_000,
        day / 60_000 % 60,
        day / 1000 % 60,
        day % 1000
    )
}

/// The `application_name` of the runner's own connections, which it never
/// terminates.
const RUNNER: &str = "fleet-runner";

/// How long the workers may take to stop after their deadline (finishing
/// the call in flight): a bound, no timing claim.
const STOP_BOUND: Duration = Duration::from_secs(60);

/// A role of `fleet-worker` (its docs say what each does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Tp,
    TpPrepared,
    Sqlx,
    Diesel,
    DieselAsync,
    Session,
    SessionPool,
    Mux,
    Sql,
    ForeignTp,
    ForeignSqlx,
    Naive,
    Leaky,
}

impl Role {
    fn arg(self) -> &'static str {
        match self {
            Role::Tp => "tp",
            Role::TpPrepared => "tp-prepared",
            Role::Sqlx => "sqlx",
            Role::Diesel => "diesel",
            Role::DieselAsync => "diesel-async",
            Role::Session => "session",
            Role::SessionPool => "session-pool",
            Role::Mux => "mux",
            Role::Sql => "sql",
            Role::ForeignTp => "foreign-tp",
            Role::ForeignSqlx => "foreign-sqlx",
            Role::Naive => "naive",
            Role::Leaky => "leaky",
        }
    }

    /// Whether the runner kills this role's processes (the lockkit ones).
    fn killable(self) -> bool {
        matches!(
            self,
            Role::Tp
                | Role::Sqlx
                | Role::Diesel
                | Role::DieselAsync
                | Role::Session
                | Role::SessionPool
                | Role::Mux
        )
    }
}

/// Whether the runner kills workers and terminates backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Chaos {
    On,
    Off,
}

/// A throwaway server, a transaction-mode pgbouncer in front of it, the
/// fleet's tables and lockkit's SQL functions, and the runner's own direct
/// connection.
pub(crate) struct Fleet {
    // Dropped before the server.
    bouncer: PgBouncer,
    db: TestServer,
    pub(crate) observer: Client,
}

/// What one worker process printed.
#[derive(Default)]
struct Seen {
    /// Its last counts line.
    last: Option<Value>,
    /// Whether that line was the final one.
    finished: bool,
    /// Its unexpected errors, as printed.
    unexpected: Vec<String>,
    /// Its foreign applications' errors that lockkit may have caused, as
    /// printed.
    harmed: Vec<String>,
    /// Its stderr.
    stderr: String,
}

/// A worker process the runner started.
struct Worker {
    role: Role,
    child: Child,
    seen: Arc<Mutex<Seen>>,
    killed: bool,
}

/// What a run did and saw.
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// Each process's last counts, with its role.
    counts: Vec<(Role, Value)>,
    /// Unexpected errors as the workers printed them, with their role.
    pub(crate) unexpected: Vec<String>,
    /// Errors of the foreign applications that lockkit may have caused
    /// (`lockkit_tests::harm`), as the workers printed them, with their
    /// role.
    pub(crate) harmed: Vec<String>,
    /// Processes started (restarts included).
    pub(crate) processes: usize,
    /// Processes killed with SIGKILL.
    pub(crate) kills: usize,
    /// Backends terminated.
    pub(crate) terminations: usize,
    /// `lockkit inspect` and `lockkit check` runs, all exiting 0.
    pub(crate) cli_runs: usize,
    /// Times the sampler read `pg_locks`.
    pub(crate) samples: u64,
    /// What the sampler saw granted exclusive to two sessions.
    pub(crate) double_holders: Vec<String>,
    /// The run's own failures (a worker that did not stop, or exited
    /// without its final line; a `lockkit` command that failed).
    pub(crate) failures: Vec<String>,
    /// How long the run took, start-up of the workers to their end.
    pub(crate) elapsed: Duration,
}

impl Report {
    /// The sum of counter `field` over every process.
    pub(crate) fn sum(&self, field: &str) -> u64 {
        self.counts
            .iter()
            .map(|(_, v)| v[field].as_u64().unwrap_or(0))
            .sum()
    }

    /// The largest value of counter `field` over every process.
    pub(crate) fn max(&self, field: &str) -> u64 {
        self.counts
            .iter()
            .map(|(_, v)| v[field].as_u64().unwrap_or(0))
            .max()
            .unwrap_or(0)
    }

    /// Transactions of the foreign applications.
    pub(crate) fn foreign_txs(&self) -> u64 {
        self.counts
            .iter()
            .filter(|(role, _)| matches!(role, Role::ForeignTp | Role::ForeignSqlx))
            .map(|(_, v)| v["txs"].as_u64().unwrap_or(0))
            .sum()
    }

    /// Errors of the foreign applications that lockkit may have caused:
    /// the workers' counts, or the lines they printed if more (a killed
    /// worker's last count may be behind its lines).
    pub(crate) fn harmed_count(&self) -> u64 {
        self.sum("harmed").max(self.harmed.len() as u64)
    }

    /// Counter `field` summed per role.
    pub(crate) fn by_role(&self, field: &str) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for (role, v) in &self.counts {
            *out.entry(role.arg()).or_default() += v[field].as_u64().unwrap_or(0);
        }
        out
    }

    /// Prints the figures of the run.
    pub(crate) fn print(&self, title: &str) {
        eprintln!("==== {title}: {:.0?} ====", self.elapsed);
        eprintln!(
            "clients: {} processes ({} killed with SIGKILL and started again); \
             backends terminated: {}; lockkit inspect/check runs: {}",
            self.processes, self.kills, self.terminations, self.cli_runs
        );
        eprintln!(
            "transactions (and session critical sections): {}; keys locked: {}; permits: {}; \
             pooled hand-outs checked: {}",
            self.sum("txs"),
            self.sum("locks"),
            self.sum("permits"),
            self.sum("probes")
        );
        eprintln!(
            "by cause: busy {}, timeouts {}, connections lost {}, \
             the diesel-async application's own name clashes {}, \
             foreign applications' own errors {}, unexpected {}",
            self.sum("busy"),
            self.sum("timeouts"),
            self.sum("lost"),
            self.sum("clashes"),
            self.sum("foreign"),
            self.sum("unexpected").max(self.unexpected.len() as u64),
        );
        eprintln!(
            "foreign applications: {} transactions, the longest {} ms; \
             errors caused by lockkit (pooler refused or gone, or a transaction over {:?}): {}",
            self.foreign_txs(),
            self.max("longest_ms"),
            lockkit_tests::harm::HOSTAGE_BOUND,
            self.harmed_count(),
        );
        for field in ["txs", "locks", "timeouts", "lost", "clashes", "unexpected"] {
            eprintln!("  {field} by role: {:?}", self.by_role(field));
        }
        eprintln!(
            "sampler: {} reads of pg_locks, {} double holders",
            self.samples,
            self.double_holders.len()
        );
        for e in self.unexpected.iter().take(10) {
            eprintln!("  unexpected: {}", short(e));
        }
        for e in self.harmed.iter().take(10) {
            eprintln!("  caused by lockkit: {}", short(e));
        }
        for f in &self.failures {
            eprintln!("  failure: {f}");
        }
    }
}

async fn connect(config: &tokio_postgres::Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.expect("the runner connects");
    tokio::spawn(connection);
    client
}

impl Fleet {
    /// Starts the server and a transaction-mode pgbouncer of `pool` server
    /// connections, and creates the tables and lockkit's SQL functions.
    pub(crate) async fn start(pool: u32) -> Fleet {
        let db = TestServer::builder()
            .setting("max_connections", "300")
            .start();
        let mut bouncer = PgBouncer::builder(&db)
            .pool_mode("transaction")
            .default_pool_size(pool);
        if std::env::var_os(POOLER_LOG).is_some() {
            // Every packet pgbouncer reads, from which client or server
            // (`verbose = 2`), and its debug lines, which say when a server
            // connection is linked to a client and released.
            bouncer = bouncer.setting("verbose", "2");
        }
        let bouncer = bouncer.start();
        let mut config = db.config();
        config.application_name(RUNNER);
        let observer = connect(&config).await;
        observer
            .batch_execute(&format!(
                "CREATE TABLE fleet_counters (id int8 PRIMARY KEY, n int8 NOT NULL); \
                 CREATE TABLE fleet_log (id int8 NOT NULL, role text NOT NULL); \
                 INSERT INTO fleet_counters SELECT g, 0 FROM generate_series(0, {}) g",
                KEYS - 1
            ))
            .await
            .expect("the fleet's tables");
        lockkit::sql::install(&observer)
            .await
            .expect("lockkit's SQL functions");
        Fleet {
            bouncer,
            db,
            observer,
        }
    }

    /// The pooler's URL.
    pub(crate) fn bouncer_url(&self) -> String {
        self.bouncer.url()
    }

    /// A sqlx application's litter: `pool` clients each in a transaction
    /// at once (so each holds a server connection of its own) run
    /// persistent statements, which sqlx names `sqlx_s_1`, `sqlx_s_2`, …
    /// and never closes; then commit.
    pub(crate) async fn litter_sqlx(&self, pool: u32) {
        use sqlx::Connection;
        let mut conns = Vec::new();
        for _ in 0..pool {
            conns.push(
                sqlx::PgConnection::connect(&self.bouncer.url())
                    .await
                    .expect("sqlx connects through the pooler"),
            );
        }
        let mut txs = Vec::new();
        for conn in &mut conns {
            let mut tx = conn.begin().await.expect("begin");
            for sql in ["SELECT 1::int8", "SELECT 2::int8", "SELECT 3::int8"] {
                let _: i64 = sqlx::query_scalar(sql)
                    .fetch_one(&mut *tx)
                    .await
                    .expect("a persistent statement");
            }
            txs.push(tx);
        }
        for tx in txs {
            tx.commit().await.expect("commit");
        }
        std::mem::forget(conns);
    }

    fn spawn(&self, role: Role, seconds: f64, seed: u64) -> Worker {
        let mut child = Command::new(env!("CARGO_BIN_EXE_fleet-worker"))
            .args([
                role.arg(),
                &self.bouncer.url(),
                &format!("{seconds:.3}"),
                &seed.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start fleet-worker");
        let pid = child.id();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let seen2 = Arc::clone(&seen);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                let mut seen = seen2.lock().unwrap();
                if let Some(message) = v.get("unexpected").and_then(Value::as_str) {
                    // At once, with the time of day, to set beside the
                    // pooler's log (`LOCKKIT_FLEET_PGBOUNCER_LOG`).
                    eprintln!(
                        "fleet: {} unexpected, {} worker {pid}: {}",
                        utc_now(),
                        role.arg(),
                        short(message)
                    );
                    seen.unexpected.push(message.to_owned());
                } else if let Some(message) = v.get("harmed").and_then(Value::as_str) {
                    eprintln!(
                        "fleet: {} caused by lockkit?, {} worker {pid}: {}",
                        utc_now(),
                        role.arg(),
                        short(message)
                    );
                    seen.harmed.push(message.to_owned());
                } else {
                    seen.finished = v["final"].as_bool().unwrap_or(false);
                    seen.last = Some(v);
                }
            }
        });
        let seen3 = Arc::clone(&seen);
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = BufReader::new(stderr).read_to_string(&mut text);
            seen3.lock().unwrap().stderr = text;
        });
        Worker {
            role,
            child,
            seen,
            killed: false,
        }
    }

    /// Runs `roles` (each so many processes) for `length`, with or without
    /// `chaos`, and gathers what they report.
    pub(crate) async fn run(
        &self,
        roles: &[(Role, usize)],
        length: Duration,
        chaos: Chaos,
    ) -> Report {
        let started = Instant::now();
        let deadline = started + length;
        let mut rng = fastrand::Rng::with_seed(0xf1ee_7000 ^ length.as_secs());
        let mut report = Report::default();
        let mut workers = Vec::new();
        for &(role, n) in roles {
            for _ in 0..n {
                workers.push(self.spawn(role, length.as_secs_f64(), rng.u64(..)));
            }
        }
        report.processes = workers.len();

        let stop = Arc::new(AtomicBool::new(false));
        let sampler = tokio::spawn(sample(self.db.config(), Arc::clone(&stop)));
        let cli = cli_binary();
        if let Err(reason) = &cli {
            eprintln!("fleet: `lockkit inspect` and `lockkit check` skipped: {reason}");
            if std::env::var("CI").as_deref() == Ok("true") {
                report.failures.push(format!("CI=true and {reason}"));
            }
        }
        let faults = std::env::var(CHAOS).unwrap_or_else(|_| "all".into());
        let (kills, terminations) = match faults.as_str() {
            "all" => (true, true),
            "kill" => (true, false),
            "terminate" => (false, true),
            "none" => (false, false),
            other => panic!("{CHAOS}={other:?}: all, kill, terminate or none"),
        };
        let mut next_cli = Instant::now() + Duration::from_secs(5);
        let mut cli_turn = 0;
        while chaos == Chaos::On && Instant::now() + Duration::from_secs(3) < deadline {
            tokio::time::sleep(Duration::from_millis(rng.u64(1_000..3_000))).await;
            let kill = rng.bool();
            if !(if kill { kills } else { terminations }) {
                continue;
            }
            if kill {
                // Kill a lockkit worker and start its role again.
                let killable: Vec<usize> = (0..workers.len())
                    .filter(|&i| workers[i].role.killable() && !workers[i].killed)
                    .collect();
                let i = killable[rng.usize(..killable.len())];
                let w = &mut workers[i];
                let pid = w.child.id();
                let _ = w.child.kill(); // SIGKILL
                let _ = w.child.wait();
                w.killed = true;
                report.kills += 1;
                let left = deadline.saturating_duration_since(Instant::now());
                eprintln!(
                    "fleet: {:>6.1?} SIGKILL {} worker {pid}; started again for {left:.1?}",
                    started.elapsed(),
                    w.role.arg()
                );
                let role = w.role;
                workers.push(self.spawn(role, left.as_secs_f64(), rng.u64(..)));
                report.processes += 1;
            } else {
                match self.terminate_one().await {
                    Some(what) => {
                        report.terminations += 1;
                        eprintln!("fleet: {:>6.1?} terminated {what}", started.elapsed());
                    }
                    None => eprintln!("fleet: no backend to terminate"),
                }
            }
            if let (Ok(cli), true) = (&cli, Instant::now() > next_cli) {
                let command = if cli_turn % 2 == 0 {
                    "inspect"
                } else {
                    "check"
                };
                cli_turn += 1;
                match run_cli(cli, command, &self.bouncer.url()).await {
                    Ok(()) => report.cli_runs += 1,
                    Err(e) => report.failures.push(e),
                }
                next_cli = Instant::now() + Duration::from_secs(10);
            }
        }
        // Both commands at least once, also in a short run.
        if let (Ok(cli), On) = (&cli, chaos) {
            for command in ["inspect", "check"] {
                match run_cli(cli, command, &self.bouncer.url()).await {
                    Ok(()) => report.cli_runs += 1,
                    Err(e) => report.failures.push(e),
                }
            }
        }

        // The workers stop at their deadline.
        let stop_by = deadline + STOP_BOUND;
        let mut dumped = false;
        for w in &mut workers {
            if w.killed {
                continue;
            }
            loop {
                match w.child.try_wait() {
                    Ok(Some(status)) => {
                        // Let the reader threads see the last lines.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        let seen = w.seen.lock().unwrap();
                        if !status.success() || !seen.finished {
                            report.failures.push(format!(
                                "a {} worker exited with {status} without its final line; stderr: {}",
                                w.role.arg(),
                                seen.stderr
                            ));
                        }
                        break;
                    }
                    Ok(None) if Instant::now() < stop_by => {
                        if !dumped && Instant::now() > deadline + Duration::from_secs(15) {
                            dumped = true;
                            eprintln!(
                                "fleet: a {} worker is still running 15 s after its deadline; the server's backends:\n{}",
                                w.role.arg(),
                                self.activity().await
                            );
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    _ => {
                        let _ = w.child.kill();
                        let _ = w.child.wait();
                        report.failures.push(format!(
                            "a {} worker did not stop within {STOP_BOUND:?} of its deadline",
                            w.role.arg()
                        ));
                        break;
                    }
                }
            }
        }
        report.elapsed = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        if let Some(path) = std::env::var_os(POOLER_LOG) {
            if let Err(e) = std::fs::write(&path, self.bouncer.log()) {
                eprintln!("fleet: pgbouncer's log not copied to {path:?}: {e}");
            }
        }
        let (samples, doubles) = sampler.await.expect("the sampler");
        report.samples = samples;
        report.double_holders = doubles;
        for w in &workers {
            // A killed worker's reader may still be reading what it wrote
            // before the kill: its last lines are in the pipe already.
            let seen = w.seen.lock().unwrap();
            if let Some(last) = &seen.last {
                report.counts.push((w.role, last.clone()));
            }
            report.unexpected.extend(
                seen.unexpected
                    .iter()
                    .map(|m| format!("{}: {m}", w.role.arg())),
            );
            report
                .harmed
                .extend(seen.harmed.iter().map(|m| format!("{}: {m}", w.role.arg())));
        }
        report
    }

    /// The server's client backends, one a line: what a stall waits on.
    async fn activity(&self) -> String {
        match self
            .observer
            .query(
                "SELECT format('pid %s %s xact %s wait %s/%s app %L: %s', pid, state, \
                   date_trunc('second', now() - xact_start), wait_event_type, wait_event, \
                   application_name, left(query, 120)) \
                 FROM pg_stat_activity WHERE backend_type = 'client backend' ORDER BY pid",
                &[],
            )
            .await
        {
            Ok(rows) => rows
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
                .join("\n"),
            Err(e) => format!("(pg_stat_activity: {e})"),
        }
    }

    /// Terminates one random backend of the fleet's clients, through the
    /// runner's connection, and says which. Never the runner's own, and
    /// never the backend of a session lock on a counted key (in
    /// `application_name`, `lockkit session lock lockkit-tests/fleet <key>`
    /// or `lockkit session locks` for the multiplexed form): the lock is
    /// then lost by design (`SessionGuard::lost`), and the work done under
    /// it can overlap the next holder's, which the counters cannot tell
    /// from a broken lock. The permits' backends (another namespace) are
    /// fair game.
    async fn terminate_one(&self) -> Option<String> {
        let row = self
            .observer
            .query_opt(
                "WITH victim AS ( \
                   SELECT pid, state, application_name FROM pg_stat_activity \
                   WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() \
                   AND application_name <> $1 \
                   AND application_name NOT LIKE 'lockkit session lock lockkit-tests/fleet %' \
                   AND application_name <> 'lockkit session locks' \
                   ORDER BY random() LIMIT 1) \
                 SELECT format('backend %s (%s, %s)', pid, state, application_name), \
                   pg_terminate_backend(pid) FROM victim",
                &[&RUNNER],
            )
            .await
            .expect("terminate a backend")?;
        let ended: bool = row.get(1);
        ended.then(|| row.get(0))
    }
}

/// Reads `pg_locks` until `stop`, recording every key granted exclusive to
/// two sessions at once; returns the number of reads and what it saw.
async fn sample(mut config: tokio_postgres::Config, stop: Arc<AtomicBool>) -> (u64, Vec<String>) {
    config.application_name(RUNNER);
    let client = connect(&config).await;
    let mut reads = 0;
    let mut doubles = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let rows = client
            .query(
                "SELECT format('%s/%s/%s held by %s', classid, objid, objsubid, \
                   array_agg(pid ORDER BY pid)) FROM pg_locks \
                 WHERE locktype = 'advisory' AND granted AND mode = 'ExclusiveLock' \
                 GROUP BY classid, objid, objsubid HAVING count(DISTINCT pid) > 1",
                &[],
            )
            .await
            .expect("the sampler reads pg_locks");
        reads += 1;
        for row in rows {
            if doubles.len() < 20 {
                doubles.push(row.get(0));
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (reads, doubles)
}

/// The `lockkit` command beside this test binary (`target/<profile>/lockkit`,
/// built by `cargo test --workspace` for lockkit-cli's own tests), or why
/// there is none.
fn cli_binary() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("no current_exe: {e}"))?;
    // target/<profile>/deps/fleet-<hash>
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .ok_or_else(|| format!("{} has no target directory", exe.display()))?;
    let cli = profile.join("lockkit");
    if cli.is_file() {
        Ok(cli)
    } else {
        Err(format!(
            "{} does not exist (built by `cargo test --workspace`, or `cargo build -p lockkit-cli`)",
            cli.display()
        ))
    }
}

/// Runs `lockkit <command> --url <url>` with a bound (the command bounds
/// each of its own waits by 10 s); `Ok` when it exits 0.
async fn run_cli(cli: &PathBuf, command: &str, url: &str) -> Result<(), String> {
    let mut child = Command::new(cli)
        .args([command, "--url", url])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("lockkit {command}: cannot start: {e}"))?;
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let bound = Instant::now() + Duration::from_secs(60);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < bound => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("lockkit {command} did not end within 60 s"));
            }
        }
    };
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    if status.success() {
        eprintln!(
            "fleet: lockkit {command} through the pooler: exit 0, {} lines",
            out.lines().count()
        );
        Ok(())
    } else {
        Err(format!(
            "lockkit {command} through the pooler exited with {status}: {err}{out}"
        ))
    }
}

use Chaos::On;

/// The start of `text`, for the printed figures: lockkit's errors carry
/// their sources in full.
pub(crate) fn short(text: &str) -> String {
    match text.char_indices().nth(400) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}
