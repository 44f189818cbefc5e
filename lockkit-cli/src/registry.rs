//! The key types `lockkit inspect` names, registered once instead of with
//! `-n` on every run.
//!
//! Entries are `NAME` (the namespace's BigInt keys and its Pair keys of the
//! derived class) or `NAME=CLASS` (its Pair keys of an explicit class), and
//! come from, all merged:
//! - the namespaces file: `--namespaces-file PATH`, else the
//!   `LOCKKIT_NAMESPACES_FILE` environment variable, else
//!   `$XDG_CONFIG_HOME/lockkit/namespaces` (or
//!   `$HOME/.config/lockkit/namespaces`) when it exists; entries separated
//!   by newlines, commas or spaces, `#` starts a comment;
//! - the `LOCKKIT_NAMESPACES` environment variable (same syntax);
//! - `-n NAME[=CLASS]` options.

use std::fmt;
use std::path::{Path, PathBuf};

use lockkit::inspect::KeyRegistry;
use lockkit::KeySpec;

/// The environment variable with entries.
pub const ENV_NAMESPACES: &str = "LOCKKIT_NAMESPACES";
/// The environment variable naming a namespaces file.
pub const ENV_NAMESPACES_FILE: &str = "LOCKKIT_NAMESPACES_FILE";

/// Why the registry cannot be built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryError(pub String);

impl fmt::Display for RegistryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RegistryError {}

/// The entries of a namespaces file or variable: separated by newlines,
/// commas or whitespace, `#` to the end of a line is a comment.
pub fn entries(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .flat_map(|l| l.split(|c: char| c == ',' || c.is_whitespace()))
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Adds one `NAME[=CLASS]` entry; `source` names where it came from, for
/// messages.
///
/// # Errors
///
/// [`RegistryError`] when the namespace or the class is invalid.
pub fn add(registry: KeyRegistry, entry: &str, source: &str) -> Result<KeyRegistry, RegistryError> {
    let (name, class) = match entry.split_once('=') {
        Some((name, class)) => {
            let class: i32 = class.parse().map_err(|e| {
                RegistryError(format!("invalid class in {entry:?} ({source}): {e}"))
            })?;
            (name, Some(class))
        }
        None => (entry, None),
    };
    let spec = KeySpec::try_new(name)
        .map_err(|e| RegistryError(format!("invalid namespace in {entry:?} ({source}): {e}")))?;
    Ok(match class {
        Some(class) => registry.register_spec(name, spec.class(class)),
        None => registry
            .register_spec(name, spec)
            .register_spec(name, spec.pair()),
    })
}

/// The default namespaces file: `$XDG_CONFIG_HOME/lockkit/namespaces`, or
/// `$HOME/.config/lockkit/namespaces`.
pub fn default_file(env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let base = env("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| Path::new(&h).join(".config")))?;
    Some(base.join("lockkit").join("namespaces"))
}

/// The registry of a run: the key types linked into the program
/// ([`KeyRegistry::linked`]), the namespaces file, [`ENV_NAMESPACES`] and the
/// `-n` entries (see the module docs). `env` reads the environment (a
/// parameter so tests need not change the process's).
///
/// # Errors
///
/// [`RegistryError`] when an explicitly named file cannot be read, or an
/// entry is invalid.
pub fn build(
    options: &[String],
    file: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<KeyRegistry, RegistryError> {
    let mut registry = KeyRegistry::linked();
    let named = file.map(Path::to_path_buf).or_else(|| {
        env(ENV_NAMESPACES_FILE)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    let path = match named {
        Some(path) => Some(
            std::fs::read_to_string(&path)
                .map(|t| (path.clone(), t))
                .map_err(|e| {
                    RegistryError(format!(
                        "cannot read the namespaces file {}: {e}",
                        path.display()
                    ))
                })?,
        ),
        // The default file is optional.
        None => default_file(env).and_then(|p| std::fs::read_to_string(&p).ok().map(|t| (p, t))),
    };
    if let Some((path, text)) = path {
        let source = path.display().to_string();
        for entry in entries(&text) {
            registry = add(registry, &entry, &source)?;
        }
    }
    if let Some(text) = env(ENV_NAMESPACES) {
        for entry in entries(&text) {
            registry = add(registry, &entry, ENV_NAMESPACES)?;
        }
    }
    for entry in options {
        registry = add(registry, entry, "--namespace")?;
    }
    Ok(registry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockkit::LockKey;

    #[test]
    fn merges_file_env_and_options() {
        let dir = std::env::temp_dir().join(format!("lockkit-registry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("namespaces");
        std::fs::write(&file, "# the shop\nOrder\nSlot=7, Invoice # billing\n").unwrap();
        let env = |k: &str| match k {
            ENV_NAMESPACES => Some("Event Tenanted".to_owned()),
            _ => None,
        };
        let registry = build(&["Extra=-3".into()], Some(&file), &env).unwrap();
        let names: Vec<&str> = registry.types().iter().map(|t| t.name()).collect();
        assert_eq!(
            names,
            [
                "Order", "Order", "Slot", "Invoice", "Invoice", "Event", "Event", "Tenanted",
                "Tenanted", "Extra"
            ]
        );
        assert_eq!(registry.decode(LockKey::Pair(7, 1))[0].namespace(), "Slot");
        // The variable names the file when no option does.
        let env_file = |k: &str| match k {
            ENV_NAMESPACES_FILE => Some(file.display().to_string()),
            _ => None,
        };
        assert_eq!(build(&[], None, &env_file).unwrap().types().len(), 5);
        // The default file under XDG_CONFIG_HOME.
        std::fs::create_dir_all(dir.join("lockkit")).unwrap();
        std::fs::write(dir.join("lockkit").join("namespaces"), "Order").unwrap();
        let xdg = |k: &str| (k == "XDG_CONFIG_HOME").then(|| dir.display().to_string());
        assert_eq!(build(&[], None, &xdg).unwrap().types().len(), 2);
        assert!(build(&["bad name".into()], None, &|_| None).is_err());
        assert!(build(&["X=notanumber".into()], None, &|_| None).is_err());
        let missing = dir.join("missing");
        let err = build(&[], Some(&missing), &|_| None).unwrap_err();
        assert!(err.0.contains("cannot read"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
