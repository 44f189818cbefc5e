//! `lockkit key` agrees with `#[derive(AdvisoryKey)]`: random values of
//! derived types covering every part type and key form are written out as
//! the command's arguments (by the rendering below, independent of the
//! parser), parsed and computed by `lockkit_cli::keyarg` (what the binary
//! runs), and compared with `lock_key()`. A few cases run the binary itself.

use std::process::Command;

use lockkit::key::HashText;
use lockkit::{AdvisoryKey, LockKey};
use lockkit_cli::keyarg::{compute, parse_value, Form, KeyRequest};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use uuid::Uuid;

/// How a value is written on the command line.
trait Arg {
    /// Inside `[…]` or `(…)`: strings JSON-quoted.
    fn nested(&self) -> String;
    /// As whole arguments (a struct: one per field; a string: as is).
    fn top(&self) -> Vec<String> {
        vec![self.nested()]
    }
}

macro_rules! int_arg {
    ($($t:ident)*) => {$(
        impl Arg for $t {
            fn nested(&self) -> String {
                format!(concat!(stringify!($t), ":{}"), self)
            }
        }
    )*};
}
int_arg!(u8 u16 u32 u64 u128 i8 i16 i32 i64 i128);

impl Arg for bool {
    fn nested(&self) -> String {
        format!("b:{self}")
    }
}

impl Arg for char {
    fn nested(&self) -> String {
        format!("c:{self}")
    }
}

impl Arg for String {
    fn nested(&self) -> String {
        format!("s:{}", serde_json::Value::from(self.as_str()))
    }
    fn top(&self) -> Vec<String> {
        vec![format!("s:{self}")]
    }
}

impl Arg for Uuid {
    fn nested(&self) -> String {
        format!("uuid:{self}")
    }
}

impl<T: Arg> Arg for Option<T> {
    fn nested(&self) -> String {
        match self {
            None => "none".into(),
            Some(v) => format!("some:{}", v.nested()),
        }
    }
    fn top(&self) -> Vec<String> {
        match self {
            None => vec!["none".into()],
            // Outside brackets the payload is written as a whole argument.
            Some(v) => match &v.top()[..] {
                [one] => vec![format!("some:{one}")],
                _ => vec![format!("some:{}", v.nested())],
            },
        }
    }
}

fn list<'a, T: Arg + 'a>(items: impl IntoIterator<Item = &'a T>) -> String {
    items
        .into_iter()
        .map(Arg::nested)
        .collect::<Vec<_>>()
        .join(",")
}

impl<T: Arg> Arg for Vec<T> {
    fn nested(&self) -> String {
        format!("seq:[{}]", list(self))
    }
}

impl<T: Arg, const N: usize> Arg for [T; N] {
    fn nested(&self) -> String {
        format!("seq:[{}]", list(self))
    }
}

impl<A: Arg, B: Arg> Arg for (A, B) {
    fn nested(&self) -> String {
        format!("({},{})", self.0.nested(), self.1.nested())
    }
}

/// A struct's fields, nested as a group or as one argument each.
fn group(fields: &[&dyn Arg]) -> String {
    let parts: Vec<String> = fields.iter().map(|f| f.nested()).collect();
    format!("({})", parts.join(","))
}

fn args(fields: &[&dyn Arg]) -> Vec<String> {
    fields.iter().flat_map(|f| f.top()).collect()
}

#[derive(AdvisoryKey, Clone, Debug)]
struct Scalars {
    a: u8,
    b: i16,
    c: i64,
    d: u128,
    e: i128,
    f: bool,
    g: char,
    h: String,
}

#[derive(AdvisoryKey, Clone, Debug)]
#[advisory_key(namespace = "cli.inner")]
struct Inner {
    id: u32,
    tag: Option<char>,
}

impl Arg for Inner {
    fn nested(&self) -> String {
        group(&[&self.id, &self.tag])
    }
    fn top(&self) -> Vec<String> {
        args(&[&self.id, &self.tag])
    }
}

#[derive(AdvisoryKey, Clone, Debug)]
enum Kind {
    Account,
    Order(i64),
    Named { id: u64, label: String },
    Nested(Inner, bool),
}

impl Kind {
    fn fields(&self) -> Vec<&dyn Arg> {
        match self {
            Kind::Account => vec![],
            Kind::Order(id) => vec![id],
            Kind::Named { id, label } => vec![id, label],
            Kind::Nested(inner, flag) => vec![inner, flag],
        }
    }
    fn name(&self) -> &'static str {
        match self {
            Kind::Account => "Account",
            Kind::Order(_) => "Order",
            Kind::Named { .. } => "Named",
            Kind::Nested(..) => "Nested",
        }
    }
}

