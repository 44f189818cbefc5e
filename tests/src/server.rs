//! [`TestServer`], its [`Builder`] and the [`LogGuard`].

use std::error::Error;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use std::{env, fmt, io, thread};

use tokio_postgres::{Client, Config, NoTls};

use crate::instance::Instance;

/// How long [`TestServer::standby`] waits for the standby to accept
/// connections in recovery.
const STANDBY_TIMEOUT: Duration = Duration::from_secs(60);

/// A PostgreSQL server for tests: a throwaway cluster this process started,
/// or the server named by `DATABASE_URL` (only for [`TestServer::shared`]).
///
/// A throwaway server is stopped and its directory removed when the handle
/// drops, or when the process exits or is killed (see the crate docs). If the
/// handle drops while its thread panics, the server log is printed to
/// stderr, which the test runner shows with the failed test.
///
/// Every method that needs the server programs (`stop`, `start`,
/// `restart`, `standby`) panics on a server from `DATABASE_URL`.
pub struct TestServer {
    url: String,
    config: Config,
    instance: Option<Instance>,
}

impl TestServer {
    /// A builder for a private throwaway server, with per-test settings.
    ///
    /// Private servers are always throwaway, even when `DATABASE_URL` is
    /// set: their settings, restarts and standbys need a server of their own.
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// The server all tests of this test binary share, started on first use.
    ///
    /// When `DATABASE_URL` is set (and not empty) that server is used and
    /// nothing is started. Otherwise a throwaway server with the default
    /// settings is started once; it is stopped and removed when the process
    /// exits. Tests that need settings or restarts of their own use
    /// [`TestServer::builder`]. Isolate tables with
    /// [`create_database`](Self::create_database) or unique names.
    ///
    /// Create a [`guard`](Self::guard) at the start of each test, so the
    /// log is printed if the test fails.
    ///
    /// # Panics
    ///
    /// If the server cannot be started (the message has its log), or
    /// `DATABASE_URL` is not a valid connection string; in every test that
    /// calls this, without trying again.
    pub fn shared() -> &'static TestServer {
        static SHARED: OnceLock<Result<TestServer, String>> = OnceLock::new();
        let shared = SHARED.get_or_init(|| match env::var("DATABASE_URL") {
            Ok(url) if !url.is_empty() => Self::external(url),
            _ => Builder::default().try_start().map_err(|e| e.to_string()),
        });
        match shared {
            Ok(server) => server,
            Err(e) => panic!("cannot start the shared test server: {e}"),
        }
    }

    fn external(url: String) -> Result<Self, String> {
        let config = url
            .parse()
            .map_err(|e| format!("DATABASE_URL is not a valid connection string: {e}"))?;
        Ok(Self {
            url,
            config,
            instance: None,
        })
    }

    fn from_instance(instance: Instance) -> Self {
        let port = instance.port();
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(port)
            .user("postgres")
            .dbname("postgres")
            .connect_timeout(Duration::from_secs(10));
        Self {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            config,
            instance: Some(instance),
        }
    }

    /// The connection URL, e.g. `postgres://postgres@127.0.0.1:41234/postgres`:
    /// for tokio-postgres, libpq and Diesel alike.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The connection settings for tokio-postgres, as in [`url`](Self::url).
    pub fn config(&self) -> Config {
        self.config.clone()
    }

    /// The directory of the server's Unix socket (`.s.PGSQL.<port>`); `None`
    /// for a server from `DATABASE_URL`.
    pub fn socket_dir(&self) -> Option<&Path> {
        self.instance.as_ref().map(Instance::socket_dir)
    }

    /// The server log (its stderr); `None` for a server from `DATABASE_URL`.
    pub fn log_path(&self) -> Option<&Path> {
        self.instance.as_ref().map(Instance::log_path)
    }

    /// Where the server log ends now: what [`log_since`](Self::log_since)
    /// reads from.
    ///
    /// # Panics
    ///
    /// For a server from `DATABASE_URL` (no log), or if the log cannot be
    /// read.
    pub fn log_offset(&self) -> usize {
        let path = self.log_path().expect("a server started by the tests");
        std::fs::metadata(path).expect("the server log").len() as usize
    }

    /// What the server logged since `offset` (from
    /// [`log_offset`](Self::log_offset)), lossily as text.
    ///
    /// # Panics
    ///
    /// As [`log_offset`](Self::log_offset).
    pub fn log_since(&self, offset: usize) -> String {
        let path = self.log_path().expect("a server started by the tests");
        let log = std::fs::read(path).expect("the server log");
        String::from_utf8_lossy(log.get(offset..).unwrap_or_default()).into_owned()
    }

    /// Promotes this standby (`pg_promote()`, which waits until it is
    /// done) on a connection of its own.
    ///
    /// # Panics
    ///
    /// If the connection fails or the server does not say it was promoted.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: dropped, the promotion may or may not happen.
    pub async fn promote(&self) {
        let client = self.connect().await;
        let promoted: bool = client
            .query_one("SELECT pg_promote()", &[])
            .await
            .expect("pg_promote()")
            .get(0);
        assert!(promoted, "pg_promote() returned false");
    }

    /// Connects as the superuser `postgres`, running the connection on a
    /// spawned tokio task.
    ///
    /// # Panics
    ///
    /// If the connection fails, or outside a tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the half-open connection.
    pub async fn connect(&self) -> Client {
        match self.try_connect().await {
            Ok(client) => client,
            Err(e) => panic!(
                "cannot connect to the test server at {}: {}",
                self.url,
                with_sources(&e)
            ),
        }
    }

    /// Like [`connect`](Self::connect), but hands back the error, for tests
    /// of what happens while the server is down.
    ///
    /// # Errors
    ///
    /// When the connection fails.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`connect`](Self::connect).
    pub async fn try_connect(&self) -> Result<Client, tokio_postgres::Error> {
        let (client, connection) = self.config.connect(NoTls).await?;
        // Its error, if any, also fails the client's next call; tests that
        // restart the server expect it.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }

    /// Connects until the server refuses, on a server started with
    /// `max_connections` at most `max` and no reserved slots: the
    /// connections it took (keep them, or the server has room again) and
    /// its refusal, checked to be `53300` (too many clients).
    ///
    /// # Panics
    ///
    /// If the server takes more than `max` connections, or refuses with
    /// another error.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropped, the connections close.
    pub async fn fill(&self, max: usize) -> (Vec<Client>, tokio_postgres::Error) {
        let mut taken = Vec::new();
        let refusal = loop {
            assert!(
                taken.len() <= max,
                "the server took more than max_connections"
            );
            match self.try_connect().await {
                Ok(client) => taken.push(client),
                Err(e) => break e,
            }
        };
        assert_eq!(
            refusal.code().map(|c| c.code()),
            Some("53300"),
            "{refusal:?}"
        );
        (taken, refusal)
    }

    /// Creates the database `name` (dropping an old one first) and returns
    /// its URL, so a test can have tables of its own on a shared server.
    ///
    /// # Panics
    ///
    /// If the database cannot be created, or outside a tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the database may or may not exist afterwards.
    pub async fn create_database(&self, name: &str) -> String {
        let client = self.connect().await;
        let ident = format!("\"{}\"", name.replace('"', "\"\""));
        // Two statements: together they would be one implicit transaction,
        // which `DROP DATABASE` refuses.
        for sql in [
            format!("DROP DATABASE IF EXISTS {ident} WITH (FORCE)"),
            format!("CREATE DATABASE {ident}"),
        ] {
            if let Err(e) = client.batch_execute(&sql).await {
                panic!(
                    "cannot create database {ident} on {}: {}",
                    self.url,
                    with_sources(&e)
                );
            }
        }
        with_dbname(&self.url, name)
    }

    /// A guard that prints the server log written while it lives, if its
    /// thread panics. Create one at the start of each test on the
    /// [`shared`](Self::shared) server. Does nothing on a server from
    /// `DATABASE_URL`.
    pub fn guard(&self) -> LogGuard<'_> {
        LogGuard {
            server: self,
            from: self.instance.as_ref().map_or(0, Instance::log_len),
        }
    }

    /// Stops the server (`pg_ctl stop -m fast`: sessions are ended, open
    /// transactions rolled back), keeping its data for [`start`](Self::start).
    ///
    /// Blocks the calling thread, also inside an async test, until the
    /// server has exited.
    ///
    /// # Panics
    ///
    /// If the server is not running or cannot be stopped, or is the one
    /// from `DATABASE_URL`.
    pub fn stop(&self) {
        if let Err(e) = self.instance("stop").stop("fast") {
            panic!("cannot stop the test server at {}: {e}", self.url);
        }
    }

    /// Stops the server in `mode`, keeping its data: [`StopMode::Immediate`]
    /// is the server's crash (a failed primary, before a failover).
    ///
    /// Blocks the calling thread, also inside an async test.
    ///
    /// # Panics
    ///
    /// As [`stop`](Self::stop).
    pub fn stop_with(&self, mode: StopMode) {
        if let Err(e) = self.instance("stop").stop(mode.pg_ctl_mode()) {
            panic!("cannot stop the test server at {}: {e}", self.url);
        }
    }

    /// Starts the server again after [`stop`](Self::stop), on the same port
    /// and data; returns once it accepts connections.
    ///
    /// Blocks the calling thread, also inside an async test.
    ///
    /// # Panics
    ///
    /// If the server cannot be started (the message has its log), or is the
    /// one from `DATABASE_URL`.
    pub fn start(&self) {
        if let Err(e) = self.instance("start").start() {
            panic!("cannot start the test server at {}: {e}", self.url);
        }
    }

    /// [`stop`](Self::stop) then [`start`](Self::start): every session ends,
    /// and with it every advisory lock; the data stays.
    ///
    /// # Panics
    ///
    /// As `stop` and `start`.
    pub fn restart(&self) {
        self.restart_with(StopMode::Fast);
    }

    /// Like [`restart`](Self::restart), stopping in `mode`:
    /// [`StopMode::Immediate`] is a crash as far as the data is concerned
    /// (the start replays the WAL).
    ///
    /// # Errors
    ///
    /// When the server cannot be stopped or started again (the message has
    /// the log of the start).
    ///
    /// # Panics
    ///
    /// If this is the server from `DATABASE_URL`.
    pub fn try_restart_with(&self, mode: StopMode) -> io::Result<()> {
        let instance = self.instance("restart");
        instance.stop(mode.pg_ctl_mode())?;
        instance.start()
    }

    /// [`try_restart_with`](Self::try_restart_with), panicking on failure.
    ///
    /// # Panics
    ///
    /// If the server cannot be restarted, or is the one from `DATABASE_URL`.
    pub fn restart_with(&self, mode: StopMode) {
        if let Err(e) = self.try_restart_with(mode) {
            panic!("cannot restart the test server at {}: {e}", self.url);
        }
    }

    /// Builds and starts a hot standby of this server with
    /// `pg_basebackup -R`, on its own port, with the same settings. Returns
    /// once the standby accepts connections and `pg_is_in_recovery()` is
    /// true there.
    ///
    /// Blocks the calling thread, also inside an async test.
    ///
    /// # Panics
    ///
    /// As [`try_standby`](Self::try_standby) fails.
    pub fn standby(&self) -> TestServer {
        match self.try_standby() {
            Ok(standby) => standby,
            Err(e) => panic!("cannot start a standby of {}: {e}", self.url),
        }
    }

    /// Like [`standby`](Self::standby), but hands back the error.
    ///
    /// # Errors
    ///
    /// When the server programs' directory has no `pg_basebackup` (as
    /// with `LOCKKIT_PG_BINDIR` from `.ci/pg-binaries`, which lists the
    /// tests that need one), when it fails, or the standby does not start
    /// or does not come up in recovery; the message has the standby's log.
    ///
    /// # Panics
    ///
    /// If this is the server from `DATABASE_URL`.
    pub fn try_standby(&self) -> io::Result<TestServer> {
        let standby = Self::from_instance(Instance::standby_of(self.instance("standby"))?);
        let deadline = Instant::now() + STANDBY_TIMEOUT;
        loop {
            let last = match query_blocking(&standby.config, "SELECT pg_is_in_recovery()") {
                Ok(Some(t)) if t == "t" => return Ok(standby),
                Ok(other) => format!("pg_is_in_recovery() returned {other:?}"),
                Err(e) => with_sources(&e),
            };
            if Instant::now() > deadline {
                let log = standby.instance("standby").log_excerpt(0, "standby log");
                return Err(io::Error::other(format!(
                    "the standby at {} did not come up in recovery within {STANDBY_TIMEOUT:?}: {last}\n{log}",
                    standby.url
                )));
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn instance(&self, what: &str) -> &Instance {
        match &self.instance {
            Some(instance) => instance,
            None => panic!(
                "`{what}` needs a throwaway server, not the one from DATABASE_URL: \
                 use TestServer::builder()"
            ),
        }
    }
}

impl fmt::Debug for TestServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestServer")
            .field("url", &self.url)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let (Some(instance), true) = (&self.instance, thread::panicking()) {
            eprint!("{}", instance.log_excerpt(0, "PostgreSQL log"));
        }
    }
}

