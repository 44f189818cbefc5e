//! PostgreSQL's `hashtext(text) -> int4`, computed client side.
//!
//! Code that already locks with `pg_advisory_xact_lock(hashtext(business_key))`
//! in SQL can compute the same key in Rust with [`hashtext_key`], so such keys
//! can be sorted into lockkit's global lock order and batched with other keys.
//!
//! The hash is `hash_bytes()` of PostgreSQL's `src/common/hashfn.c` (Bob
//! Jenkins' 2006 "lookup3" hash with PostgreSQL's own initial value), which
//! `hashtext` applies to the bytes of the text value when its collation is
//! deterministic. The little-endian test vectors below were measured on a
//! PostgreSQL 15 server. See [`hashtext`] for what must match the server.

use crate::LockKey;

/// The byte order of the PostgreSQL server's build, which decides the value
/// of `hashtext`.
///
/// # Byte order
///
/// `hash_bytes()` reads the text as 32-bit words in the server's native byte
/// order (`WORDS_BIGENDIAN` in PostgreSQL's build), so the same text hashes
/// to different values on little- and big-endian servers. Every mainstream
/// server platform (x86-64, AArch64 as configured by Linux, macOS and
/// Windows, POWER in `ppc64le` mode) is little-endian: that is the default of
/// [`hashtext`] and [`hashtext_key`]. Use [`ByteOrder::Big`] only for a
/// big-endian server, such as IBM Z (`s390x`) or big-endian POWER/SPARC.
/// To tell which one a server is, run `SELECT hashtext('a')`: `1075015857` on
/// a little-endian server, `-887099196` on a big-endian one. (Values whose
/// bytes read the same both ways, such as `''` or `'xxxx'`, hash the same on
/// both.)
///
/// The byte order of the client computing the hash does not matter: both
/// variants give the same results on every client.
///
/// ```
/// use lockkit::key::{hashtext, hashtext_with, ByteOrder};
///
/// assert_eq!(hashtext_with(ByteOrder::Little, "a"), hashtext("a"));
/// assert_eq!(hashtext_with(ByteOrder::Little, "a"), 1_075_015_857);
/// assert_eq!(hashtext_with(ByteOrder::Big, "a"), -887_099_196);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ByteOrder {
    /// A little-endian server (x86-64, AArch64, `ppc64le`, ...): the default.
    #[default]
    Little,
    /// A big-endian server (`WORDS_BIGENDIAN`: `s390x`, big-endian POWER or
    /// SPARC, ...).
    Big,
}

/// PostgreSQL's `hashtext(s)` on a little-endian server with a `UTF8`
/// database, as a signed `int4` exactly as SQL returns it.
///
/// This is `hash_any()` of the UTF-8 bytes of `s`.
///
/// # Matching the server
///
/// - **Encoding.** The server hashes the value's bytes in the database
///   encoding. This function hashes the UTF-8 bytes of a `&str`, which is
///   what a `UTF8` database stores. For a database in another encoding (say
///   `LATIN1`), hash the bytes in that encoding with [`hash_bytes`]; ASCII
///   text has the same bytes in every server encoding.
/// - **Collation.** With a nondeterministic collation (an ICU collation
///   created with `deterministic = false`), `hashtext` hashes a collation sort
///   key instead of the bytes; that is not reproduced here. A database's
///   default collation is always deterministic.
/// - **Byte order.** See below.
///
/// # Byte order
///
/// The value depends on the server's byte order; this function gives the
/// little-endian value, which is right for every mainstream server. For a
/// big-endian server use [`hashtext_with`] and [`ByteOrder::Big`].
///
/// ```
/// use lockkit::key::hashtext;
///
/// // SELECT hashtext('payroll-1405-01');  --> -1493109243
/// assert_eq!(hashtext("payroll-1405-01"), -1_493_109_243);
/// assert_eq!(hashtext(""), -1_477_818_771);
/// ```
#[must_use]
pub const fn hashtext(s: &str) -> i32 {
    hashtext_with(ByteOrder::Little, s)
}

