//! docs/KEYS.md cannot drift from the code: its golden vectors, its parts
//! examples, its `ns_hash` and its `hashtext` figures are read out of the
//! document and each is compared with what lockkit computes.

use lockkit::key::{hashtext_key, parts_bytes};
use lockkit::{KeySpec, LockKey};
use lockkit_tests::keys_doc::{tables, text as doc};

fn unquote(cell: &str) -> &str {
    cell.trim().trim_matches('`')
}

/// One field of the golden table, `name: type = value`, put into `parts`
/// as a value of that Rust type.
fn put_field(field: &str, parts: &mut lockkit::key::Parts<'_>) {
    let (_, rest) = field.split_once(": ").expect("`name: type = value`");
    let (ty, value) = rest.split_once(" = ").expect("`type = value`");
    let string = || {
        value
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or_else(|| panic!("string value {value:?} is not quoted"))
    };
    match ty {
        "i64" => parts.put(&value.parse::<i64>().unwrap()),
        "i32" => parts.put(&value.parse::<i32>().unwrap()),
        "u64" => parts.put(&value.parse::<u64>().unwrap()),
        "String" => parts.put(&string().to_owned()),
        "&str" => parts.put(string()),
        other => panic!("field type {other} of docs/KEYS.md is not known to this test"),
    };
}

fn parse_pair(cell: &str) -> LockKey {
    let inner = cell.trim_start_matches('(').trim_end_matches(')');
    let (c, o) = inner.split_once(", ").expect("(class, object)");
    LockKey::Pair(c.parse().unwrap(), o.parse().unwrap())
}

#[test]
fn golden_vectors_equal_the_code() {
    let doc = doc();
    let rows = &tables(&doc, "Golden vectors")[0];
    for row in rows {
        let [ns, options, fields, bigint, pair] = &row[..] else {
            panic!("a golden vector row has 5 cells: {row:?}");
        };
        let mut spec = KeySpec::try_new(unquote(ns)).unwrap();
        let options = unquote(options);
        if !options.is_empty() {
            let n = options
                .strip_prefix("stripes = ")
                .unwrap_or_else(|| panic!("unknown type option {options:?}"));
            spec = spec.stripes(n.parse().unwrap());
        }
        let fields = unquote(fields);
        let encode = |p: &mut lockkit::key::Parts<'_>| {
            for field in fields.split("`, `").flat_map(|f| f.split(", ")) {
                put_field(field, p);
            }
        };
        let want_bigint = LockKey::BigInt(bigint.parse().unwrap());
        assert_eq!(spec.key_with(encode), want_bigint, "BigInt of {row:?}");
        assert_eq!(
            spec.pair().key_with(encode),
            parse_pair(pair),
            "Pair of {row:?}"
        );
    }
    assert!(rows.len() >= 6, "the six golden vectors of version 1");
}

#[test]
fn parts_examples_equal_the_code() {
    let doc = doc();
    let sections = tables(&doc, "The canonical encoding");
    let [_rules, examples] = &sections[..] else {
        panic!("the encoding section has a rules table and an examples table");
    };
    let mut checked = 0;
    for row in examples {
        let value = unquote(&row[0]);
        let computed = match value {
            "42_i32" => parts_bytes(&42_i32),
            "-1_i64" => parts_bytes(&-1_i64),
            "true" => parts_bytes(&true),
            "'x'" => parts_bytes(&'x'),
            "\"ab\"" => parts_bytes("ab"),
            "None::<u8>" => parts_bytes(&None::<u8>),
            "Some(7_u8)" => parts_bytes(&Some(7_u8)),
            "vec![true, false]" => parts_bytes(&vec![true, false]),
            "(1_u8, \"a\")" => parts_bytes(&(1_u8, "a")),
            other => panic!("example {other:?} of docs/KEYS.md is not known to this test"),
        };
        let hex: Vec<String> = computed.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(unquote(&row[1]), hex.join(" "), "parts of {value}");
        checked += 1;
    }
    assert_eq!(checked, examples.len());
    assert!(checked >= 9, "the examples of docs/KEYS.md");
}

#[test]
fn ns_hash_and_hashtext_lines_equal_the_code() {
    let doc = doc();
    let line = doc
        .lines()
        .find(|l| l.starts_with("`ns_hash(\"Order\") = 0x"))
        .expect("the ns_hash line");
    let hex = line
        .split("= 0x")
        .nth(1)
        .and_then(|s| s.split('`').next())
        .unwrap();
    let spec = KeySpec::new("Order");
    assert_eq!(spec.ns_hash(), u64::from_str_radix(hex, 16).unwrap());
    let tag = line.rsplit("= 0x").next().unwrap().trim_end_matches("`.");
    assert_eq!(spec.tag(), u16::from_str_radix(tag, 16).unwrap());

    let line = doc
        .lines()
        .find(|l| l.starts_with("`hashtext('"))
        .expect("the hashtext line");
    let text = line.split('\'').nth(1).unwrap();
    let value: i64 = line
        .split(") = ")
        .nth(1)
        .and_then(|s| s.split('`').next())
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(hashtext_key(text), LockKey::BigInt(value));
    assert!(doc.contains(&format!("`BigInt({value})`")));
}
