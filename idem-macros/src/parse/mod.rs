//! Parse: the attribute's tokens into [`RawArgs`], as written, unchecked.
//!
//! The grammar is declared once, in `grammar`: darling's derive reads the
//! options, and the value types in `values` read one each. Each item is first
//! read on its own, so that a mistake gets an error at its own tokens that says
//! what to write instead, and so that one bad item does not hide the others: it
//! is reported and left out, and everything else is still read (and the
//! signature still checked).

use std::collections::BTreeSet;

use darling::ast::NestedMeta;
use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::Lit;

use crate::errors::{Errors, ranged};

mod grammar;
mod values;

use grammar::Grammar;
pub use grammar::{RawArgs, example};
pub use values::{Fingerprint, Text};

/// What the parser saw besides the values.
#[derive(Debug, Default)]
pub struct Written {
    /// The names of the options written, well-formed or not, so that a refused
    /// option is not also reported as missing.
    pub names: BTreeSet<String>,
    /// The tokens could not be read as a list of options at all, or an option
    /// could not be named (a bare value): nothing is reported missing then.
    pub unreadable: bool,
}

/// Parses the attribute's argument tokens. Every problem goes to `errors`; what
/// could be read is returned.
pub fn parse_args(args: TokenStream, errors: &mut Errors) -> (RawArgs, Written) {
    let mut written = Written::default();
    let items = match NestedMeta::parse_meta_list(args) {
        Ok(items) => items,
        Err(e) => {
            errors.push(syn::Error::new(
                e.span(),
                format!(
                    "`#[idempotent(...)]` takes options written `name = \"value\"`, `flag` or `fingerprint(...)`, separated by commas ({e}); e.g. `#[idempotent(operation = \"create-order\", retention = \"24h\")]`"
                ),
            ));
            written.unreadable = true;
            return (RawArgs::default(), written);
        }
    };
    // The errors of `fingerprint(...)`'s items are reported where it stands.
    let (mut args, _) = read_list::<RawArgs>(items, errors, &mut written.names, |one| {
        one.fingerprint.take().map(|f| f.errors).unwrap_or_default()
    });
    written.unreadable |= written.names.remove("*");
    if args.fingerprint.as_ref().is_some_and(|f| f.unreadable) {
        // Its error is reported; what it meant is unknown.
        *args.fingerprint = None;
    }
    (args, written)
}

/// Reads a list of options into `G`. Each item is checked on its own first and
/// left out when refused (its error is pushed); `written` collects the names
/// written. Returns what was read, and whether any item was refused.
///
/// `nested` takes the errors a well-formed item carries about its own items
/// (`fingerprint(...)`'s), which are pushed after the item's own checks.
fn read_list<G: Grammar>(
    items: Vec<NestedMeta>,
    errors: &mut Errors,
    written: &mut BTreeSet<String>,
    nested: impl Fn(&mut G) -> Errors,
) -> (G, bool) {
    let mut kept = Vec::new();
    let mut refused = false;
    for item in items {
        match check_item::<G>(&item, written) {
            Ok(mut one) => {
                errors.extend(nested(&mut one));
                kept.push(item);
            }
            Err(e) => {
                errors.push(e);
                refused = true;
            }
        }
    }
    let read = G::from_list(&kept).unwrap_or_else(|e| {
        // Each item was read on its own above; whatever darling still refuses
        // is reported as it says.
        errors.push_darling(e);
        G::default()
    });
    (read, refused)
}

/// Checks one item: it is named, the name is an option, written once unless it
/// may repeat, and darling reads its value. The item read alone, or the error.
fn check_item<G: Grammar>(
    item: &NestedMeta,
    written: &mut BTreeSet<String>,
) -> Result<G, syn::Error> {
    let path = match item {
        NestedMeta::Lit(lit) => {
            // Which option it meant is unknown: none is reported missing.
            written.insert("*".to_owned());
            return Err(syn::Error::new_spanned(
                lit,
                format!("a bare value: {}", G::bare_value(&lit_text(lit))),
            ));
        }
        NestedMeta::Meta(meta) => meta.path(),
        NestedMeta::NameValueInvalidExpr(nv) => &nv.path,
    };
    let name = path_text(path);
    if !G::knows(&name) {
        return Err(match item {
            NestedMeta::NameValueInvalidExpr(nv) => {
                written.insert(name);
                syn::Error::new_spanned(nv, values::cannot_be_read(nv))
            }
            _ => unknown::<G>(path, &name, written),
        });
    }
    let is_meta = matches!(item, NestedMeta::Meta(_));
    if is_meta && !repeatable::<G>(&name) && !written.insert(name.clone()) {
        return Err(syn::Error::new_spanned(
            path,
            format!("`{name}` is written twice: keep one"),
        ));
    }
    written.insert(name);
    G::from_list(std::slice::from_ref(item)).map_err(|e| refusal(e, item))
}

