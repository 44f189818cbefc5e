//! Property tests of the key format (KEYS.md, "Parts"):
//!
//! - injectivity: distinct values never share parts bytes, equal values always
//!   do, across strings built to look like encodings, nested options, nested
//!   sequences, mixed tuples, a derived enum and a heterogeneous value model;
//! - integers encode by value: every integer type that can hold a value gives
//!   the same key, in both key spaces;
//! - owned, borrowed, boxed, `Rc`, `Arc` and `Cow` fields give the same key.
//!
//! Each injectivity property has a control: the same generator run against a
//! deliberately ambiguous encoder must find a collision, which shows the
//! generator reaches the confusions the property is about.

use std::borrow::Cow;
use std::fmt::Debug;
use std::num::{
    NonZeroI128, NonZeroI16, NonZeroI32, NonZeroI64, NonZeroI8, NonZeroIsize, NonZeroU128,
    NonZeroU16, NonZeroU32, NonZeroU64, NonZeroU8, NonZeroUsize,
};
use std::rc::Rc;
use std::sync::Arc;

use lockkit::key::{parts_bytes, KeyPart, Parts};
use lockkit::{AdvisoryKey, KeySpec, LockKey};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestError, TestRng, TestRunner};

/// Cases per injectivity property.
const CASES: u32 = 4096;
/// Cases per property whose case is heavier (many derived types per case).
const HEAVY_CASES: u32 = 1024;

fn config(cases: u32) -> Config {
    Config {
        cases,
        // Failures are reported with their shrunk input; no regression files.
        failure_persistence: None,
        ..Config::default()
    }
}