/// How [`TestServer::restart_with`] stops the server (`pg_ctl stop -m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StopMode {
    /// `fast`: sessions are ended (`57P01`), open transactions rolled back,
    /// and a shutdown checkpoint is written.
    Fast,
    /// `immediate`: every process quits at once, with no checkpoint; the
    /// next start runs crash recovery. With the harness's default
    /// `synchronous_commit=off`, transactions committed in the last moments
    /// may be lost (their WAL was still in shared memory): set it `on` when
    /// committed data must survive.
    Immediate,
}

impl StopMode {
    fn pg_ctl_mode(self) -> &'static str {
        match self {
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        }
    }
}

/// Options for a private [`TestServer`]; from [`TestServer::builder`].
#[derive(Debug, Clone, Default)]
pub struct Builder {
    settings: Vec<(String, String)>,
    files: Vec<(String, Vec<u8>)>,
}

impl Builder {
    /// Sets a server setting (`postgresql.conf` parameter), e.g.
    /// `.setting("max_locks_per_transaction", "10")`. Later calls win; so do
    /// these over the harness's defaults (`fsync=off`, `max_connections=200`,
    /// …).
    ///
    /// # Panics
    ///
    /// If `name` is not a setting name (letters, digits, `_` and `.`).
    pub fn setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let name = name.into();
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.'),
            "`{name}` is not a PostgreSQL setting name"
        );
        self.settings.push((name, value.into()));
        self
    }

    /// Writes `contents` to `name` in the data directory before the first
    /// start, owned by the server account with mode 0600: a TLS
    /// certificate and key (`server.crt` and `server.key` are the defaults
    /// of `ssl_cert_file` and `ssl_key_file`), or a `pg_hba.conf` that
    /// replaces the harness's (trust for everyone; keep a `local` line so
    /// `pg_ctl` can see the server come up).
    ///
    /// # Panics
    ///
    /// If `name` is not a plain file name (a path separator, `..`, empty).
    pub fn data_file(mut self, name: impl Into<String>, contents: impl Into<Vec<u8>>) -> Self {
        let name = name.into();
        assert!(
            !name.is_empty() && name != ".." && name != "." && !name.contains('/'),
            "`{name}` is not a file name"
        );
        self.files.push((name, contents.into()));
        self
    }

    /// Creates and starts the server; returns once it accepts connections
    /// (about a second).
    ///
    /// Blocks the calling thread; that is fine inside an async test.
    ///
    /// # Panics
    ///
    /// As [`try_start`](Self::try_start) fails.
    pub fn start(self) -> TestServer {
        match self.try_start() {
            Ok(server) => server,
            Err(e) => panic!("cannot start a test server: {e}"),
        }
    }

    /// Like [`start`](Self::start), but hands back the error.
    ///
    /// # Errors
    ///
    /// When the PostgreSQL programs cannot be found or fail; the message has
    /// their output and the server log.
    pub fn try_start(self) -> io::Result<TestServer> {
        Instance::init(self.settings, self.files).map(TestServer::from_instance)
    }
}

