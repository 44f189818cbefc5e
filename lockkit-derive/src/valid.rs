//! Checks that span several options or look at field types, turning the
//! parsed [`Input`] into the [`Key`] the derive generates.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::{GenericArgument, LitStr, Member, Path, PathArguments, Type};

use crate::ast::{Data, Field, Input};
use crate::attr::PairMode;
use crate::ctxt::Ctxt;

/// The longest namespace, in bytes (KEYS.md).
const MAX_NAMESPACE_LEN: usize = 64;

const FLOAT: &str = "floats cannot be lock key parts: NaN and -0.0 make equality ambiguous; \
                     convert the field or give it a custom encoder with `#[advisory_key(with = \"...\")]`";

/// What the derive generates: a valid key specification.
pub(crate) struct Key {
    /// The namespace literal (explicit, or the type's name).
    pub(crate) namespace: LitStr,
    /// Key space and mode.
    pub(crate) form: Form,
    /// `class = N` as written.
    pub(crate) class: Option<TokenStream>,
    /// `stripes = N`, at least 1, and where it was written.
    pub(crate) stripes: Option<(u64, Span)>,
}

/// A key's space and mode.
pub(crate) enum Form {
    /// Hashed `BigInt`.
    BigInt,
    /// Hashed `Pair`.
    Pair,
    /// `Pair(class, self.<member>)`.
    Exact(Member),
    /// `BigInt(self.<member>)`.
    RawBigInt(Member),
    /// `Pair(self.<member>.0, self.<member>.1)`.
    RawPair(Member),
}

/// Validates `input`, recording every problem in `cx`. `None` when no key can
/// be built (the errors say why).
pub(crate) fn check(cx: &Ctxt, input: &Input<'_>) -> Option<Key> {
    check_field_options(cx, input);
    let a = &input.attrs;

    if let Some(raw) = &a.raw {
        let hashed_options = [
            a.namespace.as_ref().map(|o| &o.name),
            a.stripes.as_ref().map(|o| &o.name),
            a.class.as_ref().map(|o| &o.name),
        ];
        for name in hashed_options.into_iter().flatten() {
            let n = crate::attr::path_name(name);
            cx.error_spanned_by(
                name,
                format!("raw keys are not hashed: `{n}` has no effect on a raw key; remove `{n}` or `raw`"),
            );
        }
        if let Some(pair) = &a.pair {
            cx.error_spanned_by(
                &pair.name,
                "`raw` and `pair` cannot be combined: a raw key's form follows its field, \
                 `i64` for a BigInt key and `(i32, i32)` for a Pair key",
            );
        }
        let shape =
            "`raw` needs a newtype over `i64` (a BigInt key) or over `(i32, i32)` (a Pair key)";
        let field = single_field(cx, input, &raw.name, shape)?;
        let form = if is_primitive(field.ty, "i64") {
            Form::RawBigInt(field.member.clone())
        } else if is_i32_pair(field.ty) {
            Form::RawPair(field.member.clone())
        } else {
            cx.error_spanned_by(
                field.ty,
                format!("{shape}, found `{}`", type_name(field.ty)),
            );
            return None;
        };
        // A raw key is not hashed; its spec still names the type for tools.
        let name = input.ident.unraw().to_string();
        let name = if namespace_problem(&name).is_none() {
            name
        } else {
            "raw".to_owned()
        };
        let namespace = LitStr::new(&name, input.ident.span());
        return Some(Key {
            namespace,
            form,
            class: None,
            stripes: None,
        });
    }

    let namespace = namespace(cx, input);
    if let (Some(class), None) = (&a.class, &a.pair) {
        cx.error_spanned_by(
            &class.name,
            "`class` requires `pair`: write `#[advisory_key(pair, class = N)]`",
        );
    }
    let form = match a.pair.as_ref().map(|p| (p.value, &p.name)) {
        Some((PairMode::Exact, name)) => {
            if let Some(stripes) = &a.stripes {
                cx.error_spanned_by(
                    &stripes.name,
                    "`stripes` cannot be used with `pair = \"exact\"`: an exact key's object is the field's value, not a hash",
                );
            }
            let shape = "`pair = \"exact\"` needs a struct with a single `i32` field";
            let field = single_field(cx, input, name, shape)?;
            if !is_primitive(field.ty, "i32") {
                cx.error_spanned_by(
                    field.ty,
                    format!(
                        "{shape}, found `{}`; use `pair` for a hashed pair key",
                        type_name(field.ty)
                    ),
                );
                return None;
            }
            Form::Exact(field.member.clone())
        }
        Some((PairMode::Hashed, _)) => Form::Pair,
        None => Form::BigInt,
    };
    if matches!(form, Form::BigInt | Form::Pair) {
        for field in all_fields(input).filter(|f| f.uses_key_part()) {
            if let Some(float) = find_float(field.ty) {
                cx.error_spanned_by(float, FLOAT);
            }
        }
    }
    Some(Key {
        namespace: namespace?,
        form,
        class: a.class.as_ref().map(|c| c.value.tokens.clone()),
        stripes: a
            .stripes
            .as_ref()
            .map(|s| (s.value.value, s.value.lit.span())),
    })
}

