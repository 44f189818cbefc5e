//! lockkit's SQL functions (`lockkit::sql::SQL`) compute the keys the
//! derive computes: for at least 1,000 random values of every part type and
//! every key shape (integer extremes of every width, Unicode strings, nested
//! options, sequences, tuples, nested types, variants, Pair keys, explicit
//! classes, stripes above 2^48, exact pairs), for random namespaces, and for
//! every vector of docs/KEYS.md. Values go to the server in batches (a
//! thousand keys per statement), both as constants (folded by the planner)
//! and as parameters (computed at run time).

use std::fmt::Write as _;

use lockkit::key::parts_bytes;
use lockkit::{AdvisoryKey, KeySpec, LockKey};
use lockkit_tests::TestServer;
use tokio_postgres::Client;

/// Values per part type and key shape.
const N: usize = 1000;

/// The generator's seed: a failure reproduces.
const SEED: u64 = 0x5eed_1ec7_2024_0030;

/// A connection to the shared server with the functions installed.
async fn installed(db: &TestServer) -> Client {
    let client = db.connect().await;
    lockkit::sql::install(&client)
        .await
        .expect("install lockkit's SQL functions");
    client
}

/// A Rust value as the SQL expression of its canonical encoding, through
/// lockkit's SQL encoders. `alt` picks among equivalent spellings
/// (`lockkit.some(x)` or `lockkit.option(x)`, `lockkit.tuple(…)` or `||`),
/// so that each is exercised.
trait Sql {
    fn sql(&self, out: &mut String, alt: bool);

    fn to_sql(&self, alt: bool) -> String {
        let mut out = String::new();
        self.sql(&mut out, alt);
        out
    }
}

impl<T: Sql + ?Sized> Sql for &T {
    fn sql(&self, out: &mut String, alt: bool) {
        (**self).sql(out, alt)
    }
}

/// A SQL string literal (`standard_conforming_strings` is on).
fn literal(text: &str) -> String {
    assert!(!text.contains('\0'), "a PostgreSQL text cannot hold U+0000");
    format!("'{}'", text.replace('\'', "''"))
}

/// Integers as a literal cast to a SQL type: each `lockkit.int` overload is
/// exercised by the Rust types that map to it.
macro_rules! sql_int {
    ($($t:ty => $sql:literal),* $(,)?) => {$(
        impl Sql for $t {
            fn sql(&self, out: &mut String, _alt: bool) {
                let _ = write!(out, "lockkit.int('{}'::{})", self, $sql);
            }
        }
    )*};
}

sql_int! {
    i8 => "int2", i16 => "int2", u8 => "int2",
    i32 => "int4", u16 => "int4",
    i64 => "int8", isize => "int8", u32 => "int8",
    u64 => "numeric", usize => "numeric", i128 => "numeric", u128 => "numeric",
}

impl Sql for bool {
    fn sql(&self, out: &mut String, _alt: bool) {
        let _ = write!(out, "lockkit.bool({self})");
    }
}

impl Sql for char {
    fn sql(&self, out: &mut String, alt: bool) {
        if alt || *self == '\0' {
            let _ = write!(out, "lockkit.char({})", u32::from(*self));
        } else {
            let _ = write!(out, "lockkit.char({})", literal(&self.to_string()));
        }
    }
}

impl Sql for str {
    fn sql(&self, out: &mut String, _alt: bool) {
        let _ = write!(out, "lockkit.str({})", literal(self));
    }
}

impl Sql for String {
    fn sql(&self, out: &mut String, alt: bool) {
        self.as_str().sql(out, alt)
    }
}

impl Sql for uuid::Uuid {
    fn sql(&self, out: &mut String, _alt: bool) {
        let _ = write!(out, "lockkit.uuid('{self}')");
    }
}

impl<T: Sql> Sql for Option<T> {
    fn sql(&self, out: &mut String, alt: bool) {
        match (self, alt) {
            (None, false) => out.push_str("lockkit.none()"),
            (None, true) => out.push_str("lockkit.option(NULL)"),
            (Some(v), false) => {
                out.push_str("lockkit.some(");
                v.sql(out, !alt);
                out.push(')');
            }
            (Some(v), true) => {
                out.push_str("lockkit.option(");
                v.sql(out, !alt);
                out.push(')');
            }
        }
    }
}

impl<T: Sql> Sql for Vec<T> {
    fn sql(&self, out: &mut String, alt: bool) {
        if self.is_empty() {
            out.push_str(if alt {
                "lockkit.seq(VARIADIC ARRAY[]::bytea[])"
            } else {
                "lockkit.seq()"
            });
            return;
        }
        out.push_str("lockkit.seq(");
        for (i, item) in self.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            item.sql(out, alt ^ (i % 2 == 1));
        }
        out.push(')');
    }
}

/// A tuple or a nested type's fields: `lockkit.tuple(a, b)`, or `a || b`.
fn tuple(out: &mut String, alt: bool, fields: &[&dyn Sql]) {
    out.push_str(if alt { "(" } else { "lockkit.tuple(" });
    for (i, field) in fields.iter().enumerate() {
        if i > 0 {
            out.push_str(if alt { " || " } else { ", " });
        }
        field.sql(out, alt ^ (i % 2 == 1));
    }
    out.push(')');
}

impl<A: Sql, B: Sql> Sql for (A, B) {
    fn sql(&self, out: &mut String, alt: bool) {
        tuple(out, alt, &[&self.0, &self.1]);
    }
}

impl<A: Sql, B: Sql, C: Sql> Sql for (A, B, C) {
    fn sql(&self, out: &mut String, alt: bool) {
        tuple(out, alt, &[&self.0, &self.1, &self.2]);
    }
}

