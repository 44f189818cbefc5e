//! Issue 47: every command that connects ends within its bound against a
//! server that accepts and then says nothing, naming what did not answer:
//! the TLS request, the TLS handshake, the startup, or a query.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use lockkit_tests::TestServer;

use super::stderr;

/// A generous bound on a command given `connect_timeout=2`: a hang (a
/// wait with no bound) lasts until the test kills it, past this.
const HANG: Duration = Duration::from_secs(60);

/// What the test's listener does with each connection it accepts.
#[derive(Clone, Copy, Debug)]
pub(super) enum Silence {
    /// Reads nothing, writes nothing.
    Total,
    /// Answers the SSLRequest with `S`, then nothing: the TLS handshake
    /// gets no answer.
    AfterTlsYes,
    /// Forwards to a real server until the server's first ReadyForQuery
    /// (the startup done), then forwards nothing either way: the first
    /// query gets no answer.
    AfterStartup(u16),
    /// Forwards the first connection to a real server both ways, and each
    /// later one as [`AfterStartup`](Self::AfterStartup): a command's own
    /// connection works, the further ones it opens (`check`'s pooler
    /// probe) get no answer to their first query.
    AllButFirst(u16),
}

/// A listener on a loopback port that keeps every connection open and
/// silent as `how` says, until the test process ends.
pub(super) fn silent_listener(how: Silence) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        let mut kept = Vec::new();
        let mut first = true;
        for client in listener.incoming() {
            let Ok(mut client) = client else { continue };
            match how {
                Silence::Total => kept.push(client),
                Silence::AfterTlsYes => {
                    let mut request = [0u8; 8];
                    if client.read_exact(&mut request).is_ok() {
                        let _ = client.write_all(b"S");
                    }
                    kept.push(client);
                }
                Silence::AfterStartup(server) => {
                    let server = TcpStream::connect(("127.0.0.1", server)).unwrap();
                    forward_until_ready(client, server);
                }
                Silence::AllButFirst(server) => {
                    let server = TcpStream::connect(("127.0.0.1", server)).unwrap();
                    if std::mem::take(&mut first) {
                        forward(client, server);
                    } else {
                        forward_until_ready(client, server);
                    }
                }
            }
        }
    });
    port
}

/// Forwards both ways until either side closes.
fn forward(client: TcpStream, server: TcpStream) {
    for (mut from, mut to) in [
        (client.try_clone().unwrap(), server.try_clone().unwrap()),
        (server, client),
    ] {
        thread::spawn(move || {
            let _ = std::io::copy(&mut from, &mut to);
            let _ = to.shutdown(std::net::Shutdown::Both);
        });
    }
}

/// Forwards both ways until the server's first ReadyForQuery has reached
/// the client, then nothing more (both sockets stay open).
fn forward_until_ready(client: TcpStream, server: TcpStream) {
    let ready = Arc::new(AtomicBool::new(false));
    let (mut up_from, mut up_to) = (client.try_clone().unwrap(), server.try_clone().unwrap());
    let up_ready = ready.clone();
    thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(n) = up_from.read(&mut buf) {
            if n == 0 || up_to.write_all(&buf[..n]).is_err() {
                return;
            }
            if up_ready.load(Ordering::SeqCst) {
                // Only what the client sent before the startup ended goes
                // through; the client sends no query before it.
                break;
            }
        }
        // Swallow everything after, keeping both sockets open.
        while matches!(up_from.read(&mut buf), Ok(n) if n > 0) {}
    });
    thread::spawn(move || {
        let (mut from, mut to) = (server, client);
        // The server's messages: a type byte and a length (itself
        // included), so that ReadyForQuery ('Z') is found whole.
        loop {
            let mut head = [0u8; 5];
            if from.read_exact(&mut head).is_err() {
                return;
            }
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            let mut body = vec![0u8; len.saturating_sub(4)];
            if from.read_exact(&mut body).is_err() {
                return;
            }
            if head[0] == b'Z' {
                ready.store(true, Ordering::SeqCst);
            }
            if to.write_all(&head).is_err() || to.write_all(&body).is_err() {
                return;
            }
            if head[0] == b'Z' {
                break;
            }
        }
        let mut buf = [0u8; 8192];
        while matches!(from.read(&mut buf), Ok(n) if n > 0) {}
        drop(to);
    });
}

/// Runs lockkit with `args`, killed past [`HANG`]: its output, and how
/// long it ran.
fn run_bounded(args: Vec<String>) -> (Output, Duration) {
    let started = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_lockkit"))
        .args(&args)
        .env_remove("DATABASE_URL")
        .env_remove("PGSSLMODE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run lockkit");
    let pid = child.id();
    let (done, finished) = mpsc::channel();
    thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match finished.recv_timeout(HANG) {
        Ok(out) => (out.expect("lockkit's output"), started.elapsed()),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("lockkit {args:?} still ran after {HANG:?}: no bound ended it");
        }
    }
}

