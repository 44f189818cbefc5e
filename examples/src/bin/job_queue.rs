//! A job queue with no broker, from the notes: workers claim jobs with
//! `FOR UPDATE SKIP LOCKED` and do them in the claiming transaction, an
//! advisory lock per job kind limits how many jobs of a kind run at once,
//! and a crashed worker's job returns to pending.
//!
//! ```sh
//! cargo run -p lockkit-examples --bin job_queue
//! ```
//!
//! Four workers share ten jobs: `report` jobs may run one at a time (one
//! slot key), `email` jobs two at a time (two slot keys). The worker that
//! first claims job 3 crashes in the middle of it (its connection drops):
//! the server rolls its transaction back, job 3 is pending again, and another
//! worker does it.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Config, Locker};
use lockkit_examples::Database;
use tokio_postgres::Client;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One of the concurrency slots of a job kind: a kind with a limit of N
/// has the slots 0..N, and a job runs only while its worker holds one.
#[derive(AdvisoryKey, Debug, Clone)]
struct KindSlot {
    kind: String,
    slot: u32,
}

/// Jobs of each kind that may run at the same time.
const LIMITS: [(&str, u32); 2] = [("report", 1), ("email", 2)];
const WORKERS: usize = 4;
/// The job whose first run crashes.
const CRASHING_JOB: i64 = 3;

const CLAIM: &str = "SELECT id, kind FROM jobs
     WHERE state = 'pending' AND run_after <= now() AND kind <> ALL($1::text[])
     ORDER BY run_after, id LIMIT 1
     FOR UPDATE SKIP LOCKED";

struct Clock(Instant);

impl Clock {
    fn say(&self, who: &str, what: impl std::fmt::Display) {
        println!("[{:>7.3}s] {who:<9} {what}", self.0.elapsed().as_secs_f64());
    }
}

/// What the workers share besides the database.
struct Shared {
    locker: Locker,
    clock: Clock,
    crashed_once: AtomicBool,
    /// Jobs of each kind running now, and the most seen at once.
    running: Mutex<HashMap<String, (usize, usize)>>,
    /// Which workers claimed each job, in order.
    claims: Mutex<HashMap<i64, Vec<String>>>,
    done: AtomicUsize,
}

fn limit(kind: &str) -> u32 {
    LIMITS
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(1, |(_, n)| *n)
}

