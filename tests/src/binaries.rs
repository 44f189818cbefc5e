//! Finding the installed PostgreSQL server programs.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::{env, fs};

/// The directory holding `initdb`, `pg_ctl`, `postgres` and `pg_basebackup`,
/// looked up once per process.
///
/// In order: `pg_config --bindir`, the newest `/usr/lib/postgresql/*/bin`
/// (Debian and Ubuntu keep the server programs off `PATH`), then `PATH`.
///
/// # Errors
///
/// When none of those holds `initdb` and `pg_ctl`.
pub(crate) fn bindir() -> io::Result<&'static Path> {
    static BINDIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    BINDIR.get_or_init(find).as_deref().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "cannot find the PostgreSQL server programs (initdb, pg_ctl) via `pg_config --bindir`, \
             in /usr/lib/postgresql/*/bin or on PATH; install the PostgreSQL server \
             or set DATABASE_URL to use a running server",
        )
    })
}

fn find() -> Option<PathBuf> {
    from_pg_config().or_else(newest_debian).or_else(from_path)
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
