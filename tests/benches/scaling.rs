//! How lockkit's transaction locks scale, on a real PostgreSQL server (the
//! harness's throwaway server, or `DATABASE_URL`): a table, and the same as
//! an SVG chart.
//!
//! ```text
//! cargo bench -p lockkit-tests --bench scaling
//! ```
//!
//! - **Batch size**: the time of one `lock_batch` call (inside an open
//!   transaction; `BEGIN` and `COMMIT` untimed) for batches of 1, 16, 64,
//!   256 and 1,024 distinct keys, on one connection, through the default API
//!   (`LockClient::begin`). The sizes take turns, call by call, so that the
//!   machine's drift hits them alike.
//! - **Connections and contention**: transactions per second for 1, 4, 16
//!   and 64 connections, each running transactions back to back for a fixed
//!   time per cell. Each transaction locks one key, inserts one row into a
//!   log table (a tiny write) and commits; a share of them (0 %, 10 %, 50 %)
//!   lock the same hot key, the others a key of their own.
//!
//! Each cell runs in four slices, one per pass over the whole grid, so that
//! the machine's drift spreads over all cells.
//!
//! `LOCKKIT_SCALING_SECS` sets the seconds per cell (default 2) and
//! `LOCKKIT_SCALING_SVG` the chart's path (default `docs/scaling.svg` in the
//! workspace). Run without `--bench` (`cargo test --benches`), it does a
//! smoke run of a few cells and writes no chart.
//!
//! After the run, the log table is checked against the counts: one row per
//! committed transaction, and as many on the hot key as hot transactions.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Batch, Config, LockClient, Locker};
use lockkit_tests::TestServer;
use tokio::sync::Barrier;

/// The key type locked in every benchmark.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
struct Item {
    id: i64,
}

/// The hot key's id; every other transaction locks an id of its own.
const HOT: i64 = 0;

/// What the run measures.
struct Plan {
    sizes: Vec<usize>,
    connections: Vec<usize>,
    hot_percent: Vec<u32>,
    cell: Duration,
}

impl Plan {
    fn from_env(bench_run: bool) -> Plan {
        let secs = std::env::var("LOCKKIT_SCALING_SECS")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .unwrap_or(2.0);
        if bench_run {
            Plan {
                sizes: vec![1, 16, 64, 256, 1024],
                connections: vec![1, 4, 16, 64],
                hot_percent: vec![0, 10, 50],
                cell: Duration::from_secs_f64(secs),
            }
        } else {
            Plan {
                sizes: vec![1, 16],
                connections: vec![1, 4],
                hot_percent: vec![0, 50],
                cell: Duration::from_millis(100),
            }
        }
    }
}

/// One size's lock calls.
struct SizeRow {
    size: usize,
    calls: usize,
    median: Duration,
    p90: Duration,
}

/// One cell of the throughput grid.
struct Cell {
    connections: usize,
    hot_percent: u32,
    /// Transactions committed within the cell's time.
    committed: usize,
    hot: usize,
    tps: f64,
    p50: Duration,
    p99: Duration,
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Times `lock_batch` for every size, the sizes taking turns, for about one
/// cell's time per size (at least 20 calls each).
async fn batch_sizes(locker: &Locker, plan: &Plan) -> Vec<SizeRow> {
    let mut conn = LockClient::new(locker, TestServer::shared().connect().await);
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); plan.sizes.len()];
    let budget = plan.cell * plan.sizes.len() as u32;
    let start = Instant::now();
    let mut round: i64 = 0;
    while start.elapsed() < budget || samples[0].len() < 20 {
        for (s, &size) in plan.sizes.iter().enumerate() {
            // Distinct keys in every call, so no call finds a key held.
            let base = 1_000_000 + (round * plan.sizes.len() as i64 + s as i64) * 1024;
            let items: Vec<Item> = (0..size as i64).map(|i| Item { id: base + i }).collect();
            let mut batch = Batch::new();
            batch.extend(&items);
            let tx = conn.begin().await.expect("begin");
            let t = Instant::now();
            let held = tx.lock_batch(&batch).await.expect("lock_batch");
            samples[s].push(t.elapsed());
            assert_eq!(tx.held_count(), size, "every key of the batch is held");
            drop(held);
            tx.commit().await.expect("commit");
        }
        round += 1;
    }
    plan.sizes
        .iter()
        .zip(samples)
        .map(|(&size, mut v)| {
            v.sort();
            SizeRow {
                size,
                calls: v.len(),
                median: quantile(&v, 0.5),
                p90: quantile(&v, 0.9),
            }
        })
        .collect()
}

