//! SipHash-2-4 with 64-bit output, as a small streaming hasher whose state is
//! a plain `Copy` value that `const fn`s can build.
//!
//! This is the reference algorithm of Aumasson and Bernstein, "SipHash: a
//! fast short-input PRF" (2012), section 2: the key initialises `v0..v3`;
//! the message is absorbed in 8-byte little-endian words `m` (`v3 ^= m`, two
//! SipRounds, `v0 ^= m`); the last word holds the 0 to 7 remaining bytes and,
//! in its top byte, the message length mod 256; then `v2 ^= 0xff`, four
//! SipRounds, and the output is `v0 ^ v1 ^ v2 ^ v3`. The bytes may arrive in
//! any number of `write`s: only their concatenation matters.
//!
//! Why not the `siphasher` crate (which stays the reference in the tests):
//! every key's body starts with `u32le(len(ns)) ++ ns`, a constant of its
//! type, so [`KeySpec`](crate::KeySpec) absorbs it at compile time and each
//! key starts from that state; `siphasher`'s state cannot be built in a
//! `const`. The same code runs at compile time and at run time.

/// A SipHash-2-4 state: the four state words, the bytes not yet absorbed
/// (fewer than 8) and the number of bytes written so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Sip24 {
    v: [u64; 4],
    /// The last `ntail` bytes written, little-endian in the low bytes; the
    /// other bytes are zero.
    tail: u64,
    /// 0 to 7.
    ntail: u32,
    /// Total bytes written; only its low byte enters the hash.
    len: u64,
}

impl Sip24 {
    /// The initial state for a 128-bit key `k0 ++ k1` (little-endian).
    pub(crate) const fn new(key: &[u8; 16]) -> Self {
        let [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p] = *key;
        let k0 = u64::from_le_bytes([a, b, c, d, e, f, g, h]);
        let k1 = u64::from_le_bytes([i, j, k, l, m, n, o, p]);
        Sip24 {
            v: [
                k0 ^ 0x736f_6d65_7073_6575,
                k1 ^ 0x646f_7261_6e64_6f6d,
                k0 ^ 0x6c79_6765_6e65_7261,
                k1 ^ 0x7465_6462_7974_6573,
            ],
            tail: 0,
            ntail: 0,
            len: 0,
        }
    }

    /// Appends `bytes` to the message.
    #[inline(always)]
    pub(crate) const fn write(&mut self, mut bytes: &[u8]) {
        while let [a, b, c, d, e, f, g, h, rest @ ..] = bytes {
            self.write_word(u64::from_le_bytes([*a, *b, *c, *d, *e, *f, *g, *h]), 8);
            bytes = rest;
        }
        self.write_word(load_le(bytes), bytes.len() as u32);
    }

    /// Appends the low `n` bytes of `word` (little-endian), `n` at most 8;
    /// the higher bytes of `word` must be zero. For the fixed-size elements
    /// of a key: no byte buffer (and no store-to-load stall reading it back).
    #[inline(always)]
    pub(crate) const fn write_word(&mut self, word: u64, n: u32) {
        self.len = self.len.wrapping_add(n as u64);
        // `word` shifted past the `ntail` pending bytes: the low 64 bits of
        // `wide` continue the pending message word; what does not fit is in
        // the high 64 bits.
        // `& 7` is a no-op (`ntail` < 8) that tells the compiler the shift
        // is below 64, which saves a branch-free select per word.
        let wide = (word as u128) << (8 * (self.ntail & 7));
        let ntail = self.ntail + n;
        if ntail >= 8 {
            self.compress(self.tail | wide as u64);
            self.tail = (wide >> 64) as u64;
            self.ntail = ntail - 8;
        } else {
            self.tail |= wide as u64;
            self.ntail = ntail;
        }
    }

    /// The 64-bit hash of everything written.
    #[inline]
    pub(crate) const fn finish(&self) -> u64 {
        let mut s = *self;
        // The last word: the pending bytes and the length mod 256 on top.
        let last = (s.len << 56) | s.tail;
        s.compress(last);
        s.v[2] ^= 0xff;
        s.round();
        s.round();
        s.round();
        s.round();
        s.v[0] ^ s.v[1] ^ s.v[2] ^ s.v[3]
    }

    /// Absorbs one message word: `v3 ^= m`, two SipRounds, `v0 ^= m`.
    #[inline(always)]
    const fn compress(&mut self, m: u64) {
        self.v[3] ^= m;
        self.round();
        self.round();
        self.v[0] ^= m;
    }

    /// SipRound (the paper's figure 2.1).
    #[inline(always)]
    const fn round(&mut self) {
        let [mut v0, mut v1, mut v2, mut v3] = self.v;
        v0 = v0.wrapping_add(v1);
        v1 = v1.rotate_left(13) ^ v0;
        v0 = v0.rotate_left(32);
        v2 = v2.wrapping_add(v3);
        v3 = v3.rotate_left(16) ^ v2;
        v0 = v0.wrapping_add(v3);
        v3 = v3.rotate_left(21) ^ v0;
        v2 = v2.wrapping_add(v1);
        v1 = v1.rotate_left(17) ^ v2;
        v2 = v2.rotate_left(32);
        self.v = [v0, v1, v2, v3];
    }
}

/// `bytes` (at most 7) as a little-endian integer, in at most three loads
/// instead of one per byte.
#[inline(always)]
const fn load_le(mut bytes: &[u8]) -> u64 {
    let mut out = 0;
    let mut shift = 0;
    if let [a, b, c, d, rest @ ..] = bytes {
        out = u32::from_le_bytes([*a, *b, *c, *d]) as u64;
        shift = 32;
        bytes = rest;
    }
    if let [a, b, rest @ ..] = bytes {
        out |= (u16::from_le_bytes([*a, *b]) as u64) << shift;
        shift += 16;
        bytes = rest;
    }
    if let [a, ..] = bytes {
        out |= (*a as u64) << shift;
    }
    out
}

