//! The canonical parts encoding of KEYS.md ("Parts: the canonical encoding of
//! a key's fields"), streamed straight into SipHash-2-4: computing a key never
//! allocates.
//!
//! Every tag byte below is part of the on-database protocol. Never change one.

use std::borrow::Cow;
use std::hash::Hasher;
use std::num::{
    NonZeroI128, NonZeroI16, NonZeroI32, NonZeroI64, NonZeroI8, NonZeroIsize, NonZeroU128,
    NonZeroU16, NonZeroU32, NonZeroU64, NonZeroU8, NonZeroUsize,
};
use std::rc::Rc;
use std::sync::Arc;

use siphasher::sip::SipHasher24;

// KEYS.md tag bytes: never change.
const TAG_INT64: u8 = 0x01;
const TAG_INT128: u8 = 0x02;
const TAG_UINT128: u8 = 0x03;
const TAG_BOOL: u8 = 0x04;
const TAG_CHAR: u8 = 0x05;
const TAG_STR: u8 = 0x06;
#[cfg(feature = "uuid")]
const TAG_UUID: u8 = 0x08;
const TAG_OPTION: u8 = 0x09;
const TAG_SEQ: u8 = 0x0A;
const TAG_VARIANT: u8 = 0x0C;

enum Sink<'a> {
    Hash(&'a mut SipHasher24),
    Bytes(&'a mut Vec<u8>),
}

/// The writer a key's fields are encoded into, in declaration order.
///
/// It only accepts canonical elements ([`KeyPart`] values and enum
/// variants), each self-delimiting, so any sequence of them decodes one way:
/// distinct field values cannot produce the same bytes.
pub struct Parts<'a> {
    sink: Sink<'a>,
}

impl core::fmt::Debug for Parts<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Parts").finish_non_exhaustive()
    }
}

impl Parts<'_> {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        match &mut self.sink {
            Sink::Hash(h) => h.write(bytes),
            Sink::Bytes(v) => v.extend_from_slice(bytes),
        }
    }

    /// A tag and its fixed-size payload in one `write`: each call into
    /// SipHash costs more than the few bytes it hashes, and the bytes (so
    /// the keys) are the same either way.
    #[inline]
    fn tagged<const N: usize>(&mut self, tag: u8, payload: [u8; N]) {
        const { assert!(N <= 16, "payloads are at most 16 bytes") };
        let mut buf = [0_u8; 17];
        buf[0] = tag;
        buf[1..=N].copy_from_slice(&payload);
        self.write(&buf[..=N]);
    }

    /// A tag and a `u32le` length, for a variable-length element.
    #[inline]
    fn tagged_len(&mut self, tag: u8, len: usize) {
        // A key part longer than 4 GiB is not a key; saturating keeps this
        // panic-free without a fallible signature.
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        self.tagged(tag, len.to_le_bytes());
    }

    /// Appends one value's canonical encoding.
    #[inline]
    pub fn put<T: KeyPart + ?Sized>(&mut self, value: &T) -> &mut Self {
        value.encode(self);
        self
    }

    /// Appends an enum variant's header: `0C ++ u32le(len) ++ utf8(name)`.
    /// The variant's fields follow with [`Parts::put`].
    #[inline]
    pub fn variant(&mut self, name: &str) -> &mut Self {
        self.tagged_len(TAG_VARIANT, name.len());
        self.write(name.as_bytes());
        self
    }

    /// Appends an integer (any width) by value: `01 ++ i64le` when it fits
    /// `i64`, else `02 ++ i128le`.
    #[inline]
    pub fn int(&mut self, value: i128) -> &mut Self {
        match i64::try_from(value) {
            Ok(v) => self.tagged(TAG_INT64, v.to_le_bytes()),
            Err(_) => self.tagged(TAG_INT128, value.to_le_bytes()),
        }
        self
    }

    /// Appends an unsigned integer (any width) by value; above `i128::MAX` it
    /// is `03 ++ u128le`.
    #[inline]
    pub fn uint(&mut self, value: u128) -> &mut Self {
        match i128::try_from(value) {
            Ok(v) => self.int(v),
            Err(_) => {
                self.tagged(TAG_UINT128, value.to_le_bytes());
                self
            }
        }
    }

    /// Appends a string: `06 ++ u32le(byte length) ++ utf8`.
    #[inline]
    pub fn str(&mut self, value: &str) -> &mut Self {
        self.tagged_len(TAG_STR, value.len());
        self.write(value.as_bytes());
        self
    }

    /// Appends a sequence: `0A ++ u32le(count) ++ enc(each)`.
    #[inline]
    pub fn seq<'i, T: KeyPart + 'i>(
        &mut self,
        items: impl ExactSizeIterator<Item = &'i T>,
    ) -> &mut Self {
        self.tagged_len(TAG_SEQ, items.len());
        for item in items {
            item.encode(self);
        }
        self
    }
}