/// PostgreSQL's `hashtext(s)` on a server of the given byte order with a
/// `UTF8` database, as a signed `int4` exactly as SQL returns it.
///
/// # Byte order
///
/// `order` is the byte order of the **server** (see [`ByteOrder`]), never
/// that of the machine running this code.
///
/// ```
/// use lockkit::key::{hashtext_with, ByteOrder};
///
/// assert_eq!(hashtext_with(ByteOrder::Little, "payroll-1405-01"), -1_493_109_243);
/// assert_eq!(hashtext_with(ByteOrder::Big, "payroll-1405-01"), 744_977_484);
/// ```
#[must_use]
pub const fn hashtext_with(order: ByteOrder, s: &str) -> i32 {
    // hashtext() returns hash_any()'s uint32 as an int4: reinterpret the bits.
    hash_bytes(order, s.as_bytes()) as i32
}

/// PostgreSQL's `hash_bytes(k, len)` (`hash_any()`): the unsigned 32-bit hash
/// of raw bytes, on a server of the given byte order.
///
/// `hashtext` of a text value is this hash of the value's bytes in the
/// database encoding, reinterpreted as a signed `int4`; use this function
/// directly for a database whose encoding is not `UTF8`.
///
/// # Byte order
///
/// `order` is the byte order of the **server** (see [`ByteOrder`]).
///
/// ```
/// use lockkit::key::{hash_bytes, hashtext, ByteOrder};
///
/// // "Zürich" in a LATIN1 database: 'ü' is the single byte 0xFC there.
/// let latin1 = hash_bytes(ByteOrder::Little, b"Z\xFCrich") as i32;
/// assert_ne!(latin1, hashtext("Zürich"));
/// assert_eq!(hash_bytes(ByteOrder::Little, b"abc") as i32, hashtext("abc"));
/// ```
#[must_use]
pub const fn hash_bytes(order: ByteOrder, bytes: &[u8]) -> u32 {
    // `keylen` is a C `int` converted to `uint32`. A text value is below
    // 1 GiB, so its length always fits; a longer slice (never a text value)
    // just wraps, without panicking.
    let init = 0x9e37_79b9_u32
        .wrapping_add(bytes.len() as u32)
        .wrapping_add(3_923_095);
    let (mut a, mut b, mut c) = (init, init, init);

    // Handle most of the key: whole 12-byte blocks, read as three words in
    // the server's byte order (identical on the aligned and unaligned paths).
    let mut rest = bytes;
    while let Some((block, tail)) = rest.split_first_chunk::<12>() {
        a = a.wrapping_add(word(order, block[0], block[1], block[2], block[3]));
        b = b.wrapping_add(word(order, block[4], block[5], block[6], block[7]));
        c = c.wrapping_add(word(order, block[8], block[9], block[10], block[11]));
        (a, b, c) = mix(a, b, c);
        rest = tail;
    }

    // Handle the last 0..=11 bytes. Both C switch statements amount to
    // zero-padding the tail to 12 bytes and reading three words, except that
    // the lowest-order byte of `c` is "reserved for the length" and gets no
    // data: on a little-endian server bytes 8..=10 go to bits 8..=31 of `c`;
    // on a big-endian one they go to bits 31..=8, which is the plain
    // big-endian word of the zero-padded bytes 8..=11.
    let mut pad = [0_u8; 12];
    let mut i = 0;
    while i < rest.len() && i < pad.len() {
        pad[i] = rest[i];
        i += 1;
    }
    a = a.wrapping_add(word(order, pad[0], pad[1], pad[2], pad[3]));
    b = b.wrapping_add(word(order, pad[4], pad[5], pad[6], pad[7]));
    c = c.wrapping_add(match order {
        ByteOrder::Little => u32::from_le_bytes([pad[8], pad[9], pad[10], 0]) << 8,
        ByteOrder::Big => u32::from_be_bytes([pad[8], pad[9], pad[10], 0]),
    });

    final_mix(a, b, c)
}

