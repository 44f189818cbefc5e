//! `lockkit key`'s typed values: the command-line syntax for every part type
//! of the key format (docs/KEYS.md), parsed into [`Value`]s that encode
//! through lockkit's own [`Parts`] API, and the key forms ([`Form`]) that
//! turn them into keys with [`KeySpec`].
//!
//! Every value names its type, so nothing is guessed: `42` is refused, and
//! `i:42` (an integer) and `s:42` (a string) are different keys, as are
//! `variant:Account` (an enum variant) and `s:Account` (a string).
//!
//! ```
//! use lockkit_cli::keyarg::{compute, parse_value, Form, KeyRequest};
//! use lockkit::LockKey;
//!
//! // docs/KEYS.md golden vector: `Tenanted { tenant: "acme", id: 1001 }`.
//! let values = vec![parse_value("s:acme")?, parse_value("u64:1001")?];
//! let request = KeyRequest::new(Some("Tenanted"), values);
//! let keys = compute(&request)?;
//! assert_eq!(keys.bigint, Some(LockKey::BigInt(-297873912991975939)));
//! assert!(parse_value("1001").is_err()); // untyped
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;

use lockkit::key::{hashtext_key, KeyForm, KeyPart, Parts};
use lockkit::{KeySpec, LockKey};

/// The syntax of a typed value, for `--help` and error messages.
pub const SYNTAX: &str = "\
Every VALUE names its type (TYPE:VALUE); untyped values are refused, never guessed.

  i:42  int:42          an integer of any Rust type (encoded by value, as KEYS.md says:
                        i32 42 and i64 42 are the same key)
  i8: i16: i32: i64: i128: isize:  u8: u16: u32: u64: u128: usize:
                        an integer checked against that type's range (same encoding)
  s:TEXT  str:TEXT      a string (String, &str, Box<str>, …)
  b:true  bool:false    a bool
  c:x  char:x           a char (exactly one Unicode scalar value)
  uuid:UUID             a uuid::Uuid (hyphenated, simple, braced or urn form)
  none                  Option::None
  some:VALUE            Option::Some(VALUE)
  seq:[V,V,…]           a Vec, slice or array of values (seq:[] is empty)
  (V,V,…)               a tuple, or a nested key type's fields (concatenated)
  variant:Name          an enum variant without fields
  variant:Name(V,…)     an enum variant with fields (tuple or named, in order)

