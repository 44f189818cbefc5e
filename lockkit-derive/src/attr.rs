//! Parsing `#[advisory_key(...)]` on the type and on its fields. Each option
//! is parsed on its own; a malformed one is reported and skipped, so the
//! others are still checked in the same compile.

use proc_macro2::{TokenStream, TokenTree};
use quote::{quote, ToTokens};
use syn::meta::ParseNestedMeta;
use syn::parse::ParseStream;
use syn::{Attribute, ExprPath, LitInt, LitStr, Path, Token};

use crate::ctxt::Ctxt;

/// The name of the derive's helper attribute.
const ATTR: &str = "advisory_key";

/// The options accepted on the type, for "expected one of" messages.
const CONTAINER_OPTIONS: &str = "`namespace`, `pair`, `class`, `stripes`, `raw`, `crate`";

/// An option's value together with the name token it was given under, for
/// errors that point at the option.
pub(crate) struct Opt<T> {
    /// The option's name as written (`class`, `stripes`, ...).
    pub(crate) name: Path,
    /// The parsed value.
    pub(crate) value: T,
}

/// `pair` or `pair = "exact"`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum PairMode {
    /// `pair`: a hashed `Pair` key.
    Hashed,
    /// `pair = "exact"`: the object is the single `i32` field, unhashed.
    Exact,
}

/// `class = N`, checked to fit in an `i32`.
pub(crate) struct Class {
    /// `-` and the integer literal, re-emitted as written so errors point at them.
    pub(crate) tokens: TokenStream,
}

/// `stripes = N`.
pub(crate) struct Stripes {
    /// The literal as written.
    pub(crate) lit: LitInt,
    /// Its value, at least 1 once validated.
    pub(crate) value: u64,
}

/// The options on the type.
#[derive(Default)]
pub(crate) struct Container {
    /// `namespace = "..."`.
    pub(crate) namespace: Option<Opt<LitStr>>,
    /// `pair` / `pair = "exact"`.
    pub(crate) pair: Option<Opt<PairMode>>,
    /// `class = N`.
    pub(crate) class: Option<Opt<Class>>,
    /// `stripes = N`.
    pub(crate) stripes: Option<Opt<Stripes>>,
    /// `raw`.
    pub(crate) raw: Option<Opt<()>>,
    /// `crate = "path"`.
    pub(crate) krate: Option<Opt<Path>>,
}

impl Container {
    /// The path generated code names lockkit by: `crate = "..."` if given,
    /// else the one found in the user's Cargo.toml (see `krate.rs`).
    pub(crate) fn krate(&self) -> TokenStream {
        match &self.krate {
            Some(opt) => opt.value.to_token_stream(),
            None => crate::krate::from_manifest(),
        }
    }
}

/// The options on a field.
#[derive(Default)]
pub(crate) struct Field {
    /// `skip`: the field is not part of the key.
    pub(crate) skip: Option<Opt<()>>,
    /// `with = "path::to::fn"`: a custom encoder.
    pub(crate) with: Option<Opt<ExprPath>>,
}

/// `name` as written, for messages.
pub(crate) fn path_name(path: &Path) -> String {
    path.to_token_stream().to_string().replace(' ', "")
}

/// Stores `value` in `slot`, or reports a duplicate.
fn set<T>(cx: &Ctxt, slot: &mut Option<Opt<T>>, name: &Path, value: T) {
    if slot.is_some() {
        cx.error_spanned_by(name, format!("duplicate attribute `{}`", path_name(name)));
    } else {
        *slot = Some(Opt {
            name: name.clone(),
            value,
        });
    }
}

/// Skips the rest of a malformed option, up to the next top-level comma, so
/// the options after it are still parsed.
fn skip_rest(input: ParseStream<'_>) -> syn::Result<()> {
    input.step(|cursor| {
        let mut rest = *cursor;
        while let Some((tt, next)) = rest.token_tree() {
            if matches!(&tt, TokenTree::Punct(p) if p.as_char() == ',') {
                break;
            }
            rest = next;
        }
        Ok(((), rest))
    })
}