/// `pg_advisory_xact_lock(hashtext(s))` as a [`LockKey`], for a little-endian
/// server with a `UTF8` database.
///
/// SQL resolves `pg_advisory_xact_lock(hashtext(s))` to the **bigint**
/// overload, sign-extending the `int4` hash, so the key is
/// `LockKey::BigInt(i64::from(hashtext(s)))`: never the `(int4, int4)` pair
/// key space. Lock the same key from Rust and from existing SQL and the two
/// exclude each other.
///
/// # Byte order
///
/// This is the little-endian value, right for every mainstream server; for a
/// big-endian server use [`hashtext_key_with`].
///
/// ```
/// use lockkit::LockKey;
/// use lockkit::key::{hashtext, hashtext_key};
///
/// let key = hashtext_key("payroll-1405-01");
/// assert_eq!(key, LockKey::BigInt(i64::from(hashtext("payroll-1405-01"))));
/// assert_eq!(key, LockKey::BigInt(-1_493_109_243));
/// ```
#[must_use]
pub const fn hashtext_key(s: &str) -> LockKey {
    hashtext_key_with(ByteOrder::Little, s)
}

/// `pg_advisory_xact_lock(hashtext(s))` as a [`LockKey`], for a server of the
/// given byte order with a `UTF8` database: `LockKey::BigInt` of the
/// sign-extended [`hashtext_with`].
///
/// # Byte order
///
/// `order` is the byte order of the **server** (see [`ByteOrder`]).
///
/// ```
/// use lockkit::LockKey;
/// use lockkit::key::{hashtext_key_with, ByteOrder};
///
/// assert_eq!(hashtext_key_with(ByteOrder::Big, "a"), LockKey::BigInt(-887_099_196));
/// ```
#[must_use]
pub const fn hashtext_key_with(order: ByteOrder, s: &str) -> LockKey {
    // Sign extension, as SQL's implicit int4 -> bigint cast (`i64::from` is
    // not callable in a const fn).
    LockKey::BigInt(hashtext_with(order, s) as i64)
}

/// Four bytes, in data order, as a word in the server's byte order.
const fn word(order: ByteOrder, b0: u8, b1: u8, b2: u8, b3: u8) -> u32 {
    match order {
        ByteOrder::Little => u32::from_le_bytes([b0, b1, b2, b3]),
        ByteOrder::Big => u32::from_be_bytes([b0, b1, b2, b3]),
    }
}

/// hashfn.c's `mix(a, b, c)`.
const fn mix(mut a: u32, mut b: u32, mut c: u32) -> (u32, u32, u32) {
    a = a.wrapping_sub(c);
    a ^= c.rotate_left(4);
    c = c.wrapping_add(b);
    b = b.wrapping_sub(a);
    b ^= a.rotate_left(6);
    a = a.wrapping_add(c);
    c = c.wrapping_sub(b);
    c ^= b.rotate_left(8);
    b = b.wrapping_add(a);
    a = a.wrapping_sub(c);
    a ^= c.rotate_left(16);
    c = c.wrapping_add(b);
    b = b.wrapping_sub(a);
    b ^= a.rotate_left(19);
    a = a.wrapping_add(c);
    c = c.wrapping_sub(b);
    c ^= b.rotate_left(4);
    b = b.wrapping_add(a);
    (a, b, c)
}

