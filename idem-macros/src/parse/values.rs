//! The value types: how one option is read, and what is said when it is
//! written in another shape than its own (a flag with a value, a string
//! unquoted). darling reads what fits; the words of a refusal are idem's,
//! since darling's ("Unexpected type `path`") do not say what to write.
//!
//! A refusal is a darling error at the first token it is about; `read_list`
//! underlines from there to the end of the item.

use std::collections::BTreeSet;
use std::ops::{Deref, DerefMut};

use darling::ast::{MetaNameValueInvalidExpr, NestedMeta};
use darling::util::SpannedValue;
use darling::{Error, FromMeta};
use proc_macro2::{Span, TokenTree};
use quote::ToTokens;
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{Expr, Lit, Meta, MetaList, Token};

use super::grammar::{FingerprintArgs, example};
use super::{first_last, path_text, read_list};
use crate::errors::Errors;

/// A string, `name = "value"`, with the span of its literal.
#[derive(Debug, Clone)]
pub struct Text(SpannedValue<String>);

impl Deref for Text {
    type Target = SpannedValue<String>;

    fn deref(&self) -> &SpannedValue<String> {
        &self.0
    }
}

impl FromMeta for Text {
    fn from_meta(meta: &Meta) -> darling::Result<Self> {
        let name = path_text(meta.path());
        match meta {
            Meta::NameValue(nv) if string_literal(&nv.value).is_some() => {
                let lit = string_literal(&nv.value).expect("matched above");
                Ok(Text(SpannedValue::new(lit.value(), lit.span())))
            }
            Meta::NameValue(nv) => Err(Error::custom(format!(
                "`{name}` takes a string: write `{name} = \"{}\"`",
                unquoted(&nv.value)
            ))
            .with_span(&nv.value)),
            _ => Err(Error::custom(format!(
                "`{name}` takes a value: write `{name} = {}`",
                example(&name)
            ))
            .with_span(meta)),
        }
    }

    fn from_invalid_expr(nv: &MetaNameValueInvalidExpr) -> darling::Result<Self> {
        let name = path_text(&nv.path);
        let value = nv.value.to_string().replace(' ', "");
        Err(Error::custom(format!(
            "`{name}` takes a string: write `{name} = \"{value}\"`"
        ))
        .with_span(&nv.path))
    }
}

/// A flag, written alone; off unless written.
#[derive(Debug, Default, Clone, Copy)]
pub struct Flag(darling::util::Flag);

impl Deref for Flag {
    type Target = darling::util::Flag;

    fn deref(&self) -> &darling::util::Flag {
        &self.0
    }
}

impl FromMeta for Flag {
    fn from_none() -> Option<Self> {
        Some(Flag::default())
    }

    fn from_meta(meta: &Meta) -> darling::Result<Self> {
        let name = path_text(meta.path());
        let advice = match meta {
            Meta::Path(_) => return darling::util::Flag::from_meta(meta).map(Flag),
            Meta::NameValue(nv) if unquoted(&nv.value) == "false" => {
                format!("`{name}` is off unless written: remove `{name} = false`")
            }
            _ => format!("write `{name}` alone"),
        };
        Err(
            Error::custom(format!("`{name}` is a flag and takes no value: {advice}"))
                .with_span(meta),
        )
    }

    fn from_invalid_expr(nv: &MetaNameValueInvalidExpr) -> darling::Result<Self> {
        let name = path_text(&nv.path);
        Err(Error::custom(format!(
            "`{name}` is a flag and takes no value: write `{name}` alone"
        ))
        .with_span(&nv.path))
    }
}

/// An option that may be left out. darling's `Option<T>` answers
/// `name = <not an expression>` itself, with syn's parse error; this one asks
/// `T`, which says what to write.
#[derive(Debug)]
pub struct Optional<T>(Option<T>);

impl<T> Default for Optional<T> {
    fn default() -> Self {
        Optional(None)
    }
}

impl<T> Deref for Optional<T> {
    type Target = Option<T>;

    fn deref(&self) -> &Option<T> {
        &self.0
    }
}

impl<T> DerefMut for Optional<T> {
    fn deref_mut(&mut self) -> &mut Option<T> {
        &mut self.0
    }
}

impl<T: FromMeta> FromMeta for Optional<T> {
    fn from_none() -> Option<Self> {
        Some(Optional(None))
    }

    fn from_meta(meta: &Meta) -> darling::Result<Self> {
        T::from_meta(meta).map(|v| Optional(Some(v)))
    }

    fn from_invalid_expr(nv: &MetaNameValueInvalidExpr) -> darling::Result<Self> {
        T::from_invalid_expr(nv).map(|v| Optional(Some(v)))
    }
}

/// `fingerprint(...)`: its options, which darling reads, the `body.field`
/// paths, which syn reads, and what its items' checks found.
#[derive(Debug)]
pub struct Fingerprint {
    pub options: FingerprintArgs,
    pub fields: Vec<FieldPath>,
    /// The first and the last token of `fingerprint(...)`.
    pub span: (Span, Span),
    /// An item was refused: what the rest leaves out of the fingerprint is not
    /// judged then.
    pub refused: bool,
    /// The list could not be split into items: it is judged as if unwritten.
    pub unreadable: bool,
    /// The errors about its items, which `parse_args` reports where the list
    /// stands among the attribute's options.
    pub errors: Errors,
}

