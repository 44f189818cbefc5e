//! An independent re-implementation of the key format, written from the text
//! of KEYS.md alone (the `siphasher` crate and hand-written tag bytes, no
//! lockkit encoding code), compared with `#[derive(AdvisoryKey)]` over many
//! generated values of every shape the format names.

use std::borrow::Cow;
use std::hash::Hasher;
use std::num::{NonZeroI128, NonZeroI16, NonZeroI64, NonZeroU128, NonZeroU32, NonZeroUsize};
use std::rc::Rc;
use std::sync::Arc;

use lockkit::{AdvisoryKey, LockKey};
use siphasher::sip::SipHasher24;

// ---- KEYS.md, "Hash" and "Keys", from the text ----

const SIP_KEY: &[u8; 16] = b"lockkit-keys-v1!";

fn sip(bytes: &[u8]) -> u64 {
    let mut h = SipHasher24::new_with_key(SIP_KEY);
    h.write(bytes);
    h.finish()
}

fn ns_hash(ns: &str) -> u64 {
    let mut b = b"ns\0".to_vec();
    b.extend_from_slice(ns.as_bytes());
    sip(&b)
}

fn body(ns: &str, parts: &[u8]) -> u64 {
    let mut b = (ns.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(ns.as_bytes());
    b.extend_from_slice(parts);
    sip(&b)
}

fn spec_bigint(ns: &str, parts: &[u8], stripes: Option<u64>) -> LockKey {
    let mut b = body(ns, parts);
    if let Some(n) = stripes {
        b %= n;
    }
    let tag16 = ns_hash(ns) >> 48;
    LockKey::BigInt(((tag16 << 48) | (b & 0xFFFF_FFFF_FFFF)) as i64)
}

fn spec_pair(ns: &str, parts: &[u8], class: Option<i32>, stripes: Option<u64>) -> LockKey {
    let mut b = body(ns, parts);
    if let Some(n) = stripes {
        b %= n;
    }
    let class = class.unwrap_or((ns_hash(ns) >> 32) as i32);
    LockKey::Pair(class, b as u32 as i32)
}

// ---- KEYS.md, "Parts", from the table ----

#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn int(&mut self, v: i128) -> &mut Self {
        if let Ok(v) = i64::try_from(v) {
            self.0.push(0x01);
            self.0.extend_from_slice(&v.to_le_bytes());
        } else {
            self.0.push(0x02);
            self.0.extend_from_slice(&v.to_le_bytes());
        }
        self
    }
    fn uint(&mut self, v: u128) -> &mut Self {
        match i128::try_from(v) {
            Ok(v) => self.int(v),
            Err(_) => {
                self.0.push(0x03);
                self.0.extend_from_slice(&v.to_le_bytes());
                self
            }
        }
    }
    fn bool(&mut self, v: bool) -> &mut Self {
        self.0.extend_from_slice(&[0x04, v as u8]);
        self
    }
    fn char(&mut self, v: char) -> &mut Self {
        self.0.push(0x05);
        self.0.extend_from_slice(&(v as u32).to_le_bytes());
        self
    }
    fn str(&mut self, v: &str) -> &mut Self {
        self.0.push(0x06);
        self.0.extend_from_slice(&(v.len() as u32).to_le_bytes());
        self.0.extend_from_slice(v.as_bytes());
        self
    }
    fn uuid(&mut self, v: &uuid::Uuid) -> &mut Self {
        self.0.push(0x08);
        // RFC 4122 order: the most significant byte first.
        self.0.extend_from_slice(&v.as_u128().to_be_bytes());
        self
    }
    fn none(&mut self) -> &mut Self {
        self.0.extend_from_slice(&[0x09, 0x00]);
        self
    }
    fn some(&mut self) -> &mut Self {
        self.0.extend_from_slice(&[0x09, 0x01]);
        self
    }
    fn seq(&mut self, n: usize) -> &mut Self {
        self.0.push(0x0A);
        self.0.extend_from_slice(&(n as u32).to_le_bytes());
        self
    }
    fn variant(&mut self, name: &str) -> &mut Self {
        self.0.push(0x0C);
        self.0.extend_from_slice(&(name.len() as u32).to_le_bytes());
        self.0.extend_from_slice(name.as_bytes());
        self
    }
}

// ---- a small deterministic generator ----

/// `fastrand`, seeded, with the draws these tests need.
struct Rng(fastrand::Rng);

