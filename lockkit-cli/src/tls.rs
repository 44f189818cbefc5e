//! TLS for the `lockkit` command, as libpq does it: `sslmode` (`disable`,
//! `prefer`, `require`, `verify-ca`, `verify-full`) and `sslrootcert`,
//! read from the connection string (URL query or `key=value`), the
//! `--sslmode` and `--sslrootcert` options, or the `PGSSLMODE` and
//! `PGSSLROOTCERT` variables; an option wins over the connection string,
//! which wins over a variable.
//!
//! tokio-postgres knows `sslmode` `disable`, `prefer` and `require` only,
//! and no root certificate: both are taken out of the connection string
//! here, and the TLS connector (OpenSSL, through postgres-openssl) does the
//! verification that `verify-ca` and `verify-full` ask for.

use std::fmt;
use std::path::{Path, PathBuf};

use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use postgres_openssl::MakeTlsConnector;

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    /// Plain text only.
    Disable,
    /// TLS when the server offers it, the certificate not verified
    /// (libpq's default).
    Prefer,
    /// TLS, the certificate not verified (verified as with `verify-ca`
    /// when a root certificate is given, as libpq does).
    Require,
    /// TLS, the certificate signed by the root certificate.
    VerifyCa,
    /// TLS, the certificate signed by the root certificate and issued for
    /// the host connected to.
    VerifyFull,
}

impl SslMode {
    /// Parses libpq's name of a mode (`allow` is taken as `prefer`: both
    /// accept either).
    ///
    /// # Errors
    ///
    /// [`TlsError`] for any other name.
    pub fn parse(name: &str) -> Result<SslMode, TlsError> {
        Ok(match name {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(TlsError(format!(
                    "invalid sslmode {other:?}: expected disable, prefer, require, verify-ca or verify-full"
                )))
            }
        })
    }

    /// The name libpq gives it.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// A TLS set-up that cannot be used, with what to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsError(pub String);

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TlsError {}

/// A connection string with the TLS parameters taken out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// What tokio-postgres parses.
    pub rest: String,
    /// `sslmode`, as written.
    pub sslmode: Option<String>,
    /// `sslrootcert`, as written (decoded, for a URL).
    pub sslrootcert: Option<String>,
}

/// Takes `sslmode` and `sslrootcert` out of a connection string, a URL
/// (`postgres://…?sslmode=verify-full&sslrootcert=/etc/ca.pem`) or a
/// `key=value` string (`host=db sslmode=require`).
///
/// # Errors
///
/// [`TlsError`] when a quoted value is not closed.
pub fn split(conn: &str) -> Result<Split, TlsError> {
    if conn.starts_with("postgres://") || conn.starts_with("postgresql://") {
        Ok(split_url(conn))
    } else {
        split_keywords(conn)
    }
}

fn split_url(url: &str) -> Split {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, query),
        None => {
            return Split {
                rest: url.to_owned(),
                sslmode: None,
                sslrootcert: None,
            }
        }
    };
    let (mut sslmode, mut sslrootcert) = (None, None);
    let mut kept = Vec::new();
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "sslmode" => sslmode = Some(percent_decode(value)),
            "sslrootcert" => sslrootcert = Some(percent_decode(value)),
            _ => kept.push(pair),
        }
    }
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Split {
        rest,
        sslmode,
        sslrootcert,
    }
}

fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `key = value` pairs as libpq reads them: blanks around `=`, a value in
/// single quotes with `\'` and `\\` escapes.
fn split_keywords(conn: &str) -> Result<Split, TlsError> {
    let chars: Vec<char> = conn.chars().collect();
    let (mut sslmode, mut sslrootcert) = (None, None);
    let mut rest = String::new();
    let mut i = 0;
    while i < chars.len() {
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        if i == chars.len() {
            break;
        }
        let start = i;
        while i < chars.len() && chars[i] != '=' && !chars[i].is_whitespace() {
            i += 1;
        }
        let key: String = chars[start..i].iter().collect();
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        if i < chars.len() && chars[i] == '=' {
            i += 1;
            while i < chars.len() && chars[i].is_whitespace() {
                i += 1;
            }
        }
        let mut value = String::new();
        if i < chars.len() && chars[i] == '\'' {
            i += 1;
            loop {
                match chars.get(i) {
                    None => {
                        return Err(TlsError(format!(
                            "invalid connection string: the quoted value of {key} is not closed"
                        )))
                    }
                    Some('\'') => {
                        i += 1;
                        break;
                    }
                    Some('\\') if i + 1 < chars.len() => {
                        value.push(chars[i + 1]);
                        i += 2;
                    }
                    Some(&c) => {
                        value.push(c);
                        i += 1;
                    }
                }
            }
        } else {
            while i < chars.len() && !chars[i].is_whitespace() {
                if chars[i] == '\\' && i + 1 < chars.len() {
                    i += 1;
                }
                value.push(chars[i]);
                i += 1;
            }
        }
        match key.as_str() {
            "sslmode" => sslmode = Some(value),
            "sslrootcert" => sslrootcert = Some(value),
            _ => {
                if !rest.is_empty() {
                    rest.push(' ');
                }
                rest.extend(&chars[start..i]);
            }
        }
    }
    Ok(Split {
        rest,
        sslmode,
        sslrootcert,
    })
}