impl Deref for Fingerprint {
    type Target = FingerprintArgs;

    fn deref(&self) -> &FingerprintArgs {
        &self.options
    }
}

impl FromMeta for Fingerprint {
    fn from_meta(meta: &Meta) -> darling::Result<Self> {
        match meta {
            Meta::List(list) => Ok(Fingerprint::read(meta, list)),
            _ => {
                let name = path_text(meta.path());
                Err(Error::custom(format!(
                    "`{name}` lists what identifies a request: write e.g. `{name}{}`",
                    example(&name)
                ))
                .with_span(meta))
            }
        }
    }

    fn from_invalid_expr(nv: &MetaNameValueInvalidExpr) -> darling::Result<Self> {
        Err(Error::custom(cannot_be_read(nv)).with_span(&nv.path))
    }
}

impl Fingerprint {
    /// The list's items, each checked as the attribute's own are.
    fn read(meta: &Meta, list: &MetaList) -> Self {
        let mut fp = Fingerprint {
            options: FingerprintArgs::default(),
            fields: Vec::new(),
            span: first_last(meta.to_token_stream())
                .unwrap_or((Span::call_site(), Span::call_site())),
            refused: false,
            unreadable: false,
            errors: Errors::default(),
        };
        let items = match Punctuated::<Item, Token![,]>::parse_terminated
            .parse2(list.tokens.clone())
        {
            Ok(items) => items,
            Err(e) => {
                fp.errors.push(syn::Error::new(
                    e.span(),
                    format!(
                        "`fingerprint(...)` lists `body`, `body.field`, `header = \"name\"` or `ignore_body`, separated by commas ({e})"
                    ),
                ));
                fp.refused = true;
                fp.unreadable = true;
                return fp;
            }
        };
        let mut options = Vec::new();
        for item in items {
            match item {
                Item::Field(f) => fp.fields.push(f),
                Item::Option(o) => options.push(o),
            }
        }
        let (read, refused) =
            read_list::<FingerprintArgs>(options, &mut fp.errors, &mut BTreeSet::new(), |_| {
                Errors::default()
            });
        fp.options = read;
        fp.refused = refused;
        fp
    }
}

/// An item of `fingerprint(...)`.
enum Item {
    Field(FieldPath),
    Option(NestedMeta),
}

impl Parse for Item {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let dotted = input.cursor().ident().is_some_and(|(ident, rest)| {
            ident == "body" && rest.punct().is_some_and(|(p, _)| p.as_char() == '.')
        });
        if dotted {
            input.parse().map(Item::Field)
        } else {
            input.parse().map(Item::Option)
        }
    }
}

/// A field of the body, `body.sku` or `body.customer.id`: not meta syntax, so
/// darling cannot read it. Whatever follows a dot is kept (validation names
/// what is wrong with it), with the span of the first, where a "no field" error
/// then points.
#[derive(Debug, Clone)]
pub struct FieldPath {
    path: String,
    span: Span,
}

impl FieldPath {
    /// The path without `body.`: `customer.id`.
    pub fn as_str(&self) -> &str {
        &self.path
    }

    pub fn span(&self) -> Span {
        self.span
    }
}

impl Parse for FieldPath {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let body: syn::Ident = input.parse()?;
        let mut segments = Vec::new();
        let mut span = None;
        while input.peek(Token![.]) {
            input.parse::<Token![.]>()?;
            let segment = input.step(|cursor| match cursor.token_tree() {
                Some((TokenTree::Punct(p), _)) if p.as_char() == ',' => {
                    Err(cursor.error("expected a field after `.`"))
                }
                Some((tt, rest)) => Ok((tt, rest)),
                None => Err(cursor.error("expected a field after `.`")),
            })?;
            span.get_or_insert(segment.span());
            segments.push(segment.to_string());
        }
        Ok(FieldPath {
            path: segments.join("."),
            span: span.unwrap_or(body.span()),
        })
    }
}

/// What an option written `name = <not an expression>` is told when its value
/// cannot be a string or a flag.
pub fn cannot_be_read(nv: &MetaNameValueInvalidExpr) -> String {
    format!(
        "`{} = {}` cannot be read: options are written `name = \"value\"`",
        path_text(&nv.path),
        nv.value.to_string().replace(' ', "")
    )
}

/// The string literal `e` is, also inside the invisible group a
/// `macro_rules!` puts around a `$op:literal` or `$op:expr` it passes on
/// (`operation = $op`).
fn string_literal(e: &Expr) -> Option<&syn::LitStr> {
    match e {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Str(s), ..
        }) => Some(s),
        Expr::Group(g) => string_literal(&g.expr),
        _ => None,
    }
}

/// The value as the user meant it, without quotes: `24h`, `create_order`.
fn unquoted(e: &Expr) -> String {
    e.to_token_stream().to_string().replace(' ', "")
}