impl Rng {
    fn seeded(seed: u64) -> Rng {
        Rng(fastrand::Rng::with_seed(seed))
    }
    fn next(&mut self) -> u64 {
        self.0.u64(..)
    }
    fn u128(&mut self) -> u128 {
        let v = (u128::from(self.next()) << 64) | u128::from(self.next());
        // Bias towards the boundaries of the encoding rules.
        match self.next() % 8 {
            0 => v,
            1 => v >> (self.next() % 128),
            2 => i64::MAX as u128 + (self.next() % 3) as u128 - 1,
            3 => i128::MAX as u128 + (self.next() % 3) as u128 - 1,
            4 => u128::MAX - (self.next() % 3) as u128,
            5 => (i64::MIN as i128 + (self.next() % 3) as i128 - 1) as u128,
            6 => (self.next() % 5) as u128,
            _ => (self.next() % 5) as u128 | (1 << 127),
        }
    }
    fn string(&mut self) -> String {
        let pool = [
            'a',
            'Z',
            '0',
            ' ',
            ',',
            '"',
            '\\',
            '\0',
            'é',
            '€',
            '😀',
            '\u{10FFFF}',
        ];
        let n = (self.next() % 20) as usize;
        (0..n)
            .map(|_| pool[(self.next() % pool.len() as u64) as usize])
            .collect()
    }
    fn char(&mut self) -> char {
        loop {
            if let Some(c) = char::from_u32((self.next() % 0x11_0000) as u32) {
                return c;
            }
        }
    }
    fn bool(&mut self) -> bool {
        self.next() % 2 == 1
    }
}

const ROUNDS: usize = 3000;

// ---- integers ----

#[derive(AdvisoryKey)]
struct AllInts {
    a: u8,
    b: u16,
    c: u32,
    d: u64,
    e: u128,
    f: i8,
    g: i16,
    h: i32,
    i: i64,
    j: i128,
    k: isize,
    l: usize,
}

#[derive(AdvisoryKey)]
struct NonZeros {
    a: NonZeroU32,
    b: NonZeroI16,
    c: NonZeroI64,
    d: NonZeroI128,
    e: NonZeroU128,
    f: NonZeroUsize,
}

fn nz(v: u128) -> u128 {
    if v == 0 {
        1
    } else {
        v
    }
}

#[test]
fn integers_match_the_spec() {
    let mut rng = Rng::seeded(11);
    for _ in 0..ROUNDS {
        let r: Vec<u128> = (0..12).map(|_| rng.u128()).collect();
        let v = AllInts {
            a: r[0] as u8,
            b: r[1] as u16,
            c: r[2] as u32,
            d: r[3] as u64,
            e: r[4],
            f: r[5] as i8,
            g: r[6] as i16,
            h: r[7] as i32,
            i: r[8] as i64,
            j: r[9] as i128,
            k: r[10] as isize,
            l: r[11] as usize,
        };
        let mut e = Enc::default();
        e.int(v.a.into())
            .int(v.b.into())
            .int(v.c.into())
            .int(v.d.into())
            .uint(v.e)
            .int(v.f.into())
            .int(v.g.into())
            .int(v.h.into())
            .int(v.i.into())
            .int(v.j)
            .int(v.k as i128)
            .int(v.l as i128);
        assert_eq!(v.lock_key(), spec_bigint("AllInts", &e.0, None));

        let w = NonZeros {
            a: NonZeroU32::new(nz(r[0] as u32 as u128) as u32).unwrap(),
            b: NonZeroI16::new(nz(r[1] as u16 as u128) as i16).unwrap(),
            c: NonZeroI64::new(nz(r[2] as u64 as u128) as i64).unwrap(),
            d: NonZeroI128::new(nz(r[3]) as i128).unwrap(),
            e: NonZeroU128::new(nz(r[4])).unwrap(),
            f: NonZeroUsize::new(nz(r[5] as usize as u128) as usize).unwrap(),
        };
        let mut e = Enc::default();
        e.int(w.a.get().into())
            .int(w.b.get().into())
            .int(w.c.get().into())
            .int(w.d.get())
            .uint(w.e.get())
            .int(w.f.get() as i128);
        assert_eq!(w.lock_key(), spec_bigint("NonZeros", &e.0, None));
    }
    // The boundaries themselves.
    for e in [
        0,
        i64::MAX as u128,
        i64::MAX as u128 + 1,
        i128::MAX as u128,
        i128::MAX as u128 + 1,
        u128::MAX,
    ] {
        let v = AllInts {
            a: 0,
            b: 0,
            c: 0,
            d: u64::MAX,
            e,
            f: i8::MIN,
            g: i16::MIN,
            h: i32::MIN,
            i: i64::MIN,
            j: i128::MIN,
            k: isize::MIN,
            l: usize::MAX,
        };
        let mut enc = Enc::default();
        enc.int(0)
            .int(0)
            .int(0)
            .int(u64::MAX.into())
            .uint(e)
            .int(i8::MIN.into())
            .int(i16::MIN.into())
            .int(i32::MIN.into())
            .int(i64::MIN.into())
            .int(i128::MIN)
            .int(isize::MIN as i128)
            .int(usize::MAX as i128);
        assert_eq!(v.lock_key(), spec_bigint("AllInts", &enc.0, None));
    }
}

