//! The derive's input as borrowed types: the type, its variants and fields,
//! each with its parsed `#[advisory_key(...)]` options.

use syn::{Data as SynData, DeriveInput, Fields, Generics, Ident, Index, Member, Type};

use crate::attr;
use crate::ctxt::Ctxt;

/// The type being derived.
pub(crate) struct Input<'a> {
    /// The type's name.
    pub(crate) ident: &'a Ident,
    /// Its generics, as written.
    pub(crate) generics: &'a Generics,
    /// Its `#[advisory_key(...)]` options.
    pub(crate) attrs: attr::Container,
    /// Its fields or variants.
    pub(crate) data: Data<'a>,
}

/// A struct's fields or an enum's variants.
pub(crate) enum Data<'a> {
    /// A named, tuple or unit struct.
    Struct(Vec<Field<'a>>),
    /// An enum.
    Enum(Vec<Variant<'a>>),
}

/// An enum variant.
pub(crate) struct Variant<'a> {
    /// The variant's name.
    pub(crate) ident: &'a Ident,
    /// Its fields, in declaration order.
    pub(crate) fields: Vec<Field<'a>>,
}

/// A field of a struct or variant.
pub(crate) struct Field<'a> {
    /// `name` or `0`, as in `self.name` / `self.0`.
    pub(crate) member: Member,
    /// The field's type.
    pub(crate) ty: &'a Type,
    /// Its `#[advisory_key(...)]` options.
    pub(crate) attrs: attr::Field,
}

impl Field<'_> {
    /// Whether the field goes into the key through its `KeyPart` impl (neither
    /// skipped nor custom-encoded).
    pub(crate) fn uses_key_part(&self) -> bool {
        self.attrs.skip.is_none() && self.attrs.with.is_none()
    }
}

impl<'a> Input<'a> {
    /// Reads `input`, recording every malformed option in `cx`. `None` for a
    /// union, which cannot be a key type.
    pub(crate) fn from_syn(cx: &Ctxt, input: &'a DeriveInput) -> Option<Self> {
        let attrs = attr::container(cx, &input.attrs);
        let data = match &input.data {
            SynData::Struct(s) => Data::Struct(fields(cx, &s.fields)),
            SynData::Enum(e) => Data::Enum(
                e.variants
                    .iter()
                    .map(|v| {
                        attr::variant(cx, &v.attrs);
                        Variant {
                            ident: &v.ident,
                            fields: fields(cx, &v.fields),
                        }
                    })
                    .collect(),
            ),
            SynData::Union(u) => {
                cx.error_spanned_by(
                    u.union_token,
                    "a union cannot derive `AdvisoryKey`: it does not know which of its fields holds the value; use a struct or an enum",
                );
                return None;
            }
        };
        Some(Input {
            ident: &input.ident,
            generics: &input.generics,
            attrs,
            data,
        })
    }
}

fn fields<'a>(cx: &Ctxt, fields: &'a Fields) -> Vec<Field<'a>> {
    fields
        .iter()
        .enumerate()
        .map(|(i, f)| Field {
            member: match &f.ident {
                Some(ident) => Member::Named(ident.clone()),
                None => Member::Unnamed(Index::from(i)),
            },
            ty: &f.ty,
            attrs: attr::field(cx, &f.attrs),
        })
        .collect()
}
