//! [`PgBouncer`]: a real pgbouncer in front of a [`TestServer`], for the
//! tests of what poolers do to session locks.
//!
//! # Layout and clean-up
//!
//! ```text
//! $TMPDIR/lockkit-pgbouncer-<pid>-<n>/   owned by the server account
//!     pgbouncer.ini, userlist.txt, pgbouncer.log
//! ```
//!
//! pgbouncer refuses to run as root, so like the server it runs as the
//! server account (see the crate docs). It is started by a `/bin/sh`
//! watchdog that blocks reading a pipe from us; on end of file (the handle
//! dropped, or this process exited or was killed) it kills pgbouncer and
//! removes the directory.

use std::fmt::Write as _;
use std::fs::{self, DirBuilder};
use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{chown, DirBuilderExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{self, Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use std::{env, fmt, thread};

use tokio_postgres::config::Host;
use tokio_postgres::Config;

use crate::account;
use crate::server::TestServer;

/// How long [`PgBouncerBuilder::start`] waits for pgbouncer to listen.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A pgbouncer process in front of a test server, stopped and removed when
/// the handle drops (or the process exits).
///
/// ```no_run
/// use lockkit_tests::{PgBouncer, TestServer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let db = TestServer::shared();
/// let bouncer = PgBouncer::builder(db).pool_mode("transaction").start();
/// let (client, connection) = bouncer.config().connect(tokio_postgres::NoTls).await.unwrap();
/// tokio::spawn(connection);
/// client.simple_query("SELECT 1").await.unwrap();
/// # }
/// ```
pub struct PgBouncer {
    port: u16,
    root: PathBuf,
    watchdog: Option<Child>,
}

impl PgBouncer {
    /// A builder for a pgbouncer in front of `server`: `pool_mode =
    /// transaction`, `default_pool_size = 2`, `auth_type = trust`, user
    /// `postgres`.
    pub fn builder(server: &TestServer) -> PgBouncerBuilder {
        let config = server.config();
        let host = match config.get_hosts().first() {
            Some(Host::Tcp(host)) => host.clone(),
            _ => "127.0.0.1".to_owned(),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        PgBouncerBuilder {
            host,
            port,
            pool_mode: "transaction".into(),
            default_pool_size: 2,
            users: vec!["postgres".into()],
            settings: Vec::new(),
            client_tls: None,
        }
    }

    /// A transaction-mode pgbouncer of one server connection: every
    /// client's transactions take turns on it, and each finds there what
    /// the others left between transactions (named statements, session
    /// state, session-level locks), as behind a pooler shared with other
    /// applications.
    pub fn one_server_connection(server: &TestServer) -> PgBouncer {
        PgBouncer::builder(server)
            .pool_mode("transaction")
            .default_pool_size(1)
            .start()
    }

    /// A transaction-mode pgbouncer of one server connection for which a
    /// client waits at most 1 s (`query_wait_timeout = 1`): with that
    /// connection pinned by an open transaction, another client's next
    /// statement fails with pgbouncer's `FATAL` `08P01`
    /// `query_wait_timeout`, and its connection is closed.
    pub fn impatient(server: &TestServer) -> PgBouncer {
        PgBouncer::builder(server)
            .pool_mode("transaction")
            .default_pool_size(1)
            .setting("query_wait_timeout", "1")
            .start()
    }

    /// The port pgbouncer listens on (loopback).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `postgres` through pgbouncer, as `postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The connection settings of [`url`](Self::url) for tokio-postgres.
    pub fn config(&self) -> Config {
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user("postgres")
            .dbname("postgres")
            .connect_timeout(Duration::from_secs(10));
        config
    }

    /// A tokio-postgres client through pgbouncer, its connection run on a
    /// spawned task.
    ///
    /// # Panics
    ///
    /// If the connection fails, or outside a tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the half-open connection.
    pub async fn connect(&self) -> tokio_postgres::Client {
        let (client, connection) = self
            .config()
            .connect(tokio_postgres::NoTls)
            .await
            .expect("connects through pgbouncer");
        tokio::spawn(connection);
        client
    }

    /// How many connections to this pgbouncer are open on their clients'
    /// side (`ESTABLISHED` in `/proc/net/tcp`, to this port): a client
    /// that closed its side is no longer counted, even while pgbouncer, not
    /// reading from a client that waits for a server connection, has not
    /// noticed yet.
    ///
    /// # Panics
    ///
    /// If `/proc/net/tcp` cannot be read (not Linux).
    pub fn clients_connected(&self) -> usize {
        let table = fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
        // `sl local_address rem_address st ...`, addresses as
        // `HEXIP:HEXPORT`; state 01 is ESTABLISHED.
        let port = format!(":{:04X}", self.port);
        table
            .lines()
            .skip(1)
            .filter(|line| {
                let mut fields = line.split_whitespace().skip(2);
                let remote = fields.next().unwrap_or("");
                let state = fields.next().unwrap_or("");
                remote.ends_with(&port) && state == "01"
            })
            .count()
    }

    /// Whether a new client of this pgbouncer connects and is answered;
    /// when not, the `FATAL` lines of its log (a pgbouncer that died says
    /// why there).
    ///
    /// # Errors
    ///
    /// When the pooler no longer serves, with those lines.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the new client.
    pub async fn serving(&self) -> Result<(), String> {
        let client = match self.config().connect(tokio_postgres::NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                Some(client)
            }
            Err(_) => None,
        };
        self.answers(client).await
    }

    /// Whether `client`, a new client of this pgbouncer (`None`: it could
    /// not connect), answers a query; when not, the `FATAL` lines of the
    /// log.
    ///
    /// # Errors
    ///
    /// When it does not answer, with those lines.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: nothing is left behind.
    pub async fn answers(&self, client: Option<tokio_postgres::Client>) -> Result<(), String> {
        let alive = match client {
            Some(client) => client.simple_query("SELECT 1").await.is_ok(),
            None => false,
        };
        match alive {
            true => Ok(()),
            false => {
                let log = self.log();
                let fatal: Vec<&str> = log.lines().filter(|l| l.contains("FATAL")).collect();
                Err(format!("pgbouncer no longer serves: {fatal:?}"))
            }
        }
    }

    /// pgbouncer's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.root.join("pgbouncer.log")).unwrap_or_default()
    }

    /// The lines of its log that contain `text`.
    pub fn log_lines(&self, text: &str) -> Vec<String> {
        self.log()
            .lines()
            .filter(|l| l.contains(text))
            .map(str::to_owned)
            .collect()
    }

    /// The lines of its log where it closed a server connection because
    /// its client left while a statement of that client's was still
    /// running there (`client disconnect while server was not ready`):
    /// each is a server connection the pooler then opens anew, a backend
    /// churned, and a statement that ran with nobody to answer.
    pub fn abrupt_client_closes(&self) -> Vec<String> {
        self.log_lines("while server was not ready")
    }

    /// Asserts that the pooler closed no server connection under a
    /// statement whose client left ([`abrupt_client_closes`](Self::abrupt_client_closes)).
    ///
    /// # Panics
    ///
    /// When it did, naming how many and the first.
    pub fn assert_no_abrupt_closes(&self) {
        let abrupt = self.abrupt_client_closes();
        assert!(
            abrupt.is_empty(),
            "the pooler closed {} server connections under a statement, first: {:?}",
            abrupt.len(),
            abrupt.first()
        );
    }

    /// How many clients pgbouncer itself counts for `database`, whatever
    /// state they are in (`SHOW CLIENTS` on its admin console): a client
    /// that closed its side while waiting for a server connection is still
    /// counted until pgbouncer reads from it again, and takes one of its
    /// `max_client_conn` until then (which
    /// [`clients_connected`](Self::clients_connected) does not see).
    ///
    /// # Panics
    ///
    /// If the admin console does not answer (it is a client too: one more
    /// of `max_client_conn`).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the admin client.
    pub async fn clients_of(&self, database: &str) -> usize {
        let (client, connection) = self
            .admin_config()
            .connect(tokio_postgres::NoTls)
            .await
            .expect("pgbouncer's admin console");
        let task = tokio::spawn(connection);
        let rows = client
            .simple_query("SHOW CLIENTS")
            .await
            .expect("SHOW CLIENTS");
        drop(client);
        let _ = task.await;
        rows.iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get("database"),
                _ => None,
            })
            .filter(|d| *d == database)
            .count()
    }

    /// Waits until pgbouncer has no client of `database` left (a hang guard
    /// of 60 s, no timing claim: a client that ends cleanly is gone at
    /// once); `after` names what they should have ended with, for the
    /// panic.
    ///
    /// # Panics
    ///
    /// When clients are still there after 60 s, or as
    /// [`clients_of`](Self::clients_of).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`clients_of`](Self::clients_of).
    pub async fn until_no_clients_of(&self, database: &str, after: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = self.clients_of(database).await;
            if left == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{left} clients left in pgbouncer 60 s after {after}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The connection settings of pgbouncer's admin console (database
    /// `pgbouncer`, as `postgres`, one of its `admin_users`).
    pub fn admin_config(&self) -> Config {
        let mut config = self.config();
        config.dbname("pgbouncer");
        config
    }

    /// The lines of its log about cancel requests: pgbouncer logs each
    /// request's client as it closes it (`… closing because: successfully
    /// sent cancel request`, or a failed one), so none means that no
    /// client sent one.
    pub fn cancel_lines(&self) -> Vec<String> {
        self.log()
            .lines()
            .filter(|l| l.contains("cancel"))
            .map(str::to_owned)
            .collect()
    }
}