/// An unknown option, with the closest known name (which is then not also
/// reported missing) and the list of them.
fn unknown<G: Grammar>(path: &syn::Path, name: &str, written: &mut BTreeSet<String>) -> syn::Error {
    let names: Vec<&str> = G::OPTIONS.iter().map(|(n, _)| *n).collect();
    let closest = closest(name, &names);
    if let Some(meant) = closest {
        written.insert(meant.to_owned());
    }
    let suggestion = closest
        .map(|n| format!("did you mean `{n}`? "))
        .unwrap_or_default();
    let list = names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    syn::Error::new_spanned(
        path,
        format!(
            "unknown option `{name}` in {}: {suggestion}the options are {list}",
            G::PLACE
        ),
    )
}

/// Whether the option `name` may be written more than once (darling's
/// `multiple`): darling is asked to read a well-formed sample of it, written
/// once and twice.
fn repeatable<G: Grammar>(name: &str) -> bool {
    let sample = [
        name.to_owned(),
        format!("{name} = \"\""),
        format!("{name}()"),
    ]
    .into_iter()
    .filter_map(|text| syn::parse_str::<NestedMeta>(&text).ok())
    .find(|item| G::from_list(std::slice::from_ref(item)).is_ok());
    sample.is_some_and(|item| G::from_list(&[item.clone(), item]).is_ok())
}

/// darling's refusal of an item, from the token it points at to the end of
/// the item (darling keeps one span, which on stable Rust is a single token).
fn refusal(e: darling::Error, item: &NestedMeta) -> syn::Error {
    let last = item
        .to_token_stream()
        .into_iter()
        .last()
        .map(|t| t.span())
        .unwrap_or_else(Span::call_site);
    e.flatten()
        .into_iter()
        .map(|e| {
            let e = syn::Error::from(e);
            ranged((e.span(), last), &e)
        })
        .reduce(|mut all, e| {
            all.combine(e);
            all
        })
        .expect("a darling error holds at least one")
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

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn parse(args: TokenStream) -> (RawArgs, Written, String) {
        let mut errors = Errors::default();
        let (a, w) = parse_args(args, &mut errors);
        (a, w, errors.messages().join("\n"))
    }

    #[test]
    fn reads_the_design_example() {
        let (a, _, e) = parse(quote!(
            operation = "create-order",
            retention = "24h",
            fingerprint(body, header = "x-currency")
        ));
        assert!(e.is_empty(), "{e}");
        assert_eq!(a.operation.as_ref().unwrap().as_str(), "create-order");
        assert_eq!(a.retention.as_ref().unwrap().as_str(), "24h");
        let fp = a.fingerprint.as_ref().unwrap();
        assert!(fp.body.is_present());
        assert_eq!(fp.header.len(), 1);
        assert!(!a.single_tenant.is_present());
    }

    #[test]
    fn dotted_body_paths_become_fields() {
        let (a, _, e) = parse(quote!(
            operation = "x",
            retention = "1h",
            fingerprint(body.sku, body.customer.id, header = "a", header = "b")
        ));
        assert!(e.is_empty(), "{e}");
        let fp = a.fingerprint.as_ref().unwrap();
        assert!(!fp.body.is_present());
        let fields: Vec<String> = fp.fields.iter().map(|f| f.as_str().to_owned()).collect();
        assert_eq!(fields, ["sku", "customer.id"]);
        assert_eq!(fp.header.len(), 2);
    }

    #[test]
    fn knobs() {
        let (a, _, e) = parse(quote!(
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
        assert_eq!(a.in_flight_wait.as_ref().unwrap().as_str(), "500ms");
        assert_eq!(a.krate.as_ref().unwrap().as_str(), "my::idem");
        assert!(a.fingerprint.as_ref().unwrap().ignore_body.is_present());
    }

    #[test]
    fn unknown_and_duplicate_arguments_are_errors_that_keep_the_rest() {
        let (a, _, e) = parse(quote!(operation = "x", retension = "1h"));
        assert!(e.contains("did you mean `retention`"), "{e}");
        assert_eq!(a.operation.as_ref().unwrap().as_str(), "x");
        let (a, _, e) = parse(quote!(operation = "x", operation = "y"));
        assert!(e.contains("written twice"), "{e}");
        assert_eq!(a.operation.as_ref().unwrap().as_str(), "x");
    }

    #[test]
    fn wrong_shapes_say_what_to_write() {
        let (_, w, e) = parse(quote!(
            operation = create_order,
            retention = 24h,
            single_tenant = true
        ));
        assert!(e.contains("write `operation = \"create_order\"`"), "{e}");
        assert!(e.contains("write `retention = \"24h\"`"), "{e}");
        assert!(e.contains("write `single_tenant` alone"), "{e}");
        assert!(w.names.contains("retention"));
        let (_, _, e) = parse(quote!(
            operation = "x",
            retention = "1h",
            fingerprint(header = x_currency, body = true, bdy)
        ));
        assert!(e.contains("write `header = \"x_currency\"`"), "{e}");
        assert!(e.contains("write `body` alone"), "{e}");
        assert!(e.contains("did you mean `body`"), "{e}");
    }
}