/// A small deterministic generator of every kind of value.
struct Gen(fastrand::Rng);

impl Gen {
    fn new(salt: u64) -> Self {
        Gen(fastrand::Rng::with_seed(SEED ^ salt))
    }

    /// 128 random bits shifted right by a random amount: every magnitude
    /// is as likely as every other.
    fn bits(&mut self) -> u128 {
        self.0.u128(..) >> self.0.u32(0..128)
    }

    /// ASCII (control characters, quotes and backslashes among them, never
    /// NUL) and 2-, 3- and 4-byte UTF-8.
    fn char(&mut self) -> char {
        loop {
            let code = match self.0.u8(0..6) {
                0 => self.0.u32(1..0x80),
                1 => *self.0.choice(&[0x27, 0x5c, 0x22, 0x24, 0x0a]).unwrap(),
                2 => self.0.u32(0x80..0x800),
                3 => self.0.u32(0x800..0x10000),
                4 => self.0.u32(0x1f300..0x1fa00),
                _ => self.0.u32(0x10000..0x110000),
            };
            if let Some(c) = char::from_u32(code) {
                return c;
            }
        }
    }

    fn string(&mut self) -> String {
        let len = self.0.usize(0..24);
        (0..len).map(|_| self.char()).collect()
    }

    fn option<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> Option<T> {
        self.0.bool().then(|| f(self))
    }

    fn vec<T>(&mut self, max: usize, mut f: impl FnMut(&mut Self) -> T) -> Vec<T> {
        let len = self.0.usize(0..=max);
        (0..len).map(|_| f(self)).collect()
    }

    /// A valid namespace: 1 to 64 of its bytes.
    fn namespace(&mut self) -> String {
        const BYTES: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:/-";
        let len = self.0.usize(1..=64);
        (0..len)
            .map(|_| char::from(*self.0.choice(BYTES).unwrap()))
            .collect()
    }
}

/// One key to compute in SQL and what the derive says it is.
struct Case {
    /// A SQL expression of type `bigint` or `integer`.
    sql: String,
    /// The derive's value for it.
    want: i64,
    /// The Rust value, for the failure message.
    what: String,
}