impl fmt::Debug for PgBouncer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgBouncer")
            .field("port", &self.port)
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "---- pgbouncer log ----\n{}---- end of pgbouncer log ----",
                self.log()
            );
        }
        if let Some(mut watchdog) = self.watchdog.take() {
            drop(watchdog.stdin.take());
            let _ = watchdog.wait();
        }
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// Options for a [`PgBouncer`]; from [`PgBouncer::builder`].
#[derive(Debug, Clone)]
pub struct PgBouncerBuilder {
    host: String,
    port: u16,
    pool_mode: String,
    default_pool_size: u32,
    users: Vec<String>,
    settings: Vec<(String, String)>,
    /// The certificate and key (PEM) clients must use TLS with.
    client_tls: Option<(Vec<u8>, Vec<u8>)>,
}

impl PgBouncerBuilder {
    /// Takes clients over TLS only (`client_tls_sslmode = require`), with
    /// certificate `cert` and its `key` (PEM), e.g. from
    /// [`tls::certificate`](crate::tls::certificate).
    pub fn client_tls(mut self, cert: Vec<u8>, key: Vec<u8>) -> Self {
        self.client_tls = Some((cert, key));
        self
    }

    /// `pool_mode`: `session`, `transaction` (the default) or `statement`.
    pub fn pool_mode(mut self, mode: &str) -> Self {
        self.pool_mode = mode.to_owned();
        self
    }

