//! Where the examples' server comes from: `DATABASE_URL`, else a throwaway
//! server of their own.

use std::env;
use std::fmt;

use std::sync::Arc;

use lockkit_tests::{StopMode, TestServer};
use tokio_postgres::Client;

/// The server an example talks to. Clones share it.
#[derive(Clone)]
pub struct Database {
    server: Server,
}

#[derive(Clone)]
enum Server {
    /// `DATABASE_URL`, through the harness's shared handle.
    External(&'static TestServer),
    /// A throwaway cluster, stopped and removed when this value drops (or
    /// the process exits).
    Throwaway(Arc<TestServer>),
}

impl fmt::Debug for Database {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Database")
            .field("url", &self.url())
            .field("throwaway", &self.is_throwaway())
            .finish()
    }
}

impl Database {
    /// The server of `DATABASE_URL` when it is set and not empty; otherwise
    /// a throwaway server started with `settings` (on top of the harness's
    /// own, see `lockkit_tests`). Starting one takes a second or two.
    ///
    /// # Panics
    ///
    /// When the throwaway server cannot be started (the message has its
    /// log) or `DATABASE_URL` is not a valid connection string.
    pub fn from_env(settings: &[(&str, &str)]) -> Database {
        match env::var("DATABASE_URL") {
            Ok(url) if !url.is_empty() => Database {
                server: Server::External(TestServer::shared()),
            },
            _ => Database::throwaway(settings),
        }
    }

    /// A throwaway server started with `settings`, whatever `DATABASE_URL`
    /// says.
    ///
    /// # Panics
    ///
    /// When the server cannot be started (the message has its log).
    pub fn throwaway(settings: &[(&str, &str)]) -> Database {
        match Database::try_throwaway(settings) {
            Ok(db) => db,
            Err(e) => panic!("cannot start a test server: {e}"),
        }
    }

    /// A throwaway server started with `settings`, or why it did not
    /// start: for a setting the server may refuse (a library to preload
    /// that is not installed), to start again without it.
    ///
    /// # Errors
    ///
    /// When the server cannot be started (the message has its log).
    pub fn try_throwaway(settings: &[(&str, &str)]) -> Result<Database, std::io::Error> {
        let mut builder = TestServer::builder();
        for (name, value) in settings {
            builder = builder.setting(*name, *value);
        }
        Ok(Database {
            server: Server::Throwaway(Arc::new(builder.try_start()?)),
        })
    }

    fn server(&self) -> &TestServer {
        match &self.server {
            Server::External(s) => s,
            Server::Throwaway(s) => s,
        }
    }

    /// Whether this is a throwaway server the example started.
    pub fn is_throwaway(&self) -> bool {
        matches!(self.server, Server::Throwaway(_))
    }

    /// Restarts the throwaway server, stopping it in `mode`: every session
    /// ends; the data stays (see [`StopMode`] for what an immediate stop
    /// keeps). Returns once it accepts connections again.
    ///
    /// # Errors
    ///
    /// On a server from `DATABASE_URL` (which the examples never restart),
    /// or when the server cannot be stopped or started again.
    ///
    /// # Cancel safety
    ///
    /// The restart runs on a blocking thread and completes even when the
    /// future is dropped.
    pub async fn restart(&self, mode: StopMode) -> Result<(), std::io::Error> {
        let Server::Throwaway(server) = &self.server else {
            return Err(std::io::Error::other(
                "cannot restart the server of DATABASE_URL: unset it to use a throwaway server",
            ));
        };
        let server = Arc::clone(server);
        tokio::task::spawn_blocking(move || server.try_restart_with(mode))
            .await
            .map_err(std::io::Error::other)?
    }

    /// The connection URL.
    pub fn url(&self) -> &str {
        self.server().url()
    }

    /// The connection settings, as in [`url`](Self::url): for
    /// `lockkit::SessionLock`, which opens connections of its own.
    pub fn config(&self) -> tokio_postgres::Config {
        self.server().config()
    }

    /// A new connection, its driver task spawned on the current runtime.
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
    /// Cancel safe: dropping the future drops the half-open connection.
    pub async fn connect(&self) -> Result<Client, tokio_postgres::Error> {
        self.server().try_connect().await
    }
}