/// Runs `test` on `cases` random inputs; panics with the shrunk failing input.
fn check<S>(cases: u32, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S: Strategy,
    S::Value: Debug,
{
    if let Err(e) = TestRunner::new(config(cases)).run(&strategy, test) {
        panic!("{e}");
    }
}

/// Runs `test` with a fixed seed and returns whether it found a failure: for
/// controls, which must fail.
fn control_fails<S>(
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> Option<S::Value>
where
    S: Strategy,
    S::Value: Debug,
{
    let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    match TestRunner::new_with_rng(config(CASES), rng).run(&strategy, test) {
        Ok(()) => None,
        Err(TestError::Fail(_, value)) => Some(value),
        Err(e) => panic!("control aborted: {e}"),
    }
}

/// `a == b` iff `encode(a) == encode(b)`.
fn injective<T: PartialEq + Debug>(
    encode: impl Fn(&T) -> Vec<u8>,
) -> impl Fn((T, T)) -> Result<(), TestCaseError> {
    move |(a, b)| {
        let (ea, eb) = (encode(&a), encode(&b));
        if a == b {
            prop_assert_eq!(ea, eb, "equal values {:?} encode differently", a);
        } else {
            prop_assert_ne!(
                ea,
                eb,
                "distinct values {:?} and {:?} share parts bytes",
                a,
                b
            );
        }
        Ok(())
    }
}

fn bytes<T: KeyPart>(value: &T) -> Vec<u8> {
    parts_bytes(value)
}

// ---------------------------------------------------------------- strings

/// Characters that are tag bytes (`00 01 04 06 09 0A 0C`), plus a few letters,
/// so strings often contain what looks like an encoded value.
fn tricky_char() -> impl Strategy<Value = char> {
    prop::sample::select(vec![
        'a', 'b', 'c', '\u{0}', '\u{1}', '\u{4}', '\u{6}', '\u{9}', '\u{a}', '\u{c}', 'é',
    ])
}

fn tricky_string(max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(tricky_char(), 0..=max).prop_map(|c| c.into_iter().collect())
}

/// Pairs of two-string tuples: independent ones (often equal, the alphabet is
/// small); the same text split at two points (`("ab", "c")` vs `("a", "bc")`);
/// and a first field that embeds the encoding of the other's second field.
fn string_pairs() -> impl Strategy<Value = ((String, String), (String, String))> {
    let independent = (
        (tricky_string(3), tricky_string(3)),
        (tricky_string(3), tricky_string(3)),
    );
    let split = (
        tricky_string(8),
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
    )
        .prop_map(|(s, i, j)| {
            let cuts: Vec<usize> = (0..=s.len()).filter(|&k| s.is_char_boundary(k)).collect();
            let (i, j) = (*i.get(&cuts), *j.get(&cuts));
            (
                (s[..i].to_owned(), s[i..].to_owned()),
                (s[..j].to_owned(), s[j..].to_owned()),
            )
        });
    let embedded = (tricky_string(4), tricky_string(4)).prop_map(|(x, y)| {
        // `("x", "y")` vs `("x" ++ bytes("y"), "")`: the second tuple's text
        // holds the exact bytes the first tuple's second field encodes to.
        let encoded_y = String::from_utf8(parts_bytes(&y)).expect("short strings encode to UTF-8");
        ((x.clone(), y), (x + &encoded_y, String::new()))
    });
    prop_oneof![independent, split, embedded]
}

#[test]
fn strings_are_injective() {
    check(CASES, string_pairs(), injective(bytes));
    // A single string field against the others' bytes, as text.
    check(
        CASES,
        (tricky_string(6), tricky_string(6)),
        injective(|s: &String| parts_bytes(s)),
    );
}

#[test]
fn strings_control_without_length_prefix_collides() {
    let naive = |t: &(String, String)| [t.0.as_bytes(), t.1.as_bytes()].concat();
    let found = control_fails(string_pairs(), injective(naive));
    let ((a0, a1), (b0, b1)) = found.expect("the generator must reach a split collision");
    assert_eq!(a0.clone() + &a1, b0.clone() + &b1);
    assert_ne!((a0, a1), (b0, b1));
}

// ---------------------------------------------------------------- options

fn option_value() -> impl Strategy<Value = (Option<String>, Option<Option<u8>>)> {
    (
        prop::option::of(tricky_string(2)),
        prop::option::of(prop::option::of(0_u8..3)),
    )
}

type OptionPair = (
    (Option<String>, Option<Option<u8>>),
    (Option<String>, Option<Option<u8>>),
);

fn option_pairs() -> impl Strategy<Value = OptionPair> {
    (option_value(), option_value())
}

#[test]
fn options_are_injective() {
    check(CASES, option_pairs(), injective(bytes));
}

#[test]
fn options_control_without_presence_byte_collides() {
    // Encodes `None` and `Some(None)` alike, as a nullable column would.
    let naive = |t: &(Option<String>, Option<Option<u8>>)| {
        let mut out = match &t.0 {
            None => vec![0xFF],
            Some(s) => parts_bytes(s),
        };
        match t.1 {
            None | Some(None) => out.push(0xFF),
            Some(Some(v)) => out.extend(parts_bytes(&v)),
        }
        out
    };
    let (a, b) = control_fails(option_pairs(), injective(naive))
        .expect("the generator must reach None vs Some(None)");
    assert_ne!(a, b);
    assert!(matches!(
        (a.1, b.1),
        (None, Some(None)) | (Some(None), None)
    ));
}

// ---------------------------------------------------------------- sequences

fn nested(max: usize) -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop::collection::vec(prop::collection::vec(0_u8..3, 0..=max), 0..=max)
}

/// Independent nested vectors, and one flat list grouped two ways
/// (`[[1], [2]]` vs `[[1, 2]]`).
fn seq_pairs() -> impl Strategy<Value = (Vec<Vec<u8>>, Vec<Vec<u8>>)> {
    let independent = (nested(3), nested(3));
    let regrouped = (
        prop::collection::vec(0_u8..3, 0..6),
        prop::collection::vec(any::<bool>(), 6),
        prop::collection::vec(any::<bool>(), 6),
    )
        .prop_map(|(flat, cuts_a, cuts_b)| (group(&flat, &cuts_a), group(&flat, &cuts_b)));
    prop_oneof![independent, regrouped]
}

/// `flat` split into groups, a new group starting after element `i` when
/// `cuts[i]`.
fn group(flat: &[u8], cuts: &[bool]) -> Vec<Vec<u8>> {
    let mut out = vec![Vec::new()];
    for (i, &v) in flat.iter().enumerate() {
        out.last_mut().expect("never empty").push(v);
        if cuts[i] && i + 1 < flat.len() {
            out.push(Vec::new());
        }
    }
    out
}

#[test]
fn sequences_are_injective() {
    check(CASES, seq_pairs(), injective(bytes));
    // Sequences as fields next to each other.
    check(
        CASES,
        ((nested(2), nested(2)), (nested(2), nested(2))),
        injective(bytes),
    );
}

#[test]
fn sequences_control_flattened_collides() {
    let naive = |v: &Vec<Vec<u8>>| v.iter().flatten().copied().collect::<Vec<u8>>();
    let (a, b) = control_fails(seq_pairs(), injective(naive))
        .expect("the generator must reach [[1],[2]] vs [[1,2]]");
    assert_ne!(a, b);
    assert_eq!(naive(&a), naive(&b));
}

// ---------------------------------------------------------------- tuples

type Mixed = (u8, String, bool, Option<i64>, char, Vec<u16>);

fn mixed() -> impl Strategy<Value = Mixed> {
    (
        0_u8..3,
        tricky_string(2),
        any::<bool>(),
        prop::option::of(-1_i64..2),
        prop::sample::select(vec!['a', '\u{6}', 'é']),
        prop::collection::vec(0_u16..2, 0..2),
    )
}

#[test]
fn mixed_tuples_are_injective() {
    check(CASES, (mixed(), mixed()), injective(bytes));
}

// ---------------------------------------------------------------- enums

/// Variants whose names are prefixes of each other and whose fields could be
/// mistaken for another variant's.
#[derive(AdvisoryKey, Clone, Debug, PartialEq)]
#[advisory_key(namespace = "props.Subject")]
enum Subject {
    Unit,
    A(String),
    Ab(String),
    B(u8),
    Named { x: String, y: Option<u8> },
    Nested(Vec<u8>, bool),
    Inner(Option<Box<Subject>>),
}

fn subject() -> impl Strategy<Value = Subject> {
    let leaf = prop_oneof![
        Just(Subject::Unit),
        tricky_string(2).prop_map(Subject::A),
        tricky_string(2).prop_map(Subject::Ab),
        (0_u8..3).prop_map(Subject::B),
        (tricky_string(2), prop::option::of(0_u8..2)).prop_map(|(x, y)| Subject::Named { x, y }),
        (prop::collection::vec(0_u8..2, 0..3), any::<bool>())
            .prop_map(|(v, b)| Subject::Nested(v, b)),
    ];
    leaf.prop_recursive(2, 6, 1, |inner| {
        prop::option::of(inner).prop_map(|s| Subject::Inner(s.map(Box::new)))
    })
}

#[test]
fn derived_enum_is_injective_and_keys_follow_bytes() {
    check(CASES, (subject(), subject()), |(a, b)| {
        injective(bytes)((a.clone(), b.clone()))?;
        if a == b {
            prop_assert_eq!(a.lock_key(), b.lock_key());
        }
        Ok(())
    });
    // Enums as fields of a tuple, next to strings that may mimic a variant.
    check(
        CASES,
        ((subject(), tricky_string(2)), (subject(), tricky_string(2))),
        injective(bytes),
    );
}

// ------------------------------------------------ heterogeneous value model

/// An integer with the type it is encoded through. Equality is by value only:
/// KEYS.md encodes integers by value.
#[derive(Clone, Copy, Debug)]
struct Int {
    value: Wide,
    ty: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Wide {
    Signed(i128),
    /// Above `i128::MAX`.
    Huge(u128),
}

impl PartialEq for Int {
    fn eq(&self, other: &Self) -> bool {
        self.value == other.value
    }
}

/// The integer types, primitive then `NonZero`, in the order of [`encode_as`].
const INT_TYPES: usize = 24;

/// Encodes `value` through integer type number `ty`, or `None` when it does
/// not fit that type.
fn encode_as(value: Wide, ty: usize, parts: &mut Parts<'_>) -> Option<()> {
    macro_rules! through {
        ($v:expr; $($n:literal => $t:ty),* ; $($m:literal => $p:ty, $nz:ty),*) => {
            match ty {
                $($n => { parts.put(&<$t>::try_from($v).ok()?); })*
                $($m => { parts.put(&<$nz>::new(<$p>::try_from($v).ok()?)?); })*
                _ => unreachable!("integer type number {ty}"),
            }
        };
    }
    match value {
        Wide::Signed(v) => through!(v;
            0 => i8, 1 => i16, 2 => i32, 3 => i64, 4 => i128, 5 => isize,
            6 => u8, 7 => u16, 8 => u32, 9 => u64, 10 => u128, 11 => usize;
            12 => i8, NonZeroI8, 13 => i16, NonZeroI16, 14 => i32, NonZeroI32,
            15 => i64, NonZeroI64, 16 => i128, NonZeroI128, 17 => isize, NonZeroIsize,
            18 => u8, NonZeroU8, 19 => u16, NonZeroU16, 20 => u32, NonZeroU32,
            21 => u64, NonZeroU64, 22 => u128, NonZeroU128, 23 => usize, NonZeroUsize),
        Wide::Huge(v) => through!(v;
            0 => i8, 1 => i16, 2 => i32, 3 => i64, 4 => i128, 5 => isize,
            6 => u8, 7 => u16, 8 => u32, 9 => u64, 10 => u128, 11 => usize;
            12 => i8, NonZeroI8, 13 => i16, NonZeroI16, 14 => i32, NonZeroI32,
            15 => i64, NonZeroI64, 16 => i128, NonZeroI128, 17 => isize, NonZeroIsize,
            18 => u8, NonZeroU8, 19 => u16, NonZeroU16, 20 => u32, NonZeroU32,
            21 => u64, NonZeroU64, 22 => u128, NonZeroU128, 23 => usize, NonZeroUsize),
    }
    Some(())
}

/// Whether `value` fits integer type number `ty`.
fn fits(value: Wide, ty: usize) -> bool {
    // `encode_as` fails exactly when the conversion does.
    let mut ok = false;
    KeySpec::new("probe").key_with(|p| ok = encode_as(value, ty, p).is_some());
    ok
}

/// A value of any key-part shape. Sequences may mix shapes, which is
/// stronger than Rust allows; variants have a fixed arity per name, as a Rust
/// enum does (a variant's field count is not encoded, its type fixes it).
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Int(Int),
    Bool(bool),
    Char(char),
    Str(String),
    Uuid(u128),
    Opt(Option<Box<Value>>),
    Seq(Vec<Value>),
    /// Variant number `.0` of `VARIANTS`, with exactly its arity of fields.
    Variant(usize, Vec<Value>),
}

const VARIANTS: [(&str, usize); 4] = [("A", 0), ("Ab", 1), ("B", 1), ("C", 2)];

impl KeyPart for Value {
    fn encode(&self, parts: &mut Parts<'_>) {
        match self {
            Value::Int(i) => encode_as(i.value, i.ty, parts).expect("generated to fit"),
            Value::Bool(b) => b.encode(parts),
            Value::Char(c) => c.encode(parts),
            Value::Str(s) => s.encode(parts),
            Value::Uuid(u) => uuid::Uuid::from_u128(*u).encode(parts),
            Value::Opt(o) => o.as_deref().encode(parts),
            Value::Seq(items) => items.encode(parts),
            Value::Variant(n, fields) => {
                parts.variant(VARIANTS[*n].0);
                for f in fields {
                    f.encode(parts);
                }
            }
        }
    }
}

fn int() -> impl Strategy<Value = Int> {
    let small = (-2_i128..3).prop_map(Wide::Signed);
    let edges = prop::sample::select(vec![
        Wide::Signed(i64::MIN.into()),
        Wide::Signed(i64::MAX.into()),
        Wide::Signed(i128::from(i64::MAX) + 1),
        Wide::Signed(i128::from(i64::MIN) - 1),
        Wide::Signed(u64::MAX.into()),
        Wide::Signed(i128::MAX),
        Wide::Signed(i128::MIN),
        Wide::Huge(i128::MAX as u128 + 1),
        Wide::Huge(u128::MAX),
    ]);
    let value = prop_oneof![3 => small, 1 => edges];
    (value, any::<prop::sample::Index>()).prop_map(|(value, pick)| {
        let types: Vec<usize> = (0..INT_TYPES).filter(|&t| fits(value, t)).collect();
        Int {
            value,
            ty: *pick.get(&types),
        }
    })
}

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        int().prop_map(Value::Int),
        any::<bool>().prop_map(Value::Bool),
        prop::sample::select(vec!['a', '\u{1}', '\u{6}']).prop_map(Value::Char),
        tricky_string(2).prop_map(Value::Str),
        prop::sample::select(vec![0_u128, 1, 0x0106_0000_0000_0000_0000_0000_0000_0000])
            .prop_map(Value::Uuid),
    ];
    leaf.prop_recursive(3, 12, 3, |inner| {
        prop_oneof![
            prop::option::of(inner.clone()).prop_map(|o| Value::Opt(o.map(Box::new))),
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Seq),
            (0..VARIANTS.len(), prop::collection::vec(inner, 2)).prop_map(|(n, mut f)| {
                f.truncate(VARIANTS[n].1);
                Value::Variant(n, f)
            }),
        ]
    })
}