Outside brackets, s:, c:, uuid: and integers take the rest of the argument as
written (s:a,b is the string \"a,b\"; s:\"x\" is three characters). Inside
[…] or (…), a string is a JSON string literal (seq:[s:\"a,b\",s:\"c\"]),
and values are separated by commas (spaces allowed after them).
A struct's fields are given one VALUE each, in declaration order; a field
that is a derived key type or a tuple may be given as (…) or as its fields
in turn, an enum field as variant:Name(…) or variant:Name followed by its
fields: the encoding is the same.";

/// One typed key part, parsed from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Value {
    /// An integer that fits `i128`.
    Int(i128),
    /// An integer above `i128::MAX`.
    UInt(u128),
    /// A bool.
    Bool(bool),
    /// A char.
    Char(char),
    /// A string.
    Str(String),
    /// A uuid.
    Uuid(uuid::Uuid),
    /// `Option::None`.
    None,
    /// `Option::Some`.
    Some(Box<Value>),
    /// A sequence (slice, `Vec`, array).
    Seq(Vec<Value>),
    /// A tuple or a nested key type: its elements concatenated.
    Tuple(Vec<Value>),
    /// An enum variant and its fields.
    Variant(String, Vec<Value>),
}

impl KeyPart for Value {
    fn encode(&self, parts: &mut Parts<'_>) {
        match self {
            Value::Int(v) => parts.int(*v),
            Value::UInt(v) => parts.uint(*v),
            Value::Bool(v) => parts.put(v),
            Value::Char(v) => parts.put(v),
            Value::Str(v) => parts.str(v),
            Value::Uuid(v) => parts.put(v),
            // `None` encodes alike whatever the payload type.
            Value::None => parts.put(&None::<u8>),
            Value::Some(v) => parts.put(&Some(&**v)),
            Value::Seq(items) => parts.seq(items.iter()),
            Value::Tuple(items) => {
                for item in items {
                    parts.put(item);
                }
                parts
            }
            Value::Variant(name, fields) => {
                parts.variant(name);
                for field in fields {
                    parts.put(field);
                }
                parts
            }
        };
    }
}

/// The value in the nested syntax (strings JSON-quoted), which
/// [`parse_value`] reads back to the same value.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn list(f: &mut fmt::Formatter<'_>, items: &[Value]) -> fmt::Result {
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    f.write_str(",")?;
                }
                write!(f, "{item}")?;
            }
            Ok(())
        }
        match self {
            Value::Int(v) => write!(f, "i:{v}"),
            Value::UInt(v) => write!(f, "i:{v}"),
            Value::Bool(v) => write!(f, "b:{v}"),
            Value::Char(v) => write!(f, "c:{v}"),
            Value::Str(v) => write!(f, "s:{}", serde_json::Value::from(v.as_str())),
            Value::Uuid(v) => write!(f, "uuid:{v}"),
            Value::None => f.write_str("none"),
            Value::Some(v) => write!(f, "some:{v}"),
            Value::Seq(items) => {
                f.write_str("seq:[")?;
                list(f, items)?;
                f.write_str("]")
            }
            Value::Tuple(items) => {
                f.write_str("(")?;
                list(f, items)?;
                f.write_str(")")
            }
            Value::Variant(name, fields) if fields.is_empty() => write!(f, "variant:{name}"),
            Value::Variant(name, fields) => {
                write!(f, "variant:{name}(")?;
                list(f, fields)?;
                f.write_str(")")
            }
        }
    }
}

/// Why an argument is not a typed value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueError {
    /// The argument.
    pub arg: String,
    /// The byte offset in it where the problem is.
    pub at: usize,
    /// What is wrong and how to write it.
    pub message: String,
}

impl fmt::Display for ValueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.at == 0 {
            write!(f, "invalid value {:?}: {}", self.arg, self.message)
        } else {
            write!(
                f,
                "invalid value {:?} at byte {}: {}",
                self.arg, self.at, self.message
            )
        }
    }
}

impl std::error::Error for ValueError {}

/// Parses one command-line argument into a typed value (syntax: [`SYNTAX`]).
///
/// # Errors
///
/// [`ValueError`] when the argument is untyped (`42`, `Account`), names an
/// unknown type (`f64:1.5`), or its value does not parse or does not fit its
/// type (`u8:300`).
pub fn parse_value(arg: &str) -> Result<Value, ValueError> {
    let mut p = Parser {
        s: arg,
        pos: 0,
        depth: 0,
        nesting: 0,
    };
    let value = p.value()?;
    if p.pos != arg.len() {
        return Err(p.error(format!("unexpected {:?} after the value", &arg[p.pos..])));
    }
    Ok(value)
}

struct Parser<'a> {
    s: &'a str,
    pos: usize,
    /// Brackets open around the current position.
    depth: usize,
    /// Values being parsed around the current position (brackets and
    /// `some:`), bounded by [`MAX_NESTING`].
    nesting: usize,
}

/// How deep values may nest (`some:`, `seq:[…]`, `(…)`, `variant:X(…)`):
/// far beyond any real key type, and far below what would overflow the
/// parser's stack (the parser, the encoder and `Display` all recurse).
pub const MAX_NESTING: usize = 128;