fn all_fields<'i, 'a>(input: &'i Input<'a>) -> Box<dyn Iterator<Item = &'i Field<'a>> + 'i> {
    match &input.data {
        Data::Struct(fields) => Box::new(fields.iter()),
        Data::Enum(variants) => Box::new(variants.iter().flat_map(|v| v.fields.iter())),
    }
}

fn check_field_options(cx: &Ctxt, input: &Input<'_>) {
    for field in all_fields(input) {
        if let (Some(skip), Some(_)) = (&field.attrs.skip, &field.attrs.with) {
            cx.error_spanned_by(
                &skip.name,
                "`skip` and `with` cannot be combined: a skipped field is not encoded at all",
            );
        }
    }
}

/// The single, encoded field that `raw` and exact mode need; `attr` is the
/// option that asks for it.
fn single_field<'i, 'a>(
    cx: &Ctxt,
    input: &'i Input<'a>,
    attr: &Path,
    shape: &str,
) -> Option<&'i Field<'a>> {
    let fields = match &input.data {
        Data::Struct(fields) => fields,
        Data::Enum(_) => {
            cx.error_spanned_by(attr, format!("{shape}, found an enum"));
            return None;
        }
    };
    match fields.as_slice() {
        [field] => {
            let options = [
                field.attrs.skip.as_ref().map(|o| &o.name),
                field.attrs.with.as_ref().map(|o| &o.name),
            ];
            for name in options.into_iter().flatten() {
                let n = crate::attr::path_name(name);
                cx.error_spanned_by(
                    name,
                    format!("`{n}` cannot be used here: {shape}, which is the key itself"),
                );
            }
            Some(field)
        }
        _ => {
            cx.error_spanned_by(attr, format!("{shape}, found {} fields", fields.len()));
            None
        }
    }
}

/// The namespace literal: explicit and valid, or the type's valid name.
fn namespace(cx: &Ctxt, input: &Input<'_>) -> Option<LitStr> {
    if let Some(ns) = &input.attrs.namespace {
        let lit = &ns.value;
        if let Some(problem) = namespace_problem(&lit.value()) {
            cx.error_spanned_by(lit, format!("invalid namespace: {problem}"));
            return None;
        }
        return Some(lit.clone());
    }
    let name = input.ident.unraw().to_string();
    if let Some(problem) = namespace_problem(&name) {
        cx.error_spanned_by(
            input.ident,
            format!(
                "the type name `{name}` is not a valid namespace ({problem}); \
                 give one with `#[advisory_key(namespace = \"...\")]`"
            ),
        );
        return None;
    }
    Some(LitStr::new(&name, input.ident.span()))
}

/// Why `ns` is not a KEYS.md namespace (1 to 64 bytes of ASCII letters,
/// digits and `_ . : / -`), or `None` when it is one.
pub(crate) fn namespace_problem(ns: &str) -> Option<String> {
    const EXPECTED: &str = "expected 1 to 64 bytes of ASCII letters, digits and `_ . : / -`";
    if ns.is_empty() {
        return Some(format!("it is empty; {EXPECTED}"));
    }
    if let Some(c) = ns
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || "_.:/-".contains(c)))
    {
        return Some(format!("{c:?} is not allowed; {EXPECTED}"));
    }
    if ns.len() > MAX_NAMESPACE_LEN {
        return Some(format!("it is {} bytes long; {EXPECTED}", ns.len()));
    }
    if ns == "lockkit.semaphore" {
        return Some(
            "it is reserved for the semaphores' slot keys (KEYS.md, \"Semaphore slots\")".into(),
        );
    }
    None
}

/// `ty` with Rust's usual spacing, for messages.
fn type_name(ty: &Type) -> String {
    ty.to_token_stream()
        .to_string()
        .replace(" ,", ",")
        .replace(" < ", "<")
        .replace("< ", "<")
        .replace(" >", ">")
        .replace("& ", "&")
        .replace("( ", "(")
        .replace(" )", ")")
        .replace(" :: ", "::")
}