/// The same value with every integer re-encoded through another type that
/// holds it.
fn retyped(v: &Value, seed: &mut u64) -> Value {
    match v {
        Value::Int(i) => {
            let types: Vec<usize> = (0..INT_TYPES).filter(|&t| fits(i.value, t)).collect();
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            Value::Int(Int {
                value: i.value,
                ty: types[(*seed >> 33) as usize % types.len()],
            })
        }
        Value::Opt(o) => Value::Opt(o.as_ref().map(|b| Box::new(retyped(b, seed)))),
        Value::Seq(items) => Value::Seq(items.iter().map(|x| retyped(x, seed)).collect()),
        Value::Variant(n, f) => Value::Variant(*n, f.iter().map(|x| retyped(x, seed)).collect()),
        other => other.clone(),
    }
}

#[test]
fn heterogeneous_values_are_injective() {
    // Up to three fields of any shape, against another such list.
    let fields = || prop::collection::vec(value(), 0..=3);
    check(HEAVY_CASES, (fields(), fields()), injective(bytes));
    // Equal values through other integer types: equal bytes.
    check(HEAVY_CASES, (fields(), any::<u64>()), |(a, mut seed)| {
        let b: Vec<Value> = a.iter().map(|v| retyped(v, &mut seed)).collect();
        injective(bytes)((a, b))
    });
}