/// Computes every case's expression on the server, a thousand to a
/// statement, and compares each with the derive.
async fn check(client: &Client, label: &str, cases: &[Case]) {
    assert!(cases.len() >= N, "{label}: {} cases", cases.len());
    let mut wrong = Vec::new();
    for chunk in cases.chunks(1000) {
        let list: Vec<&str> = chunk.iter().map(|c| c.sql.as_str()).collect();
        let query = format!("SELECT ARRAY[{}]::int8[]", list.join(",\n"));
        let row = client
            .query_one(&query, &[])
            .await
            .unwrap_or_else(|e| panic!("{label}: {e:?}"));
        let got: Vec<i64> = row.get(0);
        assert_eq!(got.len(), chunk.len(), "{label}");
        for (case, got) in chunk.iter().zip(got) {
            if got != case.want {
                wrong.push(format!(
                    "{}: SQL {got}, derive {} ({})",
                    case.what, case.want, case.sql
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{label}: {} of {} keys differ, e.g.\n{}",
        wrong.len(),
        cases.len(),
        wrong[..wrong.len().min(5)].join("\n")
    );
}

fn bigint(key: LockKey) -> i64 {
    match key {
        LockKey::BigInt(k) => k,
        LockKey::Pair(..) => panic!("{key} is not a BigInt key"),
    }
}

fn pair(key: LockKey) -> (i32, i32) {
    match key {
        LockKey::Pair(c, o) => (c, o),
        LockKey::BigInt(_) => panic!("{key} is not a Pair key"),
    }
}

/// BigInt-key cases of a derived type `K` with one field: `lockkit.key(ns,
/// enc(field))` against `K::lock_key`.
fn cases_of<T: Sql + std::fmt::Debug, K: AdvisoryKey>(
    values: &[T],
    key: impl Fn(&T) -> K,
) -> Vec<Case> {
    let ns = literal(K::KEY_SPEC.namespace());
    values
        .iter()
        .enumerate()
        .map(|(i, v)| Case {
            sql: format!("lockkit.key({ns}, {})", v.to_sql(i % 2 == 1)),
            want: bigint(key(v).lock_key()),
            what: format!("{v:?}"),
        })
        .collect()
}

// One derived type per integer width, the namespace its name.
macro_rules! int_keys {
    ($($name:ident($t:ty)),* $(,)?) => {$(
        #[derive(AdvisoryKey, Debug)]
        struct $name {
            v: $t,
        }
    )*};
}

int_keys! {
    SqlI8(i8), SqlI16(i16), SqlI32(i32), SqlI64(i64), SqlI128(i128), SqlIsize(isize),
    SqlU8(u8), SqlU16(u16), SqlU32(u32), SqlU64(u64), SqlU128(u128), SqlUsize(usize),
}

/// `N` values of an integer type: its extremes, the i64 and i128 bounds
/// that fall in its range, and random values of every magnitude.
fn ints<T: TryFrom<i128> + TryFrom<u128> + Copy>(gen: &mut Gen) -> Vec<T> {
    let mut out = Vec::new();
    // Every width's bounds, each with its neighbours.
    let signed: [i128; 11] = [
        0,
        i8::MIN.into(),
        i8::MAX.into(),
        u8::MAX.into(),
        i16::MIN.into(),
        i16::MAX.into(),
        u16::MAX.into(),
        i32::MIN.into(),
        i32::MAX.into(),
        u32::MAX.into(),
        i64::MIN.into(),
    ];
    let unsigned: [u128; 4] = [
        i64::MAX as u128,
        u64::MAX.into(),
        i128::MAX as u128,
        u128::MAX,
    ];
    for d in [-1, 0, 1] {
        for s in signed {
            out.extend(s.checked_add(d).and_then(|v| T::try_from(v).ok()));
        }
        for u in unsigned {
            out.extend(u.checked_add_signed(d).and_then(|v| T::try_from(v).ok()));
        }
    }
    out.extend(T::try_from(i128::MIN).ok());
    out.extend(T::try_from(i128::MIN + 1).ok());
    while out.len() < N {
        let bits = gen.bits();
        let v = if gen.0.bool() {
            T::try_from(bits).ok()
        } else {
            T::try_from(-(bits as i128 & i128::MAX)).ok()
        };
        out.extend(v);
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn integers_of_every_width_equal_the_derive() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = installed(db).await;
    let mut gen = Gen::new(1);

    macro_rules! width {
        ($name:ident, $t:ty, $sql:literal) => {{
            let values: Vec<$t> = ints(&mut gen);
            for extreme in [<$t>::MIN, <$t>::MAX] {
                assert!(values.contains(&extreme));
            }
            // As constants: each `lockkit.int` overload, folded by the planner.
            let cases = cases_of(&values, |&v| $name { v });
            check(&client, stringify!($name), &cases).await;
            // As parameters, computed at run time, with the encodings.
            let text: Vec<String> = values.iter().map(|v| v.to_string()).collect();
            let query = concat!(
                "SELECT array_agg(lockkit.key($1, lockkit.int(v::",
                $sql,
                ")) ORDER BY i), array_agg(lockkit.int(v::",
                $sql,
                ") ORDER BY i) FROM unnest($2::text[]) WITH ORDINALITY AS u(v, i)"
            );
            let row = client
                .query_one(query, &[&stringify!($name), &text])
                .await
                .unwrap();
            let keys: Vec<i64> = row.get(0);
            let bytes: Vec<Vec<u8>> = row.get(1);
            for ((v, key), bytes) in values.iter().zip(keys).zip(bytes) {
                assert_eq!(key, bigint($name { v: *v }.lock_key()), "{v}");
                assert_eq!(bytes, parts_bytes(v), "{v}");
            }
        }};
    }
    width!(SqlI8, i8, "int2");
    width!(SqlI16, i16, "int2");
    width!(SqlI32, i32, "int4");
    width!(SqlI64, i64, "int8");
    width!(SqlI128, i128, "numeric");
    width!(SqlIsize, isize, "int8");
    width!(SqlU8, u8, "int2");
    width!(SqlU16, u16, "int4");
    width!(SqlU32, u32, "int8");
    width!(SqlU64, u64, "numeric");
    width!(SqlU128, u128, "numeric");
    width!(SqlUsize, usize, "numeric");
}

#[derive(AdvisoryKey, Debug)]
struct SqlBool {
    v: bool,
}

#[derive(AdvisoryKey, Debug)]
struct SqlChar {
    v: char,
}

#[derive(AdvisoryKey, Debug)]
#[advisory_key(namespace = "lockkit-tests.sql/str")]
struct SqlStr {
    v: String,
}

#[derive(AdvisoryKey, Debug)]
struct SqlUuid {
    v: uuid::Uuid,
}

#[tokio::test(flavor = "multi_thread")]
async fn scalars_equal_the_derive() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = installed(db).await;
    let mut gen = Gen::new(2);

    let bools: Vec<bool> = (0..N).map(|_| gen.0.bool()).collect();
    check(&client, "bool", &cases_of(&bools, |&v| SqlBool { v })).await;

    let mut chars: Vec<char> = vec!['\0', '\'', '\\', char::MAX, '\u{d7ff}', '\u{e000}'];
    chars.extend((chars.len()..N).map(|_| gen.char()));
    check(&client, "char", &cases_of(&chars, |&v| SqlChar { v })).await;

    let mut strings: Vec<String> =
        vec![String::new(), "'".into(), "\\".into(), "a\u{10ffff}".into()];
    strings.extend((strings.len()..N).map(|_| gen.string()));
    assert!(strings.iter().any(|s| s.chars().any(|c| c.len_utf8() == 4)));
    let cases = cases_of(&strings, |v| SqlStr { v: v.clone() });
    check(&client, "string", &cases).await;

    let uuids: Vec<uuid::Uuid> = (0..N)
        .map(|_| uuid::Uuid::from_u128(gen.0.u128(..)))
        .chain([uuid::Uuid::nil(), uuid::Uuid::max()])
        .collect();
    check(&client, "uuid", &cases_of(&uuids, |&v| SqlUuid { v })).await;
}

/// In a SQL_ASCII database, whose text is the bytes the client sent with
/// no encoding (its `char_length('é')` counts 2), `lockkit.char` reads those
/// bytes as UTF-8, as a UTF-8 client sends them, and gives the key Rust
/// gives for every char of the scalar test (and `lockkit.str` for strings);
/// bytes that are not exactly one well-formed UTF-8 character are refused,
/// with the bytes in hex.
#[tokio::test(flavor = "multi_thread")]
async fn chars_in_a_sql_ascii_database_equal_the_derive() {
    let db = TestServer::shared();
    let _log = db.guard();
    let admin = db.connect().await;
    let name = "lockkit_tests_sql_ascii";
    for sql in [
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        format!(
            "CREATE DATABASE {name} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' \
             TEMPLATE template0"
        ),
    ] {
        admin.batch_execute(&sql).await.expect(&sql);
    }
    let mut config = db.config();
    config.dbname(name);
    let (client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .expect("connect to the SQL_ASCII database");
    tokio::spawn(connection);
    lockkit::sql::install(&client)
        .await
        .expect("install lockkit's SQL functions");
    // The failure of a function that counts the database's characters.
    let row = client
        .query_one(
            "SELECT current_setting('server_encoding'), char_length('é')::int4",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "SQL_ASCII");
    assert_eq!(row.get::<_, i32>(1), 2, "SQL_ASCII counts bytes");

    let mut gen = Gen::new(2);
    let mut chars: Vec<char> = vec!['é', '€', '\u{1f600}', '\u{80}', '\u{7ff}', '\u{800}'];
    chars.extend(['\0', '\'', '\\', char::MAX, '\u{d7ff}', '\u{e000}']);
    chars.extend((chars.len()..N).map(|_| gen.char()));
    let cases = cases_of(&chars, |&v| SqlChar { v });
    check(&client, "char in SQL_ASCII", &cases).await;
    // Strings too: their bytes, as UTF-8.
    let mut strings: Vec<String> = vec!["é".into(), "a\u{10ffff}".into(), String::new()];
    strings.extend((strings.len()..N).map(|_| gen.string()));
    let cases = cases_of(&strings, |v| SqlStr { v: v.clone() });
    check(&client, "string in SQL_ASCII", &cases).await;
    let e = client
        .query_one(r"SELECT lockkit.str(E'\xe9')", &[])
        .await
        .expect_err("a string that is not UTF-8");
    assert_eq!(e.code().map(|c| c.code()), Some("22021"), "{e:?}");

    for (bytes, message) in [
        (r"\xe9", "one UTF-8 character, not bytes e9"), // é in LATIN1
        (r"\xc3\xa9\xc3\xa9", "one character, not 2 (bytes c3a9c3a9)"),
        (r"\xc3", "one UTF-8 character, not bytes c3"), // cut short
        (r"\xc0\xaf", "one UTF-8 character, not bytes c0af"), // overlong '/'
        (r"\xed\xa0\x80", "one UTF-8 character, not bytes eda080"), // a surrogate
        (
            r"\xf4\x90\x80\x80",
            "one UTF-8 character, not bytes f4908080",
        ), // above U+10FFFF
        ("", "one character, not 0 (bytes )"),
    ] {
        let sql = format!("SELECT lockkit.char(E'{bytes}')");
        let e = client.query_one(&sql, &[]).await.expect_err(&sql);
        let db_error = e.as_db_error().expect(&sql);
        assert_eq!(db_error.code().code(), "22023", "{sql}: {e:?}");
        assert!(db_error.message().contains(message), "{sql}: {e:?}");
    }
    drop(client);
    admin
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .unwrap();
}

#[derive(AdvisoryKey, Debug)]
struct SqlNestedOption {
    v: Option<Option<Option<i32>>>,
}

#[derive(AdvisoryKey, Debug)]
struct SqlSeq {
    v: Vec<String>,
}

#[derive(AdvisoryKey, Debug)]
struct SqlNestedSeq {
    v: Vec<Vec<Option<u8>>>,
}

#[derive(AdvisoryKey, Debug)]
struct SqlTuple {
    v: (i64, String, bool),
}

#[derive(AdvisoryKey, Debug)]
struct SqlNestedTuple {
    v: ((u8, char), Option<u128>),
}

#[tokio::test(flavor = "multi_thread")]
async fn options_sequences_and_tuples_equal_the_derive() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = installed(db).await;
    let mut gen = Gen::new(3);

    let options: Vec<Option<Option<Option<i32>>>> = (0..N)
        .map(|_| gen.option(|g| g.option(|g| g.option(|g| g.0.i32(..)))))
        .collect();
    assert!(options.iter().any(|o| matches!(o, Some(Some(Some(_))))));
    let cases = cases_of(&options, |&v| SqlNestedOption { v });
    check(&client, "nested options", &cases).await;

    let seqs: Vec<Vec<String>> = (0..N).map(|_| gen.vec(5, Gen::string)).collect();
    assert!(seqs.iter().any(Vec::is_empty));
    let cases = cases_of(&seqs, |v| SqlSeq { v: v.clone() });
    check(&client, "sequences", &cases).await;

    let nested: Vec<Vec<Vec<Option<u8>>>> = (0..N)
        .map(|_| gen.vec(3, |g| g.vec(3, |g| g.option(|g| g.0.u8(..)))))
        .collect();
    let cases = cases_of(&nested, |v| SqlNestedSeq { v: v.clone() });
    check(&client, "nested sequences", &cases).await;

    let tuples: Vec<(i64, String, bool)> = (0..N)
        .map(|_| (gen.bits() as i64, gen.string(), gen.0.bool()))
        .collect();
    let cases = cases_of(&tuples, |v| SqlTuple { v: v.clone() });
    check(&client, "tuples", &cases).await;

    let nested: Vec<((u8, char), Option<u128>)> = (0..N)
        .map(|_| ((gen.0.u8(..), gen.char()), gen.option(Gen::bits)))
        .collect();
    let cases = cases_of(&nested, |&v| SqlNestedTuple { v });
    check(&client, "nested tuples", &cases).await;
}

/// A key type nested in others: its fields concatenated.
#[derive(AdvisoryKey, Debug, Clone)]
struct Inner {
    a: u16,
    b: String,
}

impl Sql for Inner {
    fn sql(&self, out: &mut String, alt: bool) {
        tuple(out, alt, &[&self.a, &self.b]);
    }
}

#[derive(AdvisoryKey, Debug, Clone)]
#[allow(non_camel_case_types)]
enum Variant {
    Unit,
    Tuple(i64, String),
    Named { id: u32, tag: Option<char> },
    Nested(Inner),
    r#type(bool),
}

impl Sql for Variant {
    fn sql(&self, out: &mut String, alt: bool) {
        let (name, fields): (&str, Vec<&dyn Sql>) = match self {
            Variant::Unit => ("Unit", vec![]),
            Variant::Tuple(a, b) => ("Tuple", vec![a as &dyn Sql, b]),
            Variant::Named { id, tag } => ("Named", vec![id as &dyn Sql, tag]),
            Variant::Nested(inner) => ("Nested", vec![inner as &dyn Sql]),
            Variant::r#type(b) => ("type", vec![b as &dyn Sql]),
        };
        let _ = write!(out, "lockkit.variant({}", literal(name));
        for field in fields {
            out.push_str(", ");
            field.sql(out, alt);
        }
        out.push(')');
    }
}

#[derive(AdvisoryKey, Debug)]
struct SqlNested {
    x: Inner,
    y: i8,
}

#[derive(AdvisoryKey, Debug)]
struct SqlVariants {
    v: Vec<Variant>,
}

#[tokio::test(flavor = "multi_thread")]
async fn nested_types_and_variants_equal_the_derive() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = installed(db).await;
    let mut gen = Gen::new(4);
    let inner = |g: &mut Gen| Inner {
        a: g.0.u16(..),
        b: g.string(),
    };
    let variant = |g: &mut Gen| match g.0.u8(0..5) {
        0 => Variant::Unit,
        1 => Variant::Tuple(g.bits() as i64, g.string()),
        2 => Variant::Named {
            id: g.0.u32(..),
            tag: g.option(Gen::char),
        },
        3 => Variant::Nested(inner(g)),
        _ => Variant::r#type(g.0.bool()),
    };

    // A nested type's fields, given as one part or as its fields in turn.
    let nested: Vec<(Inner, i8)> = (0..N).map(|_| (inner(&mut gen), gen.0.i8(..))).collect();
    let mut cases = Vec::new();
    for (i, (x, y)) in nested.iter().enumerate() {
        let want = bigint(
            SqlNested {
                x: x.clone(),
                y: *y,
            }
            .lock_key(),
        );
        let sql = if i % 2 == 0 {
            format!(
                "lockkit.key('SqlNested', {}, {})",
                x.to_sql(false),
                y.to_sql(false)
            )
        } else {
            format!(
                "lockkit.key('SqlNested', {}, {}, {})",
                x.a.to_sql(true),
                x.b.to_sql(true),
                y.to_sql(true)
            )
        };
        cases.push(Case {
            sql,
            want,
            what: format!("{x:?}, {y}"),
        });
    }
    check(&client, "nested types", &cases).await;

    // Every variant as the key type itself, then in sequences.
    let variants: Vec<Variant> = (0..N).map(|_| variant(&mut gen)).collect();
    let cases = cases_of(&variants, |v| v.clone());
    check(&client, "variants", &cases).await;
    let seqs: Vec<Vec<Variant>> = (0..N).map(|_| gen.vec(3, variant)).collect();
    let cases = cases_of(&seqs, |v| SqlVariants { v: v.clone() });
    check(&client, "sequences of variants", &cases).await;
}

#[derive(AdvisoryKey, Debug)]
#[advisory_key(namespace = "Tenanted", pair)]
struct SqlPair<'a> {
    tenant: &'a str,
    id: u64,
}

#[derive(AdvisoryKey, Debug)]
#[advisory_key(namespace = "lockkit-tests.sql:class", pair, class = -2147483648)]
struct SqlClass<'a> {
    tenant: &'a str,
    id: u64,
}

#[derive(AdvisoryKey, Debug)]
#[advisory_key(stripes = 18446744073709551615)]
struct SqlStripesMax {
    v: i64,
}

#[derive(AdvisoryKey, Debug)]
#[advisory_key(pair, stripes = 281474976710677)]
struct SqlPairStripes {
    v: i64,
}

#[derive(AdvisoryKey, Debug)]
#[advisory_key(pair = "exact")]
struct SqlExact {
    id: i32,
}

#[derive(AdvisoryKey, Debug)]
#[advisory_key(pair = "exact", class = 7)]
struct SqlExactClass {
    id: i32,
}

#[tokio::test(flavor = "multi_thread")]
async fn pair_keys_classes_stripes_and_exact_pairs_equal_the_derive() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = installed(db).await;
    let mut gen = Gen::new(5);
    let values: Vec<(String, u64)> = (0..N).map(|_| (gen.string(), gen.bits() as u64)).collect();
    let parts =
        |(t, id): &(String, u64), alt: bool| format!("{}, {}", t.to_sql(alt), id.to_sql(alt));

    // Pair keys of the derived class, and of an explicit class.
    let mut objects = Vec::new();
    let mut classes = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let (class, object) = pair(
            SqlPair {
                tenant: &v.0,
                id: v.1,
            }
            .lock_key(),
        );
        classes.push(Case {
            sql: "lockkit.pair_class('Tenanted')".into(),
            want: class.into(),
            what: format!("{v:?}"),
        });
        objects.push(Case {
            sql: format!("lockkit.pair_object('Tenanted', {})", parts(v, i % 2 == 1)),
            want: object.into(),
            what: format!("{v:?}"),
        });
        let (class, object) = pair(
            SqlClass {
                tenant: &v.0,
                id: v.1,
            }
            .lock_key(),
        );
        assert_eq!(class, i32::MIN);
        objects.push(Case {
            sql: format!(
                "lockkit.pair_object('lockkit-tests.sql:class', {})",
                parts(v, i % 2 == 0)
            ),
            want: object.into(),
            what: format!("class {v:?}"),
        });
    }
    check(&client, "pair classes", &classes).await;
    check(&client, "pair objects", &objects).await;

    // Random explicit classes: the class is the caller's, the object the
    // same as the derived class's.
    let mut cases = Vec::new();
    for v in &values {
        let class = gen.0.i32(..);
        let spec = KeySpec::new("Tenanted").class(class);
        let (c, object) = pair(spec.key_of(&(v.0.as_str(), v.1)));
        assert_eq!(c, class);
        cases.push(Case {
            sql: format!("lockkit.pair_object('Tenanted', {})", parts(v, false)),
            want: object.into(),
            what: format!("class {class}, {v:?}"),
        });
    }
    check(&client, "explicit classes", &cases).await;

    // Stripes above 2^48, random (through KeySpec, as the derive expands)
    // and as derive attributes, in both key spaces.
    let mut cases = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let stripes = (1_u64 << 48) + gen.0.u64(..u64::MAX - (1 << 48));
        let spec = KeySpec::new("lockkit-tests.sql/stripes").stripes(stripes);
        let field = (v.0.as_str(), v.1);
        cases.push(Case {
            sql: format!(
                "lockkit.striped_key('lockkit-tests.sql/stripes', {stripes}, {})",
                parts(v, i % 2 == 1)
            ),
            want: bigint(spec.key_of(&field)),
            what: format!("stripes {stripes}, {v:?}"),
        });
        cases.push(Case {
            sql: format!(
                "lockkit.striped_pair_object('lockkit-tests.sql/stripes', {stripes}, {})",
                parts(v, i % 2 == 0)
            ),
            want: pair(spec.pair().key_of(&field)).1.into(),
            what: format!("pair, stripes {stripes}, {v:?}"),
        });
        let small = gen.0.u64(1..1000);
        let spec = KeySpec::new("Small").stripes(small);
        cases.push(Case {
            sql: format!("lockkit.striped_key('Small', {small}, {})", parts(v, false)),
            want: bigint(spec.key_of(&field)),
            what: format!("stripes {small}, {v:?}"),
        });
        let n = v.1 as i64;
        cases.push(Case {
            sql: format!(
                "lockkit.striped_key('SqlStripesMax', 18446744073709551615, {})",
                n.to_sql(false)
            ),
            want: bigint(SqlStripesMax { v: n }.lock_key()),
            what: format!("SqlStripesMax {n}"),
        });
        cases.push(Case {
            sql: format!(
                "lockkit.striped_pair_object('SqlPairStripes', 281474976710677, {})",
                n.to_sql(true)
            ),
            want: pair(SqlPairStripes { v: n }.lock_key()).1.into(),
            what: format!("SqlPairStripes {n}"),
        });
    }
    check(&client, "stripes", &cases).await;

    // Exact pairs: the class is the namespace's (or explicit), the object
    // the value itself.
    let mut cases = Vec::new();
    for _ in 0..N {
        let id = gen.0.i32(..);
        let (class, object) = pair(SqlExact { id }.lock_key());
        assert_eq!(object, id);
        cases.push(Case {
            sql: "lockkit.pair_class('SqlExact')".into(),
            want: class.into(),
            what: format!("SqlExact {id}"),
        });
        assert_eq!(SqlExactClass { id }.lock_key(), LockKey::Pair(7, id));
    }
    check(&client, "exact pairs", &cases).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn namespaces_tags_and_classes_equal_keyspec() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = installed(db).await;
    let mut gen = Gen::new(6);
    let namespaces: Vec<String> = (0..N).map(|_| gen.namespace()).collect();
    let mut cases = Vec::new();
    for ns in &namespaces {
        let spec = KeySpec::try_new(ns).unwrap();
        let lit = literal(ns);
        cases.push(Case {
            sql: format!("lockkit.ns_hash({lit})"),
            want: spec.ns_hash() as i64,
            what: format!("ns_hash {ns}"),
        });
        cases.push(Case {
            sql: format!("lockkit.tag({lit})"),
            want: spec.tag().into(),
            what: format!("tag {ns}"),
        });
        cases.push(Case {
            sql: format!("lockkit.pair_class({lit})"),
            want: spec.pair_class().into(),
            what: format!("pair_class {ns}"),
        });
        // Types without fields.
        cases.push(Case {
            sql: format!("lockkit.key({lit})"),
            want: bigint(spec.key_with(|_| {})),
            what: format!("key {ns}"),
        });
        // KEYS.md's body(ns, parts): its low 48 bits are the BigInt key's.
        cases.push(Case {
            sql: format!("lockkit.body({lit}, decode('', 'hex')) & 281474976710655"),
            want: bigint(spec.key_with(|_| {})) & 0xFFFF_FFFF_FFFF,
            what: format!("body {ns}"),
        });
        cases.push(Case {
            sql: format!("lockkit.pair_object({lit})"),
            want: pair(spec.pair().key_with(|_| {})).1.into(),
            what: format!("pair_object {ns}"),
        });
    }
    check(&client, "namespaces", &cases).await;

    // A BigInt key's tag is in pg_locks: the top 16 bits of classid.
    let tx_client = db.connect().await;
    tx_client.batch_execute("BEGIN").await.unwrap();
    let row = tx_client
        .query_one(
            "SELECT pg_advisory_xact_lock(lockkit.key('Order', lockkit.int(42))), \
             (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
              AND pid = pg_backend_pid() AND classid::int8 >> 16 = lockkit.tag('Order'))",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(1), 1);
    tx_client.batch_execute("ROLLBACK").await.unwrap();
}