impl Arg for Kind {
    fn nested(&self) -> String {
        let fields = self.fields();
        if fields.is_empty() {
            format!("variant:{}", self.name())
        } else {
            let parts: Vec<String> = fields.iter().map(|f| f.nested()).collect();
            format!("variant:{}({})", self.name(), parts.join(","))
        }
    }
    /// As whole arguments: the variant, then its fields one by one (the
    /// same encoding as `variant:Name(…)`).
    fn top(&self) -> Vec<String> {
        let mut out = vec![format!("variant:{}", self.name())];
        out.extend(args(&self.fields()));
        out
    }
}

#[derive(AdvisoryKey, Clone, Debug)]
#[advisory_key(namespace = "cli.composite")]
struct Composite {
    kind: Kind,
    kinds: Vec<Kind>,
    parent: Option<Inner>,
    ids: [u16; 3],
    pair: (i8, String),
    id: Uuid,
    maybe: Option<Option<bool>>,
    names: Vec<String>,
    nested: Vec<Vec<i32>>,
}

#[derive(AdvisoryKey, Clone, Debug)]
#[advisory_key(pair)]
struct PairKey {
    s: String,
    i: i32,
}

#[derive(AdvisoryKey, Clone, Debug)]
#[advisory_key(pair, class = -17)]
struct Classed {
    i: u64,
    k: Kind,
}

#[derive(AdvisoryKey, Clone, Debug)]
#[advisory_key(stripes = 7)]
struct Striped {
    s: String,
}

#[derive(AdvisoryKey, Clone, Debug)]
#[advisory_key(pair = "exact", class = 9)]
struct Exact(i32);

#[derive(AdvisoryKey, Clone, Debug)]
#[advisory_key(raw)]
struct Raw(i64);

#[derive(AdvisoryKey, Clone, Debug)]
#[advisory_key(raw)]
struct RawPair((i32, i32));

fn inner() -> impl Strategy<Value = Inner> {
    (any::<u32>(), any::<Option<char>>()).prop_map(|(id, tag)| Inner { id, tag })
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Account),
        any::<i64>().prop_map(Kind::Order),
        (any::<u64>(), any::<String>()).prop_map(|(id, label)| Kind::Named { id, label }),
        (inner(), any::<bool>()).prop_map(|(i, b)| Kind::Nested(i, b)),
    ]
}

fn scalars() -> impl Strategy<Value = Scalars> {
    (
        (any::<u8>(), any::<i16>(), any::<i64>(), any::<u128>()),
        (any::<i128>(), any::<bool>(), any::<char>(), any::<String>()),
    )
        .prop_map(|((a, b, c, d), (e, f, g, h))| Scalars {
            a,
            b,
            c,
            d,
            e,
            f,
            g,
            h,
        })
}

fn composite() -> impl Strategy<Value = Composite> {
    (
        (
            kind(),
            prop::collection::vec(kind(), 0..4),
            prop::option::of(inner()),
            any::<[u16; 3]>(),
        ),
        (
            (any::<i8>(), any::<String>()),
            any::<u128>().prop_map(Uuid::from_u128),
            any::<Option<Option<bool>>>(),
            prop::collection::vec(any::<String>(), 0..4),
            prop::collection::vec(prop::collection::vec(any::<i32>(), 0..3), 0..3),
        ),
    )
        .prop_map(
            |((kind, kinds, parent, ids), (pair, id, maybe, names, nested))| Composite {
                kind,
                kinds,
                parent,
                ids,
                pair,
                id,
                maybe,
                names,
                nested,
            },
        )
}

fn composite_args(v: &Composite) -> Vec<String> {
    args(&[
        &v.kind, &v.kinds, &v.parent, &v.ids, &v.pair, &v.id, &v.maybe, &v.names, &v.nested,
    ])
}

