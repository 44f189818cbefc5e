//! Namespaces: validation and `ns_hash` (KEYS.md, "Hash").

use core::fmt;

use siphasher::sip::SipHasher24;

/// The SipHash key of key format version 1. Never change: every lock key of
/// every process that ever ran depends on these 16 bytes.
pub(crate) const SIP_KEY: &[u8; 16] = b"lockkit-keys-v1!";

/// The longest namespace, in bytes.
pub const MAX_NAMESPACE_LEN: usize = 64;

/// Why a namespace is not valid: it must be 1 to 64 bytes of ASCII letters,
/// digits and `_ . : / -`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NamespaceError {
    /// The namespace is empty.
    Empty,
    /// The namespace is longer than 64 bytes (holds the length).
    TooLong(usize),
    /// The namespace holds a byte outside ASCII letters, digits and
    /// `_ . : / -` (holds the byte offset).
    InvalidByte(usize),
}

impl fmt::Display for NamespaceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NamespaceError::Empty => f.write_str("namespace is empty; expected 1 to 64 bytes of ASCII letters, digits and `_ . : / -`"),
            NamespaceError::TooLong(n) => write!(f, "namespace is {n} bytes long; at most 64 are allowed"),
            NamespaceError::InvalidByte(at) => write!(
                f,
                "namespace has an invalid character at byte {at}; expected ASCII letters, digits and `_ . : / -`"
            ),
        }
    }
}

impl std::error::Error for NamespaceError {}

impl NamespaceError {
    pub(crate) const fn const_panic(self) -> ! {
        match self {
            NamespaceError::Empty => panic!("lockkit: namespace is empty"),
            NamespaceError::TooLong(_) => panic!("lockkit: namespace is longer than 64 bytes"),
            NamespaceError::InvalidByte(_) => {
                panic!("lockkit: namespace may hold only ASCII letters, digits and `_ . : / -`")
            }
        }
    }
}

/// Checks a namespace against KEYS.md.
pub(crate) const fn validate(ns: &str) -> Result<(), NamespaceError> {
    let bytes = ns.as_bytes();
    if bytes.is_empty() {
        return Err(NamespaceError::Empty);
    }
    if bytes.len() > MAX_NAMESPACE_LEN {
        return Err(NamespaceError::TooLong(bytes.len()));
    }
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if !(b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'/' | b'-')) {
            return Err(NamespaceError::InvalidByte(i));
        }
        i += 1;
    }
    Ok(())
}

pub(crate) fn hasher() -> SipHasher24 {
    SipHasher24::new_with_key(SIP_KEY)
}

/// `ns_hash(ns) = sip(b"ns\0" ++ utf8(ns))`, through `siphasher`: the
/// reference for [`ns_hash_const`].
#[cfg(test)]
fn ns_hash(ns: &str) -> u64 {
    use std::hash::Hasher;
    let mut h = hasher();
    h.write(b"ns\0");
    h.write(ns.as_bytes());
    h.finish()
}

/// `ns_hash(ns) = sip(b"ns\0" ++ utf8(ns))`: SipHash-2-4 keyed with
/// [`SIP_KEY`], as a `const fn` so that [`KeySpec`](crate::KeySpec) computes
/// it once, at compile time, instead of once per key. Tested against
/// `siphasher` below.
pub(crate) const fn ns_hash_const(ns: &str) -> u64 {
    const PREFIX: &[u8; 3] = b"ns\0";
    const fn byte(ns: &[u8], i: usize) -> u8 {
        if i < PREFIX.len() {
            PREFIX[i]
        } else {
            ns[i - PREFIX.len()]
        }
    }
    const fn round(v: &mut [u64; 4]) {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    }
    let ns = ns.as_bytes();
    let k = SIP_KEY;
    let k0 = u64::from_le_bytes([k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7]]);
    let k1 = u64::from_le_bytes([k[8], k[9], k[10], k[11], k[12], k[13], k[14], k[15]]);
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    let len = PREFIX.len() + ns.len();
    let mut i = 0;
    while i + 8 <= len {
        let mut m = 0_u64;
        let mut j = 0;
        while j < 8 {
            m |= (byte(ns, i + j) as u64) << (8 * j);
            j += 1;
        }
        v[3] ^= m;
        round(&mut v);
        round(&mut v);
        v[0] ^= m;
        i += 8;
    }
    let mut last = (len as u64 & 0xff) << 56;
    let mut j = 0;
    while i + j < len {
        last |= (byte(ns, i + j) as u64) << (8 * j);
        j += 1;
    }
    v[3] ^= last;
    round(&mut v);
    round(&mut v);
    v[0] ^= last;
    v[2] ^= 0xff;
    round(&mut v);
    round(&mut v);
    round(&mut v);
    round(&mut v);
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn const_ns_hash_is_siphash_2_4() {
        // KEYS.md: never change.
        assert_eq!(ns_hash_const("Order"), 0x9c01_0d81_5759_8ee2);
        const AT_COMPILE_TIME: u64 = ns_hash_const("Order");
        assert_eq!(AT_COMPILE_TIME, 0x9c01_0d81_5759_8ee2);
        // Every length from 1 to 64 (every tail length, 0 to 8 blocks).
        let long = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:/-";
        for n in 1..=MAX_NAMESPACE_LEN {
            let ns = &long[..n];
            assert_eq!(ns_hash_const(ns), ns_hash(ns), "namespace {ns:?}");
        }
    }
}