/// An invalid namespace, a NULL part and an out-of-range integer are
/// errors, never a key (`pg_advisory_xact_lock(NULL)` would lock nothing).
#[tokio::test(flavor = "multi_thread")]
async fn invalid_input_is_an_error() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = installed(db).await;
    for (sql, code) in [
        ("lockkit.key('', lockkit.int(1))", "22023"),
        ("lockkit.key('a b', lockkit.int(1))", "22023"),
        (&*format!("lockkit.key('{}')", "x".repeat(65)), "22023"),
        ("lockkit.key('Order', lockkit.int(NULL::int8))", "22004"),
        ("lockkit.key(NULL, lockkit.int(1))", "22004"),
        ("lockkit.pair_object('Order', lockkit.str(NULL))", "22004"),
        (
            "lockkit.key('Order', lockkit.seq(lockkit.int(1), NULL))",
            "22004",
        ),
        ("lockkit.striped_key('Order', 0, lockkit.int(1))", "22023"),
        (
            "lockkit.striped_key('Order', 18446744073709551616, lockkit.int(1))",
            "22023",
        ),
        (
            "lockkit.striped_key('Order', NULL, lockkit.int(1))",
            "22004",
        ),
        (
            "lockkit.key('Order', lockkit.int(340282366920938463463374607431768211456))",
            "22003",
        ),
        (
            "lockkit.key('Order', lockkit.int(-170141183460469231731687303715884105729))",
            "22003",
        ),
        ("lockkit.key('Order', lockkit.int(1.5))", "22023"),
        ("lockkit.key('Order', lockkit.char('ab'))", "22023"),
        ("lockkit.key('Order', lockkit.char(55296))", "22023"),
    ] {
        let e = client
            .query_one(&format!("SELECT {sql}"), &[])
            .await
            .expect_err(sql);
        assert_eq!(e.code().map(|c| c.code()), Some(code), "{sql}: {e:?}");
    }
}