// ---- text, bool, char, pointers ----

#[derive(AdvisoryKey)]
struct Texts<'a> {
    a: &'a str,
    b: String,
    c: Box<str>,
    d: Cow<'a, str>,
    e: Arc<str>,
    f: char,
    g: bool,
    h: Rc<str>,
    i: &'a String,
    j: Box<u64>,
    k: Rc<i64>,
    l: Arc<String>,
    m: &'a &'a u8,
}

#[test]
fn text_and_pointers_match_the_spec() {
    let mut rng = Rng::seeded(12);
    for _ in 0..ROUNDS {
        let s: Vec<String> = (0..7).map(|_| rng.string()).collect();
        let c = rng.char();
        let g = rng.bool();
        let (j, k, m) = (rng.next(), rng.next() as i64, rng.next() as u8);
        let mref = &m;
        let v = Texts {
            a: &s[0],
            b: s[1].clone(),
            c: s[2].clone().into_boxed_str(),
            d: if rng.bool() {
                Cow::Borrowed(&s[3])
            } else {
                Cow::Owned(s[3].clone())
            },
            e: Arc::from(s[4].as_str()),
            f: c,
            g,
            h: Rc::from(s[5].as_str()),
            i: &s[6],
            j: Box::new(j),
            k: Rc::new(k),
            l: Arc::new(s[0].clone()),
            m: &mref,
        };
        let mut e = Enc::default();
        for t in &s {
            if std::ptr::eq(t, &s[5]) {
                e.char(c).bool(g);
            }
            e.str(t);
        }
        e.int(j.into()).int(k.into()).str(&s[0]).int(m.into());
        assert_eq!(v.lock_key(), spec_bigint("Texts", &e.0, None));
    }
}

// ---- Option, sequences, tuples ----

#[derive(AdvisoryKey)]
struct Containers<'a> {
    a: Option<u64>,
    b: Option<Option<String>>,
    c: Vec<i32>,
    d: [u8; 3],
    e: [u16; 0],
    f: Vec<Vec<bool>>,
    g: &'a [i16],
    h: (u8, String, (bool, char)),
    i: Option<Vec<Option<i128>>>,
    j: (),
    k: Box<[u128]>,
}

