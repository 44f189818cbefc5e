//! Lock keys: PostgreSQL's two advisory key spaces, their global order, their
//! `pg_locks` form, and the [`AdvisoryKey`] trait that maps a domain type to
//! one of them (KEYS.md, "PostgreSQL's two key spaces" and "Keys").

pub(crate) mod encoding;
pub(crate) mod linked;
pub(crate) mod namespace;
pub(crate) mod semaphore;
pub(crate) mod sip;
pub(crate) mod text_hash;

pub use encoding::{parts_bytes, KeyPart, Parts};
pub use linked::{linked_key_types, LinkedKeyType};
pub use namespace::{NamespaceError, MAX_NAMESPACE_LEN};
pub use semaphore::{
    semaphore_base, semaphore_of, semaphore_slot, MAX_PERMITS, SEMAPHORE_CLASS, SEMAPHORE_NAMESPACE,
};
pub use text_hash::{
    hash_bytes, hashtext, hashtext_key, hashtext_key_with, hashtext_with, ByteOrder, HashText,
};

use core::fmt;

use crate::key::sip::Sip24;

/// An advisory lock key in one of PostgreSQL's two key spaces.
///
/// The derived [`Ord`] is the global lock order of `docs/KEYS.md`: every `BigInt`
/// key ascending by signed value, then every `Pair` key ascending by
/// `(class, object)` as signed integers. Every multi-key acquisition in
/// lockkit takes its keys in this order, so two processes can never take the
/// same two keys in opposite orders.
///
/// ```
/// use lockkit::LockKey;
///
/// let mut keys = vec![LockKey::Pair(1, 2), LockKey::BigInt(5), LockKey::BigInt(-9)];
/// keys.sort();
/// assert_eq!(keys, [LockKey::BigInt(-9), LockKey::BigInt(5), LockKey::Pair(1, 2)]);
/// ```
// Never reorder these variants: the derived `Ord` is the on-database lock order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LockKey {
    /// `pg_advisory_xact_lock(bigint)`.
    BigInt(i64),
    /// `pg_advisory_xact_lock(int4, int4)`: `(class, object)`.
    Pair(i32, i32),
}

/// How a [`LockKey`] appears in a row of `pg_locks` (`locktype = 'advisory'`).
///
/// `classid` and `objid` are `oid` columns, that is unsigned 32-bit integers;
/// `objsubid` is `1` for the bigint key space and `2` for the pair key space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PgLocksId {
    /// `pg_locks.classid`.
    pub classid: u32,
    /// `pg_locks.objid`.
    pub objid: u32,
    /// `pg_locks.objsubid`.
    pub objsubid: i16,
}

impl LockKey {
    /// The key's columns in `pg_locks`.
    ///
    /// ```
    /// use lockkit::LockKey;
    /// use lockkit::key::PgLocksId;
    ///
    /// let id = LockKey::BigInt(-2).to_pg_locks();
    /// assert_eq!(id, PgLocksId { classid: 0xFFFF_FFFF, objid: 0xFFFF_FFFE, objsubid: 1 });
    /// assert_eq!(LockKey::from_pg_locks(id.classid, id.objid, id.objsubid), Some(LockKey::BigInt(-2)));
    /// ```
    pub const fn to_pg_locks(self) -> PgLocksId {
        match self {
            LockKey::BigInt(v) => PgLocksId {
                classid: ((v as u64) >> 32) as u32,
                objid: v as u64 as u32,
                objsubid: 1,
            },
            LockKey::Pair(class, object) => PgLocksId {
                classid: class as u32,
                objid: object as u32,
                objsubid: 2,
            },
        }
    }

    /// The key named by a `pg_locks` row, or `None` when `objsubid` is neither
    /// `1` nor `2` (not an advisory lock taken through these functions).
    pub const fn from_pg_locks(classid: u32, objid: u32, objsubid: i16) -> Option<Self> {
        match objsubid {
            1 => Some(LockKey::BigInt(
                (((classid as u64) << 32) | objid as u64) as i64,
            )),
            2 => Some(LockKey::Pair(classid as i32, objid as i32)),
            _ => None,
        }
    }