/// Prints the server log written during its life if it drops while its
/// thread panics; from [`TestServer::guard`].
#[must_use = "the log is printed when the guard drops in a failing test; bind it: `let _log = server.guard();`"]
pub struct LogGuard<'a> {
    server: &'a TestServer,
    from: u64,
}

impl fmt::Debug for LogGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LogGuard")
            .field("server", &self.server.url)
            .field("from", &self.from)
            .finish()
    }
}

impl Drop for LogGuard<'_> {
    fn drop(&mut self) {
        if let (Some(instance), true) = (&self.server.instance, thread::panicking()) {
            eprint!(
                "{}",
                instance.log_excerpt(self.from, "PostgreSQL log during this test")
            );
        }
    }
}

/// Runs `sql` on a fresh connection from a synchronous context (even one
/// inside an async runtime), returning the first column of the first row.
fn query_blocking(config: &Config, sql: &str) -> Result<Option<String>, tokio_postgres::Error> {
    thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("cannot build a tokio runtime");
                runtime.block_on(async {
                    let (client, connection) = config.connect(NoTls).await?;
                    let connection = tokio::spawn(connection);
                    let value = crate::observe::simple_value(&client, sql).await;
                    drop(client);
                    let _ = connection.await;
                    value
                })
            })
            .join()
            .expect("the query thread panicked")
    })
}

/// `error` and its sources: tokio-postgres says "error connecting to
/// server" and keeps the reason in `source()`.
fn with_sources(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// `url` with its database replaced by `dbname`.
fn with_dbname(url: &str, dbname: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        // A `key=value` connection string: a later key wins.
        return format!("{url} dbname={dbname}");
    };
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_end = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{dbname}", &base[..authority_end]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::with_dbname;

    #[test]
    fn replaces_the_database_in_urls() {
        assert_eq!(
            with_dbname("postgres://postgres@127.0.0.1:5432/postgres", "t1"),
            "postgres://postgres@127.0.0.1:5432/t1"
        );
        assert_eq!(
            with_dbname("postgres://u:p@h:1?sslmode=disable", "t1"),
            "postgres://u:p@h:1/t1?sslmode=disable"
        );
        assert_eq!(
            with_dbname("host=h user=u", "t1"),
            "host=h user=u dbname=t1"
        );
    }
}
