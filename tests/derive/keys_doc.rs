//! docs/KEYS.md cannot drift from the code: its golden vectors, its parts
//! examples, its `ns_hash` and its `hashtext` figures, its semaphore slot
//! vectors and class are read out of the document and each is compared with
//! what lockkit computes.

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

/// A semaphore key cell, `` `BigInt(v)` `` or `` `Pair(c, o)` ``.
fn parse_key(cell: &str) -> LockKey {
    let cell = unquote(cell);
    if let Some(v) = cell
        .strip_prefix("BigInt(")
        .and_then(|v| v.strip_suffix(')'))
    {
        return LockKey::BigInt(v.parse().unwrap());
    }
    let pair = cell
        .strip_prefix("Pair")
        .unwrap_or_else(|| panic!("semaphore key {cell:?} is neither BigInt(..) nor Pair(..)"));
    parse_pair(pair)
}

/// "Semaphore slots" from its text alone, with the reference SipHash: the
/// key of slot `slot` of the semaphore named by `k`.
fn slot_from_the_text(k: LockKey, slot: u8) -> LockKey {
    use std::hash::Hasher as _;
    let sip = |bytes: &[u8]| {
        let mut h = siphasher::sip::SipHasher24::new_with_key(b"lockkit-keys-v1!");
        h.write(bytes);
        h.finish()
    };
    let class = (sip(b"ns\0lockkit.semaphore") >> 32) as u32 as i32;
    let mut bytes = b"semaphore\0".to_vec();
    match k {
        LockKey::BigInt(v) => {
            bytes.push(0x01);
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        LockKey::Pair(c, o) => {
            bytes.push(0x02);
            bytes.extend_from_slice(&c.to_le_bytes());
            bytes.extend_from_slice(&o.to_le_bytes());
        }
    }
    let base = ((sip(&bytes) >> 40) << 8) as u32 as i32;
    LockKey::Pair(class, base | i32::from(slot))
}

#[test]
fn semaphore_slot_vectors_equal_the_code() {
    use lockkit::key::{semaphore_base, semaphore_of, semaphore_slot};
    let doc = doc();
    let rows = tables(&doc, "Golden vectors")
        .into_iter()
        .find(|t| t.iter().all(|r| r.len() == 4))
        .expect("the semaphore slot table of the golden vectors");
    let mut spaces = (0, 0);
    for row in &rows {
        let [k, base, slot0, slot3] = &row[..] else {
            unreachable!()
        };
        let k = parse_key(k);
        match k {
            LockKey::BigInt(_) => spaces.0 += 1,
            LockKey::Pair(..) => spaces.1 += 1,
        }
        let base = unquote(base)
            .strip_prefix("0x")
            .unwrap_or_else(|| panic!("base {base:?} is not hex"));
        let base = u32::from_str_radix(base, 16).unwrap() as i32;
        assert_eq!(semaphore_base(k), base, "base of {row:?}");
        for (slot, cell) in [(0, slot0), (3, slot3)] {
            let want = parse_pair(cell);
            assert_eq!(semaphore_slot(k, slot), want, "slot {slot} of {row:?}");
            assert_eq!(slot_from_the_text(k, slot), want, "slot {slot} of {row:?}");
            assert_eq!(semaphore_of(want), Some((base, slot)), "{row:?}");
        }
    }
    assert!(
        rows.len() >= 4 && spaces.0 >= 1 && spaces.1 >= 1,
        "semaphore slot vectors of both key spaces: {rows:?}"
    );
    // The rows said to be the semaphores of the first golden vector are.
    let keys: Vec<LockKey> = rows.iter().map(|r| parse_key(&r[0])).collect();
    let order = KeySpec::new("Order");
    assert!(keys.contains(&order.key_of(&42_i64)), "{keys:?}");
    assert!(keys.contains(&order.pair().key_of(&42_i64)), "{keys:?}");
}

#[test]
fn semaphore_class_equals_the_code() {
    use lockkit::key::{NamespaceError, SEMAPHORE_CLASS, SEMAPHORE_NAMESPACE};
    use std::hash::Hasher;
    let doc = doc();
    assert_eq!(SEMAPHORE_NAMESPACE, "lockkit.semaphore");
    let mut sip = siphasher::sip::SipHasher24::new_with_key(b"lockkit-keys-v1!");
    sip.write(b"ns\0lockkit.semaphore");
    let ns_hash = format!("`ns_hash(\"lockkit.semaphore\") = {:#018x}`", sip.finish());
    assert!(doc.contains(&ns_hash), "docs/KEYS.md should say {ns_hash}");
    let class = format!(
        "`SEMAPHORE_CLASS = {:#010x} = {SEMAPHORE_CLASS}`",
        SEMAPHORE_CLASS as u32
    );
    assert!(doc.contains(&class), "docs/KEYS.md should say {class}");
    // It is the class a Pair type of the namespace would get: the upper
    // 32 bits of its ns_hash. The namespace is refused to key types, and
    // so is the explicit class.
    assert_eq!((sip.finish() >> 32) as u32 as i32, SEMAPHORE_CLASS);
    assert_eq!(
        KeySpec::try_new(SEMAPHORE_NAMESPACE).err(),
        Some(NamespaceError::Reserved)
    );
    let explicit = std::panic::catch_unwind(|| KeySpec::new("Other").pair().class(SEMAPHORE_CLASS));
    assert!(explicit.is_err(), "the class is refused");
    // The class the section reserves is this one.
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("Semaphore slots"))
        .expect("the section \"Semaphore slots\"");
    assert!(section.contains(&format!("explicit class {SEMAPHORE_CLASS} ")));
}