    /// For a hashed `BigInt` key, the top 16 bits, which name its namespace
    /// ([`KeySpec::tag`]). `None` for `Pair` keys.
    pub const fn tag(self) -> Option<u16> {
        match self {
            LockKey::BigInt(v) => Some(((v as u64) >> 48) as u16),
            LockKey::Pair(..) => None,
        }
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockKey::BigInt(v) => write!(f, "{v}"),
            LockKey::Pair(c, o) => write!(f, "({c}, {o})"),
        }
    }
}

/// Which key space a [`KeySpec`] produces, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyForm {
    /// A hashed `BigInt` key: namespace tag in the top 16 bits, 48 bits of body.
    BigInt,
    /// A hashed `Pair` key: `(class, low 32 bits of the body)`.
    Pair,
    /// A `Pair` key whose object is the value of the type's single `i32`
    /// field, unhashed (`docs/KEYS.md`, "Exact pair").
    PairExact,
    /// The value is the key, unhashed, for interoperating with SQL that locks
    /// plain ids. Raw keys carry no namespace tag and cannot be traced back to
    /// their type in `pg_locks`.
    Raw,
    /// A `BigInt` key equal to the server's `hashtext(text)`, for SQL that
    /// already locks `pg_advisory_xact_lock(hashtext(...))`. lockkit checks
    /// once per `Locker` (each adapter's) that the client computes what the
    /// connected server computes, and refuses these keys otherwise.
    HashText,
}

/// The static description of a key type: namespace, key space, class and
/// stripes. Every process that locks the type must agree on it, so it is a
/// constant of the type ([`AdvisoryKey::KEY_SPEC`]).
///
/// The `const` constructors check their arguments at compile time when used in
/// a `const` (as `KEY_SPEC` is): an invalid namespace or `stripes(0)` does not
/// build.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeySpec<'n> {
    namespace: &'n str,
    /// `ns_hash(namespace)`, computed by the constructors (at compile time
    /// for a `const` spec) rather than once per key.
    ns_hash: u64,
    /// The body hash's state after its namespace prefix, likewise computed
    /// once: a key hashes only its parts.
    body: Sip24,
    form: KeyForm,
    class: Option<i32>,
    stripes: Option<u64>,
}

// By hand: the hash state derived from the namespace is noise in a message.
impl fmt::Debug for KeySpec<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeySpec")
            .field("namespace", &self.namespace)
            .field("ns_hash", &self.ns_hash)
            .field("form", &self.form)
            .field("class", &self.class)
            .field("stripes", &self.stripes)
            .finish()
    }
}

impl<'n> KeySpec<'n> {
    /// A hashed `BigInt` key in `namespace`.
    ///
    /// # Panics
    ///
    /// When `namespace` is not 1 to 64 bytes of ASCII letters, digits and
    /// `_ . : / -`, or is the reserved `lockkit.semaphore`. In a `const`
    /// this is a compile error; use
    /// [`KeySpec::try_new`] for namespaces known only at run time.
    pub const fn new(namespace: &'n str) -> Self {
        if let Err(e) = namespace::validate(namespace) {
            e.const_panic();
        }
        KeySpec {
            namespace,
            ns_hash: namespace::ns_hash_const(namespace),
            body: namespace::body_prefix(namespace),
            form: KeyForm::BigInt,
            class: None,
            stripes: None,
        }
    }

    /// A hashed `BigInt` key in `namespace`, or why the namespace is invalid.
    ///
    /// # Errors
    ///
    /// [`NamespaceError`] when `namespace` is empty, longer than 64 bytes,
    /// holds a byte other than ASCII letters, digits and `_ . : / -`, or is
    /// the reserved `lockkit.semaphore`.
    pub const fn try_new(namespace: &'n str) -> Result<Self, NamespaceError> {
        match namespace::validate(namespace) {
            Ok(()) => Ok(KeySpec {
                namespace,
                ns_hash: namespace::ns_hash_const(namespace),
                body: namespace::body_prefix(namespace),
                form: KeyForm::BigInt,
                class: None,
                stripes: None,
            }),
            Err(e) => Err(e),
        }
    }