/// `body(ns, parts) = sip(u32le(len(ns)) ++ ns ++ parts)`.
pub(crate) fn body_hash(ns: &str, encode: impl FnOnce(&mut Parts<'_>)) -> u64 {
    let mut h = crate::namespace::hasher();
    h.write(&(ns.len() as u32).to_le_bytes());
    h.write(ns.as_bytes());
    encode(&mut Parts {
        sink: Sink::Hash(&mut h),
    });
    h.finish()
}

/// The canonical parts bytes of a value (what is hashed after the namespace).
///
/// For tests, tools and debugging; computing a key never builds this buffer.
///
/// ```
/// assert_eq!(lockkit::parts_bytes(&(true, "a")), [0x04, 0x01, 0x06, 1, 0, 0, 0, b'a']);
/// ```
pub fn parts_bytes<T: KeyPart + ?Sized>(value: &T) -> Vec<u8> {
    let mut out = Vec::new();
    value.encode(&mut Parts {
        sink: Sink::Bytes(&mut out),
    });
    out
}

/// A value with a canonical encoding (KEYS.md, "Parts"): a key's field.
///
/// Implemented for integers (by value, whatever their type), `bool`, `char`,
/// strings, `Option`, slices, `Vec`, arrays, tuples (concatenated), references
/// and smart pointers (transparent), `uuid::Uuid` (feature `uuid`), and every
/// `#[derive(AdvisoryKey)]` type (its fields, so key types nest).
///
/// Floats are deliberately not key parts: `NaN != NaN` and `-0.0 == 0.0`
/// make equality, and so mutual exclusion, ambiguous.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be part of a lock key",
    label = "no canonical key encoding for `{Self}`",
    note = "key parts are integers, bool, char, strings, Option, sequences, tuples, uuid::Uuid and #[derive(AdvisoryKey)] types; floats are refused because NaN and -0.0 make equality ambiguous",
    note = "convert the field, or give it a custom encoder with `#[advisory_key(with = \"path::to::fn\")]`"
)]
pub trait KeyPart {
    /// Appends this value's canonical encoding.
    fn encode(&self, parts: &mut Parts<'_>);
}

macro_rules! signed {
    ($($t:ty),*) => {$(
        impl KeyPart for $t {
            #[inline]
            fn encode(&self, parts: &mut Parts<'_>) {
                parts.int(*self as i128);
            }
        }
    )*};
}
signed!(i8, i16, i32, i64, i128, isize);

macro_rules! unsigned {
    ($($t:ty),*) => {$(
        impl KeyPart for $t {
            #[inline]
            fn encode(&self, parts: &mut Parts<'_>) {
                parts.uint(*self as u128);
            }
        }
    )*};
}
unsigned!(u8, u16, u32, u64, u128, usize);

macro_rules! nonzero {
    ($($t:ty),*) => {$(
        impl KeyPart for $t {
            #[inline]
            fn encode(&self, parts: &mut Parts<'_>) {
                self.get().encode(parts);
            }
        }
    )*};
}
nonzero!(
    NonZeroI8,
    NonZeroI16,
    NonZeroI32,
    NonZeroI64,
    NonZeroI128,
    NonZeroIsize,
    NonZeroU8,
    NonZeroU16,
    NonZeroU32,
    NonZeroU64,
    NonZeroU128,
    NonZeroUsize
);

impl KeyPart for bool {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.write(&[TAG_BOOL, u8::from(*self)]);
    }
}

impl KeyPart for char {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.tagged(TAG_CHAR, u32::from(*self).to_le_bytes());
    }
}

impl KeyPart for str {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.str(self);
    }
}

impl KeyPart for String {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.str(self);
    }
}

#[cfg(feature = "uuid")]
impl KeyPart for uuid::Uuid {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.tagged(TAG_UUID, *self.as_bytes());
    }
}

impl<T: KeyPart> KeyPart for Option<T> {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        match self {
            None => parts.write(&[TAG_OPTION, 0]),
            Some(v) => {
                parts.write(&[TAG_OPTION, 1]);
                v.encode(parts);
            }
        }
    }
}

impl<T: KeyPart> KeyPart for [T] {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.seq(self.iter());
    }
}

