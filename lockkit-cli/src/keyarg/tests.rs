use super::*;

fn parse(arg: &str) -> Value {
    parse_value(arg).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn parses_every_type() {
    assert_eq!(parse("i:-42"), Value::Int(-42));
    assert_eq!(
        parse("u128:340282366920938463463374607431768211455"),
        Value::UInt(u128::MAX)
    );
    assert_eq!(parse("s:a,b)"), Value::Str("a,b)".into()));
    assert_eq!(parse("s:"), Value::Str(String::new()));
    assert_eq!(parse("c:,"), Value::Char(','));
    assert_eq!(parse("none"), Value::None);
    assert_eq!(
        parse("some:s:none"),
        Value::Some(Box::new(Value::Str("none".into())))
    );
    assert_eq!(
        parse("seq:[ i:1, s:\"x,\\\"y\", c:,,none, (b:true,c:)), seq:[]]"),
        Value::Seq(vec![
            Value::Int(1),
            Value::Str("x,\"y".into()),
            Value::Char(','),
            Value::None,
            Value::Tuple(vec![Value::Bool(true), Value::Char(')')]),
            Value::Seq(vec![]),
        ])
    );
    assert_eq!(
        parse("variant:r#Named(u8:1,variant:Unit)"),
        Value::Variant(
            "Named".into(),
            vec![Value::Int(1), Value::Variant("Unit".into(), vec![])]
        )
    );
}

#[test]
fn refuses_untyped_and_bad_values() {
    for (arg, needle) in [
        ("42", "i:42"),
        ("Account", "variant:Account"),
        ("true", "b:true"),
        ("seq:[1]", "i:1"),
        ("u8:256", "out of range"),
        ("i32:-2147483649", "out of range"),
        ("u64:-1", "out of range"),
        ("f64:1.5", "floats"),
        ("c:ab", "one character"),
        ("seq:[s:a]", "JSON string"),
        ("seq:[i:1", "expected"),
        ("b:yes", "true"),
        ("uuid:nope", "uuid"),
        ("x:1", "unknown type"),
        ("", "missing"),
    ] {
        let e = parse_value(arg).expect_err(arg).to_string();
        assert!(e.contains(needle), "{arg}: {e}");
    }
}

#[test]
fn display_reads_back() {
    for arg in [
        "seq:[i:1,s:\"a,b\",some:(b:false,c:\"),variant:X(uuid:67e55044-10b1-426f-9247-bb680e5fe0c8)]",
        "variant:Unit",
        "none",
    ] {
        let v = parse(arg);
        assert_eq!(parse(&v.to_string()), v, "{v}");
    }
}

#[test]
fn forms() {
    let req = |form, ns: Option<&str>, values: &[&str]| KeyRequest {
        form,
        ..KeyRequest::new(ns, values.iter().map(|v| parse(v)).collect())
    };
    let keys = compute(&req(Form::Raw, None, &["i:9"])).unwrap();
    assert_eq!(keys.bigint, Some(LockKey::BigInt(9)));
    let keys = compute(&req(Form::Raw, None, &["(i32:1,i32:-2)"])).unwrap();
    assert_eq!(keys.pair, Some(LockKey::Pair(1, -2)));
    let keys = compute(&req(Form::HashText, None, &["s:payroll-1405-01"])).unwrap();
    assert_eq!(keys.bigint, Some(LockKey::BigInt(-1493109243)));
    let mut exact = req(Form::Exact, Some("Account"), &["i:5"]);
    exact.class = Some(7);
    assert_eq!(compute(&exact).unwrap().pair, Some(LockKey::Pair(7, 5)));
    assert!(compute(&req(Form::Raw, Some("X"), &["i:1"])).is_err());
    assert!(compute(&req(Form::Exact, Some("X"), &["i:2147483648"])).is_err());
    assert!(compute(&req(Form::HashText, None, &["i:1"])).is_err());
    assert!(compute(&req(Form::Hashed, None, &["i:1"])).is_err());
}