#[cfg(test)]
mod tests {
    use std::hash::Hasher;

    use siphasher::sip::SipHasher24;

    use super::*;
    use crate::key::namespace::SIP_KEY;

    /// `siphasher`, the reference implementation.
    fn reference(parts: &[&[u8]]) -> u64 {
        let mut h = SipHasher24::new_with_key(SIP_KEY);
        for p in parts {
            h.write(p);
        }
        h.finish()
    }

    fn ours(parts: &[&[u8]]) -> u64 {
        let mut h = Sip24::new(SIP_KEY);
        for p in parts {
            h.write(p);
        }
        h.finish()
    }

    /// Deterministic pseudo-random numbers (splitmix64).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
    }

    /// `data` split into writes of `size` bytes (the last one shorter).
    fn split(data: &[u8], size: usize) -> Vec<&[u8]> {
        data.chunks(size).collect()
    }

    /// `data` split into writes of random sizes 0 to `max`.
    fn random_split<'d>(data: &'d [u8], rng: &mut Rng, max: u64) -> Vec<&'d [u8]> {
        let mut out = Vec::new();
        let mut rest = data;
        while !rest.is_empty() {
            let n = ((rng.next() % (max + 1)) as usize).min(rest.len());
            let (head, tail) = rest.split_at(n);
            out.push(head);
            rest = tail;
        }
        out
    }

    #[test]
    fn paper_test_vector() {
        // The paper's appendix A: key 00..0f, message 00..0e (15 bytes).
        let key: [u8; 16] = core::array::from_fn(|i| i as u8);
        let msg: Vec<u8> = (0..15).collect();
        let mut h = Sip24::new(&key);
        h.write(&msg);
        assert_eq!(h.finish(), 0xa129_ca61_49be_45e5);
    }

    #[test]
    fn same_as_siphasher_for_every_length_and_split() {
        let mut rng = Rng(1);
        let data: Vec<u8> = (0..300).map(|_| rng.next() as u8).collect();
        for len in 0..=300 {
            let msg = &data[..len];
            let expected = reference(&[msg]);
            assert_eq!(ours(&[msg]), expected, "one write of {len}");
            for size in [1, 3, 8, 9, 17] {
                assert_eq!(
                    ours(&split(msg, size)),
                    expected,
                    "{len} in writes of {size}"
                );
                // The reference split the same way, as a check of `split`.
                assert_eq!(reference(&split(msg, size)), expected);
            }
            for max in [2, 9, 20, 64] {
                for _ in 0..8 {
                    let parts = random_split(msg, &mut rng, max);
                    assert_eq!(ours(&parts), expected, "{len} split as {parts:?}");
                }
            }
        }
    }

    /// `write_word` and `write` mixed at random, against the same bytes
    /// written to `siphasher`.
    #[test]
    fn words_and_slices_mixed() {
        let mut rng = Rng(3);
        for _ in 0..20_000 {
            let mut ours = Sip24::new(SIP_KEY);
            let mut bytes = Vec::new();
            for _ in 0..rng.next() % 12 {
                if rng.next() % 2 == 0 {
                    let n = (rng.next() % 9) as u32;
                    let word = rng.next() & u64::MAX.checked_shr(64 - 8 * n).unwrap_or(0);
                    ours.write_word(word, n);
                    bytes.extend_from_slice(&word.to_le_bytes()[..n as usize]);
                } else {
                    let slice: Vec<u8> = (0..rng.next() % 20).map(|_| rng.next() as u8).collect();
                    ours.write(&slice);
                    bytes.extend_from_slice(&slice);
                }
            }
            assert_eq!(ours.finish(), reference(&[&bytes]), "{bytes:?}");
        }
    }

    /// What `KeySpec` does: the body prefix absorbed in a `const`, the parts
    /// at run time, for every namespace length and parts length 0 to 300.
    #[test]
    fn body_prefix_state_then_parts() {
        let long = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:/-";
        let mut rng = Rng(2);
        let data: Vec<u8> = (0..300).map(|_| rng.next() as u8).collect();
        for n in 1..=crate::key::MAX_NAMESPACE_LEN {
            let ns = &long[..n];
            let len_le = (n as u32).to_le_bytes();
            let mut prefix = Sip24::new(SIP_KEY);
            prefix.write(&len_le);
            prefix.write(ns.as_bytes());
            for len in 0..=300 {
                let msg = &data[..len];
                let expected = reference(&[&len_le, ns.as_bytes(), msg]);
                for size in [1, 3, 8, 9, 17, 300] {
                    let mut h = prefix;
                    for p in split(msg, size) {
                        h.write(p);
                    }
                    assert_eq!(h.finish(), expected, "ns {ns:?}, {len} in writes of {size}");
                }
                let mut h = prefix;
                for p in random_split(msg, &mut rng, 20) {
                    h.write(p);
                }
                assert_eq!(h.finish(), expected, "ns {ns:?}, {len} split at random");
            }
        }
    }

    #[test]
    fn builds_at_compile_time() {
        const H: u64 = {
            let mut h = Sip24::new(SIP_KEY);
            h.write(b"ns\0Order");
            h.finish()
        };
        // KEYS.md: `ns_hash("Order")`.
        assert_eq!(H, 0x9c01_0d81_5759_8ee2);
    }
}
