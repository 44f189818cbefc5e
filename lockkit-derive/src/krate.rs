//! Where generated code finds lockkit, when `#[advisory_key(crate = "...")]`
//! does not say: the user's own dependency on `lockkit` (renamed or not),
//! else their dependency on an adapter crate, which re-exports lockkit as
//! `lockkit` (`pub use lockkit;`), else `::lockkit`.
//!
//! The dependencies are read from the Cargo.toml of the crate being compiled
//! (`CARGO_MANIFEST_DIR`), workspace inheritance included, by
//! `proc-macro-crate`. Cargo.toml does not say which target a dependency
//! serves: a crate with `lockkit` only among its dev-dependencies and an
//! adapter among its dependencies gets `::lockkit` in its library too, and
//! names the path with `crate = "::lockkit_diesel::lockkit"`.

use proc_macro2::{Span, TokenStream};
use proc_macro_crate::FoundCrate;
use quote::quote;
use syn::Ident;

/// The adapter crates whose users can derive without depending on lockkit,
/// in the order they are looked for. Each must keep `pub use lockkit;` at
/// its root; an adapter added to the workspace is added here.
const ADAPTERS: &[&str] = &["lockkit-diesel", "lockkit-sqlx", "lockkit-diesel-async"];

/// The path to lockkit in the user's crate, from their Cargo.toml.
pub(crate) fn from_manifest() -> TokenStream {
    resolve(|name| proc_macro_crate::crate_name(name).ok())
}

/// [`from_manifest`] with the look-up of a dependency (by package name, as
/// `proc_macro_crate::crate_name` does) given, for unit tests.
fn resolve(find: impl Fn(&str) -> Option<FoundCrate>) -> TokenStream {
    if let Some(found) = find("lockkit") {
        let root = root(found, "lockkit");
        return quote!(::#root);
    }
    for adapter in ADAPTERS {
        if let Some(found) = find(adapter) {
            let root = root(found, adapter);
            return quote!(::#root::lockkit);
        }
    }
    quote!(::lockkit)
}

/// The extern-crate name a dependency is known by. `Itself` (the derive used
/// in the package's own doctests or examples, which name it by its own name)
/// is the package's name, not `crate`: its library does not use the derive.
fn root(found: FoundCrate, package: &str) -> Ident {
    let name = match found {
        FoundCrate::Name(name) => name,
        FoundCrate::Itself => package.replace('-', "_"),
    };
    Ident::new(&name, Span::call_site())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(deps: &[(&str, FoundCrate)]) -> String {
        resolve(|name| {
            deps.iter()
                .find(|(package, _)| *package == name)
                .map(|(_, found)| found.clone())
        })
        .to_string()
    }

    fn named(name: &str) -> FoundCrate {
        FoundCrate::Name(name.to_owned())
    }

    #[test]
    fn lockkit_itself_renamed_or_not() {
        assert_eq!(path(&[("lockkit", named("lockkit"))]), ":: lockkit");
        assert_eq!(path(&[("lockkit", named("locks"))]), ":: locks");
        assert_eq!(path(&[("lockkit", FoundCrate::Itself)]), ":: lockkit");
    }

    #[test]
    fn a_direct_dependency_on_lockkit_wins_over_an_adapter() {
        let deps = [
            ("lockkit-diesel", named("lockkit_diesel")),
            ("lockkit", named("lk")),
        ];
        assert_eq!(path(&deps), ":: lk");
    }

    #[test]
    fn an_adapter_alone_reexports_lockkit() {
        let deps = [("lockkit-diesel", named("lockkit_diesel"))];
        assert_eq!(path(&deps), ":: lockkit_diesel :: lockkit");
        let deps = [("lockkit-diesel", named("db_locks"))];
        assert_eq!(path(&deps), ":: db_locks :: lockkit");
        let deps = [("lockkit-diesel", FoundCrate::Itself)];
        assert_eq!(path(&deps), ":: lockkit_diesel :: lockkit");
        let deps = [("lockkit-sqlx", named("lockkit_sqlx"))];
        assert_eq!(path(&deps), ":: lockkit_sqlx :: lockkit");
    }

    #[test]
    fn neither_falls_back_to_lockkit() {
        assert_eq!(path(&[]), ":: lockkit");
        assert_eq!(path(&[("diesel", named("diesel"))]), ":: lockkit");
    }
}
