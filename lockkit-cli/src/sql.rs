//! `lockkit key --sql`: the SQL expression that computes a key with the
//! functions of lockkit's SQL script (`lockkit::sql::SQL`, installed by
//! `lockkit sql install`), for a migration or a psql session that must take
//! the same lock as the Rust service.
//!
//! ```
//! use lockkit_cli::keyarg::{parse_value, KeyRequest};
//! use lockkit_cli::sql::expressions;
//!
//! let request = KeyRequest::new(Some("Order"), vec![parse_value("i:42")?]);
//! let sql = expressions(&request)?;
//! assert_eq!(sql.bigint.as_deref(), Some("lockkit.key('Order', lockkit.int(42))"));
//! assert_eq!(
//!     sql.pair.as_deref(),
//!     Some("lockkit.pair_class('Order'), lockkit.pair_object('Order', lockkit.int(42))")
//! );
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt::Write as _;

use crate::keyarg::{compute, Form, KeyError, KeyRequest, Value};

/// The SQL arguments of `pg_advisory_xact_lock` (and the other advisory
/// lock functions) for a request's keys: one `bigint` expression for a
/// `BigInt` key, two `int4` expressions separated by `, ` for a `Pair` key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqlKeys {
    /// The `BigInt` key's expression, when the form has one.
    pub bigint: Option<String>,
    /// The `Pair` key's two expressions, when the form has one.
    pub pair: Option<String>,
}

/// The SQL expressions of a request's keys (the same keys as
/// [`compute`])).
///
/// # Errors
///
/// [`KeyError`] when the request has no key ([`compute`] says why), or
/// when a string or char value holds U+0000, which a PostgreSQL text cannot
/// (a char U+0000 alone is written `lockkit.char(0)`).
pub fn expressions(request: &KeyRequest) -> Result<SqlKeys, KeyError> {
    // The same checks, and the same answer on which keys exist.
    let keys = compute(request)?;
    let mut parts = String::new();
    for value in &request.values {
        parts.push_str(", ");
        part(&mut parts, value)?;
    }
    let stripes = request.stripes;
    let ns = request.namespace.as_deref().map(literal);
    let bigint = match (keys.bigint, request.form, &ns) {
        (None, ..) => None,
        (Some(_), Form::Raw, _) => Some(raw(request)?),
        (Some(_), Form::HashText, _) => match flat(&request.values)[..] {
            [Value::Str(s)] => Some(format!("hashtext({})", text_literal(s)?)),
            _ => return Err(KeyError("a hashtext key takes one string".into())),
        },
        (Some(_), _, Some(ns)) => Some(match stripes {
            None if parts.is_empty() => format!("lockkit.key({ns})"),
            None => format!("lockkit.key({ns}{parts})"),
            Some(n) => format!("lockkit.striped_key({ns}, {n}{})", variadic(&parts)),
        }),
        (Some(_), _, None) => return Err(KeyError("a namespace is needed".into())),
    };
    let pair = match (keys.pair, request.form, &ns) {
        (None, ..) => None,
        (Some(_), Form::Raw, _) => Some(raw(request)?),
        (Some(key), Form::Exact, Some(ns)) => {
            let lockkit::LockKey::Pair(_, object) = key else {
                return Err(KeyError("an exact key is a Pair key".into()));
            };
            Some(format!("{}, {object}", class(request, ns)))
        }
        (Some(_), _, Some(ns)) => {
            let object = match stripes {
                None if parts.is_empty() => format!("lockkit.pair_object({ns})"),
                None => format!("lockkit.pair_object({ns}{parts})"),
                Some(n) => format!("lockkit.striped_pair_object({ns}, {n}{})", variadic(&parts)),
            };
            Some(format!("{}, {object}", class(request, ns)))
        }
        (Some(_), _, None) => return Err(KeyError("a namespace is needed".into())),
    };
    Ok(SqlKeys { bigint, pair })
}

/// The class expression: explicit, or derived from the namespace.
fn class(request: &KeyRequest, ns: &str) -> String {
    match request.class {
        Some(c) => c.to_string(),
        None => format!("lockkit.pair_class({ns})"),
    }
}

/// The variadic parts after a fixed argument: `, p, …`, or an explicit
/// empty array for a type without fields (a variadic call needs one).
fn variadic(parts: &str) -> String {
    if parts.is_empty() {
        ", VARIADIC ARRAY[]::bytea[]".into()
    } else {
        parts.to_owned()
    }
}

/// A raw key's values: one bigint, or two int4s.
fn raw(request: &KeyRequest) -> Result<String, KeyError> {
    let values: Vec<String> = flat(&request.values)
        .iter()
        .map(|v| match v {
            Value::Int(i) => Ok(i.to_string()),
            _ => Err(KeyError("a raw key takes integers".into())),
        })
        .collect::<Result<_, _>>()?;
    Ok(values.join(", "))
}

fn flat(values: &[Value]) -> Vec<&Value> {
    let mut out = Vec::new();
    for v in values {
        match v {
            Value::Tuple(items) => out.extend(flat(items)),
            other => out.push(other),
        }
    }
    out
}