/// Where the root certificates come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCert {
    /// A PEM file of one or more certificates.
    File(PathBuf),
    /// The system's trust store (`sslrootcert=system`, as libpq 16+).
    System,
}

/// The TLS set-up of a connection, decided from the sources in their order
/// (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// The mode.
    pub mode: SslMode,
    /// The root certificates, when the mode verifies.
    pub root_cert: Option<RootCert>,
}

impl TlsSettings {
    /// Decides the mode and root certificate: `option` (the command line),
    /// then `url` (the connection string), then `env` (`PGSSLMODE`,
    /// `PGSSLROOTCERT`), then libpq's defaults (`prefer`, and
    /// `~/.postgresql/root.crt` when a verifying mode has no root
    /// certificate named).
    ///
    /// # Errors
    ///
    /// [`TlsError`] for an unknown mode, or a verifying mode without a
    /// readable root certificate file.
    pub fn decide(
        option: (Option<&str>, Option<&Path>),
        url: &Split,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<TlsSettings, TlsError> {
        let mode_name = option
            .0
            .map(str::to_owned)
            .or_else(|| url.sslmode.clone())
            .or_else(|| env("PGSSLMODE").filter(|v| !v.is_empty()));
        let mode = match mode_name {
            Some(name) => SslMode::parse(&name)?,
            None => SslMode::Prefer,
        };
        let named = option
            .1
            .map(|p| p.display().to_string())
            .or_else(|| url.sslrootcert.clone())
            .or_else(|| env("PGSSLROOTCERT").filter(|v| !v.is_empty()));
        let root_cert = match named {
            Some(name) if name == "system" => Some(RootCert::System),
            Some(path) => Some(RootCert::File(PathBuf::from(path))),
            None => None,
        };
        let verifies = matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull);
        let root_cert = match (root_cert, verifies) {
            (Some(RootCert::File(path)), _) if verifies || mode == SslMode::Require => {
                if !path.is_file() {
                    return Err(TlsError(format!(
                        "the root certificate file {} does not exist or is not a file (sslrootcert)",
                        path.display()
                    )));
                }
                Some(RootCert::File(path))
            }
            (Some(RootCert::System), _) => Some(RootCert::System),
            (Some(RootCert::File(_)), _) => None,
            (None, true) => {
                let default = env("HOME")
                    .map(|h| Path::new(&h).join(".postgresql").join("root.crt"))
                    .filter(|p| p.is_file());
                match default {
                    Some(path) => Some(RootCert::File(path)),
                    None => {
                        return Err(TlsError(format!(
                            "sslmode={} verifies the server's certificate and needs a root \
                             certificate: give --sslrootcert FILE (or sslrootcert=FILE, or \
                             sslrootcert=system for the system's trust store); \
                             ~/.postgresql/root.crt does not exist",
                            mode.as_str()
                        )));
                    }
                }
            }
            (None, false) => None,
        };
        Ok(TlsSettings { mode, root_cert })
    }

    /// The `sslmode` tokio-postgres is given: it negotiates TLS, the
    /// connector verifies.
    pub fn driver_mode(&self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as Driver;
        match self.mode {
            SslMode::Disable => Driver::Disable,
            SslMode::Prefer => Driver::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Driver::Require,
        }
    }