/// Whether `text` is an optionally signed run of decimal digits (an integer
/// too large for any integer type when it does not parse).
fn is_decimal(text: &str) -> bool {
    let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

fn is_terminator(c: char) -> bool {
    matches!(c, ',' | ')' | ']') || c.is_whitespace()
}

impl<'a> Parser<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    fn error(&self, message: impl Into<String>) -> ValueError {
        ValueError {
            arg: self.s.to_owned(),
            at: self.pos,
            message: message.into(),
        }
    }

    /// The scalar text at the position: the rest of the argument outside
    /// brackets, up to the next terminator inside.
    fn scalar(&mut self) -> &'a str {
        let rest = &self.s[self.pos..];
        let len = if self.depth == 0 {
            rest.len()
        } else {
            rest.find(is_terminator).unwrap_or(rest.len())
        };
        self.pos += len;
        &rest[..len]
    }

    fn skip_spaces(&mut self) {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start().len();
    }

    fn value(&mut self) -> Result<Value, ValueError> {
        if self.nesting >= MAX_NESTING {
            return Err(self.error(format!(
                "values nest more than {MAX_NESTING} levels deep (some:, seq:[…], (…), variant:X(…))"
            )));
        }
        self.nesting += 1;
        let value = self.nested_value();
        self.nesting -= 1;
        value
    }

    fn nested_value(&mut self) -> Result<Value, ValueError> {
        if self.rest().starts_with('(') {
            self.pos += 1;
            return Ok(Value::Tuple(self.list(')')?));
        }
        let start = self.pos;
        let rest = self.rest();
        let word_len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let word = &rest[..word_len];
        let after = &rest[word_len..];
        if word == "none"
            && (after.is_empty() || (self.depth > 0 && after.starts_with(is_terminator)))
        {
            self.pos += word_len;
            return Ok(Value::None);
        }
        if !after.starts_with(':') {
            return Err(self.untyped(start));
        }
        self.pos += word_len + 1;
        let value = match word {
            "i" | "int" => Value::from_int(self.integer(i128::MIN, u128::MAX, word)?),
            "i8" => Value::from_int(self.integer(i8::MIN.into(), i8::MAX as u128, word)?),
            "i16" => Value::from_int(self.integer(i16::MIN.into(), i16::MAX as u128, word)?),
            "i32" => Value::from_int(self.integer(i32::MIN.into(), i32::MAX as u128, word)?),
            "i64" => Value::from_int(self.integer(i64::MIN.into(), i64::MAX as u128, word)?),
            "i128" => Value::from_int(self.integer(i128::MIN, i128::MAX as u128, word)?),
            "isize" => {
                Value::from_int(self.integer(isize::MIN as i128, isize::MAX as u128, word)?)
            }
            "u8" => Value::from_int(self.integer(0, u8::MAX.into(), word)?),
            "u16" => Value::from_int(self.integer(0, u16::MAX.into(), word)?),
            "u32" => Value::from_int(self.integer(0, u32::MAX.into(), word)?),
            "u64" => Value::from_int(self.integer(0, u64::MAX.into(), word)?),
            "u128" => Value::from_int(self.integer(0, u128::MAX, word)?),
            "usize" => Value::from_int(self.integer(0, usize::MAX as u128, word)?),
            "s" | "str" => Value::Str(self.string()?),
            "b" | "bool" => {
                let at = self.pos;
                match self.scalar() {
                    "true" => Value::Bool(true),
                    "false" => Value::Bool(false),
                    other => {
                        let message = format!("a bool is `true` or `false`, not {other:?}");
                        self.pos = at;
                        return Err(self.error(message));
                    }
                }
            }
            "c" | "char" => Value::Char(self.char()?),
            "uuid" => {
                let at = self.pos;
                let text = self.scalar();
                match uuid::Uuid::parse_str(text) {
                    Ok(u) => Value::Uuid(u),
                    Err(e) => {
                        let message = format!("invalid uuid {text:?}: {e}");
                        self.pos = at;
                        return Err(self.error(message));
                    }
                }
            }
            "some" => Value::Some(Box::new(self.value()?)),
            "seq" => {
                if !self.rest().starts_with('[') {
                    return Err(self.error("a sequence is written seq:[V,V,…]"));
                }
                self.pos += 1;
                Value::Seq(self.list(']')?)
            }
            "variant" => self.variant()?,
            "f32" | "f64" | "float" => {
                self.pos = start;
                return Err(self.error(
                    "floats are not key parts (NaN and -0.0 make equality ambiguous); \
                     a field with a custom encoder is given as the values it encodes",
                ));
            }
            other => {
                self.pos = start;
                return Err(self.error(format!(
                    "unknown type `{other}:`; expected one of i, int, i8…i128, isize, u8…u128, usize, \
                     s, str, b, bool, c, char, uuid, some, seq, variant (or none, or (…))"
                )));
            }
        };
        Ok(value)
    }

    fn untyped(&mut self, start: usize) -> ValueError {
        self.pos = start;
        let token = if self.depth == 0 {
            self.rest().to_owned()
        } else {
            let rest = self.rest();
            rest[..rest.find(is_terminator).unwrap_or(rest.len())].to_owned()
        };
        let hint = if token.is_empty() {
            "a value is missing".to_owned()
        } else if token.parse::<i128>().is_ok() || token.parse::<u128>().is_ok() {
            format!("untyped value: write i:{token} for an integer field or s:{token} for a string field")
        } else if token == "true" || token == "false" {
            format!(
                "untyped value: write b:{token} for a bool field or s:{token} for a string field"
            )
        } else if token.chars().all(|c| c.is_alphanumeric() || c == '_') {
            format!(
                "untyped value: write variant:{token} for an enum variant or s:{token} for a string field"
            )
        } else {
            "untyped value: write TYPE:VALUE, e.g. s:… for a string (see `lockkit key --help`)"
                .to_owned()
        };
        self.error(hint)
    }

    fn integer(&mut self, min: i128, max: u128, ty: &str) -> Result<Int, ValueError> {
        let at = self.pos;
        let text = self.scalar();
        let parsed = match text.parse::<i128>() {
            Ok(v) => Some(Int::Signed(v)),
            Err(_) => text.parse::<u128>().ok().map(Int::Unsigned),
        };
        let in_range = |v: &Int| match *v {
            Int::Signed(v) => v >= min && (v < 0 || v as u128 <= max),
            Int::Unsigned(v) => v <= max,
        };
        match parsed {
            Some(v) if in_range(&v) => Ok(v),
            Some(_) => {
                let message = format!("{text} is out of range for {ty}");
                self.pos = at;
                Err(self.error(message))
            }
            None if is_decimal(text) => {
                let message = match ty {
                    "i" | "int" => {
                        format!("{text} is out of range for every integer type (i128, u128)")
                    }
                    ty => format!("{text} is out of range for {ty}"),
                };
                self.pos = at;
                Err(self.error(message))
            }
            None => {
                let message =
                    format!("{text:?} is not an integer (decimal digits, optionally signed)");
                self.pos = at;
                Err(self.error(message))
            }
        }
    }

    fn string(&mut self) -> Result<String, ValueError> {
        if self.depth == 0 {
            let text = self.rest().to_owned();
            self.pos = self.s.len();
            return Ok(text);
        }
        if !self.rest().starts_with('"') {
            return Err(
                self.error("inside […] or (…) a string is a JSON string literal, e.g. s:\"a,b\"")
            );
        }
        // The literal ends at the first quote not escaped by a backslash.
        let rest = self.rest();
        let mut escaped = false;
        let mut end = None;
        for (i, c) in rest.char_indices().skip(1) {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => {
                    end = Some(i + 1);
                    break;
                }
                _ => {}
            }
        }
        let Some(end) = end else {
            return Err(self.error("unterminated string literal"));
        };
        match serde_json::from_str::<String>(&rest[..end]) {
            Ok(text) => {
                self.pos += end;
                Ok(text)
            }
            Err(e) => Err(self.error(format!("invalid JSON string literal: {e}"))),
        }
    }

    fn char(&mut self) -> Result<char, ValueError> {
        let mut chars = self.rest().chars();
        let Some(c) = chars.next() else {
            return Err(self.error("a char is exactly one character, e.g. c:x"));
        };
        let next = chars.next();
        let ends = match next {
            None => true,
            Some(n) => self.depth > 0 && is_terminator(n),
        };
        if !ends {
            return Err(self.error("a char is exactly one character, e.g. c:x"));
        }
        self.pos += c.len_utf8();
        Ok(c)
    }

    fn variant(&mut self) -> Result<Value, ValueError> {
        let rest = self.rest();
        let raw = rest.strip_prefix("r#");
        let body = raw.unwrap_or(rest);
        let len = body
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(body.len());
        let name = &body[..len];
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(
                self.error("a variant is named by its Rust identifier, e.g. variant:Account")
            );
        }
        let name = name.to_owned();
        self.pos += len + if raw.is_some() { 2 } else { 0 };
        let fields = if self.rest().starts_with('(') {
            self.pos += 1;
            self.list(')')?
        } else {
            Vec::new()
        };
        Ok(Value::Variant(name, fields))
    }

    /// `V,V,…` up to `close` (the opening bracket already read).
    fn list(&mut self, close: char) -> Result<Vec<Value>, ValueError> {
        self.depth += 1;
        let mut items = Vec::new();
        self.skip_spaces();
        if self.rest().starts_with(close) {
            self.pos += 1;
            self.depth -= 1;
            return Ok(items);
        }
        loop {
            self.skip_spaces();
            items.push(self.value()?);
            self.skip_spaces();
            let rest = self.rest();
            if rest.starts_with(',') {
                self.pos += 1;
            } else if rest.starts_with(close) {
                self.pos += 1;
                self.depth -= 1;
                return Ok(items);
            } else {
                return Err(self.error(format!("expected `,` or `{close}`")));
            }
        }
    }
}