fn strip(mut ty: &Type) -> &Type {
    loop {
        match ty {
            Type::Paren(p) => ty = &p.elem,
            Type::Group(g) => ty = &g.elem,
            _ => return ty,
        }
    }
}

/// Whether `ty` is written as the primitive `name` (`i64`,
/// `core::primitive::i64`, ...).
pub(crate) fn is_primitive(ty: &Type, name: &str) -> bool {
    match strip(ty) {
        Type::Path(p) if p.qself.is_none() => {
            let segs = &p.path.segments;
            let last_ok = segs
                .last()
                .is_some_and(|s| s.ident == name && s.arguments.is_none());
            let prefix_ok = segs.len() == 1 && p.path.leading_colon.is_none()
                || segs.len() == 3
                    && (segs[0].ident == "core" || segs[0].ident == "std")
                    && segs[1].ident == "primitive";
            last_ok && prefix_ok
        }
        _ => false,
    }
}

fn is_i32_pair(ty: &Type) -> bool {
    match strip(ty) {
        Type::Tuple(t) => t.elems.len() == 2 && t.elems.iter().all(|e| is_primitive(e, "i32")),
        _ => false,
    }
}

/// The first `f32`/`f64` visible in `ty`: itself, or inside generic
/// arguments, references, pointers, arrays, slices and tuples.
pub(crate) fn find_float(ty: &Type) -> Option<&Type> {
    match strip(ty) {
        t if is_primitive(t, "f32") || is_primitive(t, "f64") => Some(t),
        Type::Path(p) => {
            if let Some(found) = p.qself.as_ref().and_then(|q| find_float(&q.ty)) {
                return Some(found);
            }
            p.path.segments.iter().find_map(|seg| match &seg.arguments {
                PathArguments::AngleBracketed(args) => args.args.iter().find_map(|arg| match arg {
                    GenericArgument::Type(t) => find_float(t),
                    GenericArgument::AssocType(a) => find_float(&a.ty),
                    _ => None,
                }),
                _ => None,
            })
        }
        Type::Reference(r) => find_float(&r.elem),
        Type::Ptr(p) => find_float(&p.elem),
        Type::Array(a) => find_float(&a.elem),
        Type::Slice(s) => find_float(&s.elem),
        Type::Tuple(t) => t.elems.iter().find_map(find_float),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use syn::parse_quote;

    #[test]
    fn namespaces_follow_keys_md() {
        assert_eq!(namespace_problem("Order"), None);
        assert_eq!(namespace_problem("billing.v2/Order:item-1_x"), None);
        assert_eq!(namespace_problem(&"x".repeat(64)), None);
        assert!(namespace_problem(&"x".repeat(65))
            .unwrap()
            .contains("65 bytes"));
        assert!(namespace_problem("").unwrap().contains("empty"));
        assert!(namespace_problem("a b")
            .unwrap()
            .starts_with("' ' is not allowed"));
        assert!(namespace_problem("Größe")
            .unwrap()
            .starts_with("'ö' is not allowed"));
        assert!(namespace_problem("lockkit.semaphore")
            .unwrap()
            .contains("reserved"));
    }

    #[test]
    fn floats_are_found_where_visible() {
        let float_types: [Type; 8] = [
            parse_quote!(f64),
            parse_quote!(core::primitive::f32),
            parse_quote!(Option<f64>),
            parse_quote!(Vec<Option<f32>>),
            parse_quote!(&'a [f64]),
            parse_quote!([f32; 3]),
            parse_quote!((u8, f64)),
            parse_quote!(std::collections::BTreeMap<u8, Box<f64>>),
        ];
        for ty in &float_types {
            let found = find_float(ty).unwrap_or_else(|| panic!("no float in {}", type_name(ty)));
            assert!(is_primitive(found, "f32") || is_primitive(found, "f64"));
        }
        let plain: [Type; 4] = [
            parse_quote!(i64),
            parse_quote!(Option<u8>),
            parse_quote!(&'a str),
            parse_quote!(my::f64::Meters),
        ];
        for ty in &plain {
            assert!(find_float(ty).is_none(), "{}", type_name(ty));
        }
    }

    #[test]
    fn raw_and_exact_shapes() {
        assert!(is_primitive(&parse_quote!(i64), "i64"));
        assert!(is_primitive(&parse_quote!(::core::primitive::i64), "i64"));
        assert!(!is_primitive(&parse_quote!(u64), "i64"));
        assert!(!is_primitive(&parse_quote!(Option<i64>), "i64"));
        assert!(is_i32_pair(&parse_quote!((i32, i32))));
        assert!(!is_i32_pair(&parse_quote!((i32, i64))));
        assert!(!is_i32_pair(&parse_quote!((i32,))));
    }
}