// ------------------------------------------------ integers encode by value

macro_rules! int_key_types {
    ($($name:ident: $t:ty),* $(,)?) => {
        /// One key type per integer type, all in namespace `Int`.
        mod bigint {
            use super::*;
            $(
                #[derive(AdvisoryKey)]
                #[advisory_key(namespace = "Int")]
                pub(super) struct $name { pub(super) id: $t }
            )*
        }
        /// The same in the Pair key space.
        mod pair {
            use super::*;
            $(
                #[derive(AdvisoryKey)]
                #[advisory_key(namespace = "Int", pair)]
                pub(super) struct $name { pub(super) id: $t }
            )*
        }
        /// `(type name, BigInt key, Pair key, key_of key)` for every integer
        /// type that holds `v`.
        fn keys_of(v: Wide) -> Vec<(&'static str, LockKey, LockKey, LockKey)> {
            let spec = KeySpec::new("Int");
            let mut out = Vec::new();
            $(
                let id: Option<$t> = match v {
                    Wide::Signed(v) => <$t as FromWide>::from_i128(v),
                    Wide::Huge(v) => <$t as FromWide>::from_u128(v),
                };
                if let Some(id) = id {
                    out.push((
                        stringify!($t),
                        bigint::$name { id }.lock_key(),
                        pair::$name { id }.lock_key(),
                        spec.key_of(&id),
                    ));
                }
            )*
            out
        }
    };
}