/// The keys `lockkit key` computes for `args` (the library the binary runs).
fn cli_key(
    form: Form,
    namespace: Option<&str>,
    class: Option<i32>,
    stripes: Option<u64>,
    args: &[String],
) -> Result<LockKey, TestCaseError> {
    let values = args
        .iter()
        .map(|a| parse_value(a))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TestCaseError::fail(format!("{e} in {args:?}")))?;
    let mut request = KeyRequest::new(namespace, values);
    request.form = form;
    request.class = class;
    request.stripes = stripes;
    let keys = compute(&request).map_err(|e| TestCaseError::fail(format!("{e} for {args:?}")))?;
    match (form, keys.bigint, keys.pair) {
        (Form::BigInt | Form::HashText, Some(k), None) => Ok(k),
        (Form::Pair | Form::Exact, None, Some(k)) => Ok(k),
        (Form::Raw, Some(k), None) | (Form::Raw, None, Some(k)) => Ok(k),
        other => Err(TestCaseError::fail(format!("unexpected keys {other:?}"))),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn scalars_agree(v in scalars()) {
        let a = args(&[&v.a, &v.b, &v.c, &v.d, &v.e, &v.f, &v.g, &v.h]);
        prop_assert_eq!(cli_key(Form::BigInt, Some("Scalars"), None, None, &a)?, v.lock_key());
    }

    #[test]
    fn composites_agree(v in composite()) {
        let a = composite_args(&v);
        prop_assert_eq!(cli_key(Form::BigInt, Some("cli.composite"), None, None, &a)?, v.lock_key());
    }

    #[test]
    fn enums_agree(k in kind(), nested in any::<bool>()) {
        // An enum key type: as `variant:Name(…)` or as the variant then its
        // fields, which encode alike.
        let a = if nested { vec![k.nested()] } else { k.top() };
        prop_assert_eq!(cli_key(Form::BigInt, Some("Kind"), None, None, &a)?, k.lock_key());
    }

    #[test]
    fn nested_groups_agree(i in inner(), s in scalars()) {
        // A derived type written as one `(…)` argument.
        prop_assert_eq!(
            cli_key(Form::BigInt, Some("cli.inner"), None, None, &[i.nested()])?,
            i.lock_key()
        );
        let fields: [&dyn Arg; 8] = [&s.a, &s.b, &s.c, &s.d, &s.e, &s.f, &s.g, &s.h];
        prop_assert_eq!(
            cli_key(Form::BigInt, Some("Scalars"), None, None, &[group(&fields)])?,
            s.lock_key()
        );
    }

    #[test]
    fn forms_agree(
        s in any::<String>(),
        i in any::<i32>(),
        u in any::<u64>(),
        k in kind(),
        l in any::<i64>(),
        p in any::<(i32, i32)>(),
    ) {
        let v = PairKey { s: s.clone(), i };
        prop_assert_eq!(cli_key(Form::Pair, Some("PairKey"), None, None, &args(&[&v.s, &v.i]))?, v.lock_key());
        let v = Classed { i: u, k };
        prop_assert_eq!(cli_key(Form::Pair, Some("Classed"), Some(-17), None, &args(&[&v.i, &v.k]))?, v.lock_key());
        let v = Striped { s: s.clone() };
        prop_assert_eq!(cli_key(Form::BigInt, Some("Striped"), None, Some(7), &args(&[&v.s]))?, v.lock_key());
        prop_assert_eq!(cli_key(Form::Exact, Some("Exact"), Some(9), None, &[i.nested()])?, Exact(i).lock_key());
        prop_assert_eq!(cli_key(Form::Raw, None, None, None, &[l.nested()])?, Raw(l).lock_key());
        prop_assert_eq!(cli_key(Form::Raw, None, None, None, &args(&[&p.0, &p.1]))?, RawPair(p).lock_key());
        prop_assert_eq!(cli_key(Form::Raw, None, None, None, &[p.nested()])?, RawPair(p).lock_key());
        prop_assert_eq!(cli_key(Form::HashText, None, None, None, &s.top())?, HashText(&s).lock_key());
    }
}

/// The control: the same comparison fails when one value is typed wrong (a
/// digit-only string given as an integer, a variant as a string), so the
/// properties above can fail.
#[test]
fn a_mistyped_value_gives_another_key() {
    let v = PairKey {
        s: "42".into(),
        i: 1,
    };
    let wrong = cli_key(
        Form::Pair,
        Some("PairKey"),
        None,
        None,
        &["i:42".into(), "i32:1".into()],
    );
    assert_ne!(wrong.unwrap(), v.lock_key());
    let right = cli_key(
        Form::Pair,
        Some("PairKey"),
        None,
        None,
        &["s:42".into(), "i32:1".into()],
    );
    assert_eq!(right.unwrap(), v.lock_key());
    let k = Kind::Account;
    let wrong = cli_key(
        Form::BigInt,
        Some("Kind"),
        None,
        None,
        &["s:Account".into()],
    );
    assert_ne!(wrong.unwrap(), k.lock_key());
}

/// The binary end to end on a few random composite values.
#[test]
fn the_binary_agrees_with_the_derive() {
    let mut runner = TestRunner::new(Config::with_cases(12));
    runner
        .run(&composite(), |v| {
            let args = composite_args(&v);
            // A process argument cannot hold a NUL byte.
            prop_assume!(args.iter().all(|a| !a.contains('\0')));
            let mut command = Command::new(env!("CARGO_BIN_EXE_lockkit"));
            command.args(["key", "--form", "bigint", "--json", "cli.composite"]);
            command.args(args);
            let out = command.output().expect("run lockkit");
            prop_assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let LockKey::BigInt(want) = v.lock_key() else {
                unreachable!()
            };
            prop_assert_eq!(doc["bigint"]["key"].as_i64(), Some(want));
            Ok(())
        })
        .unwrap();
}
