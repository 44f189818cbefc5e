//! lockkit hashes a key with its own streaming SipHash-2-4, started from a
//! state computed at compile time for the namespace. These properties check
//! it against the format's definition (KEYS.md, "Hash" and "Keys") computed
//! with the `siphasher` crate from `parts_bytes`: random namespaces of every
//! length, random sequences of fields of every kind (so the hasher sees
//! writes of every size at every alignment), both key spaces and stripes.

use std::hash::Hasher;

use lockkit::key::{parts_bytes, KeyPart, Parts};
use lockkit::{KeySpec, LockKey};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestError, TestRng, TestRunner};
use siphasher::sip::SipHasher24;

const CASES: u32 = 4096;

/// One field of any kind with a fixed-size or variable-size encoding.
#[derive(Clone, Debug)]
enum Field {
    Int(i64),
    Wide(i128),
    Huge(u128),
    Bool(bool),
    Char(char),
    Str(String),
    Uuid(u128),
    Opt(Option<i64>),
    Seq(Vec<u16>),
}

impl KeyPart for Field {
    fn encode(&self, parts: &mut Parts<'_>) {
        match self {
            Field::Int(v) => v.encode(parts),
            Field::Wide(v) => v.encode(parts),
            Field::Huge(v) => v.encode(parts),
            Field::Bool(v) => v.encode(parts),
            Field::Char(v) => v.encode(parts),
            Field::Str(v) => v.encode(parts),
            Field::Uuid(v) => uuid::Uuid::from_u128(*v).encode(parts),
            Field::Opt(v) => v.encode(parts),
            Field::Seq(v) => v.encode(parts),
        }
    }
}

/// Fields concatenated, as a derived struct encodes them.
#[derive(Clone, Debug)]
struct Fields(Vec<Field>);

impl KeyPart for Fields {
    fn encode(&self, parts: &mut Parts<'_>) {
        for f in &self.0 {
            f.encode(parts);
        }
    }
}

fn field() -> impl Strategy<Value = Field> {
    prop_oneof![
        any::<i64>().prop_map(Field::Int),
        any::<i128>().prop_map(Field::Wide),
        any::<u128>().prop_map(Field::Huge),
        any::<bool>().prop_map(Field::Bool),
        any::<char>().prop_map(Field::Char),
        ".{0,40}".prop_map(Field::Str),
        any::<u128>().prop_map(Field::Uuid),
        any::<Option<i64>>().prop_map(Field::Opt),
        prop::collection::vec(any::<u16>(), 0..6).prop_map(Field::Seq),
    ]
}

fn namespace() -> impl Strategy<Value = String> {
    "[A-Za-z0-9_.:/-]{1,64}"
}

type Case = (String, Fields, Option<u64>);

fn case() -> impl Strategy<Value = Case> {
    (
        namespace(),
        prop::collection::vec(field(), 0..8).prop_map(Fields),
        prop::option::of(1_u64..5000),
    )
}

fn sip(chunks: &[&[u8]]) -> u64 {
    let mut h = SipHasher24::new_with_key(b"lockkit-keys-v1!");
    for c in chunks {
        h.write(c);
    }
    h.finish()
}

/// KEYS.md's definition: `body(ns, parts) = sip(u32le(len(ns)) ++ ns ++ parts)`.
fn body(ns: &str, parts: &[u8]) -> u64 {
    sip(&[&(ns.len() as u32).to_le_bytes(), ns.as_bytes(), parts])
}

/// The BigInt and Pair keys of KEYS.md for a body computed by `body`.
fn expected_keys(ns: &str, body: u64, stripes: Option<u64>) -> (LockKey, LockKey) {
    let ns_hash = sip(&[b"ns\0", ns.as_bytes()]);
    let body = stripes.map_or(body, |n| body % n);
    let bigint = ((ns_hash >> 48) << 48) | (body & 0xFFFF_FFFF_FFFF);
    (
        LockKey::BigInt(bigint as i64),
        LockKey::Pair((ns_hash >> 32) as u32 as i32, body as u32 as i32),
    )
}

/// lockkit's keys equal the keys `reference_body` defines.
fn keys_follow(
    reference_body: fn(&str, &[u8]) -> u64,
) -> impl Fn(Case) -> Result<(), TestCaseError> {
    move |(ns, fields, stripes)| {
        let mut spec = KeySpec::try_new(&ns).expect("generated namespaces are valid");
        if let Some(n) = stripes {
            spec = spec.stripes(n);
        }
        let body = reference_body(&ns, &parts_bytes(&fields));
        let (bigint, pair) = expected_keys(&ns, body, stripes);
        prop_assert_eq!(spec.key_of(&fields), bigint);
        prop_assert_eq!(spec.pair().key_of(&fields), pair);
        Ok(())
    }
}

#[test]
fn keys_are_the_keys_md_hash_of_the_parts() {
    let config = Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    };
    if let Err(e) = TestRunner::new(config).run(&case(), keys_follow(body)) {
        panic!("{e}");
    }
}

/// Control: a reference that leaves out the `u32le(len(ns))` prefix must
/// disagree, which shows the property compares the full 48 and 32 bits.
#[test]
fn control_without_namespace_length_disagrees() {
    fn no_length(ns: &str, parts: &[u8]) -> u64 {
        sip(&[ns.as_bytes(), parts])
    }
    let config = Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    };
    let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    match TestRunner::new_with_rng(config, rng).run(&case(), keys_follow(no_length)) {
        Err(TestError::Fail(..)) => {}
        other => panic!("the control must fail, got {other:?}"),
    }
}