enum Int {
    Signed(i128),
    Unsigned(u128),
}

impl Value {
    fn from_int(v: Int) -> Value {
        match v {
            Int::Signed(v) => Value::Int(v),
            Int::Unsigned(v) => match i128::try_from(v) {
                Ok(v) => Value::Int(v),
                Err(_) => Value::UInt(v),
            },
        }
    }

    /// The integer, if the value is one.
    fn as_int(&self) -> Option<i128> {
        match self {
            Value::Int(v) => Some(*v),
            _ => None,
        }
    }
}

/// Which key a request computes (the type's form, as its derive attributes
/// say).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Form {
    /// Both hashed forms, `BigInt` and `Pair`: for a type whose form is not
    /// known.
    #[default]
    Hashed,
    /// The hashed `BigInt` key (the derive's default).
    BigInt,
    /// The hashed `Pair` key (`pair`, or `class = N`).
    Pair,
    /// `pair = "exact"`: `Pair(class, value)` of one `i32` value.
    Exact,
    /// `raw`: one `i64` value is `BigInt(value)`, two `i32` values are
    /// `Pair(a, b)`; no namespace.
    Raw,
    /// `lockkit::key::HashText`: `BigInt(hashtext(text))` of one string; no
    /// namespace.
    HashText,
}

impl Form {
    /// Whether keys of this form have a namespace.
    pub fn has_namespace(self) -> bool {
        !matches!(self, Form::Raw | Form::HashText)
    }
}

