//! Finding the PostgreSQL server programs: the directory named by
//! [`BINDIR_VAR`], else the installed ones.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::{env, fs};

/// The environment variable naming the directory of the server programs
/// to use, e.g. `/opt/pg14/bin` as laid out by `.ci/pg-binaries 14
/// /opt/pg14`: the way to run the tests on another PostgreSQL major.
pub(crate) const BINDIR_VAR: &str = "LOCKKIT_PG_BINDIR";

/// The directory holding `initdb`, `pg_ctl`, `postgres` and (when it has
/// it) `pg_basebackup`, looked up once per process.
///
/// The directory named by [`BINDIR_VAR`] when it is set and not empty,
/// and no other. Otherwise, in order: `pg_config --bindir`, the newest
/// `/usr/lib/postgresql/*/bin` (Debian and Ubuntu keep the server programs
/// off `PATH`), then `PATH`.
///
/// # Errors
///
/// When [`BINDIR_VAR`] names a directory without `initdb`, `pg_ctl` and
/// `postgres` (it is never silently replaced by the installed server), or,
/// without it, when none of the other places holds `initdb` and `pg_ctl`.
pub(crate) fn bindir() -> io::Result<&'static Path> {
    static BINDIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BINDIR
        .get_or_init(find)
        .as_deref()
        .map_err(|e| io::Error::new(io::ErrorKind::NotFound, e.clone()))
}

fn find() -> Result<PathBuf, String> {
    match env::var_os(BINDIR_VAR) {
        Some(dir) if !dir.is_empty() => chosen(Path::new(&dir)),
        _ => from_pg_config()
            .or_else(newest_debian)
            .or_else(from_path)
            .ok_or_else(|| {
                format!(
                    "cannot find the PostgreSQL server programs (initdb, pg_ctl) via \
                     `pg_config --bindir`, in /usr/lib/postgresql/*/bin or on PATH; install \
                     the PostgreSQL server, name their directory in {BINDIR_VAR}, or set \
                     DATABASE_URL to use a running server"
                )
            }),
    }
}

/// The directory of [`BINDIR_VAR`], made absolute (the programs run in
/// their cluster's directory), if it holds the three server programs.
pub(crate) fn chosen(dir: &Path) -> Result<PathBuf, String> {
    let dir = fs::canonicalize(dir).map_err(|e| format!("{BINDIR_VAR}={}: {e}", dir.display()))?;
    let missing: Vec<&str> = ["initdb", "pg_ctl", "postgres"]
        .into_iter()
        .filter(|program| !dir.join(program).is_file())
        .collect();
    if missing.is_empty() {
        Ok(dir)
    } else {
        Err(format!(
            "{BINDIR_VAR}={} has no {}",
            dir.display(),
            missing.join(", ")
        ))
    }
}

fn has_server(dir: &Path) -> bool {
    dir.join("initdb").is_file() && dir.join("pg_ctl").is_file()
}

fn from_pg_config() -> Option<PathBuf> {
    let out = Command::new("pg_config").arg("--bindir").output().ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    has_server(&dir).then_some(dir)
}

fn newest_debian() -> Option<PathBuf> {
    fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version = version_key(entry.file_name().to_str()?)?;
            let bin = entry.path().join("bin");
            has_server(&bin).then_some((version, bin))
        })
        .max_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, bin)| bin)
}

/// `"9.6"` → `[9, 6]`, so that 10 sorts after 9.6; `None` for other names.
fn version_key(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

/// A directory on `PATH` with `initdb`, resolved through symlinks so that
/// its siblings (`pg_basebackup`) are found too.
fn from_path() -> Option<PathBuf> {
    env::split_paths(&env::var_os("PATH")?)
        .filter(|dir| has_server(dir))
        .find_map(|dir| {
            Some(
                fs::canonicalize(dir.join("initdb"))
                    .ok()?
                    .parent()?
                    .to_owned(),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::version_key;

    #[test]
    fn versions_sort_numerically() {
        assert!(version_key("10") > version_key("9.6"));
        assert!(version_key("16") > version_key("15"));
        assert_eq!(version_key("README"), None);
    }
}