    /// `default_pool_size`: server connections per user and database.
    pub fn default_pool_size(mut self, size: u32) -> Self {
        self.default_pool_size = size;
        self
    }

    /// Sets `name = value` in the `[pgbouncer]` section (after the
    /// defaults, so it overrides them).
    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.settings.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Lets `user` connect too (trust auth still needs it in the auth file).
    pub fn user(mut self, user: &str) -> Self {
        self.users.push(user.to_owned());
        self
    }

    /// Starts pgbouncer; returns once it accepts connections.
    ///
    /// # Panics
    ///
    /// As [`try_start`](Self::try_start) fails.
    pub fn start(self) -> PgBouncer {
        match self.try_start() {
            Ok(bouncer) => bouncer,
            Err(e) => panic!("cannot start pgbouncer: {e}"),
        }
    }

    /// Like [`start`](Self::start), but hands back the error.
    ///
    /// # Errors
    ///
    /// When pgbouncer is not installed (`apt-get install pgbouncer`), or
    /// does not listen in time; the message has its log.
    pub fn try_start(self) -> io::Result<PgBouncer> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let program = find_pgbouncer()?;
        let account = account::for_server()?;
        let base = if account.is_some() {
            PathBuf::from("/tmp")
        } else {
            env::temp_dir()
        };
        let root = loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let root = base.join(format!("lockkit-pgbouncer-{}-{n}", process::id()));
            match DirBuilder::new().mode(0o700).create(&root) {
                Ok(()) => break root,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        };
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let ini = root.join("pgbouncer.ini");
        fs::write(&ini, self.ini(&root, port))?;
        let mut userlist = String::new();
        for user in &self.users {
            let _ = writeln!(userlist, "\"{user}\" \"\"");
        }
        fs::write(root.join("userlist.txt"), userlist)?;
        let mut files = vec![ini.clone(), root.join("userlist.txt")];
        if let Some((cert, key)) = &self.client_tls {
            fs::write(root.join("client.crt"), cert)?;
            fs::write(root.join("client.key"), key)?;
            files.extend([root.join("client.crt"), root.join("client.key")]);
        }
        if let Some(account) = account {
            chown(&root, Some(account.uid), Some(account.gid))?;
            for path in &files {
                chown(path, Some(account.uid), Some(account.gid))?;
            }
        }

