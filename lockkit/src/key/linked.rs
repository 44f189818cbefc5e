//! The key types linked into the program: every type that derives
//! [`AdvisoryKey`](crate::AdvisoryKey) registers its [`KeySpec`] here, so a
//! process can name the type behind any key it sees in `pg_locks` without a
//! list kept by hand ([`KeyRegistry::linked`](crate::inspect::KeyRegistry::linked),
//! [`Locker::publish_key_types`](crate::Locker::publish_key_types)).
//!
//! The registration is `inventory`'s: each derive submits one
//! [`LinkedKeyType`], collected before `main` runs. A type is listed when
//! the code that derives it is linked into the program: a derive in a
//! library crate that the program never uses at all may be left out by the
//! linker, as every `inventory` item may.

use crate::key::KeySpec;

/// A key type of the program, as `#[derive(AdvisoryKey)]` registered it.
#[derive(Debug)]
pub struct LinkedKeyType {
    name: &'static str,
    spec: KeySpec<'static>,
}

impl LinkedKeyType {
    /// What the derive submits: the type's path (`module_path!()` and its
    /// name, without generic parameters) and its
    /// [`KEY_SPEC`](crate::AdvisoryKey::KEY_SPEC).
    #[doc(hidden)]
    pub const fn new(name: &'static str, spec: KeySpec<'static>) -> Self {
        LinkedKeyType { name, spec }
    }

    /// The type's path, e.g. `billing::Invoice`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The type's key spec.
    pub fn spec(&self) -> KeySpec<'static> {
        self.spec
    }
}

inventory::collect!(LinkedKeyType);

/// Every key type that derives [`AdvisoryKey`](crate::AdvisoryKey) in the
/// program, in no particular order.
///
/// ```
/// use lockkit::AdvisoryKey;
///
/// #[derive(AdvisoryKey)]
/// #[advisory_key(namespace = "docs.linked")]
/// struct Linked {
///     id: i64,
/// }
///
/// let found = lockkit::key::linked_key_types().find(|t| t.spec().namespace() == "docs.linked");
/// assert!(found.unwrap().name().ends_with("::Linked"));
/// ```
pub fn linked_key_types() -> impl Iterator<Item = &'static LinkedKeyType> {
    inventory::iter::<LinkedKeyType>.into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    inventory::submit! {
        LinkedKeyType::new("lockkit::key::linked::tests::Linked", KeySpec::new("unit.linked"))
    }

    /// A key type submitted at link time is found, with its name and spec.
    #[test]
    fn a_linked_type_is_found_with_its_name_and_spec() {
        let found = linked_key_types()
            .find(|t| t.spec().namespace() == "unit.linked")
            .expect("the submitted type");
        assert_eq!(found.name(), "lockkit::key::linked::tests::Linked");
    }
}