/// Checked conversion from the wide value types to every integer type.
trait FromWide: Sized {
    fn from_i128(v: i128) -> Option<Self>;
    fn from_u128(v: u128) -> Option<Self>;
}

macro_rules! from_wide {
    ($($t:ty),*) => {$(
        impl FromWide for $t {
            fn from_i128(v: i128) -> Option<Self> { <$t>::try_from(v).ok() }
            fn from_u128(v: u128) -> Option<Self> { <$t>::try_from(v).ok() }
        }
    )*};
}
from_wide!(i8, i16, i32, i64, i128, isize, u8, u16, u32, u64, u128, usize);

macro_rules! from_wide_nonzero {
    ($($nz:ty: $p:ty),*) => {$(
        impl FromWide for $nz {
            fn from_i128(v: i128) -> Option<Self> { <$nz>::new(<$p>::try_from(v).ok()?) }
            fn from_u128(v: u128) -> Option<Self> { <$nz>::new(<$p>::try_from(v).ok()?) }
        }
    )*};
}
from_wide_nonzero!(
    NonZeroI8: i8, NonZeroI16: i16, NonZeroI32: i32, NonZeroI64: i64, NonZeroI128: i128,
    NonZeroIsize: isize, NonZeroU8: u8, NonZeroU16: u16, NonZeroU32: u32, NonZeroU64: u64,
    NonZeroU128: u128, NonZeroUsize: usize
);