    /// The TLS connector, `None` for `disable`.
    ///
    /// # Errors
    ///
    /// [`TlsError`] when OpenSSL cannot be set up or the root certificate
    /// file cannot be read.
    pub fn connector(&self) -> Result<Option<MakeTlsConnector>, TlsError> {
        if self.mode == SslMode::Disable {
            return Ok(None);
        }
        let openssl = |e: openssl::error::ErrorStack| TlsError(format!("cannot set up TLS: {e}"));
        let mut builder = SslConnector::builder(SslMethod::tls_client()).map_err(openssl)?;
        match &self.root_cert {
            Some(RootCert::File(path)) => builder.set_ca_file(path).map_err(|e| {
                TlsError(format!(
                    "cannot read the root certificate file {}: {e}",
                    path.display()
                ))
            })?,
            Some(RootCert::System) => builder.set_default_verify_paths().map_err(openssl)?,
            None => {}
        }
        // `require` with a root certificate verifies as `verify-ca` does
        // (libpq's rule); `prefer` and plain `require` only encrypt.
        let verify = self.root_cert.is_some() && self.mode != SslMode::Prefer;
        builder.set_verify(if verify {
            SslVerifyMode::PEER
        } else {
            SslVerifyMode::NONE
        });
        let mut connector = MakeTlsConnector::new(builder.build());
        let full = self.mode == SslMode::VerifyFull;
        connector.set_callback(move |config, _domain| {
            config.set_verify_hostname(full);
            Ok(())
        });
        Ok(Some(connector))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn splits_urls_and_keywords() {
        let s = split("postgres://u@h:5/db?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem")
            .unwrap();
        assert_eq!(s.rest, "postgres://u@h:5/db?application_name=x");
        assert_eq!(s.sslmode.as_deref(), Some("verify-full"));
        assert_eq!(s.sslrootcert.as_deref(), Some("/etc/ca.pem"));
        let s = split("postgresql://h/db?sslmode=require").unwrap();
        assert_eq!(s.rest, "postgresql://h/db");
        let s = split("host=h sslmode = verify-ca user='a b' sslrootcert='/x y/ca.pem' dbname=d")
            .unwrap();
        assert_eq!(s.rest, "host=h user='a b' dbname=d");
        assert_eq!(s.sslmode.as_deref(), Some("verify-ca"));
        assert_eq!(s.sslrootcert.as_deref(), Some("/x y/ca.pem"));
        assert!(split("host=h sslrootcert='/x").is_err());
        let s = split("host=h").unwrap();
        assert_eq!((s.rest.as_str(), s.sslmode), ("host=h", None));
    }

    #[test]
    fn decides_as_libpq() {
        let url = split("host=h sslmode=require").unwrap();
        let t = TlsSettings::decide((None, None), &url, &no_env).unwrap();
        assert_eq!((t.mode, t.root_cert), (SslMode::Require, None));
        // The option wins over the string, the string over the variable.
        let t = TlsSettings::decide((Some("disable"), None), &url, &no_env).unwrap();
        assert_eq!(t.mode, SslMode::Disable);
        let env = |k: &str| (k == "PGSSLMODE").then(|| "disable".to_owned());
        let t = TlsSettings::decide((None, None), &url, &env).unwrap();
        assert_eq!(t.mode, SslMode::Require);
        let plain = split("host=h").unwrap();
        let t = TlsSettings::decide((None, None), &plain, &env).unwrap();
        assert_eq!(t.mode, SslMode::Disable);
        let t = TlsSettings::decide((None, None), &plain, &no_env).unwrap();
        assert_eq!(t.mode, SslMode::Prefer);
        assert!(TlsSettings::decide((Some("sometimes"), None), &plain, &no_env).is_err());
        // A verifying mode needs a root certificate.
        let err = TlsSettings::decide((Some("verify-full"), None), &plain, &no_env).unwrap_err();
        assert!(err.0.contains("--sslrootcert"), "{err}");
        let missing = Path::new("/nonexistent/ca.pem");
        let err =
            TlsSettings::decide((Some("verify-ca"), Some(missing)), &plain, &no_env).unwrap_err();
        assert!(err.0.contains("does not exist"), "{err}");
        let system = split("host=h sslmode=verify-full sslrootcert=system").unwrap();
        let t = TlsSettings::decide((None, None), &system, &no_env).unwrap();
        assert_eq!(t.root_cert, Some(RootCert::System));
    }
}
