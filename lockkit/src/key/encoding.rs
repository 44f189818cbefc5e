//! The canonical parts encoding of KEYS.md ("Parts: the canonical encoding of
//! a key's fields"), streamed straight into SipHash-2-4: computing a key never
//! allocates.
//!
//! Every tag byte below is part of the on-database protocol. Never change one.

use std::borrow::Cow;
use std::num::{
    NonZeroI128, NonZeroI16, NonZeroI32, NonZeroI64, NonZeroI8, NonZeroIsize, NonZeroU128,
    NonZeroU16, NonZeroU32, NonZeroU64, NonZeroU8, NonZeroUsize,
};
use std::rc::Rc;
use std::sync::Arc;

use crate::key::sip::Sip24;

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
    Hash(&'a mut Sip24),
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
    #[inline(always)]
    fn write(&mut self, bytes: &[u8]) {
        match &mut self.sink {
            Sink::Hash(h) => h.write(bytes),
            Sink::Bytes(v) => v.extend_from_slice(bytes),
        }
    }

    /// A tag and the low `N` bytes of `payload`, little-endian (`N` at most
    /// 16). The hasher takes them as at most three words straight from
    /// registers: cheaper than a byte buffer (whose unaligned read-back
    /// stalls on the bytes just stored), and the bytes, so the keys, are the
    /// same.
    #[inline(always)]
    fn tagged<const N: u32>(&mut self, tag: u8, payload: u128) {
        const { assert!(N <= 16, "payloads are at most 16 bytes") };
        // Only the low `N` bytes are the payload.
        let payload = match 1_u128.checked_shl(8 * N) {
            Some(bound) => payload & (bound - 1),
            None => payload,
        };
        match &mut self.sink {
            Sink::Hash(h) => {
                // The `N + 1` bytes `tag ++ payload` as little-endian words.
                let first = ((payload << 8) as u64) | u64::from(tag);
                if N < 8 {
                    h.write_word(first, N + 1);
                } else {
                    h.write_word(first, 8);
                    let second = (payload >> 56) as u64;
                    if N < 16 {
                        h.write_word(second, N - 7);
                    } else {
                        h.write_word(second, 8);
                        h.write_word((payload >> 120) as u64, 1);
                    }
                }
            }
            Sink::Bytes(v) => {
                v.push(tag);
                v.extend_from_slice(&payload.to_le_bytes()[..N as usize]);
            }
        }
    }

    /// A tag and a `u32le` length, for a variable-length element.
    #[inline(always)]
    fn tagged_len(&mut self, tag: u8, len: usize) {
        // A key part longer than 4 GiB is not a key; saturating keeps this
        // panic-free without a fallible signature.
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        self.tagged::<4>(tag, u128::from(len));
    }

    /// Appends one value's canonical encoding.
    #[inline(always)]
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
    #[inline(always)]
    pub fn int(&mut self, value: i128) -> &mut Self {
        match i64::try_from(value) {
            Ok(v) => self.tagged::<8>(TAG_INT64, u128::from(v as u64)),
            Err(_) => self.tagged::<16>(TAG_INT128, value as u128),
        }
        self
    }

    /// Appends an unsigned integer (any width) by value; above `i128::MAX` it
    /// is `03 ++ u128le`.
    #[inline(always)]
    pub fn uint(&mut self, value: u128) -> &mut Self {
        match i128::try_from(value) {
            Ok(v) => self.int(v),
            Err(_) => {
                self.tagged::<16>(TAG_UINT128, value);
                self
            }
        }
    }

    /// Appends a string: `06 ++ u32le(byte length) ++ utf8`.
    #[inline(always)]
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

/// `body(ns, parts) = sip(u32le(len(ns)) ++ ns ++ parts)`, from `prefix`, the
/// state after `u32le(len(ns)) ++ ns` ([`crate::key::namespace::body_prefix`]).
#[inline(always)]
pub(crate) fn body_hash(mut prefix: Sip24, encode: impl FnOnce(&mut Parts<'_>)) -> u64 {
    encode(&mut Parts {
        sink: Sink::Hash(&mut prefix),
    });
    prefix.finish()
}

/// The canonical parts bytes of a value (what is hashed after the namespace).
///
/// For tests, tools and debugging; computing a key never builds this buffer.
///
/// ```
/// assert_eq!(lockkit::key::parts_bytes(&(true, "a")), [0x04, 0x01, 0x06, 1, 0, 0, 0, b'a']);
/// ```
pub fn parts_bytes<T: KeyPart + ?Sized>(value: &T) -> Vec<u8> {
    let mut out = Vec::new();
    value.encode(&mut Parts {
        sink: Sink::Bytes(&mut out),
    });
    out
}

/// A value with a canonical encoding (`docs/KEYS.md`, "The canonical encoding"): a key's field.
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
        parts.tagged::<1>(TAG_BOOL, u128::from(*self));
    }
}