int_key_types!(
    I8: i8, I16: i16, I32: i32, I64: i64, I128: i128, Isize: isize,
    U8: u8, U16: u16, U32: u32, U64: u64, U128: u128, Usize: usize,
    NzI8: NonZeroI8, NzI16: NonZeroI16, NzI32: NonZeroI32, NzI64: NonZeroI64,
    NzI128: NonZeroI128, NzIsize: NonZeroIsize, NzU8: NonZeroU8, NzU16: NonZeroU16,
    NzU32: NonZeroU32, NzU64: NonZeroU64, NzU128: NonZeroU128, NzUsize: NonZeroUsize,
);

/// Values across every type boundary: each bit width's min and max, one past
/// them, and random values of every width.
fn wide() -> impl Strategy<Value = Wide> {
    let bounds: [(i128, i128); 9] = [
        (i8::MIN.into(), i8::MAX.into()),
        (i16::MIN.into(), i16::MAX.into()),
        (i32::MIN.into(), i32::MAX.into()),
        (i64::MIN.into(), i64::MAX.into()),
        (i128::MIN, i128::MAX),
        (0, u8::MAX.into()),
        (0, u16::MAX.into()),
        (0, u32::MAX.into()),
        (0, u64::MAX.into()),
    ];
    let mut edges = vec![Wide::Signed(0), Wide::Signed(1), Wide::Signed(-1)];
    for (min, max) in bounds {
        for v in [min.checked_sub(1), Some(min), Some(max), max.checked_add(1)] {
            edges.extend(v.map(Wide::Signed));
        }
    }
    edges.push(Wide::Huge(i128::MAX as u128 + 1));
    edges.push(Wide::Huge(u128::MAX));
    let signed = prop_oneof![
        any::<i8>().prop_map(i128::from),
        any::<i16>().prop_map(i128::from),
        any::<i32>().prop_map(i128::from),
        any::<i64>().prop_map(i128::from),
        any::<u64>().prop_map(i128::from),
        any::<i128>(),
    ]
    .prop_map(Wide::Signed);
    let huge = (i128::MAX as u128 + 1..=u128::MAX).prop_map(Wide::Huge);
    prop_oneof![2 => prop::sample::select(edges), 4 => signed, 1 => huge]
}

