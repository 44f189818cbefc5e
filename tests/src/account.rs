//! Who the server programs run as.
//!
//! PostgreSQL refuses to run as root, and this project's machines (CI
//! included) run everything as root. So when our effective uid is 0, every
//! server program runs as `postgres` if `/etc/passwd` has it, else as
//! `nobody`, via [`std::os::unix::process::CommandExt::uid`]. We read
//! `/etc/passwd` ourselves: two fields of one line do not justify a crate.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::sync::OnceLock;

/// A Unix account: the ids a server program runs with and its files belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Account {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

/// The account to run the server programs as, or `None` to run them as
/// ourselves (we are not root). Looked up once per process.
///
/// # Errors
///
/// When we are root and `/etc/passwd` has neither `postgres` nor `nobody`.
pub(crate) fn for_server() -> io::Result<Option<Account>> {
    static ACCOUNT: OnceLock<Result<Option<Account>, String>> = OnceLock::new();
    ACCOUNT
        .get_or_init(|| {
            if !running_as_root() {
                return Ok(None);
            }
            let passwd = fs::read_to_string("/etc/passwd")
                .map_err(|e| format!("cannot read /etc/passwd: {e}"))?;
            ["postgres", "nobody"]
                .iter()
                .find_map(|name| lookup(&passwd, name))
                .map(Some)
                .ok_or_else(|| {
                    "running as root, and /etc/passwd has neither `postgres` nor `nobody` \
                     to run PostgreSQL as"
                        .to_owned()
                })
        })
        .clone()
        .map_err(io::Error::other)
}

/// `/proc/self` belongs to the effective uid of the process; without
/// `/proc` (not Linux) we assume we are not root.
fn running_as_root() -> bool {
    fs::metadata("/proc/self").is_ok_and(|meta| meta.uid() == 0)
}

/// The account called `name` in the text of an `/etc/passwd`.
fn lookup(passwd: &str, name: &str) -> Option<Account> {
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != name {
            return None;
        }
        let _password = fields.next()?;
        Some(Account {
            uid: fields.next()?.parse().ok()?,
            gid: fields.next()?.parse().ok()?,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::{lookup, Account};

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
                          nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n\
                          postgres:x:101:104:PostgreSQL administrator,,,:/var/lib/postgresql:/bin/bash\n";

    #[test]
    fn finds_accounts_by_name() {
        assert_eq!(
            lookup(PASSWD, "postgres"),
            Some(Account { uid: 101, gid: 104 })
        );
        assert_eq!(
            lookup(PASSWD, "nobody"),
            Some(Account {
                uid: 65534,
                gid: 65534
            })
        );
        assert_eq!(lookup(PASSWD, "post"), None);
    }
}