/// hashfn.c's `final(a, b, c)`, returning `c`.
const fn final_mix(mut a: u32, mut b: u32, mut c: u32) -> u32 {
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(14));
    a ^= c;
    a = a.wrapping_sub(c.rotate_left(11));
    b ^= a;
    b = b.wrapping_sub(a.rotate_left(25));
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(16));
    a ^= c;
    a = a.wrapping_sub(c.rotate_left(4));
    b ^= a;
    b = b.wrapping_sub(a.rotate_left(14));
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(24));
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::PgLocksId;

    /// `SELECT hashtext(s)` measured on PostgreSQL 15.18 (Debian 15.18,
    /// x86_64, little-endian), database encoding `UTF8`, locale `C.UTF-8`.
    const MEASURED_LITTLE_ENDIAN: &[(&str, i32)] = &[
        ("", -1477818771),
        ("a", 1075015857),
        ("ab", 1718550461),
        ("abc", -785388649),
        ("abcd", -393934804),
        ("abcde", -445659580),
        ("abcdef", -1747460160),
        ("abcdefg", 501636814),
        ("abcdefgh", -1960928205),
        ("abcdefghi", -92131489),
        ("abcdefghij", 1948051852),
        ("abcdefghijk", -1483803693),
        ("abcdefghijkl", -1586087212),
        ("abcdefghijklm", 405849808),
        ("abcdefghijklmn", 315215413),
        ("abcdefghijklmno", -1389283689),
        ("abcdefghijklmnop", -2079749669),
        ("abcdefghijklmnopq", 1648114242),
        ("abcdefghijklmnopqr", -952297252),
        ("abcdefghijklmnopqrs", -684650393),
        ("abcdefghijklmnopqrst", 766334193),
        ("abcdefghijklmnopqrstu", 2124303250),
        ("abcdefghijklmnopqrstuv", -50608962),
        ("abcdefghijklmnopqrstuvw", -1149376136),
        ("abcdefghijklmnopqrstuvwx", 1251586959),
        ("abcdefghijklmnopqrstuvwxy", 980150893),
        ("é", -983094517),
        ("ÿ", -651125260),
        ("😀", 1734229978),
        ("日本語", 554517316),
        ("Zürich-Straße", -726815734),
        ("ééééé", -2059020057),
        ("ÿÿÿÿÿÿ", 1606049923),
        ("€€€€€€€€€€€€€€€€€€€€€€€€€€€€€€€€€€€€", -758179611),
        ("注文-2024-東京", -788538414),
        ("🦀🐘", -1202731116),
        (
            "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789",
            37821613,
        ),
        ("payroll-1405-01", -1493109243),
        ("payroll-1405-02", -890795034),
        ("PAYROLL-1405-01", 338481902),
        ("invoice:42", 761680324),
        ("tenant/7f3a9c/order/100001", 400053827),
        ("user@example.com", 1805580667),
        ("hello world", 1021725223),
        (" ", 1206411442),
        ("x", 1074944137),
        ("xxxxxxxxxxx", -1494243903),
        ("xxxxxxxxxxxx", 631527812),
        ("xxxxxxxxxxxxxxxxxxxxxxx", 597544042),
        ("xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", -260526245),
    ];

    /// Big-endian values: DERIVED, NOT MEASURED (no big-endian server was
    /// available). They were worked out from hashfn.c's `WORDS_BIGENDIAN`
    /// branches as implemented above, and cross-checked by compiling a
    /// transcription of `hash_bytes()` with `WORDS_BIGENDIAN` defined and the
    /// key at an odd address, so that the unaligned big-endian path ran: that
    /// path reads every byte with explicit shifts, so its result does not
    /// depend on the host's byte order (and hashfn.c's aligned path gives the
    /// same result on a big-endian host). The same transcription without
    /// `WORDS_BIGENDIAN` reproduced every measured little-endian value on both
    /// its aligned and unaligned paths.
    const DERIVED_BIG_ENDIAN: &[(&str, i32)] = &[
        ("", -1477818771),
        ("a", -887099196),
        ("ab", 1538399343),
        ("abc", 1813621039),
        ("abcd", 988143241),
        ("abcde", 165474242),
        ("abcdef", -1928001325),
        ("abcdefg", -415015721),
        ("abcdefgh", -722554068),
        ("abcdefghi", 91601365),
        ("abcdefghij", -421007426),
        ("abcdefghijk", 914273936),
        ("abcdefghijkl", -1045120825),
        ("abcdefghijklm", 206833211),
        ("abcdefghijklmnopqrstuvwxy", -862448703),
        ("é", 927373849),
        ("😀", -1959927938),
        ("日本語", -1751873065),
        ("payroll-1405-01", 744977484),
        (
            "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789",
            -1486803688,
        ),
        // Bytes that read the same in either order hash the same: a check of
        // the tail handling, where `c`'s low byte stays free in both orders.
        ("xxxxxxxxxxx", -1494243903),
        ("xxxxxxxxxxxx", 631527812),
    ];

    #[test]
    fn little_endian_matches_postgresql_15() {
        for &(s, expected) in MEASURED_LITTLE_ENDIAN {
            assert_eq!(hashtext(s), expected, "hashtext({s:?})");
            assert_eq!(hashtext_with(ByteOrder::Little, s), expected, "{s:?}");
            assert_eq!(hash_bytes(ByteOrder::Little, s.as_bytes()) as i32, expected);
        }
    }

    #[test]
    fn big_endian_matches_derived_vectors() {
        for &(s, expected) in DERIVED_BIG_ENDIAN {
            assert_eq!(hashtext_with(ByteOrder::Big, s), expected, "{s:?}");
        }
    }

    #[test]
    fn vectors_cover_every_tail_length_and_several_blocks() {
        let mut tails = [false; 12];
        for &(s, _) in MEASURED_LITTLE_ENDIAN {
            tails[s.len() % 12] = true;
        }
        assert_eq!(tails, [true; 12]);
        assert!(MEASURED_LITTLE_ENDIAN.iter().any(|&(s, _)| s.len() == 100));
        assert!(MEASURED_LITTLE_ENDIAN.iter().any(|&(s, _)| s.len() > 24));
        assert!(DERIVED_BIG_ENDIAN.iter().any(|&(s, _)| s.is_empty()));
    }

    #[test]
    fn long_value_matches_postgresql_15() {
        // SELECT hashtext(repeat('ab', 500));  -- 1000 bytes
        assert_eq!(hashtext(&"ab".repeat(500)), 135141396);
    }

    #[test]
    fn byte_orders_agree_only_where_no_word_is_read() {
        assert_eq!(hashtext_with(ByteOrder::Big, ""), hashtext(""));
        assert_ne!(hashtext_with(ByteOrder::Big, "a"), hashtext("a"));
        assert_eq!(ByteOrder::default(), ByteOrder::Little);
    }

    #[test]
    fn lock_key_is_the_sign_extended_bigint() {
        for &(s, expected) in MEASURED_LITTLE_ENDIAN {
            assert_eq!(hashtext_key(s), LockKey::BigInt(i64::from(expected)));
        }
        for &(s, expected) in DERIVED_BIG_ENDIAN {
            let key = hashtext_key_with(ByteOrder::Big, s);
            assert_eq!(key, LockKey::BigInt(i64::from(expected)));
        }
        // Measured: BEGIN; SELECT pg_advisory_xact_lock(hashtext('payroll-1405-01'));
        // SELECT classid, objid, objsubid FROM pg_locks WHERE locktype = 'advisory';
        // --> 4294967295 | 2801858053 | 1
        assert_eq!(
            hashtext_key("payroll-1405-01").to_pg_locks(),
            PgLocksId {
                classid: 4_294_967_295,
                objid: 2_801_858_053,
                objsubid: 1
            }
        );
    }

    #[test]
    fn usable_in_const_context() {
        const KEY: LockKey = hashtext_key("payroll-1405-01");
        assert_eq!(KEY, LockKey::BigInt(-1493109243));
    }
}

/// A lock key equal to the server's `hashtext(text)`, so lockkit excludes SQL
/// (and other services) that already run
/// `pg_advisory_xact_lock(hashtext(business_key))`.
///
/// It sorts and batches like any other key. A `Locker` (each adapter's)
/// checks once, when it connects, that [`hashtext`] agrees with the server
/// (which differs on big-endian servers and non-UTF8 databases) and refuses
/// `HashText` keys with [`ErrorKind::HashtextMismatch`](crate::ErrorKind::HashtextMismatch)
/// otherwise.
///
/// ```
/// use lockkit::{AdvisoryKey, LockKey};
/// use lockkit::key::HashText;
///
/// // SELECT hashtext('payroll-1405-01') = -1493109243 on a little-endian server.
/// assert_eq!(HashText("payroll-1405-01").lock_key(), LockKey::BigInt(-1493109243));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HashText<S>(pub S);

impl<S: AsRef<str>> crate::AdvisoryKey for HashText<S> {
    const KEY_SPEC: crate::KeySpec<'static> = crate::KeySpec::new("hashtext").hashtext();
    fn lock_key(&self) -> LockKey {
        hashtext_key(self.0.as_ref())
    }
}