#[test]
fn every_integer_type_holding_a_value_gives_its_key() {
    check(HEAVY_CASES, wide(), |v| {
        let keys = keys_of(v);
        // i128 or u128 holds every generated value.
        prop_assert!(!keys.is_empty());
        let reference = KeySpec::new("Int");
        let (big, pair) = match v {
            Wide::Signed(v) => (reference.key_of(&v), reference.pair().key_of(&v)),
            Wide::Huge(v) => (reference.key_of(&v), reference.pair().key_of(&v)),
        };
        for (ty, b, p, k) in keys {
            prop_assert_eq!(b, big, "BigInt key of {:?} through {}", v, ty);
            prop_assert_eq!(p, pair, "Pair key of {:?} through {}", v, ty);
            prop_assert_eq!(k, big, "key_of {:?} through {}", v, ty);
        }
        Ok(())
    });
}

#[test]
fn integer_control_small_values_reach_every_type() {
    // Guards the property above against vacuity: a value every type holds
    // really is checked through all 24 types, and 0 through the 12 primitive ones.
    assert_eq!(keys_of(Wide::Signed(5)).len(), 24);
    assert_eq!(keys_of(Wide::Signed(0)).len(), 12);
    assert_eq!(keys_of(Wide::Signed(-1)).len(), 12);
    assert_eq!(keys_of(Wide::Huge(u128::MAX)).len(), 2);
    // And a different value is another key.
    assert_ne!(keys_of(Wide::Signed(5))[0].1, keys_of(Wide::Signed(6))[0].1);
}

// ------------------------------------------- owned, borrowed and pointers

/// One key type, many field representations, all in namespace `Holder`.
mod holders {
    use super::*;

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Holder")]
    pub(super) struct Owned {
        pub(super) name: String,
        pub(super) id: i64,
        pub(super) tags: Vec<String>,
        pub(super) parent: Option<String>,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Holder")]
    pub(super) struct Borrowed<'a> {
        pub(super) name: &'a str,
        pub(super) id: &'a i64,
        pub(super) tags: &'a [&'a str],
        pub(super) parent: Option<&'a str>,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Holder")]
    pub(super) struct Boxed {
        pub(super) name: Box<str>,
        pub(super) id: Box<i64>,
        pub(super) tags: Box<[Box<str>]>,
        pub(super) parent: Option<Box<str>>,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Holder")]
    pub(super) struct Shared {
        pub(super) name: Arc<str>,
        pub(super) id: Rc<i64>,
        pub(super) tags: Arc<[Rc<str>]>,
        pub(super) parent: Option<Arc<String>>,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Holder")]
    pub(super) struct Cowed<'a> {
        pub(super) name: Cow<'a, str>,
        pub(super) id: Cow<'a, i64>,
        pub(super) tags: Cow<'a, [Cow<'a, str>]>,
        pub(super) parent: Option<Cow<'a, str>>,
    }

    /// The same key in the Pair key space, for both forms.
    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Holder", pair)]
    pub(super) struct OwnedPair {
        pub(super) name: String,
        pub(super) id: u32,
        pub(super) tags: Vec<String>,
        pub(super) parent: Option<String>,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Holder", pair)]
    pub(super) struct SharedPair<'a> {
        pub(super) name: Rc<Cow<'a, str>>,
        pub(super) id: Box<i128>,
        pub(super) tags: Vec<Arc<str>>,
        pub(super) parent: Option<&'a String>,
    }
}

