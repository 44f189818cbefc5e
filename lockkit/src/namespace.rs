//! Namespaces: validation and `ns_hash` (KEYS.md, "Hash").

use core::fmt;

use siphasher::sip::SipHasher24;
use std::hash::Hasher;

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

/// `ns_hash(ns) = sip(b"ns\0" ++ utf8(ns))`.
pub(crate) fn ns_hash(ns: &str) -> u64 {
    let mut h = hasher();
    h.write(b"ns\0");
    h.write(ns.as_bytes());
    h.finish()
}