/// Each command that connects, against each kind of silence, with
/// `connect_timeout=2`: each ends in failure within [`HANG`], its message
/// naming the step that got no answer and the 2 s bound. All run at once.
#[test]
fn every_command_ends_against_a_silent_server() {
    let db = TestServer::shared();
    let server_port = db.config().get_ports()[0];
    let total = silent_listener(Silence::Total);
    let tls_yes = silent_listener(Silence::AfterTlsYes);
    let after_startup = silent_listener(Silence::AfterStartup(server_port));
    let url = |port: u16, sslmode: &str| {
        format!("postgres://postgres@127.0.0.1:{port}/postgres?connect_timeout=2&sslmode={sslmode}")
    };
    let commands: [&[&str]; 3] = [&["inspect"], &["check"], &["sql", "install"]];
    let mut cases = Vec::new();
    for command in commands {
        let first_query = match command[0] {
            "inspect" => "the query reading the published key types",
            "check" => "the query reading the server settings",
            _ => "the query installing lockkit's SQL functions",
        };
        for (url, expected) in [
            (url(total, "disable"), "the startup"),
            (url(total, "prefer"), "the TLS request"),
            (url(tls_yes, "require"), "the TLS handshake"),
            (url(after_startup, "disable"), first_query),
        ] {
            let mut args = vec!["--url".to_owned(), url];
            args.extend(command.iter().map(|s| (*s).to_owned()));
            cases.push((args, expected));
        }
    }
    let runs: Vec<_> = cases
        .into_iter()
        .map(|(args, expected)| {
            let run = thread::spawn({
                let args = args.clone();
                move || run_bounded(args)
            });
            (args, expected, run)
        })
        .collect();
    let mut longest = Duration::ZERO;
    for (args, expected, run) in runs {
        let (out, took) = run.join().unwrap();
        longest = longest.max(took);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(&format!("no reply to {expected}")) && err.contains("within 2s"),
            "{args:?} should name {expected:?} and the bound: {err}"
        );
        assert!(err.contains("connect_timeout"), "{args:?}: {err}");
    }
    println!("the slowest of the silent-server runs took {longest:?}");
}

/// Each command's help states its bound.
#[test]
fn the_bound_is_in_each_commands_help() {
    for command in [&["inspect"][..], &["check"], &["sql", "install"]] {
        let mut args = command.to_vec();
        args.push("--help");
        let out = super::lockkit(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let text = super::stdout(&out);
        assert!(
            text.contains("BOUNDS")
                && text.contains("connect_timeout")
                && text.contains("10 s")
                && text.contains("the TLS handshake"),
            "{args:?}: {text}"
        );
        let mut args = command.to_vec();
        args.push("-h");
        let text = super::stdout(&super::lockkit(&args));
        assert!(
            text.contains("connect_timeout, 10 s when unset"),
            "{args:?}: {text}"
        );
    }
}

/// Every option in seconds is checked alike: `nan`, negative, zero and
/// infinite values are refused before connecting, never rounded to
/// something else; a wrong URL scheme and a broken URL say so.
#[test]
fn seconds_and_urls_are_checked_alike() {
    let url = "postgres://postgres@127.0.0.1:1/postgres";
    for value in ["nan", "-0.5", "0", "inf", "1e300"] {
        for (option, args) in [
            (
                "--watch interval",
                vec!["--url", url, "inspect", "--watch", value],
            ),
            (
                "--session-keepalive",
                vec!["--url", url, "check", "--session-keepalive", value],
            ),
        ] {
            let out = super::lockkit(&args);
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
            assert!(
                err.contains(&format!("invalid {option}")) && !err.contains("connection refused"),
                "{args:?}: {err}"
            );
        }
    }
    let out = super::lockkit(&["--url", url, "inspect", "--watch=-0.5"]);
    assert!(
        stderr(&out).contains("expected a positive number of seconds"),
        "{}",
        stderr(&out)
    );
    let out = super::lockkit(&["--url", url, "inspect", "--watch", "0.01"]);
    assert!(stderr(&out).contains("at least 0.1"), "{}", stderr(&out));

    let out = super::lockkit(&["--url", "mysql://root@db:3306/app", "inspect"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("wrong URL scheme \"mysql\""), "{err}");
    assert!(err.contains("postgres://"), "{err}");
    let out = super::lockkit(&["--url", "postgres//broken", "check"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("neither a URL") && !err.contains("unexpected EOF"),
        "{err}"
    );
}

/// `--watch` into a pipe: a stream of snapshots, each after a timestamp
/// line, and no terminal codes (it cleared the screen of a log file).
#[test]
fn watch_off_a_terminal_streams_timestamped_snapshots() {
    use std::io::{BufRead, BufReader};
    let db = TestServer::shared();
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockkit"))
        .args(["--url", db.url(), "inspect", "--watch", "0.1"])
        .env_remove("DATABASE_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run lockkit");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    let mut stamps = 0;
    while stamps < 3 {
        let line = lines
            .next()
            .expect("lockkit --watch ended")
            .expect("a line");
        if line.starts_with("=== ") {
            stamps += 1;
        }
        seen.push(line);
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let text = seen.join("\n");
    assert!(!text.contains('\x1b'), "terminal codes in a pipe: {text:?}");
    let stamp = seen.iter().find(|l| l.starts_with("=== ")).unwrap();
    // `=== 2024-05-01T12:34:56.789Z ===`
    assert!(
        stamp.len() == 32 && stamp.ends_with("Z ===") && stamp.as_bytes()[14] == b'T',
        "{stamp}"
    );
}