/// `s` borrowed, or copied when `owned`.
fn cow(s: &str, owned: bool) -> Cow<'_, str> {
    if owned {
        Cow::Owned(s.to_owned())
    } else {
        Cow::Borrowed(s)
    }
}

#[test]
fn owned_borrowed_and_pointer_fields_give_one_key() {
    use holders::*;
    let input = (
        tricky_string(4),
        any::<u32>().prop_map(i64::from),
        prop::collection::vec(tricky_string(2), 0..3),
        prop::option::of(tricky_string(2)),
        any::<bool>(),
    );
    check(HEAVY_CASES, input, |(name, id, tags, parent, cow_owned)| {
        let owned = Owned {
            name: name.clone(),
            id,
            tags: tags.clone(),
            parent: parent.clone(),
        }
        .lock_key();
        let spec = KeySpec::new("Holder");
        prop_assert_eq!(owned, spec.key_of(&(&name, id, &tags, &parent)));

        let tag_refs: Vec<&str> = tags.iter().map(String::as_str).collect();
        let borrowed = Borrowed {
            name: &name,
            id: &id,
            tags: &tag_refs,
            parent: parent.as_deref(),
        };
        prop_assert_eq!(borrowed.lock_key(), owned);
        prop_assert_eq!(<&Borrowed<'_> as AdvisoryKey>::lock_key(&&borrowed), owned);

        let boxed = Boxed {
            name: name.as_str().into(),
            id: Box::new(id),
            tags: tags.iter().map(|t| t.as_str().into()).collect(),
            parent: parent.as_deref().map(Into::into),
        };
        prop_assert_eq!(boxed.lock_key(), owned);

        let shared = Shared {
            name: Arc::from(name.as_str()),
            id: Rc::new(id),
            tags: tags.iter().map(|t| Rc::from(t.as_str())).collect(),
            parent: parent.clone().map(Arc::new),
        };
        prop_assert_eq!(shared.lock_key(), owned);

        let cow = |s| cow(s, cow_owned);
        let cow_tags: Vec<Cow<'_, str>> = tags.iter().map(|t| cow(t)).collect();
        let cowed = Cowed {
            name: cow(&name),
            id: if cow_owned {
                Cow::Owned(id)
            } else {
                Cow::Borrowed(&id)
            },
            tags: if cow_owned {
                Cow::Owned(cow_tags.clone())
            } else {
                Cow::Borrowed(&cow_tags)
            },
            parent: parent.as_deref().map(cow),
        };
        prop_assert_eq!(cowed.lock_key(), owned);

        let pair = OwnedPair {
            name: name.clone(),
            id: u32::try_from(id).expect("generated from u32"),
            tags: tags.clone(),
            parent: parent.clone(),
        }
        .lock_key();
        prop_assert_eq!(pair, spec.pair().key_of(&(&name, id, &tags, &parent)));
        let shared_pair = SharedPair {
            name: Rc::new(cow(&name)),
            id: Box::new(i128::from(id)),
            tags: tags.iter().map(|t| Arc::from(t.as_str())).collect(),
            parent: parent.as_ref(),
        };
        prop_assert_eq!(shared_pair.lock_key(), pair);
        Ok(())
    });
}

#[test]
fn holders_control_a_changed_field_changes_the_key() {
    use holders::*;
    let owned = |id| {
        Owned {
            name: "acme".into(),
            id,
            tags: vec!["a".into()],
            parent: None,
        }
        .lock_key()
    };
    assert_ne!(owned(1), owned(2));
    let moved_tag = Owned {
        name: "acme".into(),
        id: 1,
        tags: vec![],
        parent: Some("a".into()),
    };
    assert_ne!(moved_tag.lock_key(), owned(1));
}
