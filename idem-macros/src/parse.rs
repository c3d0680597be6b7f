//! Parse: the attribute's tokens into [`RawArgs`], as written, unchecked.
//!
//! darling does the conversion. Before it, every item is checked for its shape
//! (a string where a string belongs, a bare flag, a list), so that a mistake gets
//! an error that says what to write instead of darling's "Unexpected literal
//! type", and so that one bad item does not hide the others: it is reported and
//! left out, and everything else is still parsed (and the signature still
//! checked).
//!
//! One form darling cannot read is the dotted `fingerprint(body.sku)` (not Rust
//! meta syntax), so those paths are first rewritten to `body_field = "sku"` with
//! the span of the field's first token, which is where a "no field" error then
//! points.

use std::collections::BTreeSet;

use darling::FromMeta;
use darling::ast::NestedMeta;
use darling::util::{Flag, SpannedValue};
use proc_macro2::{Delimiter, Group, Literal, Punct, Spacing, Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::{Expr, Lit, Meta};

use crate::errors::Errors;

/// The arguments as written.
#[derive(Debug, Default, FromMeta)]
pub struct RawArgs {
    pub operation: Option<SpannedValue<String>>,
    pub retention: Option<SpannedValue<String>>,
    pub fingerprint: Option<RawFingerprint>,
    pub in_flight_wait: Option<SpannedValue<String>>,
    pub lease: Option<SpannedValue<String>>,
    pub lease_ceiling: Option<SpannedValue<String>>,
    pub accepted: Flag,
    pub single_tenant: Flag,
    #[darling(rename = "crate")]
    pub krate: Option<SpannedValue<String>>,
    /// Not an option: where `fingerprint(...)` was written, and which options
    /// were written at all (even if refused), so that a refused option is not
    /// also reported as missing.
    #[darling(skip)]
    pub meta: Written,
}

/// What the parser saw besides the values.
#[derive(Debug, Default)]
pub struct Written {
    /// The names of the options written, well-formed or not.
    pub names: BTreeSet<String>,
    /// The first and last token of `fingerprint(...)`.
    pub fingerprint_span: Option<(Span, Span)>,
    /// The tokens could not be read as a list of options at all, or an option
    /// could not be named (a bare value): nothing is reported missing then.
    pub unreadable: bool,
    /// An item of `fingerprint(...)` was refused: what the rest leaves out of
    /// the fingerprint is not judged then.
    pub fingerprint_refused: bool,
}

/// The contents of `fingerprint(...)`.
#[derive(Debug, Default, FromMeta)]
pub struct RawFingerprint {
    pub body: Flag,
    #[darling(multiple, rename = "body_field")]
    pub fields: Vec<SpannedValue<String>>,
    #[darling(multiple)]
    pub header: Vec<SpannedValue<String>>,
    pub ignore_body: Flag,
}

/// The options, with an example value each (used in the hints).
const OPTIONS: &[(&str, Shape)] = &[
    ("operation", Shape::Str("\"create-order\"")),
    ("retention", Shape::Str("\"24h\"")),
    ("fingerprint", Shape::List),
    ("single_tenant", Shape::Flag),
    ("in_flight_wait", Shape::Str("\"500ms\"")),
    ("lease", Shape::Str("\"30s\"")),
    ("lease_ceiling", Shape::Str("\"5m\"")),
    ("accepted", Shape::Flag),
    ("crate", Shape::Str("\"::idem_runtime\"")),
];

const FINGERPRINT_OPTIONS: &[(&str, Shape)] = &[
    ("body", Shape::Flag),
    ("header", Shape::Str("\"x-currency\"")),
    ("ignore_body", Shape::Flag),
    // Written `body.sku`; rewritten before this check.
    ("body_field", Shape::Str("\"sku\"")),
];

#[derive(Clone, Copy)]
enum Shape {
    Str(&'static str),
    Flag,
    List,
}

/// Parses the attribute's argument tokens. Every problem goes to `errors`; what
/// could be read is returned.
pub fn parse_args(args: TokenStream, errors: &mut Errors) -> RawArgs {
    let items = match NestedMeta::parse_meta_list(rewrite_fingerprint(args)) {
        Ok(items) => items,
        Err(e) => {
            errors.push(syn::Error::new(
                e.span(),
                format!(
                    "`#[idempotent(...)]` takes options written `name = \"value\"`, `flag` or `fingerprint(...)`, separated by commas ({e}); e.g. `#[idempotent(operation = \"create-order\", retention = \"24h\")]`"
                ),
            ));
            return RawArgs {
                meta: Written {
                    unreadable: true,
                    ..Written::default()
                },
                ..RawArgs::default()
            };
        }
    };
    let mut written = Written::default();
    let mut kept = Vec::new();
    for item in items {
        let Some(meta) = check_item(&item, OPTIONS, "", errors, &mut written.names) else {
            continue;
        };
        if meta.path().is_ident("fingerprint") {
            let tokens = meta.to_token_stream();
            written.fingerprint_span = first_last(tokens);
            if let Meta::List(list) = meta {
                match check_fingerprint(list, errors, &mut written.fingerprint_refused) {
                    Some(clean) => kept.push(NestedMeta::Meta(clean)),
                    None => continue,
                }
                continue;
            }
        }
        kept.push(NestedMeta::Meta(meta.clone()));
    }
    let mut args = match RawArgs::from_list(&kept) {
        Ok(a) => a,
        Err(e) => {
            // The shapes were checked above; whatever darling still refuses is
            // reported as it says.
            errors.push_darling(e);
            RawArgs::default()
        }
    };
    written.unreadable |= written.names.remove("*");
    args.meta = written;
    args
}

/// Checks one item against the option table; `None` when it is refused (the
/// error is pushed).
fn check_item<'a>(
    item: &'a NestedMeta,
    table: &[(&str, Shape)],
    within: &str,
    errors: &mut Errors,
    seen: &mut BTreeSet<String>,
) -> Option<&'a Meta> {
    let names: Vec<&str> = table
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| *n != "body_field")
        .collect();
    let meta = match item {
        NestedMeta::Meta(m) => m,
        NestedMeta::Lit(lit) => {
            let hint = if within.is_empty() {
                format!(
                    "options are written `name = \"value\"`: write e.g. `operation = {}`",
                    lit_text(lit)
                )
            } else {
                format!("write `header = {}` for a header, or `body`", lit_text(lit))
            };
            errors.push_spanned(lit, format!("a bare value: {hint}"));
            // Which option it meant is unknown: none is reported missing.
            seen.insert("*".to_owned());
            return None;
        }
        NestedMeta::NameValueInvalidExpr(nv) => {
            let name = path_text(&nv.path);
            let value = nv.value.to_string().replace(' ', "");
            seen.insert(name.clone());
            let msg = match table.iter().find(|(n, _)| *n == name) {
                Some((_, Shape::Str(_))) => {
                    format!("`{name}` takes a string: write `{name} = \"{value}\"`")
                }
                Some((_, Shape::Flag)) => {
                    format!("`{name}` is a flag and takes no value: write `{name}` alone")
                }
                _ => format!(
                    "`{name} = {value}` cannot be read: options are written `name = \"value\"`"
                ),
            };
            errors.push_spanned(nv, msg);
            return None;
        }
    };
    let name = meta
        .path()
        .get_ident()
        .map(|i| i.to_string())
        .unwrap_or_else(|| path_text(meta.path()));
    let Some((_, shape)) = table.iter().find(|(n, _)| *n == name) else {
        let place = if within.is_empty() {
            "`#[idempotent(...)]`".to_owned()
        } else {
            format!("`{within}(...)`")
        };
        let closest = closest(&name, &names);
        if let Some(meant) = closest {
            // The option meant is not also reported missing.
            seen.insert(meant.to_owned());
        }
        let suggestion = closest
            .map(|n| format!("did you mean `{n}`? "))
            .unwrap_or_default();
        errors.push_spanned(
            meta.path(),
            format!(
                "unknown option `{name}` in {place}: {suggestion}the options are {}",
                names
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
        return None;
    };
    // `header` and `body_field` may repeat; everything else is written once.
    let repeatable = matches!(name.as_str(), "header" | "body_field");
    if !repeatable && !seen.insert(name.clone()) {
        errors.push_spanned(meta.path(), format!("`{name}` is written twice: keep one"));
        return None;
    }
    seen.insert(name.clone());
    let wrong = match (shape, meta) {
        (Shape::Str(_), Meta::NameValue(nv)) => match &nv.value {
            Expr::Lit(l) if matches!(l.lit, Lit::Str(_)) => None,
            other => Some((
                other.to_token_stream(),
                format!(
                    "`{name}` takes a string: write `{name} = \"{}\"`",
                    unquoted(other)
                ),
            )),
        },
        (Shape::Str(example), _) => Some((
            meta.to_token_stream(),
            format!("`{name}` takes a value: write `{name} = {example}`"),
        )),
        (Shape::Flag, Meta::Path(_)) => None,
        (Shape::Flag, Meta::NameValue(nv)) => {
            let text = unquoted(&nv.value);
            let advice = if text == "false" {
                format!("`{name}` is off unless written: remove `{name} = false`")
            } else {
                format!("write `{name}` alone")
            };
            Some((
                meta.to_token_stream(),
                format!("`{name}` is a flag and takes no value: {advice}"),
            ))
        }
        (Shape::Flag, Meta::List(_)) => Some((
            meta.to_token_stream(),
            format!("`{name}` is a flag and takes no value: write `{name}` alone"),
        )),
        (Shape::List, Meta::List(_)) => None,
        (Shape::List, _) => Some((
            meta.to_token_stream(),
            format!(
                "`{name}` lists what identifies a request: write e.g. `{name}(body, header = \"x-currency\")`"
            ),
        )),
    };
    if let Some((tokens, msg)) = wrong {
        errors.push_spanned(tokens, msg);
        return None;
    }
    Some(meta)
}

/// Checks the items of `fingerprint(...)`; the list without the refused ones.
fn check_fingerprint(
    list: &syn::MetaList,
    errors: &mut Errors,
    refused: &mut bool,
) -> Option<Meta> {
    let items = match NestedMeta::parse_meta_list(list.tokens.clone()) {
        Ok(items) => items,
        Err(e) => {
            *refused = true;
            errors.push(syn::Error::new(
                e.span(),
                format!(
                    "`fingerprint(...)` lists `body`, `body.field`, `header = \"name\"` or `ignore_body`, separated by commas ({e})"
                ),
            ));
            return None;
        }
    };
    let mut seen = BTreeSet::new();
    let kept: Vec<&Meta> = items
        .iter()
        .filter_map(|i| check_item(i, FINGERPRINT_OPTIONS, "fingerprint", errors, &mut seen))
        .collect();
    *refused |= kept.len() != items.len();
    let path = &list.path;
    let delimiter = &list.delimiter;
    let mut tokens = TokenStream::new();
    for (n, m) in kept.iter().enumerate() {
        if n > 0 {
            tokens.extend(quote::quote!(,));
        }
        m.to_tokens(&mut tokens);
    }
    Some(Meta::List(syn::MetaList {
        path: path.clone(),
        delimiter: delimiter.clone(),
        tokens,
    }))
}

/// The value as the user meant it, without quotes: `24h`, `create_order`.
fn unquoted(e: &Expr) -> String {
    e.to_token_stream().to_string().replace(' ', "")
}

fn lit_text(l: &Lit) -> String {
    match l {
        Lit::Str(_) => l.to_token_stream().to_string(),
        other => format!("\"{}\"", other.to_token_stream()),
    }
}

fn path_text(p: &syn::Path) -> String {
    p.to_token_stream().to_string().replace(' ', "")
}

fn first_last(tokens: TokenStream) -> Option<(Span, Span)> {
    let mut it = tokens.into_iter();
    let first = it.next()?.span();
    let last = it.last().map(|t| t.span()).unwrap_or(first);
    Some((first, last))
}

/// The closest known name within a small edit distance.
fn closest<'a>(name: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edit_distance(name, k), *k))
        .filter(|(d, k)| *d <= (k.len() / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(row[j]).min(row[j + 1])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

fn rewrite_fingerprint(args: TokenStream) -> TokenStream {
    let mut out = Vec::new();
    let mut after_fingerprint = false;
    for tt in args {
        match tt {
            TokenTree::Group(g) if after_fingerprint && g.delimiter() == Delimiter::Parenthesis => {
                let mut inner = Group::new(Delimiter::Parenthesis, rewrite_body_paths(g.stream()));
                inner.set_span(g.span());
                out.push(TokenTree::Group(inner));
                after_fingerprint = false;
            }
            TokenTree::Ident(ref i) => {
                after_fingerprint = i == "fingerprint";
                out.push(tt);
            }
            other => {
                after_fingerprint = false;
                out.push(other);
            }
        }
    }
    out.into_iter().collect()
}

/// `body . a . b` becomes `body_field = "a.b"`.
fn rewrite_body_paths(inner: TokenStream) -> TokenStream {
    let tokens: Vec<TokenTree> = inner.into_iter().collect();
    let mut out: Vec<TokenTree> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let is_body = matches!(&tokens[i], TokenTree::Ident(id) if id == "body");
        let dot_follows =
            matches!(tokens.get(i + 1), Some(TokenTree::Punct(p)) if p.as_char() == '.');
        if is_body && dot_follows {
            let mut segments = Vec::new();
            let mut span = None;
            let mut j = i + 1;
            while let (Some(TokenTree::Punct(p)), Some(next)) = (tokens.get(j), tokens.get(j + 1)) {
                if p.as_char() != '.' {
                    break;
                }
                span.get_or_insert(next.span());
                // Keep whatever follows the dot; validation names what is wrong with it.
                segments.push(next.to_string());
                j += 2;
            }
            let mut lit = Literal::string(&segments.join("."));
            lit.set_span(span.unwrap_or_else(|| tokens[i].span()));
            let ident = proc_macro2::Ident::new("body_field", tokens[i].span());
            out.push(TokenTree::Ident(ident));
            let mut eq = Punct::new('=', Spacing::Alone);
            eq.set_span(tokens[i].span());
            out.push(TokenTree::Punct(eq));
            out.push(TokenTree::Literal(lit));
            i = j;
        } else {
            out.push(tokens[i].clone());
            i += 1;
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn parse(args: TokenStream) -> (RawArgs, String) {
        let mut errors = Errors::default();
        let a = parse_args(args, &mut errors);
        (a, errors.messages().join("\n"))
    }

    #[test]
    fn reads_the_design_example() {
        let (a, e) = parse(quote!(
            operation = "create-order",
            retention = "24h",
            fingerprint(body, header = "x-currency")
        ));
        assert!(e.is_empty(), "{e}");
        assert_eq!(a.operation.unwrap().as_str(), "create-order");
        assert_eq!(a.retention.unwrap().as_str(), "24h");
        let fp = a.fingerprint.unwrap();
        assert!(fp.body.is_present());
        assert_eq!(fp.header.len(), 1);
        assert!(!a.single_tenant.is_present());
        assert!(a.meta.fingerprint_span.is_some());
    }

    #[test]
    fn dotted_body_paths_become_fields() {
        let (a, e) = parse(quote!(
            operation = "x",
            retention = "1h",
            fingerprint(body.sku, body.customer.id, header = "a", header = "b")
        ));
        assert!(e.is_empty(), "{e}");
        let fp = a.fingerprint.unwrap();
        assert!(!fp.body.is_present());
        let fields: Vec<String> = fp.fields.iter().map(|f| f.as_str().to_owned()).collect();
        assert_eq!(fields, ["sku", "customer.id"]);
        assert_eq!(fp.header.len(), 2);
    }

    #[test]
    fn knobs() {
        let (a, e) = parse(quote!(
            operation = "x",
            retention = "1h",
            single_tenant,
            in_flight_wait = "500ms",
            crate = "my::idem",
            accepted,
            fingerprint(header = "x", ignore_body)
        ));
        assert!(e.is_empty(), "{e}");
        assert!(a.accepted.is_present());
        assert!(a.single_tenant.is_present());
        assert_eq!(a.in_flight_wait.unwrap().as_str(), "500ms");
        assert_eq!(a.krate.unwrap().as_str(), "my::idem");
        assert!(a.fingerprint.unwrap().ignore_body.is_present());
    }

    #[test]
    fn unknown_and_duplicate_arguments_are_errors_that_keep_the_rest() {
        let (a, e) = parse(quote!(operation = "x", retension = "1h"));
        assert!(e.contains("did you mean `retention`"), "{e}");
        assert_eq!(a.operation.unwrap().as_str(), "x");
        let (a, e) = parse(quote!(operation = "x", operation = "y"));
        assert!(e.contains("written twice"), "{e}");
        assert_eq!(a.operation.unwrap().as_str(), "x");
    }

    #[test]
    fn wrong_shapes_say_what_to_write() {
        let (a, e) = parse(quote!(
            operation = create_order,
            retention = 24h,
            single_tenant = true
        ));
        assert!(e.contains("write `operation = \"create_order\"`"), "{e}");
        assert!(e.contains("write `retention = \"24h\"`"), "{e}");
        assert!(e.contains("write `single_tenant` alone"), "{e}");
        assert!(a.meta.names.contains("retention"));
        let (_, e) = parse(quote!(
            operation = "x",
            retention = "1h",
            fingerprint(header = x_currency, body = true, bdy)
        ));
        assert!(e.contains("write `header = \"x_currency\"`"), "{e}");
        assert!(e.contains("write `body` alone"), "{e}");
        assert!(e.contains("did you mean `body`"), "{e}");
    }
}
