//! Namespaces: validation and `ns_hash` (KEYS.md, "Hash").

use core::fmt;

use crate::key::sip::Sip24;

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
    /// The namespace is `lockkit.semaphore`, whose `Pair` class belongs to
    /// the semaphores' slot keys (KEYS.md, "Semaphore slots").
    Reserved,
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
            NamespaceError::Reserved => f.write_str(
                "namespace `lockkit.semaphore` is reserved for the semaphores' slot keys",
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
            NamespaceError::Reserved => {
                panic!("lockkit: namespace `lockkit.semaphore` is reserved for semaphore slot keys")
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
    if is_reserved(bytes) {
        return Err(NamespaceError::Reserved);
    }
    Ok(())
}

/// Whether `ns` is `lockkit.semaphore` (a `const fn`, so compared by hand).
const fn is_reserved(ns: &[u8]) -> bool {
    let reserved = super::semaphore::SEMAPHORE_NAMESPACE.as_bytes();
    if ns.len() != reserved.len() {
        return false;
    }
    let mut i = 0;
    while i < ns.len() {
        if ns[i] != reserved[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// `ns_hash(ns) = sip(b"ns\0" ++ utf8(ns))`, through `siphasher`: the
/// reference for [`ns_hash_const`].
#[cfg(test)]
fn ns_hash(ns: &str) -> u64 {
    use std::hash::Hasher;
    let mut h = siphasher::sip::SipHasher24::new_with_key(SIP_KEY);
    h.write(b"ns\0");
    h.write(ns.as_bytes());
    h.finish()
}

/// `ns_hash(ns) = sip(b"ns\0" ++ utf8(ns))`: SipHash-2-4 keyed with
/// [`SIP_KEY`], as a `const fn` so that [`KeySpec`](crate::KeySpec) computes
/// it once, at compile time, instead of once per key. Tested against
/// `siphasher` below.
pub(crate) const fn ns_hash_const(ns: &str) -> u64 {
    let mut h = Sip24::new(SIP_KEY);
    h.write(b"ns\0");
    h.write(ns.as_bytes());
    h.finish()
}

/// The SipHash-2-4 state after absorbing the constant prefix of every body
/// hash in `ns`, `u32le(len(utf8(ns))) ++ utf8(ns)` (KEYS.md, "Hash"): each
/// key of the namespace hashes only its parts from there. A `const fn`, so a
/// `const` [`KeySpec`](crate::KeySpec) computes it at compile time.
pub(crate) const fn body_prefix(ns: &str) -> Sip24 {
    let mut h = Sip24::new(SIP_KEY);
    // A namespace is at most 64 bytes (`validate`), so the cast is exact.
    h.write(&(ns.len() as u32).to_le_bytes());
    h.write(ns.as_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each namespace error says what is wrong, with the length or the
    /// byte's offset.
    #[test]
    fn namespace_errors_say_what_is_wrong() {
        assert!(NamespaceError::Empty.to_string().contains("empty"));
        assert!(NamespaceError::TooLong(70)
            .to_string()
            .contains("70 bytes long"));
        assert!(NamespaceError::InvalidByte(3)
            .to_string()
            .contains("at byte 3"));
    }

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

    #[test]
    fn body_prefix_is_siphash_2_4_of_the_prefix() {
        use std::hash::Hasher;
        let long = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:/-";
        for n in 1..=MAX_NAMESPACE_LEN {
            let ns = &long[..n];
            let mut reference = siphasher::sip::SipHasher24::new_with_key(SIP_KEY);
            reference.write(&(n as u32).to_le_bytes());
            reference.write(ns.as_bytes());
            assert_eq!(
                body_prefix(ns).finish(),
                reference.finish(),
                "namespace {ns:?}"
            );
        }
    }
}