/// Parses `= <value>` after an option's name, reporting (and skipping) a
/// missing `=` or a malformed value. `form` is the correct syntax, for the
/// message.
fn value<T>(
    cx: &Ctxt,
    meta: &ParseNestedMeta<'_>,
    form: &str,
    parse: impl FnOnce(ParseStream<'_>) -> syn::Result<T>,
) -> syn::Result<Option<T>> {
    if !meta.input.peek(Token![=]) {
        cx.error_spanned_by(&meta.path, format!("expected `{form}`"));
        skip_rest(meta.input)?;
        return Ok(None);
    }
    let input = meta.value()?;
    match parse(input) {
        Ok(v) if input.is_empty() || input.peek(Token![,]) => Ok(Some(v)),
        Ok(_) => {
            cx.error_spanned_by(&meta.path, format!("expected `{form}`"));
            skip_rest(meta.input)?;
            Ok(None)
        }
        Err(e) => {
            cx.syn_error(syn::Error::new(e.span(), format!("{e}, as in `{form}`")));
            skip_rest(meta.input)?;
            Ok(None)
        }
    }
}

/// Reports a value given to a flag option (`raw = true`), and skips it.
fn flag(cx: &Ctxt, meta: &ParseNestedMeta<'_>) -> syn::Result<()> {
    if !(meta.input.is_empty() || meta.input.peek(Token![,])) {
        let name = path_name(&meta.path);
        cx.error_spanned_by(
            &meta.path,
            format!("`{name}` takes no value; write `{name}` alone"),
        );
        skip_rest(meta.input)?;
    }
    Ok(())
}

/// Runs `each` on every option of every `#[advisory_key(...)]` in `attrs`.
fn for_each_option(
    cx: &Ctxt,
    attrs: &[Attribute],
    mut each: impl FnMut(&ParseNestedMeta<'_>) -> syn::Result<()>,
) {
    for attr in attrs.iter().filter(|a| a.path().is_ident(ATTR)) {
        if let Err(e) = attr.parse_nested_meta(|meta| each(&meta)) {
            cx.syn_error(e);
        }
    }
}

/// The options of `#[advisory_key(...)]` on the type.
pub(crate) fn container(cx: &Ctxt, attrs: &[Attribute]) -> Container {
    let mut c = Container::default();
    for_each_option(cx, attrs, |meta| {
        let name = &meta.path;
        if name.is_ident("namespace") {
            if let Some(lit) = value(cx, meta, "namespace = \"...\"", |i| i.parse::<LitStr>())? {
                set(cx, &mut c.namespace, name, lit);
            }
        } else if name.is_ident("pair") {
            if meta.input.peek(Token![=]) {
                let form = "pair = \"exact\"";
                if let Some(lit) = value(cx, meta, form, |i| i.parse::<LitStr>())? {
                    if lit.value() == "exact" {
                        set(cx, &mut c.pair, name, PairMode::Exact);
                    } else {
                        cx.error_spanned_by(
                            &lit,
                            "unknown pair mode, expected `pair` (a hashed pair key) or `pair = \"exact\"` (the single `i32` field is the object)",
                        );
                    }
                }
            } else {
                flag(cx, meta)?;
                set(cx, &mut c.pair, name, PairMode::Hashed);
            }
        } else if name.is_ident("class") {
            if let Some(class) = value(cx, meta, "class = <i32>", parse_class)? {
                if let Some(class) = check_class(cx, class) {
                    set(cx, &mut c.class, name, class);
                }
            }
        } else if name.is_ident("stripes") {
            if let Some(lit) = value(cx, meta, "stripes = <integer of at least 1>", |i| {
                i.parse::<LitInt>()
            })? {
                match lit.base10_parse::<u64>() {
                    Ok(0) => cx.error_spanned_by(
                        &lit,
                        "`stripes` must be at least 1: every value of the type folds onto that many keys",
                    ),
                    Ok(value) => set(cx, &mut c.stripes, name, Stripes { lit, value }),
                    Err(_) => cx.error_spanned_by(&lit, "`stripes` must be an integer from 1 to 18446744073709551615"),
                }
            }
        } else if name.is_ident("raw") {
            flag(cx, meta)?;
            set(cx, &mut c.raw, name, ());
        } else if name.is_ident("crate") {
            if let Some(lit) = value(cx, meta, "crate = \"path::to::lockkit\"", |i| {
                i.parse::<LitStr>()
            })? {
                match lit.parse::<Path>() {
                    Ok(path) => set(cx, &mut c.krate, name, path),
                    Err(_) => cx.error_spanned_by(
                        &lit,
                        "expected a path to the lockkit crate, as in `crate = \"::lockkit\"`",
                    ),
                }
            }
        } else if name.is_ident("skip") || name.is_ident("with") {
            let n = path_name(name);
            cx.error_spanned_by(
                name,
                format!("`{n}` is a field attribute; put `#[advisory_key({n})]` on a field"),
            );
            skip_rest(meta.input)?;
        } else {
            cx.error_spanned_by(
                name,
                format!(
                    "unknown attribute `{}`, expected one of {CONTAINER_OPTIONS}",
                    path_name(name)
                ),
            );
            skip_rest(meta.input)?;
        }
        Ok(())
    });
    c
}

/// `class = 7` or `class = -7`, with an optional `i32` suffix.
fn parse_class(input: ParseStream<'_>) -> syn::Result<(Option<Token![-]>, LitInt)> {
    Ok((input.parse()?, input.parse()?))
}

fn check_class(cx: &Ctxt, (neg, lit): (Option<Token![-]>, LitInt)) -> Option<Class> {
    let tokens = quote!(#neg #lit);
    if !matches!(lit.suffix(), "" | "i32") {
        cx.error_spanned_by(
            &lit,
            format!("`class` is an `i32`; remove the `{}` suffix", lit.suffix()),
        );
        return None;
    }
    let magnitude = lit
        .base10_parse::<u64>()
        .ok()
        .and_then(|m| i64::try_from(m).ok());
    let value = magnitude.map(|m| if neg.is_some() { -m } else { m });
    match value.and_then(|v| i32::try_from(v).ok()) {
        Some(_) => Some(Class { tokens }),
        None => {
            cx.error_spanned_by(
                &tokens,
                "`class` must fit in an `i32` (-2147483648 to 2147483647)",
            );
            None
        }
    }
}

/// The options of `#[advisory_key(...)]` on a field.
pub(crate) fn field(cx: &Ctxt, attrs: &[Attribute]) -> Field {
    let mut f = Field::default();
    for_each_option(cx, attrs, |meta| {
        let name = &meta.path;
        if name.is_ident("skip") {
            flag(cx, meta)?;
            set(cx, &mut f.skip, name, ());
        } else if name.is_ident("with") {
            if let Some(lit) = value(cx, meta, "with = \"path::to::fn\"", |i| i.parse::<LitStr>())?
            {
                match lit.parse::<ExprPath>() {
                    Ok(path) => set(cx, &mut f.with, name, path),
                    Err(_) => cx.error_spanned_by(
                        &lit,
                        "expected the path of a `fn(&FieldType, &mut lockkit::key::Parts<'_>)`, as in `with = \"path::to::fn\"`",
                    ),
                }
            }
        } else if ["namespace", "pair", "class", "stripes", "raw", "crate"]
            .iter()
            .any(|n| name.is_ident(n))
        {
            let n = path_name(name);
            cx.error_spanned_by(name, format!("`{n}` is a type attribute; put it in `#[advisory_key(...)]` on the struct or enum"));
            skip_rest(meta.input)?;
        } else {
            cx.error_spanned_by(
                name,
                format!(
                    "unknown field attribute `{}`, expected `skip` or `with`",
                    path_name(name)
                ),
            );
            skip_rest(meta.input)?;
        }
        Ok(())
    });
    f
}

/// Enum variants take no options: reports any `#[advisory_key(...)]` on one.
pub(crate) fn variant(cx: &Ctxt, attrs: &[Attribute]) {
    for attr in attrs.iter().filter(|a| a.path().is_ident(ATTR)) {
        cx.error_spanned_by(
            attr,
            "`#[advisory_key]` takes no options on an enum variant; put type options on the enum and `skip`/`with` on fields",
        );
    }
}
