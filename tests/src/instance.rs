//! One PostgreSQL cluster in a temporary directory: `initdb` or
//! `pg_basebackup`, `pg_ctl start` and `stop`, the log, and clean-up.
//!
//! # Layout
//!
//! ```text
//! $TMPDIR/lockkit-pg-<pid>-<n>/   owned by the server account, mode 0700
//!     data/                      the cluster; data/lockkit.conf is ours
//!     postgres.log               the server's stderr (`pg_ctl -l`)
//!     .s.PGSQL.<port>            the Unix socket
//! ```
//!
//! The first cluster of a process is made by `initdb` into such a directory
//! that is kept as a template (never started); every server is a copy.
//!
//! # Clean-up
//!
//! Each instance has a watchdog: a `/bin/sh` child, running as the server
//! account, that blocks reading a pipe from us, and on end of file stops the
//! server (`pg_ctl stop -m immediate`) and removes the directory. Dropping
//! the instance closes the pipe; so does the kernel when this process
//! exits or is killed, even by SIGKILL. That covers the shared server,
//! which lives in a `static` and is never dropped. The watchdog ignores
//! SIGHUP, SIGINT, SIGTERM and SIGQUIT, so a Ctrl-C on `cargo test` reaches
//! the clean-up; only a SIGKILL sent to the watchdog itself leaves a server
//! behind. No `unsafe`, no `atexit`, no `PR_SET_PDEATHSIG`.

