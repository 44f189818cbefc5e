//! `lockkit`: the operator's view of advisory locks.
//!
//! - `lockkit inspect`: advisory locks held and awaited, each semaphore's
//!   permits as one entry, wait chains as a tree; a summary past 40 rows
//!   (`--full` for every row), the wait-for graph as Graphviz DOT or
//!   Mermaid (`--graph`), `--watch` to refresh, `--json` for scripts.
//! - `lockkit key NAMESPACE VALUE...`: the keys (and their `pg_locks`
//!   columns) of a key type's typed field values (`i:42`, `s:acme`,
//!   `variant:Account`, …), in every form of the key format,
//!   `docs/KEYS.md` in lockkit's source.
//! - `lockkit check`: the server's lock table capacity, how much advisory
//!   locks use now, hot standby, whether the connection is pooled and
//!   what is safe behind the pooler.
//! - `lockkit sql install` / `lockkit sql print`: lockkit's SQL functions,
//!   which compute the same keys in SQL (`lockkit key --sql` prints a key's
//!   expression).
//!
//! Connects with `--url` or `DATABASE_URL`, over TLS as libpq would
//! (`sslmode`, `sslrootcert`; see `lockkit_cli::tls`); every wait for the
//! server is bounded (see the `connect` module).
mod connect;
mod render;
mod sql_command;

use std::error::Error as StdError;
use std::fmt::Write as _;
use std::io::{self, IsTerminal as _};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use connect::{Conn, HostFailure};
use lockkit::inspect::{
    advisory_locks, published_key_types, relation_lock_queues, KeyRegistry, RelationLockRow,
};
use lockkit::SessionLock;
use lockkit_cli::keyarg::{compute, parse_value, Form, KeyRequest};
use lockkit_cli::settings;
use lockkit_cli::tls::{self, TlsSettings};
use postgres_openssl::MakeTlsConnector;
use serde_json::json;
use sql_command::{sql_install, sql_text, SqlCommand};

