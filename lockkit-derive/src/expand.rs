//! Code generation: `impl KeyPart` (the fields, in declaration order) and
//! `impl AdvisoryKey` (the `KeySpec` and `lock_key`), or, when the input has
//! errors, those errors and a stub impl that keeps follow-on errors away.

use std::collections::BTreeSet;

use proc_macro2::{Literal, TokenStream, TokenTree};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{DeriveInput, GenericParam, Generics, Ident, WhereClause};

use crate::ast::{Data, Field, Input};
use crate::ctxt::Ctxt;
use crate::valid::{self, Form, Key};

/// The whole derive: parse, validate, generate.
pub(crate) fn derive(input: &DeriveInput) -> TokenStream {
    let cx = Ctxt::default();
    let parsed = Input::from_syn(&cx, input);
    let key = parsed.as_ref().and_then(|p| valid::check(&cx, p));
    match (cx.check(), &parsed, key) {
        (Ok(()), Some(parsed), Some(key)) => expand(parsed, &key),
        (result, _, _) => {
            let errors = result.err().map(|e| e.to_compile_error());
            let krate = match &parsed {
                Some(p) => p.attrs.krate(),
                None => crate::krate::from_manifest(),
            };
            let stub = stub(&input.ident, &input.generics, &krate);
            quote! { #errors #stub }
        }
    }
}

fn expand(input: &Input<'_>, key: &Key) -> TokenStream {
    let krate = input.attrs.krate();
    let ident = input.ident;
    let (impl_generics, ty_generics, _) = input.generics.split_for_impl();
    let where_clause = where_clause(input, &krate);

    let (encode, uses_parts) = encode_body(input, &krate);
    let parts = if uses_parts {
        quote!(__parts)
    } else {
        quote!(_)
    };
    let spec = key_spec(key, &krate);
    let name = ident.to_string();
    let name = name.strip_prefix("r#").unwrap_or(&name).to_owned();
    let lock_key = match &key.form {
        Form::BigInt | Form::Pair => quote!(Self::KEY_SPEC.key_of(self)),
        Form::Exact(member) => quote!(Self::KEY_SPEC.exact_key(self.#member)),
        Form::RawBigInt(member) => quote!(#krate::__private::LockKey::BigInt(self.#member)),
        Form::RawPair(member) => {
            quote!(#krate::__private::LockKey::Pair(self.#member.0, self.#member.1))
        }
    };

    quote! {
        const _: () = {
            #[automatically_derived]
            impl #impl_generics #krate::__private::KeyPart for #ident #ty_generics #where_clause {
                fn encode(&self, #parts: &mut #krate::__private::Parts<'_>) {
                    #encode
                }
            }

            #[automatically_derived]
            impl #impl_generics #krate::__private::AdvisoryKey for #ident #ty_generics #where_clause {
                const KEY_SPEC: #krate::__private::KeySpec<'static> = #spec;

                #[inline]
                fn lock_key(&self) -> #krate::__private::LockKey {
                    #lock_key
                }
            }

            // The program's registry of key types (`lockkit::key::linked_key_types`).
            // The spec does not depend on generic parameters, so a generic
            // type is registered once.
            #krate::__private::inventory::submit! {
                #krate::__private::LinkedKeyType::new(
                    ::core::concat!(::core::module_path!(), "::", #name),
                    #spec,
                )
            }
        };
    }
}

/// `KeySpec::new(ns)` and its builder calls, evaluated at compile time.
fn key_spec(key: &Key, krate: &TokenStream) -> TokenStream {
    let ns = &key.namespace;
    let mut spec = quote!(#krate::__private::KeySpec::new(#ns));
    match key.form {
        Form::BigInt => {}
        Form::Pair => spec.extend(quote!(.pair())),
        Form::Exact(_) => spec.extend(quote!(.exact())),
        Form::RawBigInt(_) | Form::RawPair(_) => spec.extend(quote!(.raw())),
    }
    if let Some(class) = &key.class {
        spec.extend(quote_spanned!(class.span()=> .class(#class)));
    }
    if let Some((stripes, span)) = key.stripes {
        // Re-emitted as a `u64` without the user's suffix.
        let mut n = Literal::u64_suffixed(stripes);
        n.set_span(span);
        spec.extend(quote!(.stripes(#n)));
    }
    spec
}

/// The body of `KeyPart::encode`, and whether it writes to the parts at all.
fn encode_body(input: &Input<'_>, krate: &TokenStream) -> (TokenStream, bool) {
    match &input.data {
        Data::Struct(fields) => {
            let puts: Vec<_> = fields
                .iter()
                .filter_map(|f| {
                    let member = &f.member;
                    encode_field(f, quote!(&self.#member), krate)
                })
                .collect();
            let uses = !puts.is_empty();
            (quote!(#(#puts)*), uses)
        }
        Data::Enum(variants) if variants.is_empty() => (quote!(match *self {}), false),
        Data::Enum(variants) => {
            let arms = variants.iter().map(|v| {
                let ident = v.ident;
                let name = ident.to_string();
                let name = name.strip_prefix("r#").unwrap_or(&name);
                let mut bindings = Vec::new();
                let mut puts = Vec::new();
                for (i, f) in v.fields.iter().enumerate() {
                    let binding = format_ident!("__field{}", i);
                    if let Some(put) = encode_field(f, quote!(#binding), krate) {
                        let member = &f.member;
                        bindings.push(quote!(#member: #binding));
                        puts.push(put);
                    }
                }
                quote! {
                    Self::#ident { #(#bindings,)* .. } => {
                        #krate::__private::Parts::variant(__parts, #name);
                        #(#puts)*
                    }
                }
            });
            (quote!(match self { #(#arms)* }), true)
        }
    }
}

/// One field's encoding, given an expression for a reference to it; `None`
/// for a skipped field.
fn encode_field(field: &Field<'_>, value: TokenStream, krate: &TokenStream) -> Option<TokenStream> {
    if field.attrs.skip.is_some() {
        return None;
    }
    if let Some(with) = &field.attrs.with {
        let path = &with.value;
        return Some(quote_spanned!(path.span()=> #path(#value, __parts);));
    }
    let ty = field.ty;
    // The field's type is named in the call so that a type without a
    // `KeyPart` impl is reported at the field's type.
    Some(quote! { #krate::__private::Parts::put::<#ty>(__parts, #value); })
}

/// The type's where-clause plus `FieldType: KeyPart` for every encoded field
/// whose type mentions a type parameter (as serde does).
fn where_clause(input: &Input<'_>, krate: &TokenStream) -> Option<WhereClause> {
    let generics: &Generics = input.generics;
    let params: BTreeSet<String> = generics
        .params
        .iter()
        .filter_map(|p| match p {
            GenericParam::Type(t) => Some(t.ident.to_string()),
            _ => None,
        })
        .collect();
    let mut clause = generics.where_clause.clone();
    if params.is_empty() {
        return clause;
    }
    let fields: Vec<&Field<'_>> = match &input.data {
        Data::Struct(fields) => fields.iter().collect(),
        Data::Enum(variants) => variants.iter().flat_map(|v| &v.fields).collect(),
    };
    let mut seen = BTreeSet::new();
    for field in fields.into_iter().filter(|f| f.uses_key_part()) {
        let tokens = field.ty.to_token_stream();
        if mentions(tokens.clone(), &params) && seen.insert(tokens.to_string()) {
            let ty = field.ty;
            clause
                .get_or_insert_with(|| WhereClause {
                    where_token: Default::default(),
                    predicates: Default::default(),
                })
                .predicates
                .push(syn::parse_quote!(#ty: #krate::__private::KeyPart));
        }
    }
    clause
}

fn mentions(tokens: TokenStream, params: &BTreeSet<String>) -> bool {
    tokens.into_iter().any(|tt| match tt {
        TokenTree::Ident(i) => params.contains(&i.to_string()),
        TokenTree::Group(g) => mentions(g.stream(), params),
        _ => false,
    })
}

/// Impls that type-check whatever the input, so that the user sees the
/// derive's errors and not a cascade of "`AdvisoryKey` is not implemented".
/// Never compiles into a program: it is only emitted next to errors.
fn stub(ident: &Ident, generics: &Generics, krate: &TokenStream) -> TokenStream {
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    quote! {
        const _: () = {
            #[automatically_derived]
            impl #impl_generics #krate::__private::KeyPart for #ident #ty_generics #where_clause {
                fn encode(&self, _: &mut #krate::__private::Parts<'_>) {
                    ::core::unimplemented!()
                }
            }

            #[automatically_derived]
            impl #impl_generics #krate::__private::AdvisoryKey for #ident #ty_generics #where_clause {
                const KEY_SPEC: #krate::__private::KeySpec<'static> =
                    #krate::__private::KeySpec::new("lockkit-derive-error");

                fn lock_key(&self) -> #krate::__private::LockKey {
                    ::core::unimplemented!()
                }
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use syn::parse_quote;

    fn run(input: DeriveInput) -> String {
        crate::derive(input.into_token_stream()).to_string()
    }

    #[test]
    fn unparsable_input_is_an_error_not_a_panic() {
        let out = crate::derive(quote!(
            fn not_a_type() {}
        ))
        .to_string();
        assert!(out.contains("compile_error"), "{out}");
    }

    #[test]
    fn struct_fields_in_declaration_order() {
        let out = run(parse_quote! { struct Transfer { from: i64, to: i64 } });
        let from = out.find("self . from").unwrap();
        let to = out.find("self . to").unwrap();
        assert!(from < to, "{out}");
        assert!(out.contains("KeySpec :: new (\"Transfer\")"), "{out}");
        assert!(out.contains("key_of (self)"), "{out}");
        assert!(!out.contains("compile_error"), "{out}");
        assert!(!out.contains("unimplemented"), "{out}");
    }

    #[test]
    fn raw_identifier_is_unraw_namespace() {
        let out = run(parse_quote! { struct r#Match(u8); });
        assert!(out.contains("KeySpec :: new (\"Match\")"), "{out}");
    }

    #[test]
    fn generic_fields_are_bounded() {
        let out = run(
            parse_quote! { struct Scoped<T, U> { tenant: T, #[advisory_key(skip)] cache: U, id: u64 } },
        );
        assert!(
            out.contains("T : :: lockkit :: __private :: KeyPart"),
            "{out}"
        );
        assert!(!out.contains("U : :: lockkit"), "{out}");
    }

    #[test]
    fn errors_are_collected_with_one_stub() {
        let out = run(parse_quote! {
            #[advisory_key(stripe = 3, class = 1, namespace = "a b")]
            struct Bad { x: f64 }
        });
        assert_eq!(out.matches("compile_error").count(), 4, "{out}");
        assert!(out.contains("unknown attribute `stripe`"), "{out}");
        assert!(out.contains("`class` requires `pair`"), "{out}");
        assert!(out.contains("invalid namespace"), "{out}");
        assert!(out.contains("floats cannot be lock key parts"), "{out}");
        assert_eq!(out.matches("unimplemented").count(), 2, "{out}");
    }

    #[test]
    fn malformed_options_do_not_panic() {
        let inputs: [DeriveInput; 8] = [
            parse_quote! { #[advisory_key] struct A(u8); },
            parse_quote! { #[advisory_key = 1] struct A(u8); },
            parse_quote! { #[advisory_key(class = 99999999999999999999999999)] struct A(u8); },
            parse_quote! { #[advisory_key(stripes = -1)] struct A(u8); },
            parse_quote! { #[advisory_key(namespace)] struct A(u8); },
            parse_quote! { #[advisory_key(pair = "exakt")] struct A(i32); },
            parse_quote! { #[advisory_key(crate = "not a path")] struct A(u8); },
            parse_quote! { struct A(#[advisory_key(with = 3)] u8); },
        ];
        for input in inputs {
            let out = run(input);
            assert!(out.contains("compile_error"), "{out}");
        }
    }
}