use std::fmt::Write as _;
use std::fs::{self, DirBuilder, File};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::os::unix::fs::{chown, DirBuilderExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::{env, process};

use crate::account::{self, Account};
use crate::binaries;

/// Settings every server gets, tuned for short-lived test clusters.
/// Per-test settings come after them in `lockkit.conf`, so they win.
const BASE_SETTINGS: &[(&str, &str)] = &[
    ("listen_addresses", "127.0.0.1"),
    ("fsync", "off"),
    ("synchronous_commit", "off"),
    ("full_page_writes", "off"),
    ("shared_buffers", "16MB"),
    // The tests open pools and run benchmarks with many sessions.
    ("max_connections", "200"),
    // For `TestServer::standby`.
    ("wal_level", "replica"),
    ("max_wal_senders", "10"),
    ("hot_standby", "on"),
    ("logging_collector", "off"),
    ("log_line_prefix", "%m [%p] %q%a "),
];

/// How often `pg_ctl start` is retried when another process took the port
/// between our probe and the server's `bind`.
const PORT_ATTEMPTS: usize = 8;

/// Env vars that would make the PostgreSQL programs talk to another server.
const LIBPQ_ENV: &[&str] = &[
    "PGDATA",
    "PGHOST",
    "PGHOSTADDR",
    "PGPORT",
    "PGUSER",
    "PGDATABASE",
    "PGSERVICE",
    "PGOPTIONS",
    "PGPASSWORD",
    "PGPASSFILE",
];

/// A cluster we created, and own until drop.
#[derive(Debug)]
pub(crate) struct Instance {
    bin: &'static Path,
    account: Option<Account>,
    root: PathBuf,
    data: PathBuf,
    log: PathBuf,
    port: u16,
    settings: Vec<(String, String)>,
    watchdog: Option<Child>,
}

impl Instance {
    /// Starts a new cluster on a free port: a copy of this process's
    /// template cluster, which is made by `initdb` on first use.
    /// `files` are written into the data directory (mode 0600) before it
    /// starts.
    pub(crate) fn init(
        settings: Vec<(String, String)>,
        files: Vec<(String, Vec<u8>)>,
    ) -> io::Result<Self> {
        // `cp -a` takes a fifth of the time of `initdb`, and most tests
        // start a server of their own.
        static TEMPLATE: OnceLock<Result<Instance, String>> = OnceLock::new();
        let template = TEMPLATE
            .get_or_init(|| Self::template().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| io::Error::other(format!("cannot make the template cluster: {e}")))?;
        let mut instance = Self::create(settings)?;
        instance.run(
            instance
                .command("cp")
                .arg("-a")
                .arg(&template.data)
                .arg(&instance.data),
        )?;
        for (name, contents) in files {
            instance.write_data_file(&name, &contents)?;
        }
        instance.launch()?;
        Ok(instance)
    }

    /// Writes a file into the data directory, owned by the server account,
    /// readable by it only (PostgreSQL refuses a key others can read).
    fn write_data_file(&self, name: &str, contents: &[u8]) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let path = self.data.join(name);
        fs::write(&path, contents)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600))?;
        if let Some(account) = self.account {
            chown(&path, Some(account.uid), Some(account.gid))?;
        }
        Ok(())
    }

    /// A cluster made by `initdb`, never started, to copy.
    fn template() -> io::Result<Self> {
        let instance = Self::create(Vec::new())?;
        instance.run(
            instance
                .command("initdb")
                .args([
                    "--auth=trust",
                    "--username=postgres",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-sync",
                    "--pgdata",
                ])
                .arg(&instance.data),
        )?;
        // `include` is relative to this file; each copy finds its own.
        let mut conf = fs::OpenOptions::new()
            .append(true)
            .open(instance.data.join("postgresql.conf"))?;
        io::Write::write_all(&mut conf, b"\ninclude 'lockkit.conf'\n")?;
        Ok(instance)
    }

    /// Copies `primary` with `pg_basebackup -R` and starts the copy, which
    /// comes up as a hot standby.
    ///
    /// # Errors
    ///
    /// When the server programs' directory has no `pg_basebackup` (the
    /// packages `.ci/pg-binaries` lays out have none), or it fails.
    pub(crate) fn standby_of(primary: &Instance) -> io::Result<Self> {
        if !primary.bin.join("pg_basebackup").is_file() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "a standby needs pg_basebackup, and {} has none",
                    primary.bin.display()
                ),
            ));
        }
        let mut instance = Self::create(primary.settings.clone())?;
        instance.run(
            instance
                .command("pg_basebackup")
                .args(["--write-recovery-conf", "--wal-method=stream"])
                .args(["--checkpoint=fast", "--no-sync", "--host=127.0.0.1"])
                .arg(format!("--port={}", primary.port))
                .args(["--username=postgres", "--pgdata"])
                .arg(&instance.data),
        )?;
        instance.launch()?;
        Ok(instance)
    }

    /// A new empty temporary directory owned by the server account, with
    /// its watchdog; no cluster yet.
    fn create(settings: Vec<(String, String)>) -> io::Result<Self> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let bin = binaries::bindir()?;
        let account = account::for_server()?;
        let base = base_dir(account);
        let root = loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let root = base.join(format!("lockkit-pg-{}-{n}", process::id()));
            match DirBuilder::new().mode(0o700).create(&root) {
                Ok(()) => break root,
                // Left by an earlier process with our pid: take the next name.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("cannot create {}: {e}", root.display()),
                    ))
                }
            }
        };
        if let Some(account) = account {
            chown(&root, Some(account.uid), Some(account.gid))?;
        }
        let mut instance = Self {
            bin,
            account,
            data: root.join("data"),
            log: root.join("postgres.log"),
            root,
            port: 0,
            settings,
            watchdog: None,
        };
        instance.watchdog = Some(instance.spawn_watchdog()?);
        Ok(instance)
    }

    fn spawn_watchdog(&self) -> io::Result<Child> {
        const SCRIPT: &str = r#"trap '' HUP INT TERM QUIT
cat >/dev/null
"$1/pg_ctl" stop -D "$2" -m immediate -s >/dev/null 2>&1
rm -rf "$3""#;
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", SCRIPT, "lockkit-pg-watchdog"])
            .arg(self.bin)
            .arg(&self.data)
            .arg(&self.root)
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.drop_privileges(&mut cmd);
        cmd.spawn()
    }

    /// Picks a free port and starts the server on it, retrying on a clash.
    fn launch(&mut self) -> io::Result<()> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.port = free_port()?;
            match self.start() {
                Err(e) if attempt < PORT_ATTEMPTS && is_port_clash(&e) => continue,
                result => return result,
            }
        }
    }

    /// `pg_ctl start`, waiting until the server accepts connections (or, for
    /// a standby, until it has started up).
    ///
    /// # Errors
    ///
    /// With `pg_ctl`'s output and the server's log from this start.
    pub(crate) fn start(&self) -> io::Result<()> {
        fs::write(self.data.join("lockkit.conf"), self.conf())?;
        let from = self.log_len();
        self.run(
            self.command("pg_ctl")
                .args(["start", "--wait", "--timeout=60", "--silent"])
                .arg("--pgdata")
                .arg(&self.data)
                .arg("--log")
                .arg(&self.log),
        )
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("{e}\n{}", self.log_excerpt(from, "server log")),
            )
        })
    }

    /// `pg_ctl stop` in `mode` (`fast` or `immediate`), waiting until the
    /// server has exited.
    pub(crate) fn stop(&self, mode: &str) -> io::Result<()> {
        self.run(
            self.command("pg_ctl")
                .args(["stop", "--wait", "--timeout=60", "--silent"])
                .arg(format!("--mode={mode}"))
                .arg("--pgdata")
                .arg(&self.data),
        )
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding the Unix socket.
    pub(crate) fn socket_dir(&self) -> &Path {
        &self.root
    }

    pub(crate) fn log_path(&self) -> &Path {
        &self.log
    }

    /// The log's length now, to print only what follows later.
    pub(crate) fn log_len(&self) -> u64 {
        fs::metadata(&self.log).map_or(0, |meta| meta.len())
    }

    /// The log from byte `from` on, framed for printing.
    pub(crate) fn log_excerpt(&self, from: u64, title: &str) -> String {
        let mut text = String::new();
        let read = File::open(&self.log).and_then(|mut file| {
            file.seek(SeekFrom::Start(from))?;
            let mut bytes = Vec::new();
            file.read_to_end(&mut bytes)?;
            text = String::from_utf8_lossy(&bytes).into_owned();
            Ok(())
        });
        let mut out = format!("---- {title}: {} ----\n", self.log.display());
        match read {
            Ok(()) if text.is_empty() => out.push_str("(empty)\n"),
            Ok(()) => out.push_str(&text),
            Err(e) => {
                let _ = writeln!(out, "(cannot read it: {e})");
            }
        }
        if !out.ends_with('\n') {
            out.push('\n');
        }
        let _ = writeln!(out, "---- end of {title} ----");
        out
    }

    /// The text of `lockkit.conf`: the base settings, this instance's
    /// addresses, then the per-test settings.
    fn conf(&self) -> String {
        let mut conf = String::from("# Written by lockkit-tests before every start.\n");
        let port = self.port.to_string();
        let socket_dir = self.root.to_string_lossy();
        let instance: [(&str, &str); 2] =
            [("port", &port), ("unix_socket_directories", &socket_dir)];
        let settings = self.settings.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        for (name, value) in BASE_SETTINGS
            .iter()
            .copied()
            .chain(instance)
            .chain(settings)
        {
            let _ = writeln!(conf, "{name} = '{}'", value.replace('\'', "''"));
        }
        conf
    }

    /// A command for one of the server programs (or `cp`), as the server
    /// account, in our directory, deaf to the caller's libpq environment.
    fn command(&self, program: &str) -> Command {
        let path = if program == "cp" {
            PathBuf::from(program)
        } else {
            self.bin.join(program)
        };
        let mut cmd = Command::new(path);
        cmd.current_dir(&self.root).env("LC_ALL", "C");
        for var in LIBPQ_ENV {
            cmd.env_remove(var);
        }
        self.drop_privileges(&mut cmd);
        cmd
    }

    fn drop_privileges(&self, cmd: &mut Command) {
        if let Some(account) = self.account {
            cmd.uid(account.uid).gid(account.gid);
        }
    }

    /// Runs `cmd` to completion.
    ///
    /// # Errors
    ///
    /// When it cannot be run or fails; the message has its output.
    fn run(&self, cmd: &mut Command) -> io::Result<()> {
        let program = Path::new(cmd.get_program())
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot run {program}: {e}")))?;
        if out.status.success() {
            return Ok(());
        }
        Err(io::Error::other(format!(
            "{program} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        )))
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // Closing its stdin lets the watchdog stop the server and remove the
        // directory: the same path as when this process dies.
        if let Some(mut watchdog) = self.watchdog.take() {
            drop(watchdog.stdin.take());
            let _ = watchdog.wait();
        }
        if self.root.exists() {
            let _ = self.stop("immediate");
            let _ = fs::remove_dir_all(&self.root);
        }
    }
}

/// Where the temporary directories go: [`env::temp_dir`], unless the
/// server account cannot reach it (`TMPDIR` under `/root`), then `/tmp`.
fn base_dir(account: Option<Account>) -> PathBuf {
    let tmp = env::temp_dir();
    match account {
        Some(account) if !traversable(&tmp, account) => PathBuf::from("/tmp"),
        _ => tmp,
    }
}

/// Whether `account` may pass through `dir` and each of its parents.
fn traversable(dir: &Path, account: Account) -> bool {
    use std::os::unix::fs::MetadataExt;
    dir.ancestors().all(|dir| {
        fs::metadata(dir).is_ok_and(|meta| {
            let mode = meta.mode();
            mode & 0o001 != 0
                || (meta.uid() == account.uid && mode & 0o100 != 0)
                || (meta.gid() == account.gid && mode & 0o010 != 0)
        })
    })
}

/// A loopback port nobody listens on right now.
fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn is_port_clash(error: &io::Error) -> bool {
    let message = error.to_string();
    message.contains("Address already in use") || message.contains("could not bind")
}