/// What one connection did in a cell.
#[derive(Default)]
struct Tally {
    /// Latencies of the transactions committed within the cell's time.
    latencies: Vec<Duration>,
    /// Hot transactions committed within the cell's time.
    hot: usize,
    /// Every committed transaction, and the hot ones, the late included.
    all: usize,
    all_hot: usize,
}

/// Runs one slice of a cell: `connections` of `conns`, each running
/// transactions until `time` is up.
async fn slice(
    conns: &mut Vec<LockClient>,
    insert: &str,
    connections: usize,
    hot_percent: u32,
    time: Duration,
    seed: u64,
) -> Tally {
    let barrier = Arc::new(Barrier::new(connections));
    let start = Arc::new(std::sync::OnceLock::<Instant>::new());
    let mut tasks = Vec::new();
    for (w, mut conn) in conns.drain(..connections).enumerate() {
        let barrier = Arc::clone(&barrier);
        let start = Arc::clone(&start);
        let insert = insert.to_owned();
        tasks.push(tokio::spawn(async move {
            let statement = conn.prepare(&insert).await.expect("prepare the insert");
            let mut rng = fastrand::Rng::with_seed(seed ^ ((w as u64) << 32));
            let mut tally = Tally::default();
            barrier.wait().await;
            let start = *start.get_or_init(Instant::now);
            let mut i: i64 = 0;
            while start.elapsed() < time {
                let hot = rng.u32(0..100) < hot_percent;
                // Cold ids: this connection's own in this slice, never reused.
                let id = if hot {
                    HOT
                } else {
                    ((w as i64 + 1) << 40) + seed as i64 * 1_000_000_000 + i
                };
                i += 1;
                let t = Instant::now();
                let tx = conn.begin().await.expect("begin");
                let held = tx.lock(Item { id }).await.expect("lock");
                tx.execute(&statement, &[&id]).await.expect("insert");
                drop(held);
                tx.commit().await.expect("commit");
                let done = t.elapsed();
                tally.all += 1;
                tally.all_hot += usize::from(hot);
                if start.elapsed() <= time {
                    tally.latencies.push(done);
                    tally.hot += usize::from(hot);
                }
            }
            (conn, tally)
        }));
    }
    let mut sum = Tally::default();
    for task in tasks {
        let (conn, tally) = task.await.expect("worker");
        conns.push(conn);
        sum.add(tally);
    }
    sum
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.latencies.extend(other.latencies);
        self.hot += other.hot;
        self.all += other.all;
        self.all_hot += other.all_hot;
    }
}

/// The throughput grid. Every cell runs in `PASSES` slices, and each pass
/// goes over the whole grid, so that the machine's drift spreads over all
/// cells instead of landing on a few.
async fn throughput(locker: &Locker, plan: &Plan, table: &str) -> Vec<Cell> {
    const PASSES: u32 = 4;
    let max = plan.connections.iter().copied().max().unwrap_or(1);
    let mut conns = Vec::with_capacity(max);
    for _ in 0..max {
        conns.push(LockClient::new(
            locker,
            TestServer::shared().connect().await,
        ));
    }
    conns[0]
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (key int8 NOT NULL)"
        ))
        .await
        .expect("create the log table");
    let insert = format!("INSERT INTO {table} (key) VALUES ($1)");
    let grid: Vec<(usize, u32)> = plan
        .connections
        .iter()
        .flat_map(|&n| plan.hot_percent.iter().map(move |&p| (n, p)))
        .collect();
    let mut tallies: Vec<Tally> = grid.iter().map(|_| Tally::default()).collect();
    let mut seed = 1;
    for _ in 0..PASSES {
        for (&(connections, hot_percent), tally) in grid.iter().zip(&mut tallies) {
            let t = slice(
                &mut conns,
                &insert,
                connections,
                hot_percent,
                plan.cell / PASSES,
                seed,
            )
            .await;
            seed += 1;
            tally.add(t);
        }
    }
    // Every committed transaction left its row, the hot ones on the hot key.
    let all: usize = tallies.iter().map(|t| t.all).sum();
    let all_hot: usize = tallies.iter().map(|t| t.all_hot).sum();
    let row = conns[0]
        .query_one(
            &format!("SELECT count(*), count(*) FILTER (WHERE key = $1) FROM {table}"),
            &[&HOT],
        )
        .await
        .expect("count the log");
    let (rows, hot_rows): (i64, i64) = (row.get(0), row.get(1));
    assert_eq!(rows as usize, all, "one row per committed transaction");
    assert_eq!(
        hot_rows as usize, all_hot,
        "one hot row per hot transaction"
    );
    conns[0]
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .expect("drop the log table");
    grid.into_iter()
        .zip(tallies)
        .map(|((connections, hot_percent), mut t)| {
            t.latencies.sort();
            Cell {
                connections,
                hot_percent,
                committed: t.latencies.len(),
                hot: t.hot,
                tps: t.latencies.len() as f64 / plan.cell.as_secs_f64(),
                p50: quantile(&t.latencies, 0.5),
                p99: quantile(&t.latencies, 0.99),
            }
        })
        .collect()
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn print_tables(sizes: &[SizeRow], cells: &[Cell], plan: &Plan) {
    println!("\nlock_batch, one call (BEGIN/COMMIT untimed), one connection");
    println!("| keys | median µs | p90 µs | µs per key | calls |");
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for r in sizes {
        println!(
            "| {} | {:.0} | {:.0} | {:.2} | {} |",
            r.size,
            micros(r.median),
            micros(r.p90),
            micros(r.median) / r.size as f64,
            r.calls
        );
    }
    println!(
        "\ntransactions per second (lock one key, insert one row, commit; {:.1} s per cell)",
        plan.cell.as_secs_f64()
    );
    let header: String = plan
        .hot_percent
        .iter()
        .map(|h| format!(" {h} % hot: tx/s | p50 ms | p99 ms |"))
        .collect();
    println!("| connections |{header}");
    println!(
        "| ---: |{}",
        " ---: | ---: | ---: |".repeat(plan.hot_percent.len())
    );
    for &n in &plan.connections {
        let mut line = format!("| {n} |");
        for c in cells.iter().filter(|c| c.connections == n) {
            let _ = write!(
                line,
                " {:.0} | {:.1} | {:.1} |",
                c.tps,
                c.p50.as_secs_f64() * 1e3,
                c.p99.as_secs_f64() * 1e3
            );
        }
        println!("{line}");
    }
    let hot: usize = cells.iter().map(|c| c.hot).sum();
    let committed: usize = cells.iter().map(|c| c.committed).sum();
    println!("({committed} transactions within the cells' time, {hot} of them on the hot key)");
}