    /// Use the `Pair(i32, i32)` key space.
    pub const fn pair(mut self) -> Self {
        self.form = KeyForm::Pair;
        self
    }

    /// Use the `Pair` key space with an explicit class instead of the one
    /// derived from the namespace.
    ///
    /// # Panics
    ///
    /// When `class` is [`SEMAPHORE_CLASS`], which belongs to the semaphores'
    /// slot keys (KEYS.md, "Semaphore slots"). In a `const` (a derived
    /// type's) this is a compile error.
    pub const fn class(mut self, class: i32) -> Self {
        if class == SEMAPHORE_CLASS {
            panic!("lockkit: class -1439830384 is reserved for semaphore slot keys");
        }
        if matches!(self.form, KeyForm::BigInt) {
            self.form = KeyForm::Pair;
        }
        self.class = Some(class);
        self
    }

    /// Exact pair mode: the key is `(class, value)` for the type's single
    /// `i32` field ([`KeySpec::exact_key`]).
    pub const fn exact(mut self) -> Self {
        self.form = KeyForm::PairExact;
        self
    }

    /// A raw key: the value is the key ([`LockKey`] built by the type itself).
    pub const fn raw(mut self) -> Self {
        self.form = KeyForm::Raw;
        self
    }

    /// A server-`hashtext` key ([`KeyForm::HashText`]).
    pub const fn hashtext(mut self) -> Self {
        self.form = KeyForm::HashText;
        self
    }

    /// Fold every value of the type onto `stripes` keys: the body is replaced
    /// by `body % stripes`.
    ///
    /// # Panics
    ///
    /// When `stripes` is 0 (a compile error in a `const`).
    pub const fn stripes(mut self, stripes: u64) -> Self {
        assert!(stripes > 0, "lockkit: `stripes` must be at least 1");
        self.stripes = Some(stripes);
        self
    }

    /// The namespace.
    pub const fn namespace(&self) -> &'n str {
        self.namespace
    }

    /// The key space and mode.
    pub const fn form(&self) -> KeyForm {
        self.form
    }

    /// The number of stripes, if the type is striped.
    pub const fn stripe_count(&self) -> Option<u64> {
        self.stripes
    }

    /// `ns_hash(namespace)` of `docs/KEYS.md`: SipHash-2-4 of `b"ns\0" ++ namespace`.
    pub fn ns_hash(&self) -> u64 {
        self.ns_hash
    }

    /// The 16-bit tag in the top bits of this type's hashed `BigInt` keys.
    pub fn tag(&self) -> u16 {
        (self.ns_hash() >> 48) as u16
    }

    /// The class of this type's `Pair` keys: explicit, or the high 32 bits of
    /// [`KeySpec::ns_hash`].
    pub fn pair_class(&self) -> i32 {
        match self.class {
            Some(c) => c,
            None => (self.ns_hash() >> 32) as u32 as i32,
        }
    }

    /// The key of a value whose canonical parts are `parts` (a field, a tuple
    /// of fields, or a whole [`KeyPart`] type).
    ///
    /// ```
    /// use lockkit::{KeySpec, LockKey};
    ///
    /// // KEYS.md golden vector: `Order { id: 42 }`.
    /// let spec = KeySpec::new("Order");
    /// assert_eq!(spec.key_of(&42_i64), LockKey::BigInt(-7205368663365046133));
    /// assert_eq!(spec.pair().key_of(&42_i32), LockKey::Pair(-1677652607, 1483026571));
    /// ```
    #[inline(always)]
    pub fn key_of<T: KeyPart + ?Sized>(&self, parts: &T) -> LockKey {
        self.key_with(|p| {
            p.put(parts);
        })
    }

    /// The key of the parts written by `encode`.
    #[inline(always)]
    pub fn key_with(&self, encode: impl FnOnce(&mut Parts<'_>)) -> LockKey {
        let body = crate::key::encoding::body_hash(self.body, encode);
        self.key_from_body(body)
    }

    /// The key for a 64-bit body hash, after striping.
    #[inline(always)]
    fn key_from_body(&self, body: u64) -> LockKey {
        let body = match self.stripes {
            Some(n) => body % n,
            None => body,
        };
        match self.form {
            KeyForm::Pair | KeyForm::PairExact => {
                LockKey::Pair(self.pair_class(), body as u32 as i32)
            }
            KeyForm::BigInt | KeyForm::Raw | KeyForm::HashText => {
                let tag = u64::from(self.tag());
                LockKey::BigInt(((tag << 48) | (body & 0xFFFF_FFFF_FFFF)) as i64)
            }
        }
    }

    /// Exact pair mode: `Pair(class, object)` with `object` unchanged.
    pub fn exact_key(&self, object: i32) -> LockKey {
        LockKey::Pair(self.pair_class(), object)
    }
}

