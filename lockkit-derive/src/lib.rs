//! Implementation detail of `lockkit`: `#[derive(AdvisoryKey)]`. Depend on
//! `lockkit` or one of its adapters (`lockkit-diesel`), feature `derive`, on
//! by default, instead.
mod ast;
mod attr;
mod ctxt;
mod expand;
mod krate;
mod valid;

use proc_macro::TokenStream;

/// Derives `lockkit::AdvisoryKey` (and `lockkit::key::KeyPart`) following the
/// normative key format, `docs/KEYS.md`.
///
/// The key of a value is a hash of its namespace and of its fields, in
/// declaration order, each in its canonical encoding ([`KeyPart`]). Field
/// names are not encoded: renaming a field keeps every key, reordering or
/// adding one changes them. An enum encodes the variant's name (not its
/// discriminant), then the variant's fields.
///
/// For example, `Order { id: 42 }` is the KEYS.md golden vector
/// `LockKey::BigInt(-7205368663365046133)`: see the [examples], which run as
/// lockkit's doctests (this crate cannot depend on lockkit).
///
/// Structs (named, tuple, unit) and enums derive it; unions do not. An enum
/// without variants is accepted: it has no values, so it never makes a key.
///
/// # Type attributes: `#[advisory_key(...)]` on the struct or enum
///
/// | option | meaning |
/// | --- | --- |
/// | `namespace = "billing.order"` | The namespace hashed into every key. Default: the type's own name (`r#` stripped). 1 to 64 bytes of ASCII letters, digits and `_ . : / -`, checked at compile time. Give one explicitly to keep keys when the type is renamed or moved; a type whose name is not a valid namespace (non-ASCII, say) needs one. |
/// | `pair` | Use PostgreSQL's `(int4, int4)` key space: `Pair(class, low 32 bits of the hash)`. Default: the `bigint` key space, `BigInt(namespace tag << 48 \| 48 bits of the hash)`. |
/// | `class = -17` | With `pair`: the class (first `int4`) instead of the high 32 bits of the namespace hash. An `i32` literal, may be negative. |
/// | `pair = "exact"` | Exact mode: `Pair(class, value)` for a struct with a single `i32` field, the value unhashed, for interoperating with SQL that locks `(class, id)`. `class` may be given; `stripes` may not. |
/// | `stripes = 1024` | Fold every value of the type onto that many keys (`hash % stripes`), bounding how many locks the type can hold. At least 1. Not with `raw` or exact mode. |
/// | `raw` | The value is the key, unhashed: only on a newtype over `i64` (`BigInt(self.0)`) or over `(i32, i32)` (`Pair(self.0.0, self.0.1)`). A raw key has no namespace, so `namespace`, `class`, `stripes` and `pair` are errors on it. |
/// | `crate = "path::to::lockkit"` | Where generated code finds lockkit. Default: found in the crate's Cargo.toml: its dependency on `lockkit` (renamed or not), else `lockkit` re-exported by its dependency on an adapter (`::lockkit_diesel::lockkit`), else `::lockkit`. Needed for other re-exports, or where a dependency the derive finds is a dev-dependency only. |
///
/// The [examples] show each option, with the keys it gives.
///
/// # Field attributes: `#[advisory_key(...)]` on a field
///
/// | option | meaning |
/// | --- | --- |
/// | `skip` | The field is not part of the key. |
/// | `with = "path::to::fn"` | Encode the field with `fn(&FieldType, &mut lockkit::key::Parts<'_>)` instead of its `KeyPart` impl. |
///
/// The [examples] show `with` (a `f64` amount locked by whole cents) and
/// `skip`.
///
/// # Field types
///
/// Every encoded field must implement `lockkit::key::KeyPart`: integers (encoded
/// by value, so widening `i32` to `i64` keeps every key), `bool`, `char`,
/// strings (`&str`, `String`, `Box<str>`, `Cow<str>`, `Arc<str>` all encode
/// alike), `Option`, slices, `Vec`, arrays, tuples, references and smart
/// pointers, `uuid::Uuid` (feature `uuid`) and other `#[derive(AdvisoryKey)]`
/// types, so key types nest. Floats (`f32`, `f64`, also inside `Option`,
/// `Vec`, arrays, references and tuples) are a compile error, since NaN and
/// -0.0 make equality ambiguous; convert them or use `with`.
///
/// A generic type gets a `FieldType: KeyPart` bound for each encoded field
/// whose type mentions a type parameter, so `struct Scoped<T> { tenant: T,
/// id: u64 }` is a key type whenever `T: KeyPart`. Every instance shares the
/// type's namespace.
///
/// [`KeyPart`]: https://docs.rs/lockkit/latest/lockkit/trait.KeyPart.html
/// [examples]: https://docs.rs/lockkit/latest/lockkit/derive.AdvisoryKey.html#examples
#[proc_macro_derive(AdvisoryKey, attributes(advisory_key))]
pub fn derive_advisory_key(input: TokenStream) -> TokenStream {
    derive(input.into()).into()
}

/// The derive on `proc_macro2` tokens, callable from unit tests.
pub(crate) fn derive(input: proc_macro2::TokenStream) -> proc_macro2::TokenStream {
    match syn::parse2::<syn::DeriveInput>(input) {
        Ok(input) => expand::derive(&input),
        Err(e) => e.to_compile_error(),
    }
}