#[test]
fn options_sequences_and_tuples_match_the_spec() {
    let mut rng = Rng::seeded(13);
    for _ in 0..ROUNDS {
        let a = rng.bool().then(|| rng.next());
        let b = match rng.next() % 3 {
            0 => None,
            1 => Some(None),
            _ => Some(Some(rng.string())),
        };
        let c: Vec<i32> = (0..rng.next() % 5).map(|_| rng.next() as i32).collect();
        let d = [rng.next() as u8, rng.next() as u8, rng.next() as u8];
        let f: Vec<Vec<bool>> = (0..rng.next() % 4)
            .map(|_| (0..rng.next() % 3).map(|_| rng.bool()).collect())
            .collect();
        let g: Vec<i16> = (0..rng.next() % 4).map(|_| rng.next() as i16).collect();
        let h = (rng.next() as u8, rng.string(), (rng.bool(), rng.char()));
        let i = rng.bool().then(|| {
            (0..rng.next() % 4)
                .map(|_| rng.bool().then(|| rng.u128() as i128))
                .collect::<Vec<_>>()
        });
        let k: Vec<u128> = (0..rng.next() % 3).map(|_| rng.u128()).collect();
        let v = Containers {
            a,
            b: b.clone(),
            c: c.clone(),
            d,
            e: [],
            f: f.clone(),
            g: &g,
            h: h.clone(),
            i: i.clone(),
            j: (),
            k: k.clone().into_boxed_slice(),
        };
        let mut e = Enc::default();
        match a {
            None => e.none(),
            Some(a) => e.some().int(a.into()),
        };
        match &b {
            None => e.none(),
            Some(None) => e.some().none(),
            Some(Some(s)) => e.some().some().str(s),
        };
        e.seq(c.len());
        for x in &c {
            e.int((*x).into());
        }
        e.seq(3);
        for x in d {
            e.int(x.into());
        }
        e.seq(0);
        e.seq(f.len());
        for inner in &f {
            e.seq(inner.len());
            for x in inner {
                e.bool(*x);
            }
        }
        e.seq(g.len());
        for x in &g {
            e.int((*x).into());
        }
        e.int(h.0.into()).str(&h.1).bool(h.2 .0).char(h.2 .1);
        match &i {
            None => e.none(),
            Some(items) => {
                e.some().seq(items.len());
                for x in items {
                    match x {
                        None => e.none(),
                        Some(x) => e.some().int(*x),
                    };
                }
                &mut e
            }
        };
        e.seq(k.len());
        for x in &k {
            e.uint(*x);
        }
        assert_eq!(v.lock_key(), spec_bigint("Containers", &e.0, None));
    }
}

// ---- enums, nesting, uuid, generics ----

#[derive(AdvisoryKey, Clone)]
enum Kind {
    Unit,
    Tuple(i64, String),
    Struct { a: bool, b: Option<u8> },
    r#Match,
    Empty(),
    Nested(Box<Kind>),
}

#[derive(AdvisoryKey)]
struct Inner {
    id: u64,
    name: String,
}

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "spec/Outer")]
struct Outer<T> {
    kind: Kind,
    inner: Inner,
    inners: Vec<Inner>,
    maybe: Option<Inner>,
    id: uuid::Uuid,
    generic: T,
}

fn gen_kind(rng: &mut Rng, depth: u32) -> Kind {
    match rng.next() % if depth > 2 { 5 } else { 6 } {
        0 => Kind::Unit,
        1 => Kind::Tuple(rng.next() as i64, rng.string()),
        2 => Kind::Struct {
            a: rng.bool(),
            b: rng.bool().then(|| rng.next() as u8),
        },
        3 => Kind::Match,
        4 => Kind::Empty(),
        _ => Kind::Nested(Box::new(gen_kind(rng, depth + 1))),
    }
}

fn enc_kind(e: &mut Enc, k: &Kind) {
    match k {
        Kind::Unit => {
            e.variant("Unit");
        }
        Kind::Tuple(a, b) => {
            e.variant("Tuple").int((*a).into()).str(b);
        }
        Kind::Struct { a, b } => {
            e.variant("Struct").bool(*a);
            match b {
                None => e.none(),
                Some(b) => e.some().int((*b).into()),
            };
        }
        Kind::Match => {
            e.variant("Match");
        }
        Kind::Empty() => {
            e.variant("Empty");
        }
        Kind::Nested(k) => {
            e.variant("Nested");
            enc_kind(e, k);
        }
    }
}

#[test]
fn enums_nested_types_and_uuids_match_the_spec() {
    let mut rng = Rng::seeded(14);
    for _ in 0..ROUNDS {
        let kind = gen_kind(&mut rng, 0);
        let mut inner = || Inner {
            id: rng.next(),
            name: rng.string(),
        };
        let first = inner();
        let inners: Vec<Inner> = (0..3).map(|_| inner()).collect();
        let maybe = Some(inner()).filter(|i| i.id % 2 == 0);
        let id = uuid::Uuid::from_u128(rng.u128());
        let generic = (rng.char(), rng.u128());
        let mut e = Enc::default();
        enc_kind(&mut e, &kind);
        e.int(first.id.into()).str(&first.name);
        e.seq(inners.len());
        for i in &inners {
            e.int(i.id.into()).str(&i.name);
        }
        match &maybe {
            None => e.none(),
            Some(i) => e.some().int(i.id.into()).str(&i.name),
        };
        e.uuid(&id).char(generic.0).uint(generic.1);
        let v = Outer {
            kind: kind.clone(),
            inner: first,
            inners,
            maybe,
            id,
            generic,
        };
        assert_eq!(v.lock_key(), spec_bigint("spec/Outer", &e.0, None));
        let mut k = Enc::default();
        enc_kind(&mut k, &kind);
        assert_eq!(kind.lock_key(), spec_bigint("Kind", &k.0, None));
    }
}