/// A type that can be locked: it names its [`KeySpec`] and maps each value to
/// a [`LockKey`].
///
/// Derive it with `#[derive(AdvisoryKey)]`, or implement it by hand with the
/// same canonical encoder the derive uses:
///
/// ```
/// use lockkit::{AdvisoryKey, KeySpec, LockKey};
///
/// struct Tenanted<'a> { tenant: &'a str, id: u64 }
///
/// impl AdvisoryKey for Tenanted<'_> {
///     const KEY_SPEC: KeySpec<'static> = KeySpec::new("Tenanted");
///     fn lock_key(&self) -> LockKey {
///         // Fields in declaration order; a tuple concatenates its parts.
///         Self::KEY_SPEC.key_of(&(self.tenant, self.id))
///     }
/// }
///
/// // KEYS.md golden vector.
/// let key = Tenanted { tenant: "acme", id: 1001 }.lock_key();
/// assert_eq!(key, LockKey::BigInt(-297873912991975939));
/// ```
pub trait AdvisoryKey {
    /// The type's namespace, key space, class and stripes. Changing it changes
    /// every key of the type: it is part of the on-database protocol.
    const KEY_SPEC: KeySpec<'static>;

    /// The value's lock key.
    ///
    /// Every process must compute the same key for the same value, so a
    /// hand-written implementation should depend on the value alone. A lock
    /// call computes it once and sends that key; the guard it returns
    /// ([`Held::key`](crate::Held::key)) names the key the server granted.
    fn lock_key(&self) -> LockKey;
}