// ---- the chart -------------------------------------------------------------

const COLORS: [&str; 3] = ["#4c78a8", "#f58518", "#e45756"];

/// Both tables as one SVG: µs per `lock_batch` call against the batch size
/// (log-log), and transactions per second per connection count, a bar per
/// hot-key share.
fn svg(sizes: &[SizeRow], cells: &[Cell], plan: &Plan, server: &str) -> String {
    let (w, h) = (920.0, 430.0);
    let (top, bottom) = (70.0, 70.0);
    let plot_h = h - top - bottom;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="Helvetica, Arial, sans-serif" font-size="12">"##
    );
    let _ = writeln!(s, r##"<rect width="100%" height="100%" fill="white"/>"##);
    let _ = writeln!(
        s,
        r##"<text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">lockkit transaction locks: batch size and concurrency</text>"##,
        w / 2.0
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="40" text-anchor="middle" fill="#555">{}, same host, 2 cores shared with other builds; one run of cargo bench -p lockkit-tests --bench scaling</text>"##,
        w / 2.0,
        escape(server)
    );

    // Left: µs per call against keys, log-log.
    let (x0, x1) = (70.0, 420.0);
    let lo_y = 10f64.powf(
        sizes
            .iter()
            .map(|r| micros(r.median).log10())
            .fold(f64::INFINITY, f64::min)
            .floor(),
    );
    let hi_y = 10f64.powf(
        sizes
            .iter()
            .map(|r| micros(r.p90).log10())
            .fold(f64::NEG_INFINITY, f64::max)
            .ceil(),
    );
    let (lo_x, hi_x) = (1f64, 1024f64);
    let px = |k: f64| x0 + (x1 - x0) * (k.log2() - lo_x.log2()) / (hi_x.log2() - lo_x.log2());
    let py = |us: f64| {
        top + plot_h * (1.0 - (us.log10() - lo_y.log10()) / (hi_y.log10() - lo_y.log10()))
    };
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="middle" font-weight="bold">One lock_batch call (µs, log scale)</text>"##,
        (x0 + x1) / 2.0,
        top - 12.0
    );
    let mut decade = lo_y;
    while decade <= hi_y * 1.0001 {
        for m in [1.0, 2.0, 5.0] {
            let v = decade * m;
            if v > hi_y * 1.0001 {
                break;
            }
            let y = py(v);
            let _ = writeln!(
                s,
                r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
                x0 - 6.0,
                y + 4.0,
                v
            );
        }
        decade *= 10.0;
    }
    for r in sizes {
        let x = px(r.size as f64);
        let _ = writeln!(
            s,
            r##"<text x="{x:.1}" y="{}" text-anchor="middle" fill="#555">{}</text>"##,
            h - bottom + 18.0,
            r.size
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="middle">keys per batch (log scale)</text>"##,
        (x0 + x1) / 2.0,
        h - bottom + 38.0
    );
    for (series, color, get) in [
        (
            "median",
            COLORS[0],
            (|r: &SizeRow| r.median) as fn(&SizeRow) -> Duration,
        ),
        ("p90", COLORS[1], |r: &SizeRow| r.p90),
    ] {
        let points: Vec<String> = sizes
            .iter()
            .map(|r| format!("{:.1},{:.1}", px(r.size as f64), py(micros(get(r)))))
            .collect();
        let _ = writeln!(
            s,
            r##"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"##,
            points.join(" ")
        );
        for r in sizes {
            let _ = writeln!(
                s,
                r##"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"##,
                px(r.size as f64),
                py(micros(get(r)))
            );
        }
        let ly = if series == "median" {
            top + 8.0
        } else {
            top + 24.0
        };
        let _ = writeln!(
            s,
            r##"<rect x="{}" y="{}" width="12" height="3" fill="{color}"/><text x="{}" y="{}">{series}</text>"##,
            x0 + 10.0,
            ly - 4.0,
            x0 + 28.0,
            ly
        );
    }
    for r in sizes {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10" fill="#333">{:.0}</text>"##,
            px(r.size as f64),
            py(micros(r.median)) + 15.0,
            micros(r.median)
        );
    }

    // Right: transactions per second, grouped bars.
    let (x0, x1) = (520.0, w - 20.0);
    let max_tps = cells.iter().map(|c| c.tps).fold(1.0, f64::max);
    let step = nice_step(max_tps / 5.0);
    let hi = (max_tps / step).ceil() * step;
    let py = |tps: f64| top + plot_h * (1.0 - tps / hi);
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="middle" font-weight="bold">Transactions per second (one key each)</text>"##,
        (x0 + x1) / 2.0,
        top - 12.0
    );
    let mut v = 0.0;
    while v <= hi * 1.0001 {
        let y = py(v);
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end" fill="#555">{v}</text>"##,
            x0 - 6.0,
            y + 4.0
        );
        v += step;
    }
    let groups = plan.connections.len() as f64;
    let group_w = (x1 - x0) / groups;
    let bar_w = group_w * 0.8 / plan.hot_percent.len() as f64;
    for (g, &n) in plan.connections.iter().enumerate() {
        let gx = x0 + g as f64 * group_w + group_w * 0.1;
        for (k, &p) in plan.hot_percent.iter().enumerate() {
            if let Some(c) = cells
                .iter()
                .find(|c| c.connections == n && c.hot_percent == p)
            {
                let y = py(c.tps);
                let _ = writeln!(
                    s,
                    r##"<rect x="{:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{n} connections, {p} % hot: {:.0} tx/s</title></rect>"##,
                    gx + k as f64 * bar_w,
                    bar_w - 2.0,
                    top + plot_h - y,
                    COLORS[k % COLORS.len()],
                    c.tps
                );
            }
        }
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#555">{n}</text>"##,
            gx + group_w * 0.4,
            h - bottom + 18.0
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="middle">connections</text>"##,
        (x0 + x1) / 2.0,
        h - bottom + 38.0
    );
    for (k, &p) in plan.hot_percent.iter().enumerate() {
        let lx = x1 - 250.0 + k as f64 * 85.0;
        let _ = writeln!(
            s,
            r##"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{p} % hot</text>"##,
            h - 22.0,
            COLORS[k % COLORS.len()],
            lx + 16.0,
            h - 12.0
        );
    }
    let _ = writeln!(s, "</svg>");
    s
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let p = 10f64.powf(raw.max(1.0).log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * p)
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn main() {
    // A real benchmark run (`cargo bench`), not `cargo test --benches`.
    let bench_run = std::env::args().any(|a| a == "--bench");
    let plan = Plan::from_env(bench_run);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let client = TestServer::shared().connect().await;
        let server: String = client
            .query_one(
                "SELECT 'PostgreSQL ' || current_setting('server_version')",
                &[],
            )
            .await
            .expect("server version")
            .get(0);
        // The largest batch must fit the budget (the server's
        // max_locks_per_transaction is 64); the shared lock table has room.
        let max = plan.sizes.iter().copied().max().unwrap_or(1);
        let locker = Locker::new(&client, Config::default().budget(max))
            .await
            .expect("locker");
        let table = format!("lockkit_scaling_{}", std::process::id());
        let sizes = batch_sizes(&locker, &plan).await;
        let cells = throughput(&locker, &plan, &table).await;
        print_tables(&sizes, &cells, &plan);
        if bench_run {
            let path = std::env::var("LOCKKIT_SCALING_SVG")
                .unwrap_or_else(|_| format!("{}/../docs/scaling.svg", env!("CARGO_MANIFEST_DIR")));
            std::fs::write(&path, svg(&sizes, &cells, &plan, &server)).expect("write the chart");
            println!("chart: {path}");
        }
    });
}