/// What `lockkit key` computes.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyRequest {
    /// The key type's namespace (none for [`Form::Raw`] and
    /// [`Form::HashText`]).
    pub namespace: Option<String>,
    /// The form.
    pub form: Form,
    /// An explicit `Pair` class (`class = N`).
    pub class: Option<i32>,
    /// The stripe count (`stripes = N`).
    pub stripes: Option<u64>,
    /// The field values, in declaration order.
    pub values: Vec<Value>,
}

impl KeyRequest {
    /// A request for the [`Form::Hashed`] keys of `values`.
    pub fn new(namespace: Option<&str>, values: Vec<Value>) -> Self {
        KeyRequest {
            namespace: namespace.map(str::to_owned),
            form: Form::Hashed,
            class: None,
            stripes: None,
            values,
        }
    }
}

/// The keys of a [`KeyRequest`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Keys {
    /// The `BigInt` key, when the form has one.
    pub bigint: Option<LockKey>,
    /// The `Pair` key, when the form has one.
    pub pair: Option<LockKey>,
    /// The namespace tag of hashed `BigInt` keys.
    pub tag: Option<u16>,
    /// The class of hashed or exact `Pair` keys.
    pub pair_class: Option<i32>,
}

/// Why a request has no key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyError(pub String);

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KeyError {}

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

