//! Parse: the attribute's tokens into [`RawArgs`], as written, unchecked.
//!
//! darling does the work. One thing it cannot read is the dotted
//! `fingerprint(body.sku)` form (not Rust meta syntax), so those paths are first
//! rewritten to `body_field = "sku"` with the span of the field's first token, which
//! is where a "no field" error then points.

use darling::FromMeta;
use darling::ast::NestedMeta;
use darling::util::{Flag, SpannedValue};
use proc_macro2::{Delimiter, Group, Literal, Punct, Spacing, TokenStream, TokenTree};

/// The arguments as written.
#[derive(Debug, FromMeta)]
pub struct RawArgs {
    pub operation: Option<SpannedValue<String>>,
    pub retention: Option<SpannedValue<String>>,
    pub fingerprint: Option<SpannedValue<RawFingerprint>>,
    pub in_flight_wait: Option<SpannedValue<String>>,
    pub lease: Option<SpannedValue<String>>,
    pub lease_ceiling: Option<SpannedValue<String>>,
    pub single_tenant: Flag,
    #[darling(rename = "crate")]
    pub krate: Option<SpannedValue<String>>,
}

/// The contents of `fingerprint(...)`.
#[derive(Debug, Default, FromMeta)]
pub struct RawFingerprint {
    pub body: Flag,
    #[darling(multiple, rename = "body_field")]
    pub fields: Vec<SpannedValue<String>>,
    #[darling(multiple)]
    pub header: Vec<SpannedValue<String>>,
}

/// Parses the attribute's argument tokens.
pub fn parse_args(args: TokenStream) -> darling::Result<RawArgs> {
    let items = NestedMeta::parse_meta_list(rewrite_fingerprint(args))?;
    RawArgs::from_list(&items)
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

    #[test]
    fn reads_the_design_example() {
        let a = parse_args(quote!(
            operation = "create-order",
            retention = "24h",
            fingerprint(body, header = "x-currency")
        ))
        .unwrap();
        assert_eq!(a.operation.unwrap().as_str(), "create-order");
        assert_eq!(a.retention.unwrap().as_str(), "24h");
        let fp = a.fingerprint.unwrap().into_inner();
        assert!(fp.body.is_present());
        assert_eq!(fp.header.len(), 1);
        assert!(!a.single_tenant.is_present());
    }

    #[test]
    fn dotted_body_paths_become_fields() {
        let a = parse_args(quote!(
            operation = "x",
            retention = "1h",
            fingerprint(body.sku, body.customer.id, header = "a", header = "b")
        ))
        .unwrap();
        let fp = a.fingerprint.unwrap().into_inner();
        assert!(!fp.body.is_present());
        let fields: Vec<String> = fp.fields.iter().map(|f| f.as_str().to_owned()).collect();
        assert_eq!(fields, ["sku", "customer.id"]);
        assert_eq!(fp.header.len(), 2);
    }

    #[test]
    fn knobs() {
        let a = parse_args(quote!(
            operation = "x",
            retention = "1h",
            single_tenant,
            in_flight_wait = "500ms",
            crate = "my::idem"
        ))
        .unwrap();
        assert!(a.single_tenant.is_present());
        assert_eq!(a.in_flight_wait.unwrap().as_str(), "500ms");
        assert_eq!(a.krate.unwrap().as_str(), "my::idem");
    }

    #[test]
    fn unknown_and_duplicate_arguments_are_errors() {
        let e = parse_args(quote!(operation = "x", retension = "1h")).unwrap_err();
        assert!(e.to_string().contains("retension"), "{e}");
        let e = parse_args(quote!(operation = "x", operation = "y")).unwrap_err();
        assert!(e.to_string().to_lowercase().contains("duplicate"), "{e}");
    }
}