impl KeyPart for char {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.tagged::<4>(TAG_CHAR, u128::from(u32::from(*self)));
    }
}

impl KeyPart for str {
    #[inline(always)]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.str(self);
    }
}

impl KeyPart for String {
    #[inline(always)]
    fn encode(&self, parts: &mut Parts<'_>) {
        parts.str(self);
    }
}

#[cfg(feature = "uuid")]
impl KeyPart for uuid::Uuid {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        // RFC 4122 byte order: the bytes as they are, read little-endian.
        parts.tagged::<16>(TAG_UUID, u128::from_le_bytes(*self.as_bytes()));
    }
}

impl<T: KeyPart> KeyPart for Option<T> {
    #[inline]
    fn encode(&self, parts: &mut Parts<'_>) {
        match self {
            None => parts.tagged::<1>(TAG_OPTION, 0),
            Some(v) => {
                parts.tagged::<1>(TAG_OPTION, 1);
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

    /// `Parts` shows its name only: the hash state is noise in a message.
    #[test]
    fn parts_show_their_name() {
        struct Shown(std::cell::RefCell<String>);
        impl KeyPart for Shown {
            fn encode(&self, parts: &mut Parts<'_>) {
                *self.0.borrow_mut() = format!("{parts:?}");
            }
        }
        let shown = Shown(Default::default());
        parts_bytes(&shown);
        assert_eq!(shown.0.into_inner(), "Parts { .. }");
    }

    /// A UUID is its 16 bytes in RFC 4122 order, after its tag.
    #[cfg(feature = "uuid")]
    #[test]
    fn a_uuid_is_its_bytes_in_rfc_4122_order() {
        let bytes: [u8; 16] = core::array::from_fn(|i| i as u8 + 1);
        let encoded = parts_bytes(&uuid::Uuid::from_bytes(bytes));
        assert_eq!(encoded[0], TAG_UUID);
        assert_eq!(encoded[1..], bytes);
    }

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

    /// The hashing sink hashes exactly the bytes the collecting sink
    /// collects: `body_hash` from the compile-time prefix state equals
    /// `siphasher` over `u32le(len(ns)) ++ ns ++ parts_bytes`, for every
    /// element kind, at every alignment of the pending bytes.
    #[test]
    fn hashed_parts_are_the_collected_parts() {
        use std::hash::Hasher;

        fn check<T: KeyPart + ?Sized + core::fmt::Debug>(value: &T) {
            let long = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:/-";
            for n in 1..=crate::key::MAX_NAMESPACE_LEN {
                let ns = &long[..n];
                let mut reference = siphasher::sip::SipHasher24::new_with_key(SIP_KEY);
                reference.write(&(n as u32).to_le_bytes());
                reference.write(ns.as_bytes());
                reference.write(&parts_bytes(value));
                let ours = body_hash(crate::key::namespace::body_prefix(ns), |p| {
                    p.put(value);
                });
                assert_eq!(ours, reference.finish(), "{value:?} in {ns:?}");
            }
        }

        use crate::key::namespace::SIP_KEY;
        for v in [0_i64, 1, -1, 42, i64::MIN, i64::MAX, 0x0102_0304_0506_0708] {
            check(&v);
            check(&(v, v as u8, true, v));
        }
        for v in [
            i128::MIN,
            i64::MIN as i128 - 1,
            i64::MAX as i128 + 1,
            i128::MAX,
        ] {
            check(&v);
            check(&(false, v, 'x'));
        }
        for v in [u128::MAX, i128::MAX as u128 + 1, u64::MAX as u128] {
            check(&v);
            check(&(7_u8, v, Some(v)));
        }
        for c in ['\0', 'a', 'é', '\u{10FFFF}'] {
            check(&c);
            check(&(c, c, None::<u8>));
        }
        let text = "0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz";
        for len in 0..=text.len() {
            check(&text[..len]);
            check(&(true, &text[..len], len as u64, [&text[..len / 2]]));
        }
        check(&vec![Some(1_u16), None, Some(3)]);
        let mut prefix = crate::key::namespace::body_prefix("Order");
        let mut expected = siphasher::sip::SipHasher24::new_with_key(SIP_KEY);
        expected.write(&5_u32.to_le_bytes());
        expected.write(b"Order");
        let mut v = Vec::new();
        Parts {
            sink: Sink::Bytes(&mut v),
        }
        .variant("Variant")
        .put(&1_u8);
        expected.write(&v);
        Parts {
            sink: Sink::Hash(&mut prefix),
        }
        .variant("Variant")
        .put(&1_u8);
        assert_eq!(prefix.finish(), expected.finish());
    }

    #[cfg(feature = "uuid")]
    #[test]
    fn uuid_hashes_as_collected() {
        use std::hash::Hasher;
        let u = uuid::Uuid::from_u128(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff);
        for ns in ["D", "Doc", "Document", "Documents"] {
            let mut reference =
                siphasher::sip::SipHasher24::new_with_key(crate::key::namespace::SIP_KEY);
            reference.write(&(ns.len() as u32).to_le_bytes());
            reference.write(ns.as_bytes());
            reference.write(&parts_bytes(&(u, Some(u))));
            let ours = body_hash(crate::key::namespace::body_prefix(ns), |p| {
                p.put(&(u, Some(u)));
            });
            assert_eq!(ours, reference.finish(), "{ns}");
        }
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

    /// `tagged` for every payload width the format allows, not only the
    /// widths today's key parts use (1, 4, 8 and 16 bytes): the hashed
    /// bytes are the collected ones.
    #[test]
    fn tagged_hashes_what_it_collects_for_every_width() {
        use std::hash::Hasher;

        use crate::key::namespace::SIP_KEY;

        fn both<const N: u32>(tag: u8, payload: u128) {
            let mut bytes = Vec::new();
            Parts {
                sink: Sink::Bytes(&mut bytes),
            }
            .tagged::<N>(tag, payload);
            assert_eq!(bytes.len(), N as usize + 1);
            let mut reference = siphasher::sip::SipHasher24::new_with_key(SIP_KEY);
            reference.write(&bytes);
            let mut ours = crate::key::sip::Sip24::new(SIP_KEY);
            Parts {
                sink: Sink::Hash(&mut ours),
            }
            .tagged::<N>(tag, payload);
            assert_eq!(ours.finish(), reference.finish(), "N = {N}");
        }
        let payload = 0x0f0e_0d0c_0b0a_0908_0706_0504_0302_0100_u128;
        both::<9>(7, payload);
        both::<10>(7, payload);
        both::<11>(7, payload);
        both::<12>(7, payload);
        both::<13>(7, payload);
        both::<14>(7, payload);
        both::<15>(7, payload);
    }

    /// References are transparent: `&T` and `&mut T` encode as `T`.
    #[test]
    fn references_encode_as_their_value() {
        let mut v = 42_i64;
        let expected = parts_bytes(&42_i64);
        assert_eq!(parts_bytes(&&v), expected);
        assert_eq!(parts_bytes(&&mut v), expected);
    }
}