/// Computes the keys of a request through [`KeySpec`] (the derive's own
/// encoding and key construction).
///
/// # Errors
///
/// [`KeyError`] when the namespace is missing or invalid, or given for a
/// form without one; when `class` or `stripes` do not apply to the form
/// (or `stripes` is 0); when exact, raw or hashtext values are not what the
/// form takes.
pub fn compute(request: &KeyRequest) -> Result<Keys, KeyError> {
    let err = |m: String| Err(KeyError(m));
    let form = request.form;
    if request.stripes == Some(0) {
        return err("--stripes must be at least 1".into());
    }
    if request.stripes.is_some() && matches!(form, Form::Exact | Form::Raw | Form::HashText) {
        return err("--stripes applies only to hashed keys (not exact, raw or hashtext)".into());
    }
    if request.class.is_some() && matches!(form, Form::BigInt | Form::Raw | Form::HashText) {
        return err("--class applies only to Pair keys (hashed or exact)".into());
    }
    if !form.has_namespace() {
        if request.namespace.is_some() {
            return err("raw and hashtext keys have no namespace".into());
        }
        let values = flat(&request.values);
        let none = Keys {
            bigint: None,
            pair: None,
            tag: None,
            pair_class: None,
        };
        return match (form, &values[..]) {
            (Form::HashText, [Value::Str(s)]) => Ok(Keys {
                bigint: Some(hashtext_key(s)),
                ..none
            }),
            (Form::HashText, _) => {
                err("a hashtext key takes exactly one string value (s:TEXT)".into())
            }
            (_, [v]) => match v.as_int().and_then(|v| i64::try_from(v).ok()) {
                Some(v) => Ok(Keys {
                    bigint: Some(LockKey::BigInt(v)),
                    ..none
                }),
                None => err("a raw BigInt key takes one integer value in the i64 range".into()),
            },
            (_, [a, b]) => {
                let int32 = |v: &Value| v.as_int().and_then(|v| i32::try_from(v).ok());
                match (int32(a), int32(b)) {
                    (Some(a), Some(b)) => Ok(Keys {
                        pair: Some(LockKey::Pair(a, b)),
                        ..none
                    }),
                    _ => err("a raw Pair key takes two integer values in the i32 range".into()),
                }
            }
            _ => err("a raw key takes one i64 value (BigInt) or two i32 values (Pair)".into()),
        };
    }
    let Some(namespace) = request.namespace.as_deref() else {
        return err("a namespace is needed (the type's name, or its `namespace = \"...\"`)".into());
    };
    let mut spec = KeySpec::try_new(namespace)
        .map_err(|e| KeyError(format!("invalid namespace {namespace:?}: {e}")))?;
    if let Some(n) = request.stripes {
        spec = spec.stripes(n);
    }
    let pair_spec = match request.class {
        Some(c) => spec.class(c),
        None => spec.pair(),
    };
    debug_assert_eq!(pair_spec.form(), KeyForm::Pair);
    let encode = |p: &mut Parts<'_>| {
        for v in &request.values {
            p.put(v);
        }
    };
    let mut keys = Keys {
        bigint: None,
        pair: None,
        tag: None,
        pair_class: None,
    };
    match form {
        Form::Hashed | Form::BigInt | Form::Pair => {
            if form != Form::Pair {
                keys.bigint = Some(spec.key_with(encode));
                keys.tag = Some(spec.tag());
            }
            if form != Form::BigInt {
                keys.pair = Some(pair_spec.key_with(encode));
                keys.pair_class = Some(pair_spec.pair_class());
            }
        }
        Form::Exact => {
            let exact = pair_spec.exact();
            let values = flat(&request.values);
            let [v] = &values[..] else {
                return err("an exact Pair key takes exactly one i32 value".into());
            };
            let Some(v) = v.as_int().and_then(|v| i32::try_from(v).ok()) else {
                return err("an exact Pair key takes an integer value in the i32 range".into());
            };
            keys.pair = Some(exact.exact_key(v));
            keys.pair_class = Some(exact.pair_class());
        }
        Form::Raw | Form::HashText => unreachable!("handled above"),
    }
    Ok(keys)
}

#[cfg(test)]
mod tests;