// ---- forms: pair, class, stripes, exact, raw; namespaces ----

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "a")]
struct Shortest(String);

const LONGEST: &str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.";

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")]
struct Longest(String);

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "/-_.:x/-")]
struct Punct(String);

#[derive(AdvisoryKey)]
#[advisory_key(pair)]
struct Paired(String);

#[derive(AdvisoryKey)]
#[advisory_key(pair, class = -2147483648)]
struct ClassMin(String);

#[derive(AdvisoryKey)]
#[advisory_key(pair, class = 7, stripes = 3)]
struct ClassStriped(String);

#[derive(AdvisoryKey)]
#[advisory_key(stripes = 1)]
struct OneStripe(String);

#[derive(AdvisoryKey)]
#[advisory_key(stripes = 18446744073709551615)]
struct MaxStripes(String);

#[derive(AdvisoryKey)]
#[advisory_key(stripes = 281474976710657)]
struct WideStripes(String);

#[derive(AdvisoryKey)]
#[advisory_key(pair, stripes = 4294967297)]
struct WidePairStripes(String);

#[derive(AdvisoryKey)]
#[advisory_key(pair = "exact")]
struct Exact(i32);

#[derive(AdvisoryKey)]
#[advisory_key(pair = "exact", class = -9)]
struct ExactClassed {
    id: i32,
}

#[derive(AdvisoryKey)]
#[advisory_key(raw)]
struct RawBig(i64);

#[derive(AdvisoryKey)]
#[advisory_key(raw)]
struct RawPair((i32, i32));

#[test]
fn forms_and_namespaces_match_the_spec() {
    assert_eq!(LONGEST.len(), 64);
    let mut rng = Rng::seeded(15);
    for _ in 0..ROUNDS {
        let s = rng.string();
        let mut e = Enc::default();
        e.str(&s);
        let p = &e.0;
        assert_eq!(Shortest(s.clone()).lock_key(), spec_bigint("a", p, None));
        assert_eq!(Longest(s.clone()).lock_key(), spec_bigint(LONGEST, p, None));
        assert_eq!(
            Punct(s.clone()).lock_key(),
            spec_bigint("/-_.:x/-", p, None)
        );
        assert_eq!(
            Paired(s.clone()).lock_key(),
            spec_pair("Paired", p, None, None)
        );
        assert_eq!(
            ClassMin(s.clone()).lock_key(),
            spec_pair("ClassMin", p, Some(i32::MIN), None)
        );
        assert_eq!(
            ClassStriped(s.clone()).lock_key(),
            spec_pair("ClassStriped", p, Some(7), Some(3))
        );
        assert_eq!(
            OneStripe(s.clone()).lock_key(),
            spec_bigint("OneStripe", p, Some(1))
        );
        assert_eq!(
            MaxStripes(s.clone()).lock_key(),
            spec_bigint("MaxStripes", p, Some(u64::MAX))
        );
        assert_eq!(
            WideStripes(s.clone()).lock_key(),
            spec_bigint("WideStripes", p, Some(281474976710657))
        );
        assert_eq!(
            WidePairStripes(s.clone()).lock_key(),
            spec_pair("WidePairStripes", p, None, Some(4294967297))
        );
        let x = rng.next() as i32;
        let class = (ns_hash("Exact") >> 32) as i32;
        assert_eq!(Exact(x).lock_key(), LockKey::Pair(class, x));
        assert_eq!(ExactClassed { id: x }.lock_key(), LockKey::Pair(-9, x));
        let y = rng.next() as i64;
        assert_eq!(RawBig(y).lock_key(), LockKey::BigInt(y));
        assert_eq!(
            RawPair((x, y as i32)).lock_key(),
            LockKey::Pair(x, y as i32)
        );
    }
    // One stripe: every value has the one key whose body is 0.
    let tag = ns_hash("OneStripe") >> 48;
    assert_eq!(
        OneStripe("anything".into()).lock_key(),
        LockKey::BigInt((tag << 48) as i64)
    );
}