        const SCRIPT: &str = r#"trap '' HUP INT TERM QUIT
"$1" "$2" &
pid=$!
cat >/dev/null
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
rm -rf "$3""#;
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", SCRIPT, "lockkit-pgbouncer-watchdog"])
            .arg(&program)
            .arg(&ini)
            .arg(&root)
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(account) = account {
            cmd.uid(account.uid).gid(account.gid);
        }
        let bouncer = PgBouncer {
            port,
            watchdog: Some(cmd.spawn()?),
            root,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "pgbouncer did not listen on port {port} within {START_TIMEOUT:?}; its log:\n{}",
                    bouncer.log()
                )));
            }
            thread::sleep(Duration::from_millis(20));
        }
        Ok(bouncer)
    }

    fn ini(&self, root: &Path, port: u16) -> String {
        let root = root.display();
        let mut extra: String = self
            .settings
            .iter()
            .map(|(name, value)| format!("{name} = {value}\n"))
            .collect();
        if self.client_tls.is_some() {
            let _ = write!(
                extra,
                "client_tls_sslmode = require\n\
                 client_tls_cert_file = {root}/client.crt\n\
                 client_tls_key_file = {root}/client.key\n"
            );
        }
        format!(
            "[databases]\n\
             * = host={host} port={server_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             admin_users = postgres\n\
             auth_file = {root}/userlist.txt\n\
             pool_mode = {mode}\n\
             default_pool_size = {size}\n\
             max_client_conn = 200\n\
             server_round_robin = 0\n\
             ignore_startup_parameters = extra_float_digits,options\n\
             logfile = {root}/pgbouncer.log\n\
             {extra}",
            host = self.host,
            server_port = self.port,
            mode = self.pool_mode,
            size = self.default_pool_size,
        )
    }
}

/// `pgbouncer` on `PATH`, else in `/usr/sbin` (Debian's package).
fn find_pgbouncer() -> io::Result<PathBuf> {
    let path = env::var_os("PATH").unwrap_or_default();
    env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|dir| dir.join("pgbouncer"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "cannot find pgbouncer on PATH or in /usr/sbin; install it (apt-get install pgbouncer)",
            )
        })
}