impl<T: KeyPart, const N: usize> KeyPart for [T; N] {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.seq(self.iter());
    }
}

impl<T: KeyPart> KeyPart for Vec<T> {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.seq(self.iter());
    }
}

macro_rules! transparent {
    ($($ptr:ident),*) => {$(
        impl<T: KeyPart + ?Sized> KeyPart for $ptr<T> {
            #[inline]
            fn encode(&self, parts: &mut Parts<'_>) {
                (**self).encode(parts);
            }
        }
    )*};
}
transparent!(Box, Rc, Arc);

impl<T: KeyPart + ?Sized> KeyPart for &T {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        (**self).encode(parts);
    }
}

impl<T: KeyPart + ?Sized> KeyPart for &mut T {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        (**self).encode(parts);
    }
}

impl<B: KeyPart + ToOwned + ?Sized> KeyPart for Cow<'_, B> {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        (**self).encode(parts);
    }
}

macro_rules! tuple {
    ($($name:ident)*) => {
        impl<$($name: KeyPart),*> KeyPart for ($($name,)*) {
            #[inline]
            #[allow(non_snake_case, unused_variables)]
            fn encode(&self, parts: &mut Parts<'_>) {
                let ($($name,)*) = self;
                $($name.encode(parts);)*
            }
        }
    };
}
tuple!();
tuple!(A);
tuple!(A B);
tuple!(A B C);
tuple!(A B C D);
tuple!(A B C D E);
tuple!(A B C D E F);
tuple!(A B C D E F G);
tuple!(A B C D E F G H);
tuple!(A B C D E F G H I);
tuple!(A B C D E F G H I J);
tuple!(A B C D E F G H I J K);
tuple!(A B C D E F G H I J K L);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_encode_by_value() {
        let one = parts_bytes(&1_u8);
        assert_eq!(one, [1, 1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(parts_bytes(&1_i128), one);
        assert_eq!(parts_bytes(&1_u128), one);
        assert_eq!(parts_bytes(&NonZeroU64::new(1).unwrap()), one);
        assert_eq!(parts_bytes(&-1_i8), parts_bytes(&-1_i64));
        let big = parts_bytes(&(i64::MAX as u64 + 1));
        assert_eq!(big[0], TAG_INT128);
        assert_eq!(big.len(), 17);
        assert_eq!(parts_bytes(&(i64::MAX as u128 + 1)), big);
        let huge = parts_bytes(&u128::MAX);
        assert_eq!(huge[0], TAG_UINT128);
        assert_eq!(&huge[1..], &u128::MAX.to_le_bytes());
        assert_eq!(parts_bytes(&(i128::MAX as u128))[0], TAG_INT128);
    }

    #[test]
    fn table_of_keys_md() {
        assert_eq!(parts_bytes(&false), [4, 0]);
        assert_eq!(parts_bytes(&'é'), [5, 0xe9, 0, 0, 0]);
        assert_eq!(parts_bytes("ab"), [6, 2, 0, 0, 0, b'a', b'b']);
        assert_eq!(parts_bytes(&None::<u8>), [9, 0]);
        assert_eq!(parts_bytes(&Some(true)), [9, 1, 4, 1]);
        assert_eq!(
            parts_bytes(&[true, false][..]),
            [0x0A, 2, 0, 0, 0, 4, 1, 4, 0]
        );
        assert_eq!(parts_bytes(&vec![true, false]), parts_bytes(&[true, false]));
        let mut v = Vec::new();
        Parts {
            sink: Sink::Bytes(&mut v),
        }
        .variant("A")
        .put(&true);
        assert_eq!(v, [0x0C, 1, 0, 0, 0, b'A', 4, 1]);
        let s: Arc<str> = Arc::from("ab");
        assert_eq!(parts_bytes(&s), parts_bytes("ab"));
        assert_eq!(
            parts_bytes(&Cow::Borrowed("ab")),
            parts_bytes(&String::from("ab"))
        );
        assert_eq!(parts_bytes(&Box::new(7_u16)), parts_bytes(&7_i64));
        assert!(parts_bytes(&()).is_empty());
    }

    #[cfg(feature = "uuid")]
    #[test]
    fn uuid_is_rfc_4122_order() {
        let u = uuid::Uuid::from_u128(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff);
        let bytes = parts_bytes(&u);
        assert_eq!(bytes[0], TAG_UUID);
        assert_eq!(
            &bytes[1..],
            &[
                0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
                0xee, 0xff
            ]
        );
    }
}