/// Inspect PostgreSQL advisory locks, compute lockkit keys, check capacity
/// and lock settings.
///
/// The key format is docs/KEYS.md in lockkit's source.
#[derive(Debug, Parser)]
#[command(name = "lockkit", version)]
struct Cli {
    /// Connection URL (`postgres://user@host:port/db?sslmode=verify-full`)
    /// or `key=value` string.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    url: Option<String>,
    /// TLS as libpq's sslmode: disable, prefer (the default: TLS when the
    /// server offers it), require, verify-ca, verify-full. Overrides the
    /// connection string's sslmode, which overrides PGSSLMODE.
    #[arg(long, global = true, value_name = "MODE")]
    sslmode: Option<String>,
    /// The root certificates (PEM) that sign the server's certificate, or
    /// `system` for the system's trust store; verify-ca and verify-full
    /// need them (default ~/.postgresql/root.crt). Overrides the connection
    /// string's sslrootcert, which overrides PGSSLROOTCERT.
    #[arg(long, global = true, value_name = "FILE")]
    sslrootcert: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Advisory locks held and awaited in the database, with wait chains.
    ///
    /// Key types are named from the key types the applications published
    /// to the server (`Locker::publish_key_types`), the session-lock
    /// connections' names, and the namespaces registered with -n, the
    /// LOCKKIT_NAMESPACES variable and a namespaces file (--namespaces-file,
    /// LOCKKIT_NAMESPACES_FILE, or $XDG_CONFIG_HOME/lockkit/namespaces,
    /// default ~/.config/lockkit/namespaces): entries NAME or NAME=CLASS,
    /// separated by newlines, commas or spaces, # for comments. An
    /// unregistered key shows its top 16 bits (BigInt), the namespace tag
    /// of a hashed lockkit key (`lockkit key` prints a namespace's tag; raw
    /// and hashtext keys carry none), or its class (Pair).
    ///
    /// A semaphore's slot keys are one entry per semaphore, named by its
    /// base in hex (the object of its slot 0): its slots held and by whom,
    /// and the sessions that wait for one ("semaphores" in JSON).
    ///
    /// A semaphore is named after a key type registered or published
    /// whose value without fields (a unit struct, `struct Exporters;`) names
    /// it, or by the key a session lock's connection names; else by its
    /// base in hex.
    ///
    /// SCOPE is `session` for a holder idle outside any transaction (a
    /// transaction lock cannot outlive its transaction), `transaction` for a
    /// prepared transaction and for lockkit's own connections inside their
    /// transaction (a SessionLock's, named `lockkit session lock …`, and a
    /// multiplexed one's, `lockkit session locks`), which take transaction
    /// locks only; `unknown` otherwise: pg_locks does not tell them apart.
    ///
    /// More than 40 rows are summed up (per holder, per key type, per
    /// semaphore, the waiters and the longest wait); --full lists them all,
    /// --graph draws who waits for whom. The key format is docs/KEYS.md in
    /// lockkit's source.
    #[command(after_long_help = BOUNDS_HELP, after_help = "Every wait for the server is bounded by the URL's connect_timeout, 10 s when unset (see --help).")]
    Inspect {
        /// A key namespace of the application, to name the type behind a key
        /// (repeatable). `NAME` covers its BigInt keys and its Pair keys of
        /// the derived class; `NAME=CLASS` its Pair keys of an explicit class.
        #[arg(long = "namespace", short = 'n', value_name = "NAME[=CLASS]")]
        namespaces: Vec<String>,
        /// A file of namespaces (see above).
        #[arg(long, value_name = "PATH")]
        namespaces_file: Option<std::path::PathBuf>,
        /// Also relation locks on every relation someone waits for (a DDL
        /// lock queue), in the same wait-chain tree.
        #[arg(long)]
        all: bool,
        /// Every lock, one row each, however many (more than 40 rows are
        /// summed up without it).
        #[arg(long)]
        full: bool,
        /// Only the wait-for graph, for Graphviz (`dot`: `lockkit inspect
        /// --graph dot | dot -Tsvg > waits.svg`) or Mermaid (`mermaid`, to
        /// paste into a ticket): a node per session that holds or waits
        /// (every holder), an edge from each waiter to the session it waits
        /// for directly (the holder, or the one queued just ahead),
        /// labelled with the lock.
        #[arg(long, value_enum, value_name = "FORMAT", conflicts_with = "json")]
        graph: Option<render::GraphFormat>,
        /// Refresh every SECONDS (at least 0.1) until interrupted: redrawn
        /// in place on a terminal, else one snapshot after another, each
        /// after a timestamp line.
        #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
        watch: Option<f64>,
        /// Print JSON (one document per refresh with --watch, with its time).
        #[arg(long)]
        json: bool,
    },
    /// The key of a key type's value, to find its lock in pg_locks.
    ///
    /// Give the type's namespace (its name, or its `namespace = "..."`),
    /// then its fields' values in declaration order, each typed (see below).
    /// Without --form, both hashed keys (BigInt and Pair) are printed.
    /// The key format is docs/KEYS.md in lockkit's source.
    #[command(after_long_help = key_help())]
    Key {
        /// The namespace (left out for --form raw and --form hashtext), then
        /// one typed VALUE per field: i:42, s:acme, variant:Account, …
        #[arg(value_name = "NAMESPACE] [VALUE", allow_negative_numbers = true)]
        args: Vec<String>,
        /// The type's key form: its derive attributes.
        #[arg(long, value_enum, default_value_t = FormArg::Hashed)]
        form: FormArg,
        /// The explicit Pair class of the type (`class = N`).
        #[arg(long, allow_negative_numbers = true)]
        class: Option<i32>,
        /// The type's stripe count (`stripes = N`).
        #[arg(long)]
        stripes: Option<u64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Also print the SQL expressions that compute the keys with
        /// lockkit's SQL functions (`lockkit sql install`): the arguments of
        /// pg_advisory_xact_lock(...).
        #[arg(long)]
        sql: bool,
    },
    /// lockkit's SQL functions: the same keys computed in SQL.
    ///
    /// For migrations, psql sessions, cron jobs and services in other
    /// languages that must take the same locks as the Rust service:
    /// SELECT pg_advisory_xact_lock(lockkit.key('Order', lockkit.int(42))).
    /// `lockkit key --sql` prints a key's SQL. The key format is
    /// docs/KEYS.md in lockkit's source.
    Sql {
        #[command(subcommand)]
        command: SqlCommand,
    },
    /// Lock table capacity and use, hot standby, pooling, and the settings
    /// that decide how locks behave (log_lock_waits, deadlock_timeout,
    /// lock_timeout, statement_timeout, idle_in_transaction_session_timeout,
    /// idle_session_timeout), each with what it means for lockkit and a
    /// recommendation where one applies; behind a transaction-mode pooler,
    /// which lockkit forms and statement mode are safe there, and that a
    /// Locker needs the connections' configuration for its cancel requests.
    #[command(after_long_help = BOUNDS_HELP, after_help = "Every wait for the server is bounded by the URL's connect_timeout, 10 s when unset (see --help).")]
    Check {
        /// The keep-alive interval of the application's session locks, to
        /// compare with the idle timeouts.
        #[arg(long, value_name = "SECONDS", allow_negative_numbers = true, default_value_t = lockkit::pg::DEFAULT_KEEPALIVE.as_secs_f64())]
        session_keepalive: f64,
        /// How long the first query and the pooler probe may each wait for
        /// the server (behind a pooler, for a server connection); past it,
        /// `check` says it cannot tell (and, its first query unanswered,
        /// exits 1).
        #[arg(long, value_name = "SECONDS", allow_negative_numbers = true, default_value_t = lockkit::pg::DEFAULT_PROBE_TIMEOUT.as_secs_f64())]
        probe_timeout: f64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// What every command that connects says of its bounds, in its `--help`.
const BOUNDS_HELP: &str = "BOUNDS
  Every wait for the server is bounded, so that a stuck server or a silent
  network path ends the command with an error naming what did not answer:
  the TCP connect, the TLS handshake and the startup (for each host in
  turn), then each query, by the connection string's connect_timeout
  (seconds: postgres://host/db?connect_timeout=3), or 10 s when it sets
  none (SessionLock's default).";

/// `lockkit key --help`'s value syntax and examples.
fn key_help() -> String {
    format!(
        "VALUES\n{}\n\nEXAMPLES\n{}",
        lockkit_cli::keyarg::SYNTAX,
        "  lockkit key Order i:42                    struct Order { id: i64 }
  lockkit key Tenanted s:acme u64:1001      struct Tenanted<'a> { tenant: &'a str, id: u64 }
  lockkit key Job variant:Account i:7       enum Job { Account(i64), … }
  lockkit key Job 'variant:Account(i:7)'    the same key
  lockkit key Batch 'seq:[s:\"a\",s:\"b\"]' none   struct Batch { ids: Vec<String>, parent: Option<u64> }
  lockkit key --form pair --class 7 Invoice u64:9
  lockkit key --form exact --class 7 Account i32:5
  lockkit key --stripes 1024 Event s:a1b2c3d4
  lockkit key --form raw i64:9
  lockkit key --form hashtext s:payroll-1405-01"
    )
}

/// A key type's form, as its derive attributes say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum FormArg {
    /// Both hashed keys, BigInt and Pair (for a type whose form you do not know).
    Hashed,
    /// The hashed BigInt key (the derive's default).
    Bigint,
    /// The hashed Pair key (`pair`; `--class` for `class = N`).
    Pair,
    /// `pair = "exact"`: Pair(class, value) of one i32 value.
    Exact,
    /// `raw`: one i64 value is BigInt(value), two i32 values Pair(a, b); no namespace.
    Raw,
    /// `lockkit::key::HashText`: BigInt(hashtext(text)) of one s:TEXT; no namespace.
    Hashtext,
}

impl From<FormArg> for Form {
    fn from(form: FormArg) -> Form {
        match form {
            FormArg::Hashed => Form::Hashed,
            FormArg::Bigint => Form::BigInt,
            FormArg::Pair => Form::Pair,
            FormArg::Exact => Form::Exact,
            FormArg::Raw => Form::Raw,
            FormArg::Hashtext => Form::HashText,
        }
    }
}

/// The `application_name` of the CLI's connections.
const APPLICATION_NAME: &str = "lockkit-cli";

/// An error for the user: what went wrong and what to do.
#[derive(Debug)]
enum Failure {
    /// Printed to stderr, exit code 1.
    Message(String),
    /// Stdout was closed (`lockkit inspect | head`): the reader has what it
    /// wanted, so the run ends quietly.
    ClosedStdout,
}

impl<T: Into<String>> From<T> for Failure {
    fn from(message: T) -> Self {
        Failure::Message(message.into())
    }
}

type Result<T> = std::result::Result<T, Failure>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("lockkit: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::ClosedStdout) => ExitCode::SUCCESS,
        Err(Failure::Message(message)) => {
            eprintln!("lockkit: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    match &cli.command {
        Command::Key {
            args,
            form,
            class,
            stripes,
            json,
            sql,
        } => key(args, (*form).into(), *class, *stripes, *json, *sql),
        Command::Sql { command } => match command {
            SqlCommand::Print => emit(lockkit::sql::SQL),
            SqlCommand::Install => {
                let (conn, _, _) = connect(&cli).await?;
                sql_install(&conn).await
            }
        },
        Command::Inspect {
            namespaces,
            namespaces_file,
            all,
            full,
            graph,
            watch,
            json,
        } => {
            // Checked before connecting, so a bad interval is reported
            // first and nothing is printed.
            let watch = watch
                .map(|s| seconds("--watch interval", s, WATCH_MIN))
                .transpose()?;
            let registry =
                lockkit_cli::registry::build(namespaces, namespaces_file.as_deref(), &|k| {
                    std::env::var(k).ok()
                })
                .map_err(|e| e.to_string())?;
            let view = View {
                all: *all,
                full: *full,
                graph: *graph,
                json: *json,
            };
            let (conn, _, _) = connect(&cli).await?;
            // Redrawn in place on a terminal; elsewhere (a file, a pipe, a
            // log) a stream of snapshots, each after a timestamp line.
            let terminal = io::stdout().is_terminal();
            loop {
                let Some(wait) = watch else {
                    return emit(&inspect(&conn, &registry, view, None).await?);
                };
                let now = std::time::SystemTime::now();
                let text = inspect(&conn, &registry, view, Some(now)).await?;
                if terminal {
                    // Clear the screen and home the cursor.
                    emit(&format!("\x1b[2J\x1b[H{text}"))?;
                } else if view.json {
                    emit(&text)?;
                } else {
                    emit(&format!("=== {} ===\n{text}\n", render::timestamp(now)))?;
                }
                tokio::time::sleep(wait).await;
            }
        }
        Command::Check {
            session_keepalive,
            probe_timeout,
            json,
        } => {
            let keepalive = seconds("--session-keepalive", *session_keepalive, 0.0)?;
            let probe_timeout = seconds("--probe-timeout", *probe_timeout, 0.0)?;
            let (conn, config, tls) = connect(&cli).await?;
            emit(&check(&conn, &config, tls, (keepalive, probe_timeout), *json).await?)
        }
    }
}

/// The shortest `--watch` interval.
const WATCH_MIN: f64 = 0.1;

/// The one check of every option given in seconds: a positive, finite
/// number that a `Duration` holds (`nan`, `inf`, `0`, `-0.5` and `1e300`
/// are refused, never rounded to something else), and at least `min`.
fn seconds(option: &str, value: f64, min: f64) -> Result<Duration> {
    if !value.is_finite() || value <= 0.0 {
        return Err(format!(
            "invalid {option} {value}: expected a positive number of seconds, e.g. 2 or 0.5"
        )
        .into());
    }
    if value < min {
        return Err(format!("invalid {option} {value}: at least {min} seconds").into());
    }
    Duration::try_from_secs_f64(value).map_err(|e| format!("invalid {option} {value}: {e}").into())
}

fn key(
    args: &[String],
    form: Form,
    class: Option<i32>,
    stripes: Option<u64>,
    json: bool,
    sql: bool,
) -> Result<()> {
    let (namespace, values) = match (form.has_namespace(), args) {
        (true, [namespace, values @ ..]) => (Some(namespace.as_str()), values),
        (true, []) => {
            return Err("a namespace is needed: lockkit key NAMESPACE VALUE... (see --help)".into())
        }
        (false, values) => (None, values),
    };
    let values = values
        .iter()
        .map(|v| {
            parse_value(v).map_err(|e| {
                let hint = if form.has_namespace() {
                    ""
                } else {
                    " (raw and hashtext keys take no namespace)"
                };
                Failure::Message(format!("{e}{hint}"))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut request = KeyRequest::new(namespace, values);
    request.form = form;
    request.class = class;
    request.stripes = stripes;
    let keys = compute(&request).map_err(|e| e.to_string())?;
    let sql = sql
        .then(|| lockkit_cli::sql::expressions(&request))
        .transpose()
        .map_err(|e| e.to_string())?;
    let rendered: Vec<String> = request.values.iter().map(ToString::to_string).collect();
    if json {
        let mut doc = json!({
            "namespace": namespace,
            "form": format!("{form:?}").to_lowercase(),
            "tag": keys.tag,
            "pair_class": keys.pair_class,
            "values": rendered,
        });
        if let Some(key) = keys.bigint {
            doc["bigint"] = render::key_json(key);
        }
        if let Some(key) = keys.pair {
            doc["pair"] = render::key_json(key);
        }
        if let Some(sql) = &sql {
            doc["bigint_sql"] = json!(sql.bigint);
            doc["pair_sql"] = json!(sql.pair);
        }
        return emit(&format!("{doc:#}\n"));
    }
    let mut out = String::new();
    if let Some(namespace) = namespace {
        let mut about = Vec::new();
        if let Some(tag) = keys.tag {
            about.push(format!("tag 0x{tag:04x}"));
        }
        if let Some(class) = keys.pair_class {
            about.push(format!("pair class {class}"));
        }
        let _ = writeln!(out, "namespace  {namespace} ({})", about.join(", "));
    }
    let _ = writeln!(out, "fields     {}", rendered.join(" "));
    for (name, key) in [("BigInt", keys.bigint), ("Pair", keys.pair)] {
        let Some(key) = key else { continue };
        let id = key.to_pg_locks();
        let _ = writeln!(
            out,
            "{name:<10} {:<28} pg_locks: classid = {} AND objid = {} AND objsubid = {}",
            key.to_string(),
            id.classid,
            id.objid,
            id.objsubid
        );
    }
    if let Some(sql) = sql {
        out.push_str(&sql_text(&sql));
    }
    emit(&out)
}

/// Writes `text` to stdout. A closed stdout ends the run quietly
/// ([`Failure::ClosedStdout`]); `print!` panicked (exit 101) on it.
fn emit(text: &str) -> Result<()> {
    use std::io::Write as _;
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Err(Failure::ClosedStdout),
        Err(e) => Err(format!("cannot write to stdout: {e}").into()),
    }
}

/// What `lockkit inspect` shows.
#[derive(Clone, Copy, Debug)]
struct View {
    /// Relation locks too.
    all: bool,
    /// Every lock, however many.
    full: bool,
    /// Only the wait-for graph.
    graph: Option<render::GraphFormat>,
    /// JSON.
    json: bool,
}

/// One inspection, each of its queries within the bound; `at` is the time
/// of a `--watch` snapshot (written into its JSON).
async fn inspect(
    conn: &Conn,
    base: &KeyRegistry,
    view: View,
    at: Option<std::time::SystemTime>,
) -> Result<String> {
    let client = &conn.client;
    // The key types the applications published, when they did: a role
    // that may not read them still sees the locks.
    let published = conn
        .within("reading the published key types", async {
            Ok(published_key_types(client).await)
        })
        .await?;
    let (published, published_error) = match published {
        Ok(published) => (published, None),
        Err(e) => (None, Some(chain(&e))),
    };
    let registry = match &published {
        Some(published) => base.clone().register_published(published),
        None => base.clone(),
    };
    let rows = conn
        .within("reading pg_locks", async {
            advisory_locks(client, &registry)
                .await
                .map_err(|e| query_error("cannot read pg_locks", &e))
        })
        .await?;
    // Without --all, the queues are read only to say, when no advisory
    // lock is there to show, that they exist.
    let all = view.all;
    let relations: Option<Vec<RelationLockRow>> = if all || rows.is_empty() {
        Some(
            conn.within("reading the relation-lock queues", async {
                relation_lock_queues(client)
                    .await
                    .map_err(|e| query_error("cannot read pg_locks", &e))
            })
            .await?,
        )
    } else {
        None
    };
    let relation_waiters = match (&relations, all) {
        (Some(relations), false) => relations
            .iter()
            .filter(|r| !r.granted)
            .filter_map(|r| r.pid)
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        _ => 0,
    };
    let relations = relations.filter(|_| all);
    let collisions = registry.collisions();
    let sources = render::Sources {
        published: published.as_deref(),
        published_error,
        relation_waiters,
        semaphores: render::semaphore_names(&registry, &rows),
    };
    Ok(if let Some(format) = view.graph {
        render::graph(&rows, relations.as_deref(), &sources, format)
    } else if view.json {
        let mut doc = render::inspect_json(&rows, relations.as_deref(), &collisions, &sources);
        if let Some(at) = at {
            doc["time"] = json!(render::timestamp(at));
        }
        format!("{doc:#}\n")
    } else if !view.full && render::is_long(&rows) {
        render::summary_text(&rows, relations.as_deref(), &collisions, &sources)
    } else {
        render::inspect_text(&rows, relations.as_deref(), &collisions, &sources)
    })
}

const CHECK_SQL: &str = "SELECT current_setting('max_locks_per_transaction')::int8, \
     current_setting('max_connections')::int8, current_setting('autovacuum_max_workers')::int8, \
     current_setting('max_worker_processes')::int8, current_setting('max_wal_senders')::int8, \
     current_setting('max_prepared_transactions')::int8, \
     (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'), \
     pg_is_in_recovery(), current_setting('server_version'), current_user::text";

/// What is safe behind a transaction-mode pooler, as `check` says it (the
/// README's "Session-duration locks" and `StatementMode`).
const POOLED_SAFE: &str = "safe here: transaction-scoped locks (LockTx), SessionLock in its \
     default form (its lock in a transaction of its own) and SessionForm::Multiplexed";
const POOLED_UNSAFE: &str = "not safe here: SessionForm::SessionLevel (pg_advisory_lock on a \
     pooled backend; lockkit refuses it when it sees a pooler)";
const POOLED_STATEMENTS: &str = "named prepared statements are not safe here: keep the default \
     StatementMode::Unnamed (StatementMode::Prepared only behind a pooler that keeps them, \
     e.g. pgbouncer 1.21+ with max_prepared_statements)";
const POOLED_CANCEL: &str = "cut-off lock calls: nothing to configure; no cancel request goes \
     through a pooler, and each wait ends on the server within one slice (deadlock_timeout + 1 s)";
const DIRECT_STATEMENTS: &str = "every lockkit form works here, and StatementMode::Prepared \
     (named prepared statements, opt-in) as well as the default StatementMode::Unnamed";

async fn check(
    conn: &Conn,
    config: &tokio_postgres::Config,
    tls: Option<MakeTlsConnector>,
    (keepalive, probe_timeout): (Duration, Duration),
    json: bool,
) -> Result<String> {
    let client = &conn.client;
    // The first query needs a server connection as the probe does: behind
    // a pooler whose server connections are all busy, none comes. Past the
    // probe's bound (or the query bound, when shorter), `check` says it
    // cannot tell and what holds everywhere, then fails naming the step.
    let cut = probe_timeout.min(conn.bound);
    let settings = client.query_typed_one(CHECK_SQL, &[]);
    let row = match tokio::time::timeout(cut, settings).await {
        Ok(row) => row.map_err(|e| {
            query_error("cannot read the server settings", &lockkit::Error::from(e))
        })?,
        Err(_) => {
            let what = "reading the server settings";
            let why = format!(
                "no reply within {} to the query {what}",
                connect::seconds_text(cut)
            );
            emit(&cannot_tell(&why, json))?;
            return Err(if probe_timeout < conn.bound {
                format!(
                    "{} did not answer within {} (--probe-timeout): no reply to the query \
                     {what}; a pooler in front of it had no server connection free in that \
                     time (or the server is stuck, or slower than that): cannot tell",
                    conn.target,
                    connect::seconds_text(cut)
                )
                .into()
            } else {
                conn.silent(what)
            });
        }
    };
    let get = |i: usize| row.get::<_, i64>(i);
    let per_tx = get(0);
    // MaxBackends (PostgreSQL 15) plus prepared transactions: the processes
    // the shared lock table is sized for.
    let processes = get(1) + get(2) + 1 + get(3) + get(4) + get(5);
    let capacity = per_tx * processes;
    let advisory = get(6);
    let standby: bool = row.get(7);
    let version: String = row.get(8);
    // The probe opens connections of its own (each bounded by the
    // config's connect_timeout) and is bounded as a whole by its own
    // timeout; the query bound on top covers anything left. A probe that
    // runs out of time (behind a pooler whose server connections are all
    // busy, the second connection it needs does not come) tells nothing:
    // the report says so, and names what is safe behind a pooler.
    let probe = conn
        .within("probing for a pooler", async {
            let sessions = match tls {
                Some(tls) => SessionLock::with_tls(config.clone(), tls),
                None => SessionLock::new(config.clone()),
            };
            match sessions.probe_timeout(probe_timeout).probe_pooler().await {
                Ok(probe) => Ok(Ok(probe)),
                Err(e) if e.kind() == lockkit::ErrorKind::Timeout => Ok(Err(format!(
                    "the pooler probe did not finish within {probe_timeout:?}"
                ))),
                Err(e) => Err(query_error("cannot probe for a pooler", &e)),
            }
        })
        .await?;
    let percent = 100.0 * advisory as f64 / capacity.max(1) as f64;
    // Unknown counts as pooled: the forms safe there are safe everywhere.
    let pooled = probe.as_ref().map_or(true, |p| p.is_transaction_pooled());
    let setting_rows = conn
        .within("reading the lock settings", async {
            client
                .query_typed(settings::SETTINGS_SQL, &[])
                .await
                .map_err(|e| query_error("cannot read the lock settings", &lockkit::Error::from(e)))
        })
        .await?;
    let mut assessed = Vec::new();
    for name in settings::NAMES {
        let Some(row) = setting_rows.iter().find(|r| r.get::<_, &str>(0) == name) else {
            continue;
        };
        let setting: &str = row.get(1);
        let unit: Option<&str> = row.get(2);
        if let Some(a) = settings::assess(name, setting, unit, keepalive) {
            assessed.push(a);
        }
    }
    if json {
        let doc = json!({
            "server_version": version,
            "max_locks_per_transaction": per_tx,
            "processes": processes,
            "lock_table_capacity": capacity,
            "advisory_locks": advisory,
            "advisory_percent": percent,
            "hot_standby": standby,
            "transaction_pooled": probe.as_ref().ok().map(|p| p.is_transaction_pooled()),
            "pooler_evidence": probe.as_ref().ok().and_then(|p| p.evidence()),
            "pooler_probe": probe.as_ref().err(),
            "safe_forms": if pooled {
                json!(["transaction-scoped locks", "SessionLock (default form)", "SessionForm::Multiplexed"])
            } else {
                json!(["transaction-scoped locks", "SessionLock (default form)", "SessionForm::Multiplexed", "SessionForm::SessionLevel"])
            },
            "unsafe_forms": if pooled { json!(["SessionForm::SessionLevel"]) } else { json!([]) },
            "statement_modes": if pooled { json!(["Unnamed"]) } else { json!(["Unnamed", "Prepared"]) },
            "session_keepalive_seconds": keepalive.as_secs_f64(),
            "settings": assessed.iter().map(|a| json!({
                "name": a.name,
                "value": a.value,
                "meaning": a.meaning,
                "recommendation": a.recommendation,
            })).collect::<Vec<_>>(),
        });
        return Ok(format!("{doc:#}\n"));
    }
    let mut out = String::new();
    let _ = writeln!(out, "server          PostgreSQL {version}");
    let _ = writeln!(
        out,
        "lock table      {capacity} entries = max_locks_per_transaction {per_tx} × {processes} processes \
         (connections, autovacuum workers, background workers, WAL senders, prepared transactions)"
    );
    let _ = writeln!(
        out,
        "advisory locks  {advisory} now ({percent:.2}% of the lock table, all databases)"
    );
    let _ = writeln!(
        out,
        "hot standby     {}",
        if standby {
            "yes: advisory locks here exclude nothing on the primary"
        } else {
            "no"
        }
    );
    // Whether a pooler was seen, or the probe could not tell, and then
    // what is safe (the same lines for both: unknown counts as pooled).
    let pooled_line = match probe.as_ref().map(|p| (p.evidence(), p.backend_pid())) {
        Err(why) => format!(
            "cannot tell: {why} (every server connection of a pooler busy?); what holds \
             behind a transaction-mode pooler, and so everywhere:"
        ),
        Ok((Some(evidence), _)) => format!("yes, a transaction-mode pooler ({evidence})"),
        Ok((None, pid)) => format!(
            "no transaction-mode pooler seen (server backend {pid} stayed with the connection)"
        ),
    };
    let _ = writeln!(out, "pooled          {pooled_line}");
    if pooled {
        for line in [POOLED_SAFE, POOLED_UNSAFE, POOLED_STATEMENTS, POOLED_CANCEL] {
            let _ = writeln!(out, "{:16}{line}", "");
        }
    } else {
        let _ = writeln!(out, "{:16}{DIRECT_STATEMENTS}", "");
    }
    let _ = writeln!(
        out,
        "\nlock settings (as this connection's role and database see them; \
         session-lock keep-alive assumed {:.1}s, --session-keepalive):",
        keepalive.as_secs_f64()
    );
    for a in &assessed {
        let _ = writeln!(out, "  {:<37} {:<9} {}", a.name, a.value, a.meaning);
        if let Some(r) = &a.recommendation {
            let _ = writeln!(out, "  {:<37} {:<9} recommendation: {r}", "", "");
        }
    }
    Ok(out)
}

/// What `check` says when no server connection answered its first query
/// within its probe's bound (`why`): it cannot tell whether a pooler is
/// there, and what holds behind a transaction-mode pooler holds
/// everywhere.
fn cannot_tell(why: &str, json: bool) -> String {
    if json {
        let doc = json!({
            "server_version": null,
            "transaction_pooled": null,
            "pooler_probe": why,
            "safe_forms": ["transaction-scoped locks", "SessionLock (default form)", "SessionForm::Multiplexed"],
            "unsafe_forms": ["SessionForm::SessionLevel"],
            "statement_modes": ["Unnamed"],
            "cancel_to_needed": true,
            "settings": null,
        });
        return format!("{doc:#}\n");
    }
    let mut out = format!(
        "server          not read: {why}\n\
         pooled          cannot tell: {why} (every server connection of a pooler busy?); \
         what holds behind a transaction-mode pooler, and so everywhere:\n"
    );
    for line in [POOLED_SAFE, POOLED_UNSAFE, POOLED_STATEMENTS, POOLED_CANCEL] {
        let _ = writeln!(out, "{:16}{line}", "");
    }
    out
}

/// Parses the URL and the TLS options, and connects, each host within the
/// bound ([`connect::bound_of`]), with messages that say what to fix.
/// Answers the connection, its config and its TLS connector (`None` for
/// `sslmode=disable`).
async fn connect(cli: &Cli) -> Result<(Conn, tokio_postgres::Config, Option<MakeTlsConnector>)> {
    let url = cli
        .url
        .as_deref()
        .filter(|u| !u.is_empty())
        .ok_or("no database given: pass --url or set DATABASE_URL")?;
    check_scheme(url)?;
    let split = tls::split(url).map_err(|e| e.to_string())?;
    let settings = TlsSettings::decide(
        (cli.sslmode.as_deref(), cli.sslrootcert.as_deref()),
        &split,
        &|k| std::env::var(k).ok(),
    )
    .map_err(|e| e.to_string())?;
    let mut config: tokio_postgres::Config = split
        .rest
        .parse()
        .map_err(|e| format!("invalid connection URL: {}", chain(&e)))?;
    config.ssl_mode(settings.driver_mode());
    // So the CLI's own sessions are recognisable in pg_stat_activity (and
    // in its own `inspect`), unless the URL names another.
    if config.get_application_name().is_none() {
        config.application_name(APPLICATION_NAME);
    }
    // The bound on each wait, also for the connections `check`'s pooler
    // probe opens.
    config.connect_timeout(connect::bound_of(&config));
    let tls = settings.connector().map_err(|e| e.to_string())?;
    let conn = connect::open(&config, tls.as_ref())
        .await
        .map_err(|e| match e.error {
            HostFailure::Driver(driver) => connect_error(&e.target, settings.mode, &driver),
            HostFailure::Io(io) if io.kind() == io::ErrorKind::ConnectionRefused => format!(
                "connection refused at {}: is PostgreSQL running and listening there?",
                e.target
            )
            .into(),
            HostFailure::Io(io) => format!("cannot connect to {}: {io}", e.target).into(),
            HostFailure::Message(message) => message,
        })?;
    Ok((conn, config, tls))
}

/// Refuses a URL of another scheme (`mysql://…`), and a string that is
/// neither a URL nor `key=value` pairs (`postgres//host`, which
/// tokio-postgres would answer with `unexpected EOF`).
fn check_scheme(url: &str) -> Result<()> {
    let trimmed = url.trim();
    let expected = "expected postgres://[user[:password]@]host[:port]/dbname[?param=value&…] \
                    or key=value pairs (host=… dbname=…)";
    if let Some((scheme, _)) = trimmed.split_once("://") {
        let plain = !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
        if plain && scheme != "postgres" && scheme != "postgresql" {
            return Err(format!(
                "wrong URL scheme {scheme:?}: lockkit connects to PostgreSQL; {expected}"
            )
            .into());
        }
        return Ok(());
    }
    if !trimmed.contains('=') {
        return Err(format!(
            "invalid connection URL {:?}: neither a URL (a scheme followed by `://`) nor \
             key=value pairs; {expected}",
            without_password(trimmed)
        )
        .into());
    }
    Ok(())
}

/// A connection string for a message, with what precedes an `@` (a
/// password, perhaps) left out.
fn without_password(url: &str) -> String {
    match url.rsplit_once('@') {
        Some((_, host)) => format!("…@{host}"),
        None => url.to_owned(),
    }
}

fn connect_error(target: &str, mode: tls::SslMode, e: &tokio_postgres::Error) -> Failure {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        let what = match code {
            "42501" => "permission denied",
            "28000" | "28P01" => "authentication failed",
            "3D000" => "no such database",
            "53300" => "the server is full (too many clients)",
            "57P03" => "the server is not accepting connections now",
            // pgbouncer 1.18 refuses a client over its max_client_conn
            // with this text and 08P01, a code that says nothing of it.
            _ if db.message() == "no more connections allowed (max_client_conn)" => {
                "the pooler is full (max_client_conn)"
            }
            _ => "the server refused the connection",
        };
        return format!("{what} at {target}: {} (SQLSTATE {code})", db.message()).into();
    }
    let mut source: Option<&(dyn StdError + 'static)> = e.source();
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<io::Error>() {
            if io.kind() == io::ErrorKind::ConnectionRefused {
                return format!(
                    "connection refused at {target}: is PostgreSQL running and listening there?"
                )
                .into();
            }
        }
        source = s.source();
    }
    let text = chain(e);
    if text.contains("certificate verify failed") {
        return format!(
            "cannot connect to {target}: the server's certificate was not accepted \
             (sslmode={}; check --sslrootcert, and for verify-full that the certificate names \
             the host connected to): {text}",
            mode.as_str()
        )
        .into();
    }
    format!(
        "cannot connect to {target} (sslmode={}): {text}",
        mode.as_str()
    )
    .into()
}

fn query_error(what: &str, e: &lockkit::Error) -> Failure {
    if e.code() == Some("42501") {
        return format!(
            "{what}: permission denied ({}); the role needs SELECT on pg_locks and pg_stat_activity, \
             and pg_read_all_stats to see other roles' queries",
            chain(e)
        )
        .into();
    }
    format!("{what}: {}", chain(e)).into()
}

/// An error and its sources, `: `-separated.
fn chain(e: &dyn StdError) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let next = s.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let cli =
            Cli::try_parse_from(["lockkit", "key", "Order", "i:-5", "--class", "-3"]).unwrap();
        assert!(
            matches!(cli.command, Command::Key { class: Some(-3), ref args, .. } if args == &["Order", "i:-5"])
        );
    }
}