/// The tables of docs/KEYS.md's section `heading`, each cell without the
/// backticks around it.
fn tables(doc: &str, heading: &str) -> Vec<Vec<Vec<String>>> {
    let mut tables = lockkit_tests::keys_doc::tables(doc, heading);
    for cell in tables.iter_mut().flatten().flatten() {
        *cell = cell.trim_matches('`').to_owned();
    }
    tables
}

#[tokio::test(flavor = "multi_thread")]
async fn every_keys_md_vector() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = installed(db).await;
    let doc = lockkit_tests::keys_doc::text();

    // The golden vectors: BigInt and Pair keys, striped or not.
    let rows = &tables(&doc, "Golden vectors")[0];
    assert!(rows.len() >= 6);
    let mut cases = Vec::new();
    for row in rows {
        let [ns, options, fields, key, pair_key] = &row[..] else {
            panic!("a golden vector row has 5 cells: {row:?}");
        };
        let mut parts = String::new();
        for field in fields.split("`, `").flat_map(|f| f.split(", ")) {
            let (_, rest) = field.split_once(": ").expect("`name: type = value`");
            let (ty, value) = rest.split_once(" = ").expect("`type = value`");
            let _ = write!(
                parts,
                ", {}",
                match ty {
                    "i64" | "i32" | "u64" => format!("lockkit.int({value})"),
                    "String" | "&str" => format!("lockkit.str('{}')", value.trim_matches('"')),
                    other => panic!("field type {other} of docs/KEYS.md is not known to this test"),
                }
            );
        }
        let (class, object) = pair_key
            .trim_matches(|c| c == '(' || c == ')')
            .split_once(", ")
            .expect("(class, object)");
        let (bigint_sql, object_sql) = match options.strip_prefix("stripes = ") {
            None => (
                format!("lockkit.key('{ns}'{parts})"),
                format!("lockkit.pair_object('{ns}'{parts})"),
            ),
            Some(n) => (
                format!("lockkit.striped_key('{ns}', {n}{parts})"),
                format!("lockkit.striped_pair_object('{ns}', {n}{parts})"),
            ),
        };
        for (sql, want) in [
            (bigint_sql, key.as_str()),
            (format!("lockkit.pair_class('{ns}')"), class),
            (object_sql, object),
        ] {
            cases.push(Case {
                sql,
                want: want.parse().unwrap(),
                what: format!("{row:?}"),
            });
        }
    }
    // `ns_hash("Order") = 0x9c010d8157598ee2`, so `tag16("Order") = 0x9c01`.
    let line = doc
        .lines()
        .find(|l| l.starts_with("`ns_hash(\"Order\") = 0x"))
        .expect("the ns_hash line");
    let hex: Vec<&str> = line
        .split("= 0x")
        .skip(1)
        .map(|s| s.split('`').next().unwrap())
        .collect();
    cases.push(Case {
        sql: "lockkit.ns_hash('Order')".into(),
        want: u64::from_str_radix(hex[0], 16).unwrap() as i64,
        what: line.into(),
    });
    cases.push(Case {
        sql: "lockkit.tag('Order')".into(),
        want: i64::from_str_radix(hex[1], 16).unwrap(),
        what: line.into(),
    });
    // Fewer than N: these are the document's, not random.
    let mut wrong = Vec::new();
    let list: Vec<&str> = cases.iter().map(|c| c.sql.as_str()).collect();
    let row = client
        .query_one(&format!("SELECT ARRAY[{}]::int8[]", list.join(", ")), &[])
        .await
        .unwrap();
    for (case, got) in cases.iter().zip(row.get::<_, Vec<i64>>(0)) {
        if got != case.want {
            wrong.push(format!(
                "{}: {got} != {} ({})",
                case.sql, case.want, case.what
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert_eq!(cases.len(), rows.len() * 3 + 2);

    // The parts examples, byte for byte.
    let examples = &tables(&doc, "The canonical encoding")[1];
    let mut checked = 0;
    for row in examples {
        let sql = match row[0].as_str() {
            "42_i32" => "lockkit.int(42)",
            "-1_i64" => "lockkit.int(-1::int8)",
            "true" => "lockkit.bool(true)",
            "'x'" => "lockkit.char('x')",
            "\"ab\"" => "lockkit.str('ab')",
            "None::<u8>" => "lockkit.none()",
            "Some(7_u8)" => "lockkit.some(lockkit.int(7::int2))",
            "vec![true, false]" => "lockkit.seq(lockkit.bool(true), lockkit.bool(false))",
            "(1_u8, \"a\")" => "lockkit.tuple(lockkit.int(1), lockkit.str('a'))",
            other => panic!("example {other:?} of docs/KEYS.md is not known to this test"),
        };
        let bytes: Vec<u8> = client
            .query_one(&format!("SELECT {sql}"), &[])
            .await
            .unwrap()
            .get(0);
        let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex.join(" "), row[1], "{sql}");
        checked += 1;
    }
    assert!(checked >= 9);
}

/// The script installs again over itself, and twice at once: concurrent
/// installs take turns instead of failing.
#[tokio::test(flavor = "multi_thread")]
async fn installs_twice_and_concurrently() {
    let db = TestServer::shared();
    let _log = db.guard();
    let client = installed(db).await;
    lockkit::sql::install(&client)
        .await
        .expect("the second install");
    let (a, b) = (db.connect().await, db.connect().await);
    let (ra, rb) = tokio::join!(lockkit::sql::install(&a), lockkit::sql::install(&b));
    ra.expect("a concurrent install");
    rb.expect("the other concurrent install");
    // Inside a transaction of the caller's, which decides.
    let mut c = db.connect().await;
    let tx = c.transaction().await.unwrap();
    lockkit::sql::install(&tx)
        .await
        .expect("install in a transaction");
    tx.rollback().await.unwrap();
    let key: i64 = client
        .query_one("SELECT lockkit.key('Order', lockkit.int(42))", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(key, -7205368663365046133);
    // Every key function is IMMUTABLE, PARALLEL SAFE and pins its
    // search_path; the two fencing functions are VOLATILE, run as their
    // owner, and pin it too.
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE p.proname NOT IN ('fence', 'fencing_token')), \
             count(*) FILTER (WHERE p.proname NOT IN ('fence', 'fencing_token') \
             AND p.provolatile = 'i' AND p.proparallel = 's' AND NOT p.prosecdef \
             AND p.proconfig = ARRAY['search_path=pg_catalog, pg_temp']), \
             count(*) FILTER (WHERE p.proname IN ('fence', 'fencing_token') \
             AND p.provolatile = 'v' AND p.prosecdef \
             AND p.proconfig = ARRAY['search_path=pg_catalog, pg_temp']) \
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'lockkit'",
            &[],
        )
        .await
        .unwrap();
    let (all, pinned, fencing): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert!(all > 20, "{all}");
    assert_eq!(all, pinned);
    assert_eq!(fencing, 2);
}

/// The caller's session cannot change a key: a search_path that puts a
/// schema of look-alike functions and operators first (the CVE-2018-1058
/// pattern) and `standard_conforming_strings = off` leave every function's
/// result as it is.
#[tokio::test(flavor = "multi_thread")]
async fn keys_do_not_depend_on_the_callers_session() {
    let db = TestServer::shared();
    let _log = db.guard();
    drop(installed(db).await);
    let mut client = db.connect().await;
    let tx = client.transaction().await.unwrap();
    tx.batch_execute(
        "CREATE SCHEMA lockkit_tests_lookalike;
         CREATE FUNCTION lockkit_tests_lookalike.int8send(bigint) RETURNS bytea
             LANGUAGE sql AS $$ SELECT decode('00', 'hex') $$;
         CREATE FUNCTION lockkit_tests_lookalike.xor(bigint, bigint) RETURNS bigint
             LANGUAGE sql AS $$ SELECT 0::bigint $$;
         CREATE OPERATOR lockkit_tests_lookalike.# (
             LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = lockkit_tests_lookalike.xor);
         SET LOCAL search_path = lockkit_tests_lookalike, pg_catalog;
         SET LOCAL standard_conforming_strings = off;",
    )
    .await
    .unwrap();
    // The look-alikes are what an unpinned function would call.
    let row = tx
        .query_one("SELECT 5::int8 # 3::int8, int8send(1::int8)", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 0);
    assert_eq!(row.get::<_, Vec<u8>>(1), [0]);
    let row = tx
        .query_one(
            "SELECT lockkit.key('Order', lockkit.int(42)), lockkit.pair_class('Order'), \
             lockkit.pair_object('Order', lockkit.int(42)), \
             lockkit.key('Tenanted', lockkit.str('acme'), lockkit.int(1001)), \
             lockkit.striped_key('Event', 1024, lockkit.str('a1b2c3d4')), \
             lockkit.key('X', lockkit.seq(), lockkit.none(), lockkit.option(NULL), lockkit.some(lockkit.bool(true))), \
             lockkit.sip(decode('', 'hex'))",
            &[],
        )
        .await
        .unwrap();
    let x = KeySpec::new("X").key_with(|p| {
        p.put(&Vec::<u8>::new())
            .put(&None::<u8>)
            .put(&None::<u8>)
            .put(&Some(true));
    });
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, i32>(1),
            row.get::<_, i32>(2),
            row.get::<_, i64>(3),
            row.get::<_, i64>(4),
            row.get::<_, i64>(5),
            row.get::<_, i64>(6),
        ),
        (
            -7205368663365046133,
            -1677652607,
            1483026571,
            -297873912991975939,
            5974306380683673735,
            bigint(x),
            // SipHash-2-4 of nothing with lockkit's key.
            0x19b9_b136_a430_c0ca,
        )
    );
    tx.rollback().await.unwrap();
}