/// One value's encoder call, appended to `out`.
fn part(out: &mut String, value: &Value) -> Result<(), KeyError> {
    let list = |out: &mut String, items: &[Value]| -> Result<(), KeyError> {
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            part(out, item)?;
        }
        Ok(())
    };
    match value {
        // A literal that fits int4 is an int4, int8 an int8, else a
        // numeric: each has its `lockkit.int`, and all encode by value.
        Value::Int(v) => {
            let _ = write!(out, "lockkit.int({v})");
        }
        Value::UInt(v) => {
            let _ = write!(out, "lockkit.int({v})");
        }
        Value::Bool(v) => {
            let _ = write!(out, "lockkit.bool({v})");
        }
        Value::Char('\0') => out.push_str("lockkit.char(0)"),
        Value::Char(c) => {
            let _ = write!(out, "lockkit.char({})", text_literal(&c.to_string())?);
        }
        Value::Str(s) => {
            let _ = write!(out, "lockkit.str({})", text_literal(s)?);
        }
        Value::Uuid(u) => {
            let _ = write!(out, "lockkit.uuid('{u}')");
        }
        Value::None => out.push_str("lockkit.none()"),
        Value::Some(v) => {
            out.push_str("lockkit.some(");
            part(out, v)?;
            out.push(')');
        }
        Value::Seq(items) if items.is_empty() => out.push_str("lockkit.seq()"),
        Value::Seq(items) => {
            out.push_str("lockkit.seq(");
            list(out, items)?;
            out.push(')');
        }
        // `()` encodes to nothing.
        Value::Tuple(items) if items.is_empty() => out.push_str("decode('', 'hex')"),
        Value::Tuple(items) => {
            out.push_str("lockkit.tuple(");
            list(out, items)?;
            out.push(')');
        }
        Value::Variant(name, fields) => {
            let _ = write!(out, "lockkit.variant({}", literal(name));
            for field in fields {
                out.push_str(", ");
                part(out, field)?;
            }
            out.push(')');
        }
    }
    Ok(())
}

/// A SQL string literal of ASCII `text` without backslashes (a namespace,
/// a variant name's identifier characters).
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// A SQL string literal of any text but U+0000, right whatever
/// `standard_conforming_strings` says: `E'…'` with backslashes doubled when
/// it holds one.
fn text_literal(text: &str) -> Result<String, KeyError> {
    if text.contains('\0') {
        return Err(KeyError(
            "a PostgreSQL text cannot hold U+0000, so SQL cannot compute this key".into(),
        ));
    }
    let quoted = text.replace('\'', "''");
    Ok(if quoted.contains('\\') {
        format!("E'{}'", quoted.replace('\\', "\\\\"))
    } else {
        format!("'{quoted}'")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keyarg::parse_value;

    fn sql(form: Form, ns: Option<&str>, values: &[&str]) -> SqlKeys {
        let mut request =
            KeyRequest::new(ns, values.iter().map(|v| parse_value(v).unwrap()).collect());
        request.form = form;
        expressions(&request).unwrap()
    }

    #[test]
    fn every_form() {
        let k = sql(Form::BigInt, Some("Tenanted"), &["s:acme", "u64:1001"]);
        assert_eq!(
            k.bigint.as_deref(),
            Some("lockkit.key('Tenanted', lockkit.str('acme'), lockkit.int(1001))")
        );
        assert_eq!(k.pair, None);
        let k = sql(Form::Hashed, Some("Unit"), &[]);
        assert_eq!(k.bigint.as_deref(), Some("lockkit.key('Unit')"));
        assert_eq!(
            k.pair.as_deref(),
            Some("lockkit.pair_class('Unit'), lockkit.pair_object('Unit')")
        );
        let k = sql(Form::Raw, None, &["i32:1", "i32:-2"]);
        assert_eq!(k.pair.as_deref(), Some("1, -2"));
        let k = sql(Form::HashText, None, &["s:it's"]);
        assert_eq!(k.bigint.as_deref(), Some("hashtext('it''s')"));
        let mut request = KeyRequest::new(Some("Account"), vec![parse_value("i:5").unwrap()]);
        request.form = Form::Exact;
        request.class = Some(7);
        assert_eq!(expressions(&request).unwrap().pair.as_deref(), Some("7, 5"));
        let mut request = KeyRequest::new(Some("Event"), vec![]);
        request.form = Form::Pair;
        request.stripes = Some(4);
        assert_eq!(
            expressions(&request).unwrap().pair.as_deref(),
            Some(
                "lockkit.pair_class('Event'), \
                 lockkit.striped_pair_object('Event', 4, VARIADIC ARRAY[]::bytea[])"
            )
        );
    }

    #[test]
    fn nested_values_and_quoting() {
        let k = sql(
            Form::BigInt,
            Some("X"),
            &[
                "seq:[s:\"a\\\\b\",none,some:c:',(b:true,i:-1)]",
                "variant:V(u128:340282366920938463463374607431768211455)",
                "seq:[]",
            ],
        );
        assert_eq!(
            k.bigint.as_deref(),
            Some(
                "lockkit.key('X', lockkit.seq(lockkit.str(E'a\\\\b'), lockkit.none(), \
                 lockkit.some(lockkit.char('''')), lockkit.tuple(lockkit.bool(true), \
                 lockkit.int(-1))), lockkit.variant('V', \
                 lockkit.int(340282366920938463463374607431768211455)), lockkit.seq())"
            )
        );
        let request = KeyRequest::new(Some("X"), vec![Value::Str("a\0".into())]);
        assert!(expressions(&request).is_err());
    }
}