#[tokio::main]
async fn main() -> ExitCode {
    let db = Database::from_env(&[]);
    match run(&db).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("job_queue: the scenario did not go as described");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("job_queue: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(db: &Database) -> Result<bool, BoxError> {
    let admin = db.connect().await?;
    admin
        .batch_execute(
            "DROP TABLE IF EXISTS jobs;
             CREATE TABLE jobs (
                 id int8 PRIMARY KEY,
                 kind text NOT NULL,
                 run_after timestamptz NOT NULL DEFAULT now(),
                 state text NOT NULL DEFAULT 'pending',
                 done_by text
             );
             INSERT INTO jobs (id, kind)
             SELECT i, CASE WHEN i % 5 IN (1, 3) THEN 'report' ELSE 'email' END
             FROM generate_series(1, 10) AS i;",
        )
        .await?;
    let jobs = admin
        .query_one("SELECT count(*) FROM jobs", &[])
        .await?
        .get::<_, i64>(0) as usize;
    let shared = Arc::new(Shared {
        locker: Locker::new(&admin, Config::default()).await?,
        clock: Clock(Instant::now()),
        crashed_once: AtomicBool::new(false),
        running: Mutex::new(HashMap::new()),
        claims: Mutex::new(HashMap::new()),
        done: AtomicUsize::new(0),
    });
    println!("{jobs} jobs; limits: report 1 at a time, email 2 at a time; {WORKERS} workers.\n");
    let mut handles = Vec::new();
    for w in 1..=WORKERS {
        let (shared, client) = (Arc::clone(&shared), db.connect().await?);
        let config = db.config();
        handles.push(tokio::spawn(async move {
            worker(format!("worker-{w}"), client, config, &shared, jobs).await
        }));
    }
    for h in handles {
        h.await??;
    }

    println!();
    let rows = admin
        .query("SELECT id, kind, state, done_by FROM jobs ORDER BY id", &[])
        .await?;
    let claims = shared.claims.lock().unwrap().clone();
    let mut all_done = true;
    for row in &rows {
        let (id, kind, state, by): (i64, String, String, Option<String>) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        all_done &= state == "done";
        println!(
            "job {id:>2} {kind:<6} {state:<7} by {:<9} claimed by {}",
            by.unwrap_or_default(),
            claims.get(&id).map(|c| c.join(" → ")).unwrap_or_default()
        );
    }
    let running = shared.running.lock().unwrap().clone();
    let mut within_limits = true;
    for (kind, n) in LIMITS {
        let max = running.get(kind).map_or(0, |(_, max)| *max);
        within_limits &= max <= n as usize;
        println!("most {kind} jobs running at once: {max} (limit {n})");
    }
    let crashed_job_redone = claims.get(&CRASHING_JOB).is_some_and(|c| c.len() == 2)
        && rows
            .iter()
            .any(|r| r.get::<_, i64>(0) == CRASHING_JOB && r.get::<_, String>(2) == "done");
    println!(
        "job {CRASHING_JOB}: {}",
        if crashed_job_redone {
            "its first worker crashed; the rollback put it back to pending and another worker did it"
        } else {
            "did not go as described"
        }
    );
    Ok(all_done
        && within_limits
        && crashed_job_redone
        && shared.done.load(Ordering::SeqCst) == jobs)
}

async fn worker(
    name: String,
    mut client: Client,
    config: tokio_postgres::Config,
    shared: &Shared,
    jobs: usize,
) -> Result<(), BoxError> {
    let mut full_kinds: Vec<String> = Vec::new();
    while shared.done.load(Ordering::SeqCst) < jobs {
        let tx = shared.locker.begin(&mut client).await?;
        let Some(job) = tx.query_opt(CLAIM, &[&full_kinds]).await? else {
            // Nothing claimable now: every pending job is claimed or of a
            // kind at its limit. Look again shortly.
            tx.rollback().await?;
            full_kinds.clear();
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let (id, kind): (i64, String) = (job.get(0), job.get(1));
        // A free slot of the kind, without waiting.
        let mut slot = None;
        for s in 0..limit(&kind) {
            if let Ok(held) = tx
                .try_lock(KindSlot {
                    kind: kind.clone(),
                    slot: s,
                })
                .await?
            {
                slot = Some(held);
                break;
            }
        }
        let Some(slot) = slot else {
            // The kind is at its limit: leave the job for later (the
            // rollback releases its row), claim another kind meanwhile.
            tx.rollback().await?;
            full_kinds.push(kind);
            continue;
        };
        tx.execute("UPDATE jobs SET state = 'running' WHERE id = $1", &[&id])
            .await?;
        shared
            .claims
            .lock()
            .unwrap()
            .entry(id)
            .or_default()
            .push(name.clone());
        started(shared, &kind);
        shared.clock.say(
            &name,
            format_args!(
                "runs job {id} ({kind}, slot {} of {})",
                slot.slot,
                limit(&kind)
            ),
        );
        let crash = id == CRASHING_JOB && !shared.crashed_once.swap(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(if kind == "report" {
            300
        } else {
            120
        }))
        .await;
        if crash {
            finished(shared, &kind);
            shared.clock.say(
                &name,
                format_args!(
                    "CRASHES in the middle of job {id}: its connection drops without COMMIT"
                ),
            );
            drop(slot);
            drop(tx);
            // The process dies: its connection goes with it. The server
            // rolls back: job {id} is 'pending' again, its row and its slot
            // are free.
            drop(client);
            tokio::time::sleep(Duration::from_millis(200)).await;
            shared.clock.say(&name, "restarted with a new connection");
            let (c, connection) = config.connect(tokio_postgres::NoTls).await?;
            tokio::spawn(connection);
            client = c;
            continue;
        }
        tx.execute(
            "UPDATE jobs SET state = 'done', done_by = $2 WHERE id = $1",
            &[&id, &name],
        )
        .await?;
        finished(shared, &kind);
        drop(slot);
        tx.commit().await?;
        shared.done.fetch_add(1, Ordering::SeqCst);
        shared.clock.say(&name, format_args!("finished job {id}"));
    }
    Ok(())
}

fn started(shared: &Shared, kind: &str) {
    let mut running = shared.running.lock().unwrap();
    let (now, max) = running.entry(kind.to_owned()).or_default();
    *now += 1;
    *max = (*max).max(*now);
}

fn finished(shared: &Shared, kind: &str) {
    let mut running = shared.running.lock().unwrap();
    if let Some((now, _)) = running.get_mut(kind) {
        *now -= 1;
    }
}
