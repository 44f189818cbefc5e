//! The keys of a semaphore's slots (KEYS.md, "Semaphore slots"): a
//! semaphore of `permits` permits named by a key holds at most one of its
//! `permits` slot keys per holder, so at most `permits` holders at once.

use super::namespace::{ns_hash_const, SIP_KEY};
use super::sip::Sip24;
use super::LockKey;

/// The namespace whose `Pair` class every semaphore slot key carries:
/// `lockkit inspect` tells a slot by it.
pub const SEMAPHORE_NAMESPACE: &str = "lockkit.semaphore";

/// The class (`pg_locks.classid`) of every semaphore slot key: the upper 32
/// bits of `ns_hash("lockkit.semaphore")`, the class a `Pair` key type of
/// that namespace has.
pub const SEMAPHORE_CLASS: i32 = (ns_hash_const(SEMAPHORE_NAMESPACE) >> 32) as u32 as i32;

/// The most permits a semaphore has: its slot is the low 8 bits of the
/// slot key's object.
pub const MAX_PERMITS: u8 = u8::MAX;

/// The object of slot 0 of the semaphore named by `key`: the top 24 bits of
/// `sip("semaphore" ++ 0x00 ++ enc(key))`, shifted left 8 bits, where
/// `enc(BigInt(k)) = 01 ++ i64le(k)` and `enc(Pair(c, o)) = 02 ++ i32le(c)
/// ++ i32le(o)`. Slot `s` is this with its low 8 bits `s`.
pub const fn semaphore_base(key: LockKey) -> i32 {
    let mut h = Sip24::new(SIP_KEY);
    h.write(b"semaphore\0");
    match key {
        LockKey::BigInt(k) => {
            h.write(&[0x01]);
            h.write(&k.to_le_bytes());
        }
        LockKey::Pair(c, o) => {
            h.write(&[0x02]);
            h.write(&c.to_le_bytes());
            h.write(&o.to_le_bytes());
        }
    }
    (((h.finish() >> 40) as u32) << 8) as i32
}

/// The key of slot `slot` of the semaphore named by `key`:
/// `Pair(SEMAPHORE_CLASS, semaphore_base(key) | slot)`.
///
/// ```
/// use lockkit::key::{semaphore_of, semaphore_slot, SEMAPHORE_CLASS};
/// use lockkit::LockKey;
///
/// let slot = semaphore_slot(LockKey::BigInt(42), 3);
/// let LockKey::Pair(class, _) = slot else { unreachable!() };
/// assert_eq!(class, SEMAPHORE_CLASS);
/// assert_eq!(semaphore_of(slot).map(|(_, s)| s), Some(3));
/// ```
pub const fn semaphore_slot(key: LockKey, slot: u8) -> LockKey {
    LockKey::Pair(SEMAPHORE_CLASS, semaphore_base(key) | slot as i32)
}

/// The semaphore (its slot-0 object, [`semaphore_base`]) and the slot a
/// semaphore slot key stands for; `None` for any other key.
pub const fn semaphore_of(key: LockKey) -> Option<(i32, u8)> {
    match key {
        LockKey::Pair(SEMAPHORE_CLASS, object) => Some((object & !0xFF, (object & 0xFF) as u8)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The class is the one a `Pair` type of the namespace gets, and the
    /// base is the sip of the documented bytes.
    #[test]
    fn slots_are_the_documented_hash() {
        use std::hash::Hasher;
        let ns = {
            let mut h = siphasher::sip::SipHasher24::new_with_key(SIP_KEY);
            h.write(b"ns\0lockkit.semaphore");
            h.finish()
        };
        assert_eq!(SEMAPHORE_CLASS, (ns >> 32) as u32 as i32);
        let sip = |bytes: &[u8]| {
            let mut h = siphasher::sip::SipHasher24::new_with_key(SIP_KEY);
            h.write(bytes);
            h.finish()
        };
        let mut bytes = b"semaphore\0\x01".to_vec();
        bytes.extend_from_slice(&(-7_i64).to_le_bytes());
        assert_eq!(
            semaphore_base(LockKey::BigInt(-7)),
            (((sip(&bytes) >> 40) as u32) << 8) as i32
        );
        let mut bytes = b"semaphore\0\x02".to_vec();
        bytes.extend_from_slice(&5_i32.to_le_bytes());
        bytes.extend_from_slice(&(-9_i32).to_le_bytes());
        assert_eq!(
            semaphore_base(LockKey::Pair(5, -9)),
            (((sip(&bytes) >> 40) as u32) << 8) as i32
        );
        // The two key spaces name different semaphores.
        assert_ne!(
            semaphore_base(LockKey::BigInt(0)),
            semaphore_base(LockKey::Pair(0, 0))
        );
        for slot in [0, 1, 200, 254] {
            let key = semaphore_slot(LockKey::BigInt(9), slot);
            assert_eq!(
                semaphore_of(key),
                Some((semaphore_base(LockKey::BigInt(9)), slot))
            );
        }
        assert_eq!(semaphore_of(LockKey::BigInt(9)), None);
        // The statement that tries the slots names this class.
        assert!(crate::engine::sql::TRY_PERMIT
            .contains(&format!("pg_try_advisory_xact_lock({SEMAPHORE_CLASS}, ")));
    }
}