impl<T: AdvisoryKey + ?Sized> AdvisoryKey for &T {
    const KEY_SPEC: KeySpec<'static> = T::KEY_SPEC;
    fn lock_key(&self) -> LockKey {
        (**self).lock_key()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spec's accessors answer what it was built with, and its `Debug`
    /// names the namespace and options without the hash state.
    #[test]
    fn a_spec_shows_what_it_was_built_with() {
        let striped = KeySpec::new("orders").stripes(16);
        assert_eq!(striped.stripe_count(), Some(16));
        assert_eq!(KeySpec::new("orders").stripe_count(), None);
        let shown = format!("{striped:?}");
        for part in ["KeySpec", "\"orders\"", "BigInt", "Some(16)"] {
            assert!(shown.contains(part), "{shown} lacks {part}");
        }
        assert!(!shown.contains("body"), "{shown}");
    }

    #[test]
    fn order_is_keys_md_global_order() {
        let mut keys = vec![
            LockKey::Pair(0, -1),
            LockKey::Pair(-1, 5),
            LockKey::BigInt(i64::MAX),
            LockKey::Pair(-1, -5),
            LockKey::BigInt(i64::MIN),
            LockKey::BigInt(0),
        ];
        keys.sort();
        assert_eq!(
            keys,
            [
                LockKey::BigInt(i64::MIN),
                LockKey::BigInt(0),
                LockKey::BigInt(i64::MAX),
                LockKey::Pair(-1, -5),
                LockKey::Pair(-1, 5),
                LockKey::Pair(0, -1),
            ]
        );
    }

    #[test]
    fn pg_locks_round_trip() {
        for key in [
            LockKey::BigInt(0),
            LockKey::BigInt(-1),
            LockKey::BigInt(i64::MIN),
            LockKey::BigInt(i64::MAX),
            LockKey::BigInt(0x1234_5678_9abc_def0),
            LockKey::Pair(i32::MIN, i32::MAX),
            LockKey::Pair(-1, 0),
        ] {
            let id = key.to_pg_locks();
            assert_eq!(
                LockKey::from_pg_locks(id.classid, id.objid, id.objsubid),
                Some(key)
            );
        }
        let id = LockKey::BigInt(0x1234_5678_9abc_def0).to_pg_locks();
        assert_eq!(
            (id.classid, id.objid, id.objsubid),
            (0x1234_5678, 0x9abc_def0, 1)
        );
        let id = LockKey::Pair(-1677652607, 7).to_pg_locks();
        assert_eq!((id.classid, id.objid, id.objsubid), (0x9c01_0d81, 7, 2));
        assert_eq!(LockKey::from_pg_locks(1, 2, 0), None);
    }

    #[test]
    fn ns_hash_and_tag_of_order() {
        let spec = KeySpec::new("Order");
        // KEYS.md: never change.
        assert_eq!(spec.ns_hash(), 0x9c01_0d81_5759_8ee2);
        assert_eq!(spec.tag(), 0x9c01);
        assert_eq!(spec.key_of(&42_i64).tag(), Some(0x9c01));
    }

    /// KEYS.md golden vectors through manual implementations. Never change.
    #[test]
    fn golden_vectors() {
        let order = KeySpec::new("Order");
        assert_eq!(order.key_of(&42_i64), LockKey::BigInt(-7205368663365046133));
        assert_eq!(
            order.pair().key_of(&42_i64),
            LockKey::Pair(-1677652607, 1483026571)
        );
        assert_eq!(order.key_of(&42_i32), LockKey::BigInt(-7205368663365046133));
        assert_eq!(
            order.pair().key_of(&42_i32),
            LockKey::Pair(-1677652607, 1483026571)
        );

        let event = KeySpec::new("Event");
        assert_eq!(
            event.key_of("a1b2c3d4"),
            LockKey::BigInt(5974391131006264455)
        );
        assert_eq!(
            event.pair().key_of("a1b2c3d4"),
            LockKey::Pair(1391066944, 2027906183)
        );

        let transfer = KeySpec::new("Transfer");
        assert_eq!(
            transfer.key_of(&(7_i64, 3_i64)),
            LockKey::BigInt(-7316124675795688780)
        );
        assert_eq!(
            transfer.pair().key_of(&(7_i64, 3_i64)),
            LockKey::Pair(-1703437380, -1363516748)
        );

        let tenanted = KeySpec::new("Tenanted");
        assert_eq!(
            tenanted.key_of(&("acme", 1001_u64)),
            LockKey::BigInt(-297873912991975939)
        );
        assert_eq!(
            tenanted.pair().key_of(&("acme", 1001_u64)),
            LockKey::Pair(-69385857, 474084861)
        );

        let striped = KeySpec::new("Event").stripes(1024);
        assert_eq!(
            striped.key_of("a1b2c3d4"),
            LockKey::BigInt(5974306380683673735)
        );
        assert_eq!(
            striped.pair().key_of("a1b2c3d4"),
            LockKey::Pair(1391066944, 135)
        );
    }

    #[test]
    fn try_new_rejects_bad_namespaces() {
        assert!(KeySpec::try_new("").is_err());
        assert!(KeySpec::try_new("a b").is_err());
        assert!(KeySpec::try_new(&"x".repeat(65)).is_err());
        assert!(KeySpec::try_new(&"x".repeat(64)).is_ok());
        assert!(KeySpec::try_new("billing.v2/Order:item-1_x").is_ok());
    }
}
